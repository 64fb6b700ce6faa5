"""``flashckpt-run``'s side of in-process recovery (``FLASHCKPT_RESTART_POLICY=in-process``).

TorchElastic restarts a node's whole worker group when one worker exits. Here its
``LocalElasticAgent`` is extended instead: a worker that dies (killed, or hung and killed by
the watchdog) is replaced by one of the node's warm standbys, which joins the round the
survivors move to (``inprocess.Rounds``), and the other workers keep running. The worker
group's own monitoring would terminate every worker at the first failure, so the workers are
watched here, their exit statuses read from ``/proc`` without reaping them. Whenever the
recovery cannot finish (no standby, a round that does not form within its deadline, a worker
that gave up on it) every worker is killed and TorchElastic restarts the group as before; the
event log says why. A worker that crashes after closing its Checkpointer (its last step done)
is not a fault: it is logged and left alone. A worker killed whose kill does not take (held in
the kernel: a hung file system, a wedged driver) counts as lost once its SIGKILL has been
pending for ``reap.KILL_TAKES_S``: it is reported, left behind and its rank replaced, and no
wait on a killed child here is unbounded (``reap``).

A node that a spare node took while it was found lost (its agent silent, the node alive) is
fenced here too: when its launcher sees the job's round move, or a worker of its own fail, it
looks for the spare's mark (``spare_marks.was_replaced``) and, found, kills its workers (each a
second claimant of a rank the spare holds now), replaces none, and ends without the exit
barrier.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from .. import config
from ..safe_paths import write_atomic
from . import preempt
from .events import EventLog, read_events
from .heartbeat import Phase, heartbeat_path
from .heartbeat import read as read_beat
from .inprocess import (
    EXIT_GAVE_UP,
    EXIT_GROUP_ENDED,
    NAMESPACE_ENV,
    ROUND_ENV,
    ROUND_FILE_ENV,
    end_rounds,
    last_round,
    move_round,
    namespace,
    restore_round,
)
from .reap import BoundedAgent, Overdue, reap
from .spare_marks import (
    mark_replaced,
    publish_node,
    run_ended,
    run_key,
    run_started,
    was_replaced,
)
from .standby import READY_FD_ENV, SCRIPT_ENV
from .store_client import StoreClient, forget, on_new_store

log = logging.getLogger(__name__)


def exit_status(pid: int) -> int | None:
    """A child's exit code (negative: killed by that signal) once it has exited, read from
    ``/proc`` so that it stays unreaped for TorchElastic; None while it runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return -1  # gone already: reaped elsewhere, its status unknown
    if fields[0] not in ("Z", "X"):
        return None
    status = int(fields[-1])
    return -(status & 0x7F) if status & 0x7F else status >> 8


class Standbys:
    """The node's warm standbys: started ahead, torch imported, waiting for a rank."""

    def __init__(self, count: int, events: EventLog):
        self.count, self.events = count, events
        self.idle: list[tuple[subprocess.Popen, int, float]] = []  # (process, ready pipe, since)
        self.script: list[str] = []  # the workers' command line: its imports are warmed too

    def fill(self) -> None:
        self.idle = [s for s in self.idle if s[0].poll() is None]
        while len(self.idle) < self.count:
            read, write = os.pipe()
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "flashckpt.faults.standby"], stdin=subprocess.PIPE,
                env={**os.environ, READY_FD_ENV: str(write), SCRIPT_ENV: json.dumps(self.script)},
                pass_fds=(write,), text=True,
            )  # fmt: skip
            os.close(write)
            self.idle.append((proc, read, time.monotonic()))

    def take(self) -> tuple[subprocess.Popen, bool] | None:
        """A live standby (and whether it is warm already), the readiest first."""
        self.idle = [s for s in self.idle if s[0].poll() is None]
        if not self.idle:
            return None
        self.idle.sort(key=lambda s: not _readable(s[1]))
        proc, read, _ = self.idle.pop(0)
        warm = _readable(read)
        os.close(read)
        return proc, warm

    def warm(self) -> int:
        """How many idle standbys are warm (their imports done)."""
        return sum(_readable(read) for proc, read, _ in list(self.idle) if proc.poll() is None)

    def close(self) -> None:
        for proc, read, _ in self.idle:
            os.close(read)
            reap(proc, "none (a standby)", self.events, "closing the standbys")
        self.idle = []


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@dataclass
class Member:
    """A rank of this node and the process that holds it now."""

    rank: int
    pid: int
    env: dict[str, str]
    replacement: subprocess.Popen | None = None
    finished: bool = False  # closed its Checkpointer, then crashed: done, not lost


