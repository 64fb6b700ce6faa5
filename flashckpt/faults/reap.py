"""Waiting on a killed worker, bounded: a kill that does not take.

A process held in the kernel (in uninterruptible sleep on a hung NFS server or a wedged
driver, or frozen) does not die of SIGKILL until the kernel lets it go, which may be never.
``flashckpt-run`` therefore never waits on a killed child for more than ``KILL_TAKES_S``: one
that outlives its SIGKILL is logged (its pid, rank and state in ``/proc``), recorded in the
event log (``kill_not_taken``) and left behind. Its SIGKILL stays pending: it dies the moment
the kernel lets it go, without running another instruction of its own (``pidfile.doomed``),
so the rank's next process takes the rank's slots over from it (``SlotPair.claim``) and the
job goes on without it:

- under in-process recovery the launcher counts such a worker lost and hands its rank to a
  standby (``inprocess_agent.Supervisor``, with ``Overdue``);
- under the restart policy ``BoundedAgent`` reports it as a failed worker (killed), and
  TorchElastic restarts the worker group;
- stopping a worker group never waits for it: TorchElastic's ``SubprocessContext._close``
  (which, before torch 2.13, waits forever on a process that outlived its SIGKILL) is
  replaced on the agent's worker context by a bounded one (``bound_close``); the launcher's
  own children (standbys, replacements) are stopped with ``reap``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
import types
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ..pidfile import doomed
from . import preempt
from .events import EventLog
from .proc import parent_and_state

log = logging.getLogger(__name__)

KILL_TAKES_S = 3.0
"""How long a SIGKILL may stay pending before the process counts as held in the kernel: a
process killed in user space takes it at once (dying may take longer, but then it is no longer
pending)."""

_left: set[tuple[int, str]] = set()  # the processes reported left behind (``_identity``)


def _identity(pid: int) -> tuple[int, str]:
    """``pid`` and its start time (``/proc``): one process, whatever reuses its pid later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        return pid, raw[raw.rfind(")") + 2 :].split()[19]
    except (OSError, IndexError):
        return pid, ""


def was_left(pid: int) -> bool:
    """Whether process ``pid`` was reported left behind already (see ``left_behind``)."""
    return _identity(pid) in _left


def left_behind(pid: int, rank: int | str | None, events: EventLog | None, where: str) -> None:
    """Report ``pid`` (rank ``rank``) as a process that outlived its SIGKILL, once for each."""
    if was_left(pid):
        return
    _left.add(_identity(pid))
    state = parent_and_state(pid)[1] or "gone"
    log.error("rank %s (pid %s) outlived its SIGKILL (seen %s): it is held in the kernel, in "
              "state %s (D: uninterruptible sleep, as in a hung file system or a wedged driver), "
              "and is left behind; its kill stays pending: it never runs again, and dies if the "
              "kernel ever lets it go", rank, pid, where, state)  # fmt: skip
    if events is not None:
        events.record("kill_not_taken", rank=rank, worker_pid=pid, process_state=state,
                      kill_pending=doomed(pid), where=where)  # fmt: skip


