"""``flashckpt-run``: torchrun with flashckpt's fault tolerance, one per node.

It takes exactly torchrun's arguments and runs ``torch.distributed.run`` (TorchElastic's
``LocalElasticAgent`` and rendezvous) with three additions:

- restarts work across nodes with an unchanged ``init_process_group()``: every rendezvous
  round gets a fresh store (rank 0 hosts a new one on a new port) instead of the agent's shared
  store, where the previous attempt's keys make the new workers' gloo/NCCL connect time out;
- ``FLASHCKPT_JOB`` is stable across reruns of the same command (``--rdzv-id``, else derived
  from the command line) and printed, so a rerun resumes;
- a watchdog (``node_watch``) reads this node's heartbeat pages, records worker starts and
  exits in the event log, and kills a hung worker after its stacks are logged, so TorchElastic
  restarts the worker group (and, through the rendezvous, every other node's); a worker whose
  kill does not take (held in the kernel) is reported and left behind, never waited for
  (``reap``);
- it keeps this node's agent running and, where it can bind the controller's address (the
  rendezvous host), serves the job's controller: the agents report to it, and on a failed
  worker or a lost node it has every node's agent kill the failed round's workers, so ranks
  blocked in a collective with a dead peer are released and every node restarts at once.

Under ``FLASHCKPT_RESTART_POLICY=in-process`` it also reaches the job's recovery store and has
a lost worker replaced by a warm standby instead (``inprocess_agent``); with ``--spare`` it
runs no workers and serves the job as a spare node (``spare``). ``main`` settles the node's
settings (``settle``), then runs either the spare (``run_spare``) or the workers
(``run_workers``).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .. import config
from ..errors import FlashCkptError
from ..pidfile import PidFileBusy, lock_pidfile
from ..safe_paths import private_dir
from . import control, preempt
from .addresses import serve_here
from .agent_keeper import AgentKeeper
from .descriptors import require_for_node
from .events import ENV as EVENTS_ENV
from .events import EventLog, events_path
from .hang import HangPolicy
from .heartbeat import remove_dead
from .launcher_help import print_help, wants_help
from .node_watch import NodeWatch
from .preempt import Preemption
from .reach import leave, listen_for_probes
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


def start_controller(args, job: str, run_dir: Path, events: EventLog,
                     serve: bool = True) -> InThread | None:  # fmt: skip
    """Serve the controller here if ``serve``, its address is this host's and no other
    process serves it (``addresses.serve_here``), and tell this node's agent where it is; None
    when this node only reports to it (a spare never serves it), or runs without one."""
    from ..agent.controller import Controller, InThread

    address = control.controller_address(args)
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
    host, port = control.split_address(control.controller_address(args))
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
    install(events, local, deadline, standbys, serves_store=isinstance(keep, StoreGate))
    log.info("in-process recovery: %d warm standby(s), rounds form within %.0fs", standbys,
             deadline)  # fmt: skip
    return keep


def _replaced_here(job: str) -> bool:
    """Whether a spare node took this node's ranks while it was lost: then it must not join
    the rendezvous (the job would restart whole for it), and serves as the job's spare."""
    from .inprocess_agent import RecoveringAgent
    from .spare_marks import was_replaced

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


@dataclass
class Launch:
    """What this launcher settled before any worker starts (``settle``), and what it holds
    until it exits."""

    args: Any  # torchrun's arguments
    argv: list[str]  # flashckpt-run's, less --spare
    launch_env: dict[str, str]  # what a spare runs this launcher again with, as a node
    spare: bool
    job: str
    policy: HangPolicy
    restart_policy: str
    shm_dir: Path
    run_dir: Path
    claim: int  # the job's claim on this node (``claim_job``)
    events: EventLog
    controller: InThread | None
    recovery_store: Any = None  # what ``in_process`` returned: closed on exit
    preemption: Preemption | None = None  # a node that runs workers: its notice's handling


def settle(args, argv: list[str], spare: bool, launch_env: dict[str, str]) -> Launch:
    """Read and check this node's settings, claim the job here, open its event log and serve
    (or find) the job's controller: all a launcher refuses to start without."""
    job = job_for(args)
    policy = HangPolicy.from_env()
    restart_policy = control.policy()
    config.check_agent_settings()  # the agent it keeps reads them
    preempt.check_settings()
    require_for_node(args.nproc_per_node)  # inherited by the workers and the agent
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
    return Launch(args, argv, launch_env, spare, job, policy, restart_policy, shm_dir, run_dir,
                  claim, events, controller)  # fmt: skip