@dataclass
class Recovery:
    """A round the workers are moving to, from the launcher's side."""

    round: int
    began: float
    ranks: list[int]
    replacement_s: float | None = None


RELAY_PATIENCE_S = 2.0  # how long one look of the round relay waits for a lost store
LAST_WORD_S = 5.0  # how long a launcher that stops its workers waits for a lost store
LEAVING_S = 10.0  # how long the launcher serving the store waits for the others to leave it


class RoundRelay(threading.Thread):
    """Relays the job's round to this node's ranks: the launcher looks at the store every
    ``interval`` for the round to be over and writes the new round to the node's round file,
    which the ranks' watches read (``inprocess.NodeRound``). The store sees a few requests a
    second per node while the job trains, however many ranks the node runs, and none from the
    ranks themselves."""

    def __init__(self, address: tuple[str, int], ns: str, path: Path, interval: float = 0.25):
        super().__init__(name="flashckpt-round-relay", daemon=True)
        self.address, self.ns, self.path, self.interval = address, ns, path, interval
        self.halt = threading.Event()
        self.round: int | None = None  # the round last relayed (the supervisor looks)

    def run(self) -> None:
        key = f"flashckpt/{self.ns}"
        round: int | None = None
        store: StoreClient | None = None
        away: float | None = None  # since when the store has not answered
        while not self.halt.wait(0 if round is None else self.interval):
            try:
                if store is None:  # a short window: the relay looks again, and may be halted
                    store = StoreClient(*self.address, timeout=RELAY_PATIENCE_S)
                if round is None or store.check([f"{key}/round-{round}/over"]):
                    now = int(store.get(f"{key}/round").decode()) if store.check(
                        [f"{key}/round"]) else 0  # fmt: skip
                    if now != round:
                        round = now
                        write_atomic(self.path, str(round).encode())
                        self.round = round
                if away is not None:
                    log.warning("the recovery store answers again after %.1fs",
                                time.monotonic() - away)  # fmt: skip
                    away = None
            except Exception as exc:  # the store away: training goes on, look again
                if away is None:
                    away = time.monotonic()
                    log.warning("the recovery store does not answer (%s): training goes on; "
                                "a fault meanwhile restarts every worker",
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
                store = None


class Supervisor:
    def __init__(self, events: EventLog, store_address: str, deadline: float, standbys: int,
                 serves_store: bool = False):  # fmt: skip
        from .control import split_address

        host, port = split_address(store_address, "the recovery store")
        self.address = (host, port)
        self._store: Any = None
        self.store  # noqa: B018  (connected now: the store must answer before workers start)
        on_new_store(self._put_back)
        self.relay: RoundRelay | None = None
        self._published: tuple[str, list[str], int, dict[int, dict]] | None = None
        self.events, self.deadline = events, deadline
        self.standbys = Standbys(standbys, events)
        self.members: dict[int, Member] = {}  # local rank -> member
        self.args: tuple[str, ...] = ()
        self.world = 0
        self.recovery: Recovery | None = None
        self.recovered = 0
        # The job, for its marks in the store: its event log is <run_dir>/<job>.events.jsonl
        # (the workers' FLASHCKPT_JOB says it once they start).
        self.job = events.path.name.removesuffix(".events.jsonl")
        self.holder = ""  # the node (or spare node) whose ranks this launcher runs
        self.fenced = ""  # the spare that took this node's ranks, once this launcher knows
        self._round_seen: int | None = None
        self.overdue = Overdue(events)  # a worker killed whose kill has not taken: lost
        self.serves_store = serves_store  # the store lives in this launcher: it leaves last
        # Where workers leave a group another launcher ended (EXIT_GROUP_ENDED): a node's
        # launcher waits for TorchElastic's restart (it costs no --max-restarts), a spare,
        # outside the rendezvous, falls back to join it (set by the spare).
        self.falls_back_when_ended = False
        self._ended_at: float | None = None
        self._said_ended = False  # the run's end said in the exit barrier (see finished_together)

    @property
    def ns(self) -> str:
        """The store keys' namespace of this launcher's worker group (it has members)."""
        return namespace(next(iter(self.members.values())).env)

    # ---- the worker group's life ------------------------------------------------------
    def started(self, wg: WorkerGroup, pids: dict[int, int], envs: dict[int, dict]) -> None:
        """The worker group TorchElastic just started (``pids``: local rank -> pid; ``envs``:
        local rank -> the variables it set for that worker over the launcher's own)."""
        self.members.clear()
        self.recovery = None
        self._said_ended = False
        self._ended_at = None
        self.falls_back_when_ended = False  # TorchElastic's workers: a node of the rendezvous
        self.args = tuple(wg.spec.args)
        self.standbys.script = list(self.args)
        self.holder = config.node_name()
        for w in wg.workers:
            env = {**os.environ, **envs[w.local_rank]}
            self.members[w.local_rank] = Member(w.global_rank, pids[w.local_rank], env)
            self.world = w.world_size
            self.job = env.get("FLASHCKPT_JOB") or self.job
        ns = self.ns
        self._relay(ns)
        self.standbys.fill()
        self._published = (ns, list(self.args), self.world,
                           {w.global_rank: envs[w.local_rank] for w in wg.workers})  # fmt: skip
        try:  # what a spare node needs to take this node's ranks if the node is lost whole
            run_started(self.store, self.job, ns)
            publish_node(self.store, config.node_name(), *self._published)
        except Exception as exc:  # the store out of reach: no spare can take this node
            log.warning("this node's workers are not published for a spare node: %s", exc)

    def adopt(self, members: dict[int, Member], args: list[str], world: int, recovery: Recovery,
              holder: str) -> None:  # fmt: skip
        """A spare node's start: ``members`` (local rank -> the standby now running it) took
        a lost node's ranks, and join ``recovery``'s round; ``holder``: the spare's name."""
        self.holder = holder
        self.members = dict(members)
        self.args, self.world, self.recovery = tuple(args), world, recovery
        self._relay(self.ns)
        self.standbys.fill()

    def _put_back(self, store: Any) -> None:
        """The recovery store restarted (``store_client``): put back what this node knows. The
        job's round and the round each of this node's ranks is in (the newest of: the round
        its process claimed it in, the one its replacement joins, the relay's), then, for a
        node running its own ranks, the job's current run and what a spare needs to take them;
        for a spare running a lost node's, its mark on that node."""
        if not self.members:
            return
        ns = self.ns
        relayed = self.relay.round if self.relay is not None else None
        claimed, rec = self._claimed(), self.recovery
        ranks = {m.rank: max(relayed or 0, claimed.get(m.rank, 0),
                             rec.round if rec is not None and m.rank in rec.ranks else 0)
                 for m in self.members.values()}  # fmt: skip
        if relayed is not None or claimed or rec is not None:
            now = restore_round(store, ns, max(ranks.values()), ranks)
            log.warning("recovery store put back: round %d of %s", now, ns)
        node = config.node_name()
        if self.holder != node:  # a spare: it holds ``node``'s ranks
            mark_replaced(store, self.job, node, self.holder, ns)
            store.append(f"flashckpt/{ns}/replaced", f"{node},")
        elif self._published is not None and self._published[0] == ns:
            store.compare_set(run_key(self.job), "", ns)
            publish_node(store, node, *self._published)

    def _claimed(self) -> dict[int, int]:
        """The newest round each rank's current process claimed it in (its ``rank_claimed``
        events in the node's event log): the rank's own word, which the relay may lag."""
        holders = {m.pid: m.rank for m in self.members.values()}
        rounds: dict[int, int] = {}
        try:
            events = read_events(self.events.path)
        except OSError:
            return rounds
        for e in events:
            rank, round = holders.get(e.get("pid")), e.get("round")
            if e["kind"] == "rank_claimed" and rank is not None and type(round) is int:
                rounds[rank] = max(rounds.get(rank, 0), round)
        return rounds

    def _relay(self, ns: str) -> None:
        if path := os.environ.get(ROUND_FILE_ENV):  # a new worker group: a new namespace
            self._stop_relay()
            self.relay = RoundRelay(self.address, ns, Path(path))
            self.relay.start()

    def node_replaced(self) -> bool:
        """Whether a spare node took a lost node's ranks in this worker group (that node's
        launcher is gone: TorchElastic's exit barrier would wait for it in vain)."""
        if not self.members:
            return False
        key = f"flashckpt/{self.ns}/replaced"
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def finished_together(self, timeout: float) -> None:
        """The exit barrier of a worker group a spare took a node of (TorchElastic's waits
        for the lost node's launcher): count this node finished in the recovery store and wait
        up to ``timeout`` for every node (the world over this node's ranks).

        Where the store lives in a launcher (``serves_store``), that launcher leaves last: the
        others, once they saw every node finished, say the run ended and count themselves gone,
        and it waits (``LEAVING_S`` at most) until all have. Without that, a node still looking
        at the count when the serving launcher exited waited out its reconnect window (30 s)
        for a store that was gone."""
        if not self.members:
            return
        prefix = f"flashckpt/{self.ns}"
        nodes = max(1, self.world // len(self.members))
        try:
            done = self._count_until(f"{prefix}/finished", nodes, time.monotonic() + timeout)
            if done < nodes:
                log.warning("exit barrier: %d of %d nodes finished within %.0fs", done, nodes,
                            timeout)  # fmt: skip
                return
            if not self.serves_store:
                self._end_run(self.store)
                self._said_ended = True
            leaving = time.monotonic() + (LEAVING_S if self.serves_store else 0.0)
            self._count_until(f"{prefix}/leaving", nodes, leaving)
        except Exception as exc:  # the store gone: the others have finished or cannot
            log.info("exit barrier: %s", exc)

    def _count_until(self, key: str, nodes: int, deadline: float) -> int:
        """Count this node in ``key``, then look until ``nodes`` are or ``deadline`` passes."""
        done = int(self.store.add(key, 1))
        while done < nodes and time.monotonic() < deadline:
            time.sleep(0.1)
            done = int(self.store.add(key, 0))
        return done

    def _end_run(self, store: Any) -> None:
        if self.members:
            run_ended(store, self.job, self.ns)
            end_rounds(store, self.ns)

    def stop(self) -> None:
        """Kill the replacements (TorchElastic stops the workers it started), and end the
        job's run: its workers stop for a restart, or have finished (a fenced node's launcher
        leaves the run to the spare)."""
        for m in self.members.values():
            if m.replacement is not None and m.replacement.poll() is None:
                reap(m.replacement, m.rank, self.events, "stopping a replacement")
        if self.members and not self.fenced and not self._said_ended:
            with contextlib.suppress(Exception):  # the store gone: so is the run
                store = self._store or StoreClient(*self.address, timeout=LAST_WORD_S)
                with store.patience(LAST_WORD_S):  # a courtesy: the next run says its own
                    self._end_run(store)

    def close(self) -> None:
        self.stop()
        self.standbys.close()
        self._stop_relay()
        forget(self._put_back)

    def _stop_relay(self) -> None:
        """End the relay before the process exits (a thread in a store call at exit takes
        the process down)."""
        if self.relay is not None:
            self.relay.halt.set()
            self.relay.join(self.relay.interval + 10)
            self.relay = None

    # ---- watching ---------------------------------------------------------------------
    @property
    def store(self) -> Any:
        """The launcher's client of the job's recovery store, connected again after a failure
        (``monitor``)."""
        if self._store is None:
            self._store = StoreClient(*self.address, timeout=30)
        return self._store

    def monitor(self, original: Any, pcontext: Any) -> RunResult:
        """One look at the workers (``_monitor``); where the recovery store cannot be reached,
        the fallback: every worker restarts, and the next look connects to the store again."""
        try:
            return self._monitor(original, pcontext)
        except dist.DistError as exc:  # lost, or a store wait timed out
            self._store = None
            return self._fall_back(f"the recovery store cannot be reached "
                                   f"({str(exc).splitlines()[0]})", original)  # fmt: skip

    def _monitor(self, original: Any, pcontext: Any) -> RunResult:
        statuses = {lr: self._status(m) for lr, m in self.members.items()}
        for lr, status in statuses.items():
            if status not in (None, 0) and self._finished(self.members[lr], status):
                statuses[lr] = 0  # its work was done: nothing to recover
        if all(s == 0 for s in statuses.values()):
            pcontext.close()  # reaps the workers TorchElastic started (a replaced one failed)
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={m.rank: None for m in self.members.values()})  # fmt: skip
        failed = {lr: s for lr, s in statuses.items() if s not in (None, 0)}
        if (failed or self._round_moved()) and (spare := self.taken_by()):
            return self._fence(spare, pcontext)
        if self.recovery is not None and self._formed(self.recovery):
            self._record_recovered(self.recovery)
            self.recovery = None
        if failed and all(s == EXIT_GROUP_ENDED for s in failed.values()):
            return self._group_ended(original)
        if any(s == EXIT_GAVE_UP for s in failed.values()):
            return self._fall_back("a worker gave up on in-process recovery (its round did not "
                                   "form in time, the recovery budget was spent, or it raised "
                                   "the same error twice: see its log)", original)  # fmt: skip
        for lr, status in failed.items():  # those found together: one recovery
            # A fault while a round forms (a replacement, or a rank that arrived, died) is
            # one more rank to replace: the round moves on and every rank follows it.
            if not self._replace(self.members[lr], status):
                during = " during recovery" if self.recovery is not None else ""
                return self._fall_back(f"no standby was ready for rank {self.members[lr].rank}"
                                       f"{during}", original)  # fmt: skip
        if self.recovery is not None and time.monotonic() - self.recovery.began > self.deadline + 5:
            return self._fall_back(f"round {self.recovery.round} did not form within "
                                   f"{self.deadline:.0f}s", original)  # fmt: skip
        self.standbys.fill()
        return RunResult(state=WorkerState.HEALTHY)

    def _group_ended(self, original: Any) -> RunResult:
        """Workers left a worker group another launcher ended (it stopped its workers: the
        job restarts whole). A node's launcher waits for TorchElastic to see the restart's
        rendezvous (a restart that costs none of ``--max-restarts``), up to the recovery
        deadline; a spare falls back at once, to join the restart."""
        why = "the job's worker group ended (another launcher stopped its workers)"
        if self.falls_back_when_ended:
            return self._fall_back(why, original)
        now = time.monotonic()
        if self._ended_at is None:
            self._ended_at = now
            log.info("%s: waiting for the job's restart", why)
        if now - self._ended_at > self.deadline:
            return self._fall_back(f"{why}, and no restart came within {self.deadline:.0f}s",
                                   original)  # fmt: skip
        return RunResult(state=WorkerState.HEALTHY)

    def _round_moved(self) -> bool:
        """Whether the relay saw the job's round move since the last look."""
        now = self.relay.round if self.relay is not None else None
        moved, self._round_seen = now != self._round_seen, now
        return moved

    def taken_by(self) -> str | None:
        """The spare node that took this node's ranks in the job's current run, if another
        than this launcher (a spare running a node it took is its holder)."""
        try:
            spare = was_replaced(self.store, config.node_name(), self.job)
        except Exception as exc:  # the store out of reach: nobody can take the node either
            log.debug("cannot look for a spare's mark: %s", exc)
            return None
        return spare if spare is not None and spare != self.holder else None

    def _fence(self, spare: str, pcontext: Any) -> RunResult:
        """Stop this node's workers for good: spare node ``spare`` runs its ranks now."""
        ranks = sorted(m.rank for m in self.members.values())
        log.error("spare node %s took this node's ranks %s while this node was found lost (its "
                  "agent silent): this node's workers are stopped, none is replaced, and this "
                  "launcher ends; the job goes on with the spare", spare, ranks)  # fmt: skip
        self.events.record("node_fenced", spare=spare, ranks=ranks,
                           pids=sorted(m.pid for m in self.members.values()))  # fmt: skip
        self.fenced = spare
        self._end_originals()
        pcontext.close()  # reaps the workers TorchElastic started
        return RunResult(state=WorkerState.SUCCEEDED, return_values=dict.fromkeys(ranks))

    def _status(self, m: Member) -> int | None:
        """The exit status of rank ``m``'s process, None while it runs; -9 (killed) for one
        whose SIGKILL has not taken (``reap``): it is left behind, and its rank replaced."""
        status = m.replacement.poll() if m.replacement is not None else exit_status(m.pid)
        if status is None and self.overdue(m.pid, m.rank, "watching the workers"):
            return -int(signal.SIGKILL)
        return status

    def _finished(self, m: Member, status: int) -> bool:
        """Whether rank ``m`` exited with ``status`` after closing its Checkpointer (its last
        step done): a crash in its teardown, logged once and not recovered. Its page gone
        (closing removes it) and its own ``closed`` event in the node's event log tell."""
        if m.finished:
            return True
        beat = read_beat(heartbeat_path(config.shm_dir(), m.env.get("FLASHCKPT_JOB", ""), m.rank))
        if beat is not None and beat.pid == m.pid and beat.phase != Phase.CLOSED:
            return False  # died with its page open: a fault
        try:
            closed = any(e["kind"] == "closed" and e.get("pid") == m.pid
                         and e.get("rank") == m.rank for e in read_events(self.events.path))  # fmt: skip
        except OSError:
            closed = False
        if not closed:
            return False
        m.finished = True
        log.warning("rank %d (pid %d) exited with %s after closing its Checkpointer, its work "
                    "done: a crash in its teardown, not a fault; it is not replaced", m.rank,
                    m.pid, status)  # fmt: skip
        self.events.record("worker_crashed_after_closing", rank=m.rank, worker_pid=m.pid,
                           status=status)  # fmt: skip
        return True

    def _replace(self, m: Member, status: int) -> bool:
        """Hand rank ``m.rank`` to a standby, in the round after the one it died in."""
        taken = self.standbys.take()
        if taken is None:
            return False
        proc, warm = taken
        ns = namespace(m.env)
        died_in = last_round(self.store, ns, m.rank)
        beat = read_beat(heartbeat_path(config.shm_dir(), m.env.get("FLASHCKPT_JOB", ""), m.rank))
        target = move_round(self.store, ns, died_in, beat.step if beat is not None else None)
        env = {**m.env, ROUND_ENV: str(target), NAMESPACE_ENV: ns}
        proc.stdin.write(json.dumps({"env": env, "args": self.args, "cwd": os.getcwd()}) + "\n")
        proc.stdin.close()
        self.events.record("replacement_started", rank=m.rank, round=target, lost_pid=m.pid,
                           lost_status=status, pid=proc.pid, warm=warm)  # fmt: skip
        log.warning("rank %d (pid %d) exited with %s: its replacement (pid %d, a %s standby) "
                    "joins round %d", m.rank, m.pid, status, proc.pid,
                    "warm" if warm else "starting", target)  # fmt: skip
        m.pid, m.replacement = proc.pid, proc
        began = time.monotonic()
        if self.recovery is None or self.recovery.round < target:
            self.recovery = Recovery(target, began, [m.rank])
        else:
            self.recovery.ranks.append(m.rank)
        self.standbys.fill()
        return True

    def _formed(self, rec: Recovery) -> bool:
        """Whether ``rec`` is over: its round formed, or the later one the job moved on to
        (its replacement found the round moved on, and the job followed it there); then
        ``rec.round`` is the round that formed."""
        key = f"flashckpt/{self.ns}"
        now = int(self.store.get(f"{key}/round").decode()) if self.store.check(
            [f"{key}/round"]) else rec.round  # fmt: skip
        for round in sorted({rec.round, max(now, rec.round)}):
            joined = f"{key}/round-{round}/joined"
            if self.store.check([joined]) and int(self.store.add(joined, 0)) >= self.world:
                rec.round = round
                return True
        return False

    def _record_recovered(self, rec: Recovery) -> None:
        self.recovered += 1
        took = time.monotonic() - rec.began
        self.events.record("inprocess_recovered", round=rec.round, ranks=rec.ranks,
                           replacement_s=round(took, 3))  # fmt: skip
        log.info("round %d formed: rank(s) %s replaced in %.2fs, every other worker kept",
                 rec.round, rec.ranks, took)  # fmt: skip

    def _end_originals(self) -> None:
        """Kill the workers TorchElastic started here (replacements are this launcher's own)
        and stop watching them."""
        for m in self.members.values():
            if m.replacement is None:
                with contextlib.suppress(OSError):
                    os.kill(m.pid, signal.SIGKILL)
        self.stop()
        self.recovery = None

    def _fall_back(self, why: str, original: Any) -> RunResult:
        log.error("in-process recovery cannot finish (%s): restarting every worker", why)
        self.events.record("inprocess_fallback", reason=why,
                           round=self.recovery.round if self.recovery else None)  # fmt: skip
        self._end_originals()
        result = original()
        if result.state != WorkerState.FAILED:  # e.g. every original had exited already
            result = RunResult(state=WorkerState.FAILED)
        return result


class RecoveringAgent(BoundedAgent):
    """TorchElastic's agent, with a lost worker replaced in place (see the module doc)."""

    supervisor: Supervisor  # set by install()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # The workers' environments, as TorchElastic hands them to start_processes: what a
        # replacement needs to become one of them.
        envs: dict[int, dict] = {}
        original = local_elastic_agent.start_processes

        def start_processes(*args: Any, **kwargs: Any) -> Any:
            envs.update(kwargs["envs"])
            return original(*args, **kwargs)

        local_elastic_agent.start_processes = start_processes
        try:
            pids = super()._start_workers(worker_group)
        finally:
            local_elastic_agent.start_processes = original
        self.supervisor.started(worker_group, pids, envs)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        original = super()._monitor_workers
        if preempt.requested():  # the job is leaving: no worker is replaced
            return original(worker_group)
        return self.supervisor.monitor(lambda: original(worker_group), self._pcontext)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.supervisor.stop()
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.supervisor.close()
        super()._shutdown(*args, **kwargs)

    def _exit_barrier(self) -> None:
        # Every node's launcher waits here for all the others; a node taken by a spare has no
        # launcher in the rendezvous any more, and the spare waits in the recovery store
        # instead. Every node sees the same mark, so all wait there; a node's own launcher,
        # fenced, waits for nobody.
        if self.supervisor.fenced:
            return
        if self.supervisor.node_replaced():
            log.info("a spare node runs a lost node's ranks: waiting for every node to finish "
                     "in the recovery store")  # fmt: skip
            self.supervisor.finished_together(self._exit_barrier_timeout)
            return
        super()._exit_barrier()


def round_prefix() -> str | None:
    """The store's key prefix of the current round of this launcher's worker group (None
    before its workers started)."""
    supervisor = getattr(RecoveringAgent, "supervisor", None)
    relay = supervisor.relay if supervisor is not None else None
    if relay is None:
        return None
    try:
        round = int(relay.path.read_text() or "0")
    except (OSError, ValueError):
        return None
    return f"flashckpt/{relay.ns}/round-{round}"


def install(events: EventLog, store_address: str, deadline: float, standbys: int,
            serves_store: bool = False) -> None:  # fmt: skip
    """Make ``torch.distributed.run`` use RecoveringAgent for this launcher's workers, which
    reach the job's recovery store at ``store_address`` (on loopback, see ``store_gate``;
    ``serves_store``: the store lives in this launcher)."""
    import torch.distributed.launcher.api as launcher_api

    RecoveringAgent.supervisor = Supervisor(events, store_address, deadline, standbys,
                                            serves_store)  # fmt: skip
    launcher_api.LocalElasticAgent = RecoveringAgent  # type: ignore[misc]
