"""``flashckpt-run``: torchrun with flashckpt's fault tolerance, one per node.

It takes exactly torchrun's arguments and runs ``torch.distributed.run`` (TorchElastic's
``LocalElasticAgent`` and rendezvous) with three additions:

- restarts work across nodes with an unchanged ``init_process_group()``: every rendezvous
  round gets a fresh store (rank 0 hosts a new one on a new port) instead of the agent's shared
  store, where the previous attempt's keys make the new workers' gloo/NCCL connect time out;
- ``FLASHCKPT_JOB`` is stable across reruns of the same command (``--rdzv-id``, else derived
  from the command line) and printed, so a rerun resumes;
- a watchdog reads this node's heartbeat pages, records worker starts and exits in the event
  log, and kills a hung worker after its stacks are logged, so TorchElastic restarts the
  worker group (and, through the rendezvous, every other node's);
- it keeps this node's agent running and, where it can bind the controller's address (the
  rendezvous host), serves the job's controller: the agents report to it, and on a failed
  worker or a lost node it has every node's agent kill the failed round's workers, so ranks
  blocked in a collective with a dead peer are released and every node restarts at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import config
from ..errors import FlashCkptError
from ..pidfile import PidFileBusy, lock_pidfile
from ..safe_paths import private_dir
from . import control
from .addresses import serve_here
from .agent_keeper import AgentKeeper
from .events import ENV as EVENTS_ENV
from .events import EventLog, events_path
from .hang import Hang, HangPolicy, Watchdog
from .heartbeat import Phase, heartbeat_path, pages, read, remove_dead
from .proc import parent_and_state
from .spare import split_flag

if TYPE_CHECKING:
    from ..agent.controller import InThread

log = logging.getLogger(__name__)


def job_for(args) -> str:
    """FLASHCKPT_JOB, else the rendezvous id when it names the run, else one derived from
    the command (the same for every rerun of it, and on every node)."""
    if os.environ.get("FLASHCKPT_JOB"):
        return config.validate_name("job", os.environ["FLASHCKPT_JOB"], "FLASHCKPT_JOB")
    rdzv = getattr(args, "rdzv_id", "none") or "none"
    if not args.standalone and rdzv != "none":
        return config.validate_name("job", rdzv, "--rdzv-id")
    command = [args.training_script, *args.training_script_args]
    derived = None if args.module else config.job_from_command(command)
    return derived or config.derived_name(args.training_script, command)  # python -m module


class NodeWatch(threading.Thread):
    """Polls this node's heartbeat pages of ``job``: logs worker starts and exits, and kills
    a hung worker (its stacks logged first)."""

    def __init__(self, shm_dir: Path, job: str, events: EventLog, policy: HangPolicy,
                 interval: float = 0.25, one_at_a_time: bool = False,
                 culprits: Any = None):  # fmt: skip
        """``one_at_a_time`` (in-process recovery): of the ranks found hung together, only
        the likely culprit is killed (see ``_culprit``); the others, blocked in a collective
        with it, are not judged again before its replacement has started (at most the
        start-up budget) and had the hang floor to join them. ``culprits`` (a
        ``culprit.JobCulprit``): the culprit is the job's, agreed with the other nodes, and
        this node kills it only if it runs it."""
        super().__init__(name="flashckpt-watchdog", daemon=True)
        self.shm_dir, self.job = shm_dir, job
        self.watchdog = Watchdog(shm_dir, job, policy)
        self.events, self.interval = events, interval
        self.one_at_a_time, self.floor = one_at_a_time, policy.floor
        self._quiet_until = 0.0
        self._startup = policy.startup
        self._replacing: tuple[Hang, float] | None = None  # the culprit killed, and when
        self.seen: dict[int, int] = {}  # pid -> rank, of our live workers
        self.culprits = culprits
        self._round_seen: str | None = None  # the round prefix of the last poll
        self._halt = self.halted = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.poll()
            except Exception:  # the watchdog must never take the launcher down
                log.exception("watchdog poll failed")

    def poll(self) -> None:
        workers = self._workers()
        for rank, pid in workers.items():
            if pid not in self.seen:
                self.seen[pid] = rank
                self.events.record("worker_started", rank=rank, worker_pid=pid)
        me = os.getpid()
        for pid, rank in list(self.seen.items()):
            if parent_and_state(pid)[0] == me:
                continue
            del self.seen[pid]
            # A worker that closed its Checkpointer removed its page (or marked it closed);
            # one that died left it as it was at its last sign of life.
            beat = read(heartbeat_path(self.shm_dir, self.job, rank))
            if beat is None or beat.pid != pid or beat.phase == Phase.CLOSED:
                self.events.record("worker_finished", rank=rank, worker_pid=pid)
            else:
                self.events.record("worker_exited", rank=rank, worker_pid=pid, step=beat.step,
                                   phase=beat.phase.name.lower(),
                                   silent_s=time.monotonic() - beat.updated_at)  # fmt: skip
        silences = self.watchdog.silences(workers)
        hangs = [h for h in silences if h.silent_s > h.timeout_s]
        # The store is asked only while a rank here is silent past half the floor: blocked
        # with a culprit elsewhere, or about to be judged (a quiet node costs the store nothing).
        suspect = bool(self._suspects(silences))
        if self.culprits is not None:
            self._note_round()
        if self.one_at_a_time and (hangs or (self.culprits is not None and suspect)):
            if self._awaiting_replacement() or time.monotonic() < self._quiet_until:
                hangs = []
            elif self.culprits is not None:
                hangs = self._jobs_culprit(silences, hangs)
            else:
                hangs = [self._culprit(silences)]
            if hangs:
                self._replacing = hangs[0], time.monotonic()
                self._quiet_until = time.monotonic() + self.floor
        states = {h.pid: parent_and_state(h.pid)[1] for h in hangs}
        # A stopped worker first: its dump needs it continued, and it must not die first of
        # the SIGTERM TorchElastic sends once another worker is killed (a stopped process
        # with SIGTERM's default action dies at once). Each is killed right after its dump.
        for hang in sorted(hangs, key=lambda h: states[h.pid] != "T"):
            log.error(
                "rank %d (pid %d) is hung: no progress for %.1fs in its %s phase at step %s "
                "(timeout %.1fs); dumping its stacks and killing it so the job restarts",
                hang.rank, hang.pid, hang.silent_s, hang.phase, hang.step, hang.timeout_s,
            )  # fmt: skip
            self.events.record("hang_detected", rank=hang.rank, worker_pid=hang.pid,
                               phase=hang.phase, step=hang.step, silent_s=hang.silent_s,
                               timeout_s=hang.timeout_s,
                               process_state=states[hang.pid])  # fmt: skip
            stacks = self.watchdog.stacks(hang.rank, hang.pid, stopped=states[hang.pid] == "T")
            self.events.record("stacks", rank=hang.rank, worker_pid=hang.pid, stacks=stacks)
            with contextlib.suppress(ProcessLookupError):
                os.kill(hang.pid, signal.SIGKILL)  # a stopped process dies too
            self.events.record("killed", rank=hang.rank, worker_pid=hang.pid, signal="SIGKILL")

    def _note_round(self) -> None:
        """A move of the job to a new round means a fault was handled meanwhile (a culprit
        killed on another node, a crash): ranks here silent with it get the floor to join."""
        try:
            prefix = self.culprits.where()
        except Exception:
            return
        if prefix != self._round_seen:
            if self._round_seen is not None:
                self._quiet_until = max(self._quiet_until, time.monotonic() + self.floor)
            self._round_seen = prefix

    def _awaiting_replacement(self) -> bool:
        """Whether the rank last killed as a culprit has no new process yet: the ranks
        blocked with it wait for that one (however long a loaded node takes to start it)."""
        if self._replacing is None:
            return False
        killed, at = self._replacing
        beat = read(heartbeat_path(self.shm_dir, self.job, killed.rank))
        if beat is not None and beat.pid != killed.pid:  # the replacement has its page
            self._replacing = None
            self._quiet_until = time.monotonic() + self.floor
            return True
        if time.monotonic() - at > self._startup:  # never replaced here: judge again
            self._replacing = None
            return False
        return True

    def _jobs_culprit(self, silences: list[Hang], hangs: list[Hang]) -> list[Hang]:
        """The job's culprit, if it runs here (see ``culprit``); [] while the nodes agree, or
        when it runs elsewhere."""
        from .culprit import Suspect

        node = self.culprits.node
        mine = [Suspect.of(node, h) for h in self._suspects(silences)]
        try:
            decided = self.culprits.decide(mine, judged=bool(hangs))
        except Exception as exc:  # the store out of reach: judge alone, as without it
            log.warning("the job's culprit cannot be agreed on (%s): judging this node alone",
                        exc)  # fmt: skip
            decided = Suspect.of(node, self._culprit(silences)) if hangs else None
        if decided is None:
            return []
        if decided.node != node:
            # Ranks here were blocked with it: they recover once its replacement joins. Not
            # judged again before they have had the hang floor to (as on its own node).
            self._quiet_until = max(self._quiet_until, time.monotonic() + self.floor)
            return []
        return [h for h in silences if (h.rank, h.pid) == (decided.rank, decided.pid)]

    def _suspects(self, silences: list[Hang]) -> list[Hang]:
        """The ranks silent past half the hang floor, whatever their phase's own timeout: a
        rank hung in ``save()`` (five minutes) is a suspect as soon as the peers blocked on it
        (thirty seconds) are."""
        return [h for h in silences if h.silent_s > min(h.timeout_s, self.floor) / 2]

    def _culprit(self, silences: list[Hang]) -> Hang:
        """Of ranks hung together (one past its timeout, the others silent at least half the
        floor: blocked in a collective with it, or about to be judged), the likely cause, by
        the evidence their pages carry (``collectives.likeliest``), within its own phase's
        budget or not."""
        from .collectives import likeliest

        return likeliest(self._suspects(silences))

    def _workers(self) -> dict[int, int]:
        """{rank: pid} of the live workers of this launcher that have a heartbeat page."""
        me = os.getpid()
        return {rank: beat.pid for rank, beat in pages(self.shm_dir, self.job)
                if parent_and_state(beat.pid)[0] == me}  # fmt: skip


def claim_job(run_dir: Path, job: str) -> int:
    """Claim the job on this node for this launcher (held until it exits): a second launcher
    of the same job here would take over the first one's agent and have its workers killed."""
    try:
        return lock_pidfile(control.launcher_path(run_dir, job))
    except PidFileBusy as busy:
        raise FlashCkptError(
            f"job {job!r} already runs on this node under flashckpt-run ({busy.holder()}); stop "
            "it first, or give this run its own job name (--rdzv-id or FLASHCKPT_JOB)"
        ) from None