def reap(proc: subprocess.Popen, rank: int | str | None, events: EventLog | None, where: str,
         timeout: float = KILL_TAKES_S) -> bool:  # fmt: skip
    """SIGKILL a child and wait for it for at most ``timeout`` (not at all for one left behind
    already); whether it died (one that did not is reported, see ``left_behind``, and left)."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
    try:
        proc.wait(0 if was_left(proc.pid) else timeout)
        return True
    except subprocess.TimeoutExpired:
        left_behind(proc.pid, rank, events, where)
        return False


class Overdue:
    """Tells the processes killed whose kill has not taken: a SIGKILL pending for more than
    ``grace`` seconds (each reported once, see ``left_behind``)."""

    def __init__(self, events: EventLog | None, grace: float = KILL_TAKES_S):
        self.events, self.grace = events, grace
        self._since: dict[int, float] = {}  # pid -> when its pending SIGKILL was first seen

    def __call__(self, pid: int, rank: int | str | None, where: str) -> bool:
        if not doomed(pid):
            self._since.pop(pid, None)
            return False
        first = self._since.setdefault(pid, time.monotonic())
        if time.monotonic() - first < self.grace:
            return False
        left_behind(pid, rank, self.events, where)
        return True


def bound_close(pcontext: Any, events: EventLog | None) -> None:
    """Make stopping ``pcontext`` (TorchElastic's worker processes) bounded (see the module
    doc); a context of another kind than a ``SubprocessContext`` is left as it is."""
    if pcontext is None or not hasattr(pcontext, "subprocess_handlers"):
        return

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        close_bounded(self, events, death_sig, timeout)

    pcontext._close = types.MethodType(_close, pcontext)


def close_bounded(pcontext: Any, events: EventLog | None, death_sig: signal.Signals,
                  timeout: float = 30) -> None:  # fmt: skip
    """TorchElastic's ``SubprocessContext._close``, bounded: ``death_sig`` to every worker
    still running, up to ``timeout`` for them to exit (not for one killed already: it takes no
    other signal first), SIGKILL to the rest and ``KILL_TAKES_S`` for them (none for one left
    behind already); one still there is reported (``left_behind``) and left."""
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    running = {lr: h for lr, h in handlers.items() if h.proc.poll() is None}
    for h in running.values():
        log.warning("sending process %d closing signal %s", h.proc.pid, death_sig.name)
        _signal(h, death_sig)
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(
        h.proc.poll() is None and not doomed(h.proc.pid) for h in running.values()
    ):
        time.sleep(0.02)
    running = {lr: h for lr, h in running.items() if h.proc.poll() is None}
    for h in running.values():
        _signal(h, signal.SIGKILL)
    end = time.monotonic() + KILL_TAKES_S
    for lr, h in running.items():
        if not was_left(h.proc.pid):  # one left behind already had its time
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.proc.wait(max(end - time.monotonic(), 0.01))
        if h.proc.poll() is None:
            rank = (getattr(pcontext, "envs", {}).get(lr) or {}).get("RANK", "")
            left_behind(h.proc.pid, int(rank) if rank.isdigit() else f"local {lr}", events,
                        "stopping the worker group")  # fmt: skip


def _signal(handler: Any, sig: signal.Signals) -> None:
    """``sig`` to a worker's process group (TorchElastic's handler), the worker gone or not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        handler.close(death_sig=sig)


class BoundedAgent(LocalElasticAgent):
    """TorchElastic's agent, with a worker that outlived its SIGKILL reported as failed (so the
    group restarts without it) and its worker group stopped within a bound (``bound_close``);
    an etcd rendezvous that restarts is waited for (``rdzv_away``)."""

    _overdue: Overdue | None = None

    def __init__(self, spec: Any, *args: Any, **kwargs: Any):
        from .rdzv_away import be_patient

        be_patient(spec.rdzv_handler)  # etcd restarting ends no healthy node's workers
        super().__init__(spec, *args, **kwargs)
        preempt.watch(self)  # a preemption stops its workers

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        bound_close(self._pcontext, EventLog.from_env())
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if preempt.requested() and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._remaining_restarts = 0  # the job is leaving: no restart
        if result.state != WorkerState.HEALTHY or self._pcontext is None:
            return result
        if self._overdue is None:
            self._overdue = Overdue(EventLog.from_env())
        for local, pid in self._pcontext.pids().items():
            worker = worker_group.workers[local]
            if self._overdue(pid, worker.global_rank, "watching the workers"):
                failure = ProcessFailure(local_rank=local, pid=pid,
                                         exitcode=-int(signal.SIGKILL), error_file="")  # fmt: skip
                return RunResult(state=WorkerState.FAILED,
                                 failures={worker.global_rank: failure})  # fmt: skip
        return result


def install() -> None:
    """Make ``torch.distributed.run`` use ``BoundedAgent`` for this launcher's workers (the
    restart policy's; in-process recovery's ``RecoveringAgent`` is one)."""
    import torch.distributed.launcher.api as launcher_api

    if not issubclass(launcher_api.LocalElasticAgent, BoundedAgent):
        launcher_api.LocalElasticAgent = BoundedAgent  # type: ignore[misc]
