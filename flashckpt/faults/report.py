"""``flashckpt report``: effective training time from a job's event logs.

    lost = start-up + steady save stall + failures x (detect + resume + recomputed steps)

The start-up is each run's, from its first launcher's start to every rank's first step (the
first ``save()`` after the ``restore()`` at start): the job trains nothing meanwhile.

A failure is a hang the watchdog detected, a worker that exited before closing, a node the
controller lost (its agent went silent) or, under in-process recovery, an exception a rank's
training function raised. Its parts:

- detect: from the failing rank's last heartbeat to the first reaction to it (the watchdog's
  verdict, the launcher seeing the exit, a peer's collective failing); 0 for an exception;
- resume: from there until every rank has restored and finished its first step after the
  restore (its first ``save()``; the restore's end where no save followed). After a full restart it
  splits into restart (to the first restore starting) and restore (the slowest rank's); after
  an in-process recovery into abort (the slowest rank tearing its process group down),
  rendezvous (the slowest rank waiting for the next round to form), replacement (a standby
  handed a lost rank, until its round formed) and restore;
- recomputed: the steps between the newest one a rank had saved and the one restored, plus
  the step in progress, at the job's typical step time.

The save stall is the time ``save()`` blocked over all saves of a rank (summed over the
processes that held it), of the rank that stalled longest: the ranks stall side by side.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Failure:
    at: float  # the first reaction to it
    kind: str  # "hang", "exit", "node" or "exception"
    ranks: list[int]
    detect_s: float
    last_step: int | None
    mode: str = "restart"  # or "in-process"
    restart_s: float | None = None
    restore_s: float | None = None
    restored_step: int | None = None
    resumed_at: float | None = None  # the last rank's restore done
    stepped_at: float | None = None  # the last rank's first step after it done
    abort_s: float | None = None
    rendezvous_s: float | None = None
    replacement_s: float | None = None
    fallback: str | None = None  # why in-process recovery gave way to a restart
    node: str | None = None  # the node it hit (the lost one, for a node)
    spare: str | None = None  # the spare node that took the lost node's ranks, in-process
    sources: list[str] = field(default_factory=list)  # where its ranks restored from

    @property
    def from_replica(self) -> bool:
        """Whether a peer's replica served some rank's restore (a lost node's, from memory)."""
        return any(s.startswith("peer ") for s in self.sources)

    def recomputed_steps(self) -> int | None:
        if self.restored_step is None or self.last_step is None:
            return None
        return max(0, self.last_step - self.restored_step) + 1

    @property
    def resume_s(self) -> float | None:
        end = self.stepped_at if self.stepped_at is not None else self.resumed_at
        return None if end is None else max(0.0, end - self.at)

    def add_step(self, step: int | None) -> None:
        if step is not None:
            self.last_step = max(step, self.last_step if self.last_step is not None else step)


@dataclass
class Report:
    wall_s: float
    failures: list[Failure] = field(default_factory=list)
    step_s: float | None = None
    save_stall_s: float = 0.0
    stall_per_save_s: float | None = None  # the slowest rank's, when the logs count saves
    startup_s: float = 0.0  # every run's launch to every rank's first step, summed
    startups: int = 0

    def lost_s(self) -> float:
        lost = self.save_stall_s + self.startup_s
        for f in self.failures:
            lost += f.detect_s + (f.resume_s or 0)
            steps = f.recomputed_steps()
            if steps and self.step_s:
                lost += steps * self.step_s
        return lost

    def effective(self) -> float | None:
        return (1 - self.lost_s() / self.wall_s) if self.wall_s > 0 else None

    def to_dict(self) -> dict:
        return {
            "wall_s": self.wall_s, "lost_s": self.lost_s(), "step_s": self.step_s,
            "effective": self.effective(), "save_stall_s": self.save_stall_s,
            "stall_per_save_s": self.stall_per_save_s, "startup_s": self.startup_s,
            "startups": self.startups,
            "failures": [{**f.__dict__, "resume_s": f.resume_s, "from_replica": f.from_replica,
                          "recomputed_steps": f.recomputed_steps()} for f in self.failures],
            "node_losses": self.node_losses(), "recoveries": self.recoveries(),
        }  # fmt: skip

    def recoveries(self) -> dict[str, int]:
        """How the failures were recovered: in-process (every healthy process kept), by a spare
        node taking a lost node's ranks (in-process too), or by a full restart."""
        out = {"in_process": 0, "spare_node": 0, "restart": 0}
        for f in self.failures:
            out["spare_node" if f.spare else "in_process" if f.mode == "in-process"
                else "restart"] += 1  # fmt: skip
        return out

    def node_losses(self) -> dict[str, dict[str, int]]:
        """Lost nodes, split by whether a peer's replica served their ranks: how many, and
        the steps recomputed after them."""
        out = {k: {"failures": 0, "recomputed_steps": 0} for k in ("replica", "storage")}
        for f in self.failures:
            if f.kind == "node":
                split = out["replica" if f.from_replica else "storage"]
                split["failures"] += 1
                split["recomputed_steps"] += f.recomputed_steps() or 0
        return out


_FAILURE = {"hang_detected": "hang", "worker_exited": "exit", "node_lost": "node"}
# The agent outlives its node's launcher where only the launcher was lost: its events are a
# sign of the node's training only where they store a step newer than any before.
_AGENT_KINDS = frozenset({"tier_committed", "tier_failed"})
_STARTING = frozenset({"launcher_started", "controller_started", "recovery_store_started"})
_PROGRESS = frozenset({"stepped", "restored", "worker_exited", "hang_detected", "tier_committed"})


class _Reader:
    """Walks the merged event logs in time order, one failure open at a time."""

    def __init__(self, report: Report):
        self.report = report
        self.open: Failure | None = None
        self.killed: set[int] = set()  # pids the watchdog killed: their exit is that failure's
        self.replaced: set[int] = set()  # pids a standby replaced: their exit is that failure's
        self.peer_fault_at: float | None = None  # a peer's collective failing, cause unknown
        self.step_times: list[float] = []
        self.stalls: dict[object, float] = {}  # rank -> its save stall, over its processes
        self.saves: dict[object, int] = {}  # rank -> its saves, over its processes
        self.node: str | None = None  # the event's node (the failed one, where it names one)
        self.seen: dict[str, float] = {}  # node -> its last event before the current one
        self.launched: set[str] = set()  # nodes whose launcher started and has not exited
        self.ranks_of: dict[str, set[int]] = {}  # node -> ranks its launcher started
        self.steps: dict[str, int] = {}  # node -> the newest step its workers reported
        # The run starting: when its first launcher started, and each rank's first step.
        self.starting: tuple[float, dict[object, float]] | None = None

    def end_startup(self) -> None:
        """The run's start-up is over (a failure, another run, the logs' end): count it."""
        if self.starting is not None and self.starting[1]:
            began, first = self.starting
            self.report.startup_s += max(first.values()) - began
            self.report.startups += 1
        self.starting = None

    def current(self, at: float, kind: str, detect_s: float, step: int | None) -> Failure:
        """The open failure, or a new one if the last has resumed."""
        if self.open is None or self.open.resumed_at is not None:
            self.end_startup()
            origin = at - detect_s  # the failing rank's last heartbeat
            if self.peer_fault_at is not None:  # a peer's collective failed first
                at = min(at, self.peer_fault_at)
            self.open = Failure(at=at, kind=kind, ranks=[], detect_s=max(0.0, at - origin),
                                last_step=step, node=self.node)  # fmt: skip
            if self.peer_fault_at is not None:
                self.open.mode = "in-process"
            self.report.failures.append(self.open)
        self.peer_fault_at = None
        return self.open

    def event(self, e: dict) -> None:
        kind, t = e["kind"], e["time"]
        node = e.get("failed_node") or e.get("node")
        self.node = node if isinstance(node, str) else None
        handler = getattr(self, f"on_{kind}", None)
        if handler is not None:
            handler(e, t)
        node = e.get("node")
        if isinstance(node, str):
            step = _int(e.get("step")) if kind in _PROGRESS else None
            newer = step is not None and step > self.steps.get(node, -1)
            if newer:
                self.steps[node] = step
            if kind not in _AGENT_KINDS and kind not in _STARTING or newer:
                self.seen[node] = t

    def on_hang_detected(self, e: dict, t: float) -> None:
        self.killed.add(e.get("worker_pid"))
        f = self.current(t, "hang", _num(e.get("silent_s")), _int(e.get("step")))
        f.kind = "hang"
        f.ranks.append(e.get("rank"))
        f.add_step(_int(e.get("step")))

    def on_launcher_started(self, e: dict, t: float) -> None:
        """A launcher started where the last one never exited: its node was lost whole
        (launcher, workers and memory), and is back. Its last event dates the loss."""
        node = e.get("node")
        if not isinstance(node, str):
            return
        if node in self.launched:
            f = self.current(t, "node", t - self.seen.get(node, t), self.steps.get(node))
            if f.kind != "node":  # the exits seen first were its consequences
                f.kind, f.node = "node", node
            f.ranks = sorted(self.ranks_of.get(node, ()))
            f.add_step(self.steps.get(node))
        else:  # a fresh start on this node: its steps so far belong to an earlier run
            self.steps.pop(node, None)
            if not self.launched:  # another run of the job: what it restores ends no failure
                self.open = None
                self.end_startup()
                self.starting = (t, {})
        self.launched.add(node)
        self.ranks_of[node] = set()

    def on_launcher_exited(self, e: dict, t: float) -> None:
        self.launched.discard(e.get("node"))
        if not self.launched:
            self.open = None

    def on_worker_started(self, e: dict, t: float) -> None:
        if isinstance(e.get("node"), str) and isinstance(e.get("rank"), int):
            self.ranks_of.setdefault(e["node"], set()).add(e["rank"])

    def on_node_lost(self, e: dict, t: float) -> None:
        f = self.current(t, "node", _num(e.get("silent_s")), _int(e.get("step")))
        f.kind, f.node = "node", self.node  # the exits seen first were its consequences
        f.ranks = [r for r in e.get("ranks") or [] if isinstance(r, int)]
        f.detect_s = max(f.detect_s, _num(e.get("silent_s")))

    def on_worker_exited(self, e: dict, t: float) -> None:
        pid = e.get("worker_pid")
        if pid in self.killed:
            return
        silent = _num(e.get("silent_s"))
        if pid in self.replaced and self.open is not None:
            # Seen by the launcher after the standby took over: the failure is open already,
            # its detection the first reaction; the exit dates the fault (its last heartbeat).
            self.open.detect_s = max(self.open.detect_s, self.open.at - (t - silent))
            self.open.add_step(_int(e.get("step")))
            return
        f = self.current(t, "exit", silent, _int(e.get("step")))
        if not f.ranks:
            f.ranks.append(e.get("rank"))  # later exits: the restart's kills
        f.add_step(_int(e.get("step")))

    def on_replacement_started(self, e: dict, t: float) -> None:
        lost = e.get("lost_pid")
        if lost in self.killed:  # a hung rank's: the failure is the hang
            f = self.current(t, "hang", 0.0, None)
        else:
            self.replaced.add(lost)
            f = self.current(t, "exit", 0.0, None)
            if e.get("rank") not in f.ranks:
                f.ranks.append(e.get("rank"))
        f.mode = "in-process"

    def on_inprocess_fault(self, e: dict, t: float) -> None:
        if e.get("own"):
            f = self.current(t, "exception", 0.0, _int(e.get("step")))
            f.mode = "in-process"
            if f.kind == "exception" and e.get("rank") not in f.ranks:
                f.ranks.append(e.get("rank"))
            f.add_step(_int(e.get("step")))
        elif self.open is not None and self.open.resumed_at is None:
            self.open.mode = "in-process"
            self.open.add_step(_int(e.get("step")))
        elif self.peer_fault_at is None:
            self.peer_fault_at = t  # a peer noticed first: the cause comes next

    def on_inprocess_left(self, e: dict, t: float) -> None:
        if self.open is not None:
            self.open.abort_s = max(self.open.abort_s or 0.0, _num(e.get("abort_s")))

    def on_inprocess_joined(self, e: dict, t: float) -> None:
        if self.open is not None:
            self.open.rendezvous_s = max(self.open.rendezvous_s or 0.0,
                                         _num(e.get("rendezvous_s")))  # fmt: skip

    def on_inprocess_recovered(self, e: dict, t: float) -> None:
        if self.open is not None:
            self.open.replacement_s = max(self.open.replacement_s or 0.0,
                                          _num(e.get("replacement_s")))  # fmt: skip

    def on_node_replaced_in_process(self, e: dict, t: float) -> None:
        """A spare took the lost node's ranks (the spare's log, under the lost node's name)."""
        if self.open is not None and isinstance(e.get("spare"), str):
            self.open.mode, self.open.spare = "in-process", e["spare"]
            self.open.replacement_s = _num(e.get("round_s")) or self.open.replacement_s

    def on_inprocess_fallback(self, e: dict, t: float) -> None:
        if self.open is not None:
            self.open.mode, self.open.fallback = "restart", str(e.get("reason"))

    def on_restored(self, e: dict, t: float) -> None:
        f = self.open
        if f is None:
            return
        took = _num(e.get("seconds"))
        if f.restart_s is None:
            f.restart_s = max(0.0, t - took - f.at)
        f.restore_s = max(f.restore_s or 0.0, took)
        f.restored_step = _int(e.get("step"))
        f.resumed_at = max(f.resumed_at or t, t)
        if isinstance(e.get("source"), str) and e["source"] not in f.sources:
            f.sources.append(e["source"])

    def on_stepped(self, e: dict, t: float) -> None:
        if self.starting is not None:  # a rank's first step of the run
            self.starting[1].setdefault(e.get("rank"), t)
            return
        f = self.report.failures[-1] if self.report.failures else None
        if f is not None and f.resumed_at is not None and t >= f.resumed_at - 1e-3:
            f.stepped_at = max(f.stepped_at or t, t)

    def on_closed(self, e: dict, t: float) -> None:
        rank = e.get("rank")
        self.stalls[rank] = self.stalls.get(rank, 0.0) + _num(e.get("save_stall_s"))
        self.saves[rank] = self.saves.get(rank, 0) + (_int(e.get("saves")) or 0)
        if _num(e.get("step_s")) > 0:
            self.step_times.append(_num(e["step_s"]))


def summarize(events: list[dict]) -> Report:
    events = sorted(events, key=lambda e: e["time"])
    times = [e["time"] for e in events]
    report = Report(wall_s=(times[-1] - times[0]) if times else 0.0)
    reader = _Reader(report)
    for e in events:
        reader.event(e)
    reader.end_startup()
    report.step_s = statistics.median(reader.step_times) if reader.step_times else None
    # The ranks stall side by side: the job loses what its slowest rank lost.
    report.save_stall_s = max(reader.stalls.values(), default=0.0)
    slowest = max(reader.stalls, key=reader.stalls.__getitem__, default=None)
    if reader.saves.get(slowest):
        report.stall_per_save_s = report.save_stall_s / reader.saves[slowest]
    return report


def render(report: Report) -> str:
    lines = [f"wall time {report.wall_s:.1f}s, {len(report.failures)} failure(s)"]
    for i, f in enumerate(report.failures, 1):
        steps = f.recomputed_steps()
        what = {"node": "lost node", "exit": "exit"}.get(f.kind, f.kind)
        if f.spare:
            parts = (f"in-process, taken by spare node {f.spare}: detect {f.detect_s:.2f}s, "
                     f"round {_s(f.replacement_s)}, restore {_s(f.restore_s)}")  # fmt: skip
        elif f.mode == "in-process":
            parts = (f"in-process: detect {f.detect_s:.2f}s, abort {_s(f.abort_s)}, "
                     f"rendezvous {_s(f.rendezvous_s)}, replacement {_s(f.replacement_s)}, "
                     f"restore {_s(f.restore_s)}")  # fmt: skip
        else:
            parts = (f"restart{' (in-process fell back: ' + f.fallback + ')' if f.fallback else ''}: "
                     f"detect {f.detect_s:.1f}s, restart {_s(f.restart_s)}, "
                     f"restore {_s(f.restore_s)}")  # fmt: skip
        served = ""
        if f.kind == "node":
            served = " from a peer's replica" if f.from_replica else " from storage"
        lines.append(
            f"  {i}. {what} of rank(s) {sorted(set(r for r in f.ranks if r is not None))}, "
            f"{parts}; training again {_s(f.resume_s and f.resume_s + f.detect_s)} after it; "
            f"restored step {f.restored_step}{served}, recomputed "
            f"{steps if steps is not None else '?'} step(s)"
        )  # fmt: skip
    losses = report.node_losses()
    if losses["replica"]["failures"] or losses["storage"]["failures"]:
        r, s = losses["replica"], losses["storage"]
        lines.append(f"lost nodes: {r['failures']} served by a peer's replica ({r['recomputed_steps']} "
                     f"step(s) recomputed), {s['failures']} from storage ({s['recomputed_steps']})")  # fmt: skip
    if report.failures:
        done = report.recoveries()
        lines.append(f"recovered: {done['in_process']} in-process, {done['spare_node']} by a spare "
                     f"node taking a lost node (in-process), {done['restart']} by a full restart")  # fmt: skip
    if report.startups:
        lines.append(f"start-up {report.startup_s:.2f}s: launch to every rank's first step, "
                     f"{report.startups} run(s)")  # fmt: skip
    step = f"{report.step_s * 1000:.1f} ms" if report.step_s else "unknown"
    lines.append(f"typical step {step}; save stall {report.save_stall_s:.2f}s (the slowest rank's)")
    effective = report.effective()
    if effective is not None:
        lines.append(f"lost {report.lost_s():.1f}s of {report.wall_s:.1f}s: effective training "
                     f"time {100 * effective:.1f}%")  # fmt: skip
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}s"


def _num(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