def controller_address(args) -> str:
    """FLASHCKPT_CONTROLLER, else the rendezvous host with the rendezvous port + 1 (any free
    port on 127.0.0.1 when standalone)."""
    if os.environ.get("FLASHCKPT_CONTROLLER"):
        control.split_address(os.environ["FLASHCKPT_CONTROLLER"])  # host:port, or ConfigError
        return os.environ["FLASHCKPT_CONTROLLER"]
    if args.standalone or not args.rdzv_endpoint:
        return "127.0.0.1:0"
    endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint else f"{args.rdzv_endpoint}:29400"
    host, port = control.split_address(endpoint, "--rdzv-endpoint")
    return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"


def start_controller(args, job: str, run_dir: Path, events: EventLog,
                     serve: bool = True) -> InThread | None:  # fmt: skip
    """Serve the controller here if ``serve``, its address is this host's and no other
    process serves it (``addresses.serve_here``), and tell this node's agent where it is; None
    when this node only reports to it (a spare never serves it), or runs without one."""
    from ..agent.controller import Controller, InThread

    address = controller_address(args)
    token = control.token_from_env()
    single = args.standalone or str(args.nnodes) in ("1", "1:1")
    if token is None and not single:
        log.warning("no FLASHCKPT_CONTROLLER_TOKEN(_FILE): the nodes run without a controller "
                    "(a lost node is not detected; hangs and exits still are, per node)")  # fmt: skip
        return None
    token = token or secrets.token_hex(32)  # one node: nobody else to agree with
    env = os.environ.get
    uses_tls = bool(env("FLASHCKPT_CONTROLLER_TLS_CERT") or env("FLASHCKPT_CONTROLLER_TLS_CA"))
    served: InThread | None = None
    if not serve:
        pass
    elif uses_tls and not env("FLASHCKPT_CONTROLLER_TLS_KEY"):
        log.info("no FLASHCKPT_CONTROLLER_TLS_KEY here: this node reports to the controller "
                 "and does not serve it")  # fmt: skip
    else:
        tls = control.Tls.from_env(server=True) if uses_tls else None
        bind = env("FLASHCKPT_CONTROLLER_BIND") or address

        def serve() -> InThread:
            made = InThread(Controller(events, control.policy()), bind, token, tls)
            made.start_serving()
            return made

        served = serve_here(*control.split_address(bind), serve, "the controller")
        if served is not None:
            host = control.split_address(address)[0]
            address = f"[{host}]:{served.port}" if ":" in host else f"{host}:{served.port}"
            log.info("controller serving on %s (policy %s)", address, served.controller.policy)
            events.record("controller_started", address=address, policy=served.controller.policy)
        else:
            log.info("this node reports to the controller at %s", address)
    control.Endpoint(address, token, uses_tls).save(run_dir, job)
    return served