def run_spare(launch: Launch) -> NoReturn:
    """Serve the job as a spare node (``spare.Spare``) until it ends, then exit with its code."""
    from .spare import Spare

    began = time.monotonic()
    run_dir, job = launch.run_dir, launch.job
    try:
        code = Spare(launch.args, launch.argv, job, EventLog(launch.events.path),
                     launch.launch_env, launch.claim).run()  # fmt: skip
    finally:
        launch.recovery_store.close()
        control.file_path(run_dir, job).unlink(missing_ok=True)
        control.launcher_path(run_dir, job).unlink(missing_ok=True)
    launch.events.record("launcher_exited", ok=code == 0, seconds=time.monotonic() - began)
    # Not through the interpreter's teardown: a daemon thread of its watch in a store call
    # then (the store served elsewhere may be gone) takes the process down with SIGABRT.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_workers(launch: Launch) -> None:
    """Run this node's workers under TorchElastic, with the node's watchdog and agent keeper,
    until the job ends here; then give up what the launcher held."""
    from torch.distributed import run as torchrun

    job, events, inplace = launch.job, launch.events, launch.restart_policy == "in-process"
    culprits, reach, halt = None, None, threading.Event()
    if inplace:
        from .culprit import JobCulprit
        from .inprocess import STORE_ENV
        from .inprocess_agent import round_prefix

        culprits = JobCulprit.connect(os.environ[STORE_ENV], config.node_name(), round_prefix)
        culprits.reach = reach = listen_for_probes(config.node_name(), lambda: culprits.store,
                                                   launch.args, halt)  # fmt: skip
    else:  # in-process recovery's agent bounds them already
        from .reap import install as bound_waits_on_killed_workers

        bound_waits_on_killed_workers()
    # Under in-process recovery a hang costs its detection plus a replacement's second: the
    # pages (a few per node) are read ten times a second.
    watch = NodeWatch(launch.shm_dir, job, events, launch.policy,
                      interval=0.1 if inplace else 0.25, one_at_a_time=inplace,
                      culprits=culprits,
                      leave=lambda why: leave(launch.run_dir, job, events, why, watch.halted))  # fmt: skip
    watch.start()
    keeper = AgentKeeper(job, launch.run_dir, launch.shm_dir)
    threading.Thread(target=keeper.run, args=(watch.halted,), daemon=True,
                     name="flashckpt-agent-keeper").start()  # fmt: skip
    started, ended, code = time.monotonic(), False, None
    try:
        torchrun.run(launch.args)
        ended = True
    except BaseException as exc:
        if not preempt.requested():  # workers a preemption stopped fail: that is its end
            events.record("launcher_exited", ok=False, error=type(exc).__name__,
                          seconds=time.monotonic() - started)  # fmt: skip
            raise
    finally:
        halt.set()
        watch.stop()
        if reach is not None:
            reach.close()
        # Before the controller stops: the other nodes' agents write under its lease.
        if launch.preemption is not None:
            code = launch.preemption.finish()
        clean_up(launch, ended or code is not None)
    if code is not None:
        events.record("launcher_exited", ok=False, preempted=True,
                      seconds=time.monotonic() - started)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    events.record("launcher_exited", ok=True, seconds=time.monotonic() - started)


def clean_up(launch: Launch, ended: bool) -> None:
    """What a launcher that ran its workers holds, given up once they are done: the controller
    it served, its files in the run directory, its claim on the job and the recovery store.

    The controller file goes (its agent's writes are not leased any more: the job is over
    here, what it holds may drain everywhere) when the run ``ended`` or this launcher served
    the controller. A launcher that failed while reporting to another node's controller (the
    rendezvous out of reach: this node may be cut off, and a spare may hold its ranks) leaves
    it: its agent keeps taking that controller's word, and drains no shared tier without it."""
    run_dir, job = launch.run_dir, launch.job
    if launch.controller is not None:
        launch.controller.end_job(job)
        launch.controller.stop()
    if ended or launch.controller is not None:
        control.file_path(run_dir, job).unlink(missing_ok=True)
    control.launcher_path(run_dir, job).unlink(missing_ok=True)  # still held: given up
    os.close(launch.claim)
    if launch.recovery_store is not None:
        launch.recovery_store.close()
        from .inprocess import ROUND_FILE_ENV

        Path(os.environ[ROUND_FILE_ENV]).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """``flashckpt-run``: torchrun's arguments (and ``--spare``), from the command line when
    ``argv`` is None."""
    from torch.distributed import run as torchrun

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[flashckpt-run] %(levelname)s %(message)s")
    launch_env = dict(os.environ)  # what a spare runs this launcher again with, as a node
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help()
    try:
        argv, spare = split_flag(argv)
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-run: {exc}")
    args = torchrun.parse_args(argv)
    try:
        launch = settle(args, argv, spare, launch_env)
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-run: {exc}")
    # A fresh store per rendezvous round: rank 0 of the workers hosts it on a new port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if launch.restart_policy == "in-process":
        try:
            launch.recovery_store = in_process(args, launch.events, launch.shm_dir, launch.job,
                                               launch.controller is not None)  # fmt: skip
        except FlashCkptError as exc:
            sys.exit(f"flashckpt-run: {exc}")
    if launch.recovery_store is not None and not launch.spare:
        launch.spare = _replaced_here(launch.job)
    os.environ["FLASHCKPT_JOB"] = launch.job
    os.environ[EVENTS_ENV] = str(launch.events.path)
    log.info("job %s; event log %s", launch.job, launch.events.path)
    launch.events.record("launcher_started", job=launch.job, argv=argv,
                         hang_policy=launch.policy.__dict__, spare=launch.spare)  # fmt: skip
    if launch.spare:
        run_spare(launch)
    launch.preemption = Preemption(launch.job, launch.run_dir, launch.shm_dir, launch.events,
                                   launch.controller)  # fmt: skip
    launch.preemption.install(args)
    try:
        run_workers(launch)
    except Exception:  # the workers failed, or the rendezvous cannot be reached
        # Not through the interpreter's teardown (see ``run_spare``): a thread still in a store
        # call then aborts the process, and the exit status says SIGABRT instead of 1.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
