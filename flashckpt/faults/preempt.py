"""Preemption with a deadline: what ``flashckpt-run`` does when the scheduler asks the job to go.

A scheduler gives notice before it kills a job: SIGTERM and a grace period (Kubernetes'
``terminationGracePeriodSeconds``, Slurm's ``KillWait``), a signal ahead of time (Slurm's
``--signal``), or a file a hook writes (a Kubernetes ``preStop``). ``FLASHCKPT_PREEMPT_SIGNAL``
names the signals (``TERM`` by default), ``FLASHCKPT_PREEMPT_FILE`` the file. On notice, within
``FLASHCKPT_PREEMPT_BUDGET`` seconds:

1. the launcher leaves the job's mark in the run directory (``preempt_mark``): the node's agent
   persists the newest step every rank here holds to every tier past its throttles
   (``every_steps`` and the rest), and ``Checkpointer.preempted()`` turns True, so a training
   loop can stop at a step boundary and ``close()``;
2. workers still running at half the budget are stopped (SIGTERM, then SIGKILL), and
   TorchElastic restarts none of them (nor does in-process recovery replace them);
3. the launcher waits, until the deadline, for every tier but the peer replicas to hold the
   newest step every rank here holds. One that serves the job's controller then also waits
   for the other nodes' launchers to be done: their agents write the shared tiers under its
   lease;
4. it records ``preempted`` in the event log (the step, the tiers that hold it, those that do
   not and why), logs the same, and exits with ``EXIT_PREEMPTED`` (143, as a process ended by
   SIGTERM), so the scheduler counts the job as failed and requeues it. The requeued job's
   ``restore()`` finds that step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import config, preempt_mark
from ..errors import ConfigError
from . import heartbeat
from .events import EventLog
from .proc import parent_and_state

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 143
DEFAULT_BUDGET_S = 25.0  # inside the 30 s both Kubernetes and Slurm give by default
OTHERS_GONE_S = 3.0  # a node not heard from for this long has left (reports go every second)
_TORCHELASTIC = "TORCHELASTIC_SIGNALS_TO_HANDLE"
_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what TorchElastic handles unless told

_asked = threading.Event()  # this launcher's job is being preempted
_agent: Any = None  # TorchElastic's agent running this node's workers (``watch``)


def requested() -> bool:
    """Whether this launcher was given notice: its workers are not restarted any more."""
    return _asked.is_set()


def watch(agent: Any) -> None:
    """Know TorchElastic's agent, whose workers a preemption stops."""
    global _agent
    _agent = agent


def budget() -> float:
    return config.setting_float("preempt_budget", None, DEFAULT_BUDGET_S, lo=1.0)