def recovery_store_address(args) -> str:
    """Where the job's recovery store is reached: FLASHCKPT_RECOVERY_STORE, else the
    controller's host with its port + 1 (on every node alike)."""
    from .inprocess import STORE_ENV

    if os.environ.get(STORE_ENV):
        control.split_address(os.environ[STORE_ENV], STORE_ENV)
        return os.environ[STORE_ENV]
    host, port = control.split_address(controller_address(args))
    return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"


def in_process(args, events: EventLog, shm_dir: Path, job: str, serves_controller: bool) -> Any:
    """Set up in-process recovery: this node's way to the job's recovery store (the store
    itself where this launcher serves the controller, or runs alone; a tunnel to it
    otherwise, see ``store_gate``), its loopback address for the workers, the warm standbys
    and the agent that replaces a lost worker. Returns what must stay referenced."""
    from .descriptors import clients_needed, prepare_store, raise_soft_limit
    from .inprocess import ROUND_FILE_ENV, STORE_ENV, Budget, nccl_environment
    from .inprocess_agent import install
    from .store_gate import LoopbackStore, StoreGate, StoreTunnel

    Budget.from_env()  # a bad FLASHCKPT_RECOVERY_BUDGET fails here, not in every worker
    for name, value in nccl_environment(os.environ).items():  # inherited by every worker
        os.environ[name] = value

    single = args.standalone or str(args.nnodes) in ("1", "1:1")
    raise_soft_limit()  # the store, or this node's tunnel, holds descriptors per client
    if single:  # nobody else to reach it: the store on loopback alone
        prepare_store(clients_needed(1, args.nproc_per_node))
        keep: Any = LoopbackStore()
        local = f"127.0.0.1:{keep.port}"
    else:
        token = control.token_from_env()
        if token is None:
            raise FlashCkptError(
                "in-process recovery across nodes needs the job's token, which the recovery "
                "store asks of every node: set FLASHCKPT_CONTROLLER_TOKEN_FILE (or "
                "FLASHCKPT_CONTROLLER_TOKEN) on every node, as for the controller"
            )
        address = recovery_store_address(args)
        host, port = control.split_address(address, "the recovery store")
        # The store lives with the controller: the node that serves one serves the other.
        gate = serve_here(host, port, lambda: StoreGate(host, port, token.encode()),
                          "the job's recovery store") if serves_controller else None  # fmt: skip
        if gate is not None:
            keep = gate
            local = f"127.0.0.1:{gate.store_port}"
            log.info("serving the job's recovery store on %s", gate.address)
            try:
                prepare_store(clients_needed(args.nnodes, args.nproc_per_node))
            except FlashCkptError:
                gate.close()
                raise
        else:
            keep = StoreTunnel(host, port, token.encode())
            local = keep.address
            log.info("reaching the job's recovery store at %s through %s", address, local)
    os.environ[STORE_ENV] = local
    # The round this node's ranks are in, relayed by the launcher (see RoundRelay).
    os.environ[ROUND_FILE_ENV] = str(private_dir(shm_dir, "shm_dir") / f"{job}.recovery-round")
    deadline = config.setting_float("recovery_deadline", None, 30.0, lo=1.0)
    standbys = int(config.setting_float("standby", None, 1.0, lo=0.0))
    install(events, local, deadline, standbys)
    log.info("in-process recovery: %d warm standby(s), rounds form within %.0fs", standbys,
             deadline)  # fmt: skip
    return keep


