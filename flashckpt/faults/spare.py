"""A spare node: ``flashckpt-run --spare`` (or ``FLASHCKPT_SPARE=1``) takes a lost node's ranks
in-process, while every healthy process of the job keeps running.

A spare joins no rendezvous and runs no rank. It reaches the job's controller and recovery
store as every node does, keeps a warm standby per rank of a node (plus the node's usual
``FLASHCKPT_STANDBY``), and reports to the controller as a spare. When the controller finds a
node lost whole (its agent silent past the node timeout) and a spare is free, it tells the
spare to take that node instead of killing the job's workers (``Controller._spares_for``). The
spare then:

- reads what the lost node's launcher published when its worker group started (the round
  namespace, the script's arguments, each rank's launch variables: ``spare_marks.publish_node``);
- marks the node taken, then moves the job to the next round, as a launcher does for a lost
  worker. The mark belongs to the job's current run (``spare_marks.run_started``): the node's
  own launcher, if it still runs, finds it and stops its workers, and a lost node that comes
  back finds it and serves as the job's spare instead. It is void once the run ends (the job
  restarts whole, ``spare_marks.run_ended``) and removed when the spare gives the node up, so
  that the node can rejoin;
- hands each of the node's ranks to a warm standby, as that node (``FLASHCKPT_NODE``: its
  replicas, its commits and its place in the job are the node's), with the spare's own shared
  memory, run directory and tiers. The healthy ranks have left their round (their collectives
  failed with the node's connections, or their round watch saw the round move) and wait in
  the next one; the spare's ranks join it, restore (the lost node's replica from its peer's
  memory, else storage) and every rank agrees on the newest step all of them can read;
- runs the node from then on as its launcher would (the watchdog, ``node_watch``; the agent; a
  standby for the next lost rank), and records ``node_replaced_in_process`` with the time of
  each phase.

Where it cannot go on (the lost node never published its workers, no standby is left, the round
does not form in time) its ranks give up like any others, and the spare becomes the lost node's
launcher (it runs ``flashckpt-run`` again without ``--spare``, as that node), so that the job's
full restart finds every node it waits for.

The marks the spare and the launchers leave in the job's recovery store, and why, are in
``spare_marks``; this module is the spare's own life (``Spare``) and ``flashckpt-run``'s
``--spare`` flag (``split_flag``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from .. import config
from ..errors import FlashCkptError
from .events import EventLog, read_events
from .node_watch import NodeWatch
from .reach import leave, listen_for_probes
from .spare_marks import current_run, mark_replaced, node_key, unmark_replaced

log = logging.getLogger(__name__)

ENV = "FLASHCKPT_SPARE"
FLAG = "--spare"
ORPHAN_S = 600.0  # a spare whose controller is silent this long exits: the job is gone
AGENT_START_S = 5.0  # the warm agent's time to answer before the keeper looks after it
DEADLINE_MARGIN_S = 5.0  # a lost node's hand-over and its ranks' start, in the recovery deadline
EXIT_BARRIER_S = 300.0  # as TorchElastic's: how long a finished node waits for the others


def split_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--spare`` (flashckpt-run's own flag, before the training script), and
    whether this node is a spare (the flag, or FLASHCKPT_SPARE)."""
    from torch.distributed import run as torchrun

    without = [a for a in argv if a != FLAG]
    script = torchrun.parse_args(without).training_script
    end = argv.index(script) if script in argv else len(argv)
    flagged = FLAG in argv[:end]
    kept = [a for i, a in enumerate(argv) if not (a == FLAG and i < end)]
    return kept, flagged or config.setting_bool("spare", None, False)