def signals() -> list[signal.Signals]:
    """The signals that give notice: ``FLASHCKPT_PREEMPT_SIGNAL``, names separated by commas
    (``TERM,USR1``; ``SIG`` optional)."""
    raw = os.environ.get("FLASHCKPT_PREEMPT_SIGNAL", "TERM")
    out = []
    for name in filter(None, (n.strip().upper() for n in raw.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"FLASHCKPT_PREEMPT_SIGNAL={raw!r}: {name!r} is not a signal a process can "
                "handle; give names such as TERM or USR1, separated by commas"
            )
        out.append(sig)
    if not out:
        raise ConfigError("FLASHCKPT_PREEMPT_SIGNAL is empty: give TERM, or USR1, ...")
    return out


def notice_file() -> Path | None:
    raw = os.environ.get("FLASHCKPT_PREEMPT_FILE")
    return Path(raw) if raw else None


def check_settings() -> None:
    """Parse the settings now: a bad one fails where the job starts, not at its notice."""
    budget()
    signals()


@dataclass
class Outcome:
    step: tuple[int, int] | None = None  # (generation, step): the newest every rank here holds
    held: list[str] = field(default_factory=list)  # the tiers that hold it
    missing: dict[str, str] = field(default_factory=dict)  # tier -> why it does not

    def said(self) -> str:
        if self.step is None:
            return "no step saved here: nothing to persist"
        where = ", ".join(self.held) or "no tier"
        text = f"step {self.step[1]} is in {where}"
        if self.missing:
            text += "; not in " + "; ".join(f"{t} ({why})" for t, why in self.missing.items())
        return text


class Preemption:
    """This launcher's handling of a notice (see the module doc). ``install`` before the
    workers start; ``finish`` once TorchElastic returned: the exit code, or None."""

    def __init__(self, job: str, run_dir: Path, shm_dir: Path, events: EventLog,
                 serves_controller: Any = None):  # fmt: skip
        self.job, self.run_dir, self.shm_dir, self.events = job, run_dir, shm_dir, events
        self.controller = serves_controller
        self.budget, self.signals, self.file = budget(), signals(), notice_file()
        self.why = ""
        self.deadline = 0.0
        self._lock = threading.Lock()
        self._finishing = False
        self._finished = threading.Event()
        preempt_mark.clear(run_dir, job)  # an earlier run's notice is not this one's

    def install(self, args: Any) -> None:
        """Handle the notice signals here (TorchElastic, run with torchrun's ``args``, is told
        to leave them alone: its handler would end the workers at once) and watch the notice
        file."""
        ours = {s.name for s in self.signals}
        theirs = getattr(args, "signals_to_handle", None) or os.environ.get(_TORCHELASTIC, _DEFAULT)
        left = ",".join(n for n in theirs.split(",") if n.strip() and n.strip() not in ours)
        if hasattr(args, "signals_to_handle"):  # torchrun sets the variable from it
            args.signals_to_handle = left
        os.environ[_TORCHELASTIC] = left
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        if self.file is not None:
            threading.Thread(target=self._watch_file, daemon=True,
                             name="flashckpt-preempt-file").start()  # fmt: skip

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A handler runs in the main thread, which TorchElastic needs: the work goes elsewhere.
        why = signal.Signals(signum).name
        threading.Thread(target=self.ask, args=(why,), daemon=True).start()

    def _watch_file(self) -> None:
        while not _asked.is_set():
            if self.file is not None and self.file.exists():
                self.ask(f"file {self.file}")
                return
            time.sleep(0.5)

    def ask(self, why: str) -> None:
        """Take notice (once): mark the job, then stop the workers at half the budget, and
        exit at the deadline whatever TorchElastic is doing."""
        with self._lock:
            if _asked.is_set():
                log.info("notice again (%s): already leaving", why)
                return
            _asked.set()
            self.why = why
            began = time.monotonic()
            self.deadline = began + self.budget
        preempt_mark.write(self.run_dir, self.job, why, self.budget)
        log.warning("preempted (%s): persisting the newest step to every tier within %.0fs; "
                    "the workers can stop at a step boundary (Checkpointer.preempted())", why,
                    self.budget)  # fmt: skip
        self.events.record("preempt_asked", why=why, budget_s=self.budget)
        self._stop_workers(began + self.budget / 2)
        # TorchElastic returns once its workers are gone; one in a rendezvous, or waiting for
        # other nodes, may not: the deadline is kept all the same.
        if self._finished.wait(max(0.0, self.deadline - time.monotonic()) + 2.0):
            return
        if self._finishing:  # the launcher is past TorchElastic: it exits by itself
            return
        log.error("TorchElastic did not return by the preemption's deadline: exiting")
        os._exit(self.finish() or EXIT_PREEMPTED)

    def _stop_workers(self, at: float) -> None:
        while time.monotonic() < at and _workers():
            time.sleep(0.1)
        pids = _workers()
        if not pids:
            return
        log.warning("workers %s still run at half the preemption budget: stopping them", pids)
        self.events.record("preempt_stopping_workers", pids=pids)
        # Stopped on purpose: their exits are no failures for the controller to act on (it
        # would kill the other nodes' workers, which their own launchers stop in a moment).
        heartbeat.forget(self.shm_dir, self.job, pids)
        _end(pids, grace=min(3.0, max(0.5, (self.deadline - time.monotonic()) / 4)))

    def finish(self) -> int | None:
        """Once the workers are done: wait (until the deadline) for the tiers to hold the
        newest step, and, serving the controller, for the other nodes; record and log the
        outcome. ``EXIT_PREEMPTED``, or None where no notice came."""
        if not _asked.is_set():
            return None
        with self._lock:
            if self._finished.is_set():
                return EXIT_PREEMPTED
            self._finishing = True
            outcome = self._wait_durable()
            if self.controller is not None:
                self._wait_for_other_nodes()
            self._finished.set()
        said = outcome.said()
        (log.warning if outcome.missing or outcome.step is None else log.info)(
            "preempted (%s): %s", self.why, said
        )
        self.events.record(
            "preempted", why=self.why, step=None if outcome.step is None else outcome.step[1],
            generation=None if outcome.step is None else outcome.step[0], tiers=outcome.held,
            missing=outcome.missing, said=said,
        )  # fmt: skip
        return EXIT_PREEMPTED

    def _wait_durable(self) -> Outcome:
        from .agent_client import AgentClient

        client = AgentClient(self.job, self.run_dir)
        outcome = Outcome()
        try:
            while True:
                outcome = self._look(client)
                # A failing tier may come back within the budget: waited for too.
                done = outcome.step is None or not outcome.missing
                if done or time.monotonic() > self.deadline:
                    return outcome
                time.sleep(0.1)
        finally:
            client.close()

    def _look(self, client: Any) -> Outcome:
        step = _newest_held(self.shm_dir, self.job, _ranks())
        try:
            tiers = [t for t in client.tier_status(timeout=2) if not t.url.startswith("peer:")]
        except Exception as exc:  # no agent: nothing can be persisted from here
            why = f"the node's agent does not answer: {exc}"
            return Outcome(step, [], {} if step is None else {"every tier": why})
        committed = {t.url: (t.last_committed_generation, t.last_committed_step) for t in tiers}
        if step is None:  # the workers closed (their last step persisted, slots freed)
            step = max((k for k in committed.values() if k[1] >= 0), default=None)
            if step is None:
                return Outcome()
        out = Outcome(step)
        for t in tiers:
            shown = _shown(t.url)
            if committed[t.url] >= step:
                out.held.append(shown)
            elif t.last_error:
                out.missing[shown] = f"failing: {t.last_error}"
            else:
                out.missing[shown] = f"behind: its newest is step {t.last_committed_step}"
        if not tiers:
            out.missing["every tier"] = "the job names no tier but peer replicas"
        return out

    def _wait_for_other_nodes(self) -> None:
        me = config.node_name()
        while time.monotonic() < self.deadline:
            try:
                nodes = self.controller.controller.status(self.job).nodes
            except Exception:
                return
            if all(n.last_seen_s > OTHERS_GONE_S for n in nodes if n.node != me):
                return
            time.sleep(0.2)


def _workers() -> list[int]:
    """Pids of this node's workers still alive (zombies are not)."""
    pcontext = getattr(_agent, "_pcontext", None)
    if pcontext is None:
        return []
    try:
        pids = list(pcontext.pids().values())
    except Exception:
        return []
    return [p for p in pids if parent_and_state(p)[1]]


def _ranks() -> set[int] | None:
    group = getattr(_agent, "_worker_group", None)
    try:
        return {w.global_rank for w in group.workers} if group is not None else None
    except Exception:
        return None


def _end(pids: list[int], grace: float) -> None:
    """SIGTERM, then SIGKILL for those alive after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        until = time.monotonic() + grace
        while time.monotonic() < until and any(parent_and_state(p)[1] for p in pids):
            time.sleep(0.05)


def _newest_held(shm_dir: Path, job: str, ranks: set[int] | None) -> tuple[int, int] | None:
    """The newest (generation, step) every rank of ``ranks`` (else every rank with slots)
    holds in this node's memory."""
    from ..agent.persist import SlotReader

    reader = SlotReader(shm_dir, job)
    try:
        held = reader.held()
    finally:
        reader.close()
    chosen = [set(held.get(r, {})) for r in (ranks if ranks else held)]
    common = set.intersection(*chosen) if chosen else set()
    return max(common) if common else None


def _shown(url: str) -> str:
    from ..storage_tiers.registry import redact

    return redact(url)