def _replaced_here(job: str) -> bool:
    """Whether a spare node took this node's ranks while it was lost: then it must not join
    the rendezvous (the job would restart whole for it), and serves as the job's spare."""
    from .inprocess_agent import RecoveringAgent
    from .spare import was_replaced

    try:
        spare = was_replaced(RecoveringAgent.supervisor.store, config.node_name(), job)
    except Exception as exc:  # the store out of reach: the rendezvous decides, as before
        log.warning("cannot tell whether a spare took this node's ranks: %s", exc)
        return False
    if spare is None:
        return False
    # Under a name of its own: the node's name is the spare's now.
    os.environ["FLASHCKPT_NODE"] = config.validate_name("node", f"{config.node_name()}-spare")
    log.warning("spare node %s runs this node's ranks since this node was lost: this node now "
                "serves the job as spare node %s", spare, config.node_name())  # fmt: skip
    return True


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[flashckpt-run] %(levelname)s %(message)s")
    launch_env = dict(os.environ)  # what a spare runs this launcher again with, as a node
    try:
        argv, spare = split_flag(sys.argv[1:] if argv is None else argv)
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-run: {exc}")
    args = torchrun.parse_args(argv)
    try:
        job = job_for(args)
        policy = HangPolicy.from_env()
        restart_policy = control.policy()
        config.check_agent_settings()  # the agent it keeps reads them
        shm_dir = config.shm_dir()
        run_dir = private_dir(config.run_dir(), "run_dir")
        claim = claim_job(run_dir, job)
        if stale := remove_dead(shm_dir, job):  # the job's only launcher here: none is ours
            log.info("removed the heartbeat pages of ranks %s, left by an earlier run", stale)
        events = EventLog(events_path(run_dir, job))
        several = not (args.standalone or str(args.nnodes) in ("1", "1:1"))
        if spare and (restart_policy != "in-process" or not several):
            raise FlashCkptError(
                "a spare node (--spare, FLASHCKPT_SPARE) takes a lost node's ranks in-process: "
                "it needs FLASHCKPT_RESTART_POLICY=in-process and a job of several nodes "
                f"(--nnodes); this one has policy {restart_policy!r}, --nnodes={args.nnodes}"
            )
        controller = start_controller(args, job, run_dir, events, serve=not spare)
        if spare and control.Endpoint.load(run_dir, job) is None:
            raise FlashCkptError(
                "a spare node hears of a lost node from the job's controller: set "
                "FLASHCKPT_CONTROLLER_TOKEN_FILE (or FLASHCKPT_CONTROLLER_TOKEN) as on every node"
            )
        if several and control.Endpoint.load(run_dir, job) is not None:
            # Each node's newest step in another node's memory: a lost node comes back from
            # there, not from storage. The agent and the workers read it from here.
            os.environ.setdefault("FLASHCKPT_PEER_REPLICAS", "1")
            config.peer_replicas()  # a bad value fails here, not in every worker
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-run: {exc}")
    # A fresh store per rendezvous round: rank 0 of the workers hosts it on a new port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    recovery_store = None
    if restart_policy == "in-process":
        try:
            recovery_store = in_process(args, events, shm_dir, job, controller is not None)
        except FlashCkptError as exc:
            sys.exit(f"flashckpt-run: {exc}")
    if recovery_store is not None and not spare:
        spare = _replaced_here(job)
    os.environ["FLASHCKPT_JOB"] = job
    os.environ[EVENTS_ENV] = str(events.path)
    log.info("job %s; event log %s", job, events.path)
    events.record("launcher_started", job=job, argv=argv, hang_policy=policy.__dict__,
                  spare=spare)  # fmt: skip
    if spare:
        from .spare import Spare

        began = time.monotonic()
        try:
            code = Spare(args, argv, job, EventLog(events.path), launch_env, claim).run()
        finally:
            recovery_store.close()
            control.file_path(run_dir, job).unlink(missing_ok=True)
            control.launcher_path(run_dir, job).unlink(missing_ok=True)
        events.record("launcher_exited", ok=code == 0, seconds=time.monotonic() - began)
        # Not through the interpreter's teardown: a daemon thread of its watch in a store call
        # then (the store served elsewhere may be gone) takes the process down with SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    culprits = None
    if restart_policy == "in-process":
        from .culprit import JobCulprit
        from .inprocess import STORE_ENV
        from .inprocess_agent import round_prefix

        culprits = JobCulprit.connect(os.environ[STORE_ENV], config.node_name(), round_prefix)
    # Under in-process recovery a hang costs its detection plus a replacement's second: the
    # pages (a few per node) are read ten times a second.
    inplace = restart_policy == "in-process"
    watch = NodeWatch(shm_dir, job, events, policy, interval=0.1 if inplace else 0.25,
                      one_at_a_time=inplace, culprits=culprits)  # fmt: skip
    watch.start()
    keeper = AgentKeeper(job, run_dir, shm_dir)
    threading.Thread(target=keeper.run, args=(watch.halted,), daemon=True,
                     name="flashckpt-agent-keeper").start()  # fmt: skip
    started = time.monotonic()
    try:
        torchrun.run(args)
    except BaseException as exc:
        events.record("launcher_exited", ok=False, error=type(exc).__name__,
                      seconds=time.monotonic() - started)  # fmt: skip
        raise
    finally:
        watch.stop()
        if controller is not None:
            controller.end_job(job)
            controller.stop()
        control.file_path(run_dir, job).unlink(missing_ok=True)
        control.launcher_path(run_dir, job).unlink(missing_ok=True)  # still held: given up
        os.close(claim)
        if recovery_store is not None:
            recovery_store.close()
            from .inprocess import ROUND_FILE_ENV

            Path(os.environ[ROUND_FILE_ENV]).unlink(missing_ok=True)
    events.record("launcher_exited", ok=True, seconds=time.monotonic() - started)


if __name__ == "__main__":
    main()