async def wait_for_node(job: str, name: str, run_dir: Any, halt: threading.Event,
                        interval: float = 0.5) -> tuple[str, float, bool]:  # fmt: skip
    """Report to the job's controller as a spare until it names a lost node: (that node, how
    long it had been silent when found lost, whether to join the job's restart as it rather
    than take its ranks in-process); ("", 0, False) when the job is over (the controller says
    so, or has not answered for ORPHAN_S). Reconnects while the controller is down or not
    known yet."""
    import grpc

    from flashckpt.proto import controller_pb2 as pb
    from flashckpt.proto import controller_pb2_grpc as pb_grpc

    from .control import Endpoint

    agent_id = uuid.uuid4().hex
    every = [interval]  # the controller's heartbeat, once it has said it
    warned = ""
    heard = time.monotonic()  # the controller's last answer (or this wait's start)

    async def write(call: Any) -> None:
        seq = 0
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:  # a broken stream ends it: the reading side says why
                seq += 1
                await call.write(pb.NodeReport(job=job, node=name, agent_id=agent_id,
                                               spare=True, seq=seq))  # fmt: skip
                await asyncio.sleep(every[0])

    while not halt.is_set():
        if time.monotonic() - heard > ORPHAN_S:
            log.warning("spare %s: no controller of job %s has answered for %.0fs: the job is "
                        "over, or its first node is lost with the controller; exiting", name,
                        job, ORPHAN_S)  # fmt: skip
            return "", 0.0, False
        endpoint = Endpoint.load(run_dir, job)
        if endpoint is None:
            await asyncio.sleep(every[0])
            continue
        channel = endpoint.channel()
        call = pb_grpc.ControllerStub(channel).Connect(metadata=endpoint.metadata())
        writer = asyncio.create_task(write(call))
        try:
            async for reply in call:
                warned, heard = "", time.monotonic()
                if reply.job_over:
                    log.info("spare %s: job %s is over", name, job)
                    return "", 0.0, False
                if reply.take_node:
                    return reply.take_node, reply.lost_silent_s, False
                if reply.join_node:
                    return reply.join_node, 0.0, True
                if reply.heartbeat_s > 0:  # twice a heartbeat: heard as fresh (controller)
                    every[0] = min(reply.heartbeat_s / 2, 1.0)
        except grpc.aio.AioRpcError as exc:
            if exc.details() != warned:
                warned = exc.details() or ""
                log.warning("spare %s: the controller at %s: %s", name, endpoint.address,
                            exc.details())  # fmt: skip
        finally:
            writer.cancel()
            call.cancel()
            await channel.close()
        await asyncio.sleep(every[0])
    raise FlashCkptError("stopped before a node was lost")


class Spare:
    """The spare's life: wait, take a node, run it (see the module doc)."""

    def __init__(self, args: Any, argv: list[str], job: str, events: EventLog,
                 launch_env: dict[str, str], claim: int):  # fmt: skip
        self.args, self.argv, self.job, self.events = args, argv, job, events
        self.launch_env, self.claim = launch_env, claim
        self.name = config.node_name()
        self.run_dir = config.run_dir()
        self.shm_dir = config.shm_dir()

    def run(self) -> int:
        from .inprocess_agent import RecoveringAgent

        supervisor = RecoveringAgent.supervisor
        deadline = config.setting_float("recovery_deadline", None, 30.0, lo=1.0)
        timeout = config.setting_float("node_timeout", None, 5.0, lo=0.1)
        if deadline < timeout + DEADLINE_MARGIN_S:
            log.warning("FLASHCKPT_RECOVERY_DEADLINE=%g is short for a spare: the healthy ranks "
                        "wait in their round while a lost node is found (FLASHCKPT_NODE_TIMEOUT="
                        "%g) and taken; give it at least %g s", deadline, timeout,
                        timeout + DEADLINE_MARGIN_S)  # fmt: skip
        # One standby a rank of a node while it waits; the node's usual spare standbys
        # (FLASHCKPT_STANDBY) once it runs ranks (``Supervisor.adopt``).
        self.standbys_after = supervisor.standbys.count
        supervisor.standbys.count = int(self.args.nproc_per_node)
        script = self.args.training_script
        supervisor.standbys.script = ["-m", script] if self.args.module else [script]
        supervisor.standbys.fill()
        supervisor.falls_back_when_ended = True  # outside the rendezvous: it joins restarts
        self.agent = self._warm_agent()
        # Published until it is: the listener lives as long as this process.
        self.reach = listen_for_probes(self.name, lambda: supervisor.store, self.args,
                                       threading.Event())  # fmt: skip
        halt = threading.Event()
        threading.Thread(target=self._announce, args=(supervisor.standbys, halt), daemon=True,
                         name="flashckpt-spare-warm").start()  # fmt: skip
        try:
            lost, silent, join = asyncio.run(wait_for_node(self.job, self.name, self.run_dir,
                                                           halt))  # fmt: skip
        finally:
            halt.set()  # the standbys are taken from here on: no more looking at them
        if (not lost or join) and self.agent is not None:  # a launcher starts its own
            from .reap import reap

            reap(self.agent, None, self.events, "stopping the spare's agent")
        if not lost:
            supervisor.close()
            return 0
        if join:
            return self._become(lost, f"more nodes were lost than spares were free: spare "
                                      f"{self.name} joins the job's restart as node {lost}")  # fmt: skip
        told = time.monotonic()
        log.warning("spare %s takes the ranks of lost node %s", self.name, lost)
        try:
            target = self._take(supervisor, lost)
        except Exception as exc:  # the store out of reach too: the restart takes over
            log.error("spare %s cannot take node %s: %s", self.name, lost, exc)
            self.events.record("spare_failed", lost_node=lost, reason=str(exc)[:300])
            return self._become(lost, f"spare {self.name} could not run node {lost} "
                                      "in-process: it joins the restart as that node")  # fmt: skip
        return self._supervise(supervisor, lost, target, told, silent)

    def _announce(self, standbys: Any, halt: threading.Event) -> None:
        """Say when every standby is warm (``spare_ready``): from then on a node taken costs no
        start-up. (The spare is handed nodes from its first report, warm or not.)"""
        began = time.monotonic()
        while not halt.wait(0.2):
            try:
                warm = standbys.warm()
            except (OSError, ValueError):  # a standby taken meanwhile (its pipe closed)
                return
            if warm >= standbys.count or time.monotonic() - began > 120:
                log.info("spare node %s of job %s: %d of %d standbys warm, waiting for a node to "
                         "be lost", self.name, self.job, warm, standbys.count)  # fmt: skip
                self.events.record("spare_ready", standbys=standbys.count, warm=warm,
                                   seconds=round(time.monotonic() - began, 3))  # fmt: skip
                return

    def _take(self, supervisor: Any, lost: str) -> int:
        """Hand each of ``lost``'s ranks to a standby in the job's next round; that round."""
        from .inprocess import NAMESPACE_ENV, ROUND_ENV, last_round, move_round
        from .inprocess_agent import Member, Recovery

        store = supervisor.store
        if not store.check([node_key(lost)]):
            raise FlashCkptError(f"node {lost} never published its workers (lost while starting)")
        record = json.loads(store.get(node_key(lost)).decode())
        ns, ranks = record["ns"], {int(r): env for r, env in record["ranks"].items()}
        if (run := current_run(store, self.job)) != ns:
            raise FlashCkptError(f"node {lost} published the workers of run {ns!r}, and the job "
                                 f"runs {run or 'none'!r} now: it restarts whole")  # fmt: skip
        died_in = max((last_round(store, ns, r) for r in ranks), default=0)
        # Marked before the round moves: the node's own launcher, if it still runs, looks for
        # the mark when it sees the round move, and stops its workers.
        mark_replaced(store, self.job, lost, self.name, ns)
        target = move_round(store, ns, died_in, None)
        store.append(f"flashckpt/{ns}/replaced", f"{lost},")
        # From here on this process is the lost node: its agent, events, ranks and training
        # address (``reach``) bear its name.
        os.environ["FLASHCKPT_NODE"] = lost
        if self.reach is not None:
            self.reach.publish(store, lost)
        self.events = EventLog(self.events.path)
        self._start_agent()
        members: dict[int, Member] = {}
        try:
            for rank, delta in sorted(ranks.items(), key=lambda x: int(x[1].get("LOCAL_RANK", 0))):
                taken = supervisor.standbys.take()
                if taken is None:
                    raise FlashCkptError(f"no live standby left for rank {rank}")
                proc, warm = taken
                local = int(delta.get("LOCAL_RANK", len(members)))
                env = {**os.environ, **delta, ROUND_ENV: str(target), NAMESPACE_ENV: ns}
                members[local] = Member(rank, proc.pid, env, proc)
                proc.stdin.write(json.dumps({"env": env, "args": record["args"],
                                             "cwd": os.getcwd()}) + "\n")  # fmt: skip
                proc.stdin.close()
                self.events.record("replacement_started", rank=rank, round=target, pid=proc.pid,
                                   warm=warm, spare=self.name)  # fmt: skip
        except BaseException:
            from .reap import reap

            for m in members.values():  # half a node must not join the round
                reap(m.replacement, m.rank, self.events, "taking a lost node")
            raise
        supervisor.standbys.count = self.standbys_after
        supervisor.adopt(members, record["args"], int(record["world"]),
                         Recovery(target, time.monotonic(), sorted(ranks)), holder=self.name)  # fmt: skip
        return target

    def _warm_agent(self) -> subprocess.Popen | None:
        """A process with the node agent's modules imported (about a second of imports), to
        become this node's agent under the name of the node it takes (``_start_agent``)."""
        from ..safe_paths import open_file
        from .agent_client import AgentClient
        from .standby import WARM_ENV

        logfile = open_file(AgentClient.log_path(self.job, self.run_dir),
                            os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # fmt: skip
        try:  # its own session, as a started agent has: it outlives this launcher's group
            return subprocess.Popen(
                [sys.executable, "-u", "-m", "flashckpt.faults.standby"], stdin=subprocess.PIPE,
                stdout=logfile, stderr=logfile, start_new_session=True, text=True,
                env={**os.environ, WARM_ENV: "flashckpt.agent.cli,flashckpt.agent.daemon"},
            )  # fmt: skip
        except OSError as exc:
            log.warning("spare %s: no warm agent (%s); one starts when a node is taken",
                        self.name, exc)  # fmt: skip
            return None
        finally:
            os.close(logfile)

    def _start_agent(self) -> None:
        """The warm agent becomes this node's agent (the keeper starts one if it is gone)."""
        from .agent_client import agent_args

        if self.agent is None or self.agent.poll() is not None:
            return
        args = agent_args(self.job, self.run_dir, self.shm_dir, ("--while-pid", str(os.getpid())))
        with contextlib.suppress(OSError):
            self.agent.stdin.write(json.dumps({"env": dict(os.environ), "args": args,
                                               "cwd": os.getcwd()}) + "\n")  # fmt: skip
            self.agent.stdin.close()

    def _supervise(self, supervisor: Any, lost: str, target: int, told: float,
                   silent: float) -> int:  # fmt: skip
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        from .agent_keeper import AgentKeeper
        from .culprit import JobCulprit
        from .hang import HangPolicy
        from .inprocess import STORE_ENV
        from .inprocess_agent import round_prefix

        culprits = JobCulprit.connect(os.environ[STORE_ENV], lost, round_prefix, self.reach)
        watch = NodeWatch(self.shm_dir, self.job, self.events, HangPolicy.from_env(),
                          interval=0.1, one_at_a_time=True, culprits=culprits,
                          leave=lambda why: leave(self.run_dir, self.job, self.events, why,
                                                  watch.halted))  # fmt: skip
        watch.start()
        keeper = AgentKeeper(self.job, self.run_dir, self.shm_dir)

        def keep(halt: threading.Event) -> None:
            halt.wait(AGENT_START_S)  # the warm agent's own start first, not a second agent
            keeper.run(halt)

        threading.Thread(target=keep, args=(watch.halted,), daemon=True,
                         name="flashckpt-agent-keeper").start()  # fmt: skip
        pids = {m.pid for m in supervisor.members.values()}
        formed_at: float | None = None
        recorded = False
        failed = RunResult(state=WorkerState.FAILED)
        try:
            while True:
                result = supervisor.monitor(lambda: failed, _Done())
                if result.state == WorkerState.SUCCEEDED:
                    if not supervisor.fenced:  # another spare took the node: no barrier
                        supervisor.finished_together(EXIT_BARRIER_S)  # as every node's launcher
                    supervisor.close()  # the idle standbys
                    return 0
                if result.state == WorkerState.FAILED:
                    break
                if formed_at is None and supervisor.recovery is None:
                    formed_at = time.monotonic()
                if formed_at is not None and not recorded:
                    recorded = self._replaced(lost, target, pids, told, formed_at, silent)
                time.sleep(0.1)
        finally:
            watch.stop()
        return self._become(lost, f"spare {self.name}'s in-process run of node {lost} ended (its "
                                  "recovery gave up): it joins the restart as that node")  # fmt: skip

    def _replaced(self, lost: str, target: int, pids: set[int], told: float, formed_at: float,
                  silent: float) -> bool:  # fmt: skip
        """Record ``node_replaced_in_process`` once every rank taken has restored; whether it
        did."""
        restored = [e for e in read_events(self.events.path)
                    if e["kind"] == "restored" and e.get("pid") in pids]  # fmt: skip
        if len(restored) < len(pids):
            return False
        steps = sorted({e.get("step") for e in restored}, key=str)
        sources = sorted({str(e.get("source")) for e in restored})
        restore_s = max(float(e.get("seconds") or 0.0) for e in restored)
        self.events.record("node_replaced_in_process", spare=self.name, lost_node=lost,
                           round=target, step=steps[0] if len(steps) == 1 else steps,
                           sources=sources, detect_s=round(silent, 3),
                           round_s=round(formed_at - told, 3), restore_s=round(restore_s, 3),
                           ranks=sorted(e.get("rank") for e in restored))  # fmt: skip
        log.info("node %s replaced in-process by spare %s: round %d formed %.2fs after it was "
                 "handed over (found lost after %.2fs of silence), ranks restored step %s from %s",
                 lost, self.name, target, formed_at - told, silent, steps, sources)  # fmt: skip
        return True

    def _become(self, lost: str, why: str) -> int:
        """Run ``flashckpt-run`` again as node ``lost`` (no longer a spare): the job's full
        restart waits for every node, this one included."""
        from .inprocess_agent import RecoveringAgent

        log.error("spare %s: %s", self.name, why)
        self.events.record("inprocess_fallback", reason=why)
        supervisor = RecoveringAgent.supervisor
        with contextlib.suppress(Exception):
            unmark_replaced(supervisor.store, self.job, lost, self.name)
        supervisor.close()  # and the run ends: the restart is a new one
        os.close(self.claim)
        env = {**self.launch_env, "FLASHCKPT_NODE": lost}
        env.pop(ENV, None)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "flashckpt.faults.launcher", *self.argv],
                  env)  # fmt: skip
        return 1  # not reached


class _Done:
    """The worker context ``Supervisor.monitor`` closes on success: a spare's ranks are its
    own children, reaped by their ``Popen``."""

    def close(self) -> None:
        pass
