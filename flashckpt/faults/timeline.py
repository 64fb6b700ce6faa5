"""The job's timeline, as ``flashckpt report --html`` and ``--svg`` draw it.

Built from the merged event logs and the report read from them (``report.summarize``):

- progress: the newest step known at each moment (steps trained, saved, committed, restored);
- faults: when each failure began (its rank's last sign of life), its kind, node and ranks;
- recoveries: each failure's phases, one after another on the clock: detection, the decision
  (a hung rank's stacks and kill), the restart or in-process round, the restore, the first
  step after it, and the steps recomputed; with the path taken and where the restore read;
- tiers: each tier's commits (step, and how far it lagged the newest step saved then) and its
  outages (from a failed store until its next commit).

What is too dense to draw (a week of steps, a commit a second) is thinned to one point per
drawn column by ``thin``, keeping each column's last value and how many it stands for.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .report import Failure, Report

_STEP_FIELDS = {"stepped": "step", "restored": "step", "tier_committed": "step",
                "hang_detected": "step", "worker_exited": "step", "closed": "last_saved"}  # fmt: skip


@dataclass
class Phase:
    name: str  # detect, decide, restart, round, restore, first step, recompute
    start: float
    end: float


@dataclass
class Recovery:
    failure: Failure
    path: str  # "in-process", "restart" or "node replaced" (a lost node back from a peer)
    source: str  # where the restore read: "own memory", "peer", "tier" or "none"
    phases: list[Phase]

    @property
    def start(self) -> float:
        return self.phases[0].start

    @property
    def end(self) -> float:
        return self.phases[-1].end


@dataclass
class Commit:
    t: float
    step: int
    lag: int  # steps between the newest one saved by then and this one
    seconds: float
    bytes: int


@dataclass
class TierLane:
    tier: str
    commits: list[Commit] = field(default_factory=list)
    outages: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, error


@dataclass
class Timeline:
    start: float
    end: float
    progress: list[tuple[float, int]]  # (time, newest step known); a restore sets it back
    recoveries: list[Recovery]
    tiers: list[TierLane]


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _progress(events: list[dict]) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    newest = None
    for e in events:
        step = _int(e.get(_STEP_FIELDS.get(e["kind"], "")))
        if step is None or step < 0:
            continue
        # A restore rolls back: training goes on from the step restored.
        if e["kind"] != "restored" and newest is not None and step <= newest:
            continue
        newest = step
        out.append((e["time"], newest))
    return out


def _source(f: Failure) -> str:
    if not f.sources:
        return "none"
    if any(s.startswith("peer ") for s in f.sources):
        return "peer"
    if all(s == "shared memory" for s in f.sources):
        return "own memory"
    return "tier"


def _decided(f: Failure, events: list[dict], times: list[float]) -> float:
    """When the failure was acted on: a hung rank's kill (after its stacks were taken), else
    its detection."""
    if f.kind != "hang":
        return f.at
    i = bisect.bisect_left(times, f.at)
    limit = f.resumed_at if f.resumed_at is not None else f.at + 60.0
    for e in events[i:]:
        if e["time"] > limit:
            break
        if e["kind"] == "killed" and (e.get("rank") in f.ranks or not f.ranks):
            return e["time"]
    return f.at


def _recovery(f: Failure, events: list[dict], times: list[float], step_s: float | None) -> Recovery:
    fault = f.at - f.detect_s
    decided = _decided(f, events, times)
    phases = [Phase("detect", fault, f.at), Phase("decide", f.at, decided)]
    if f.resumed_at is not None:
        restore_from = max(decided, f.resumed_at - (f.restore_s or 0.0))
        phases.append(
            Phase("round" if f.mode == "in-process" else "restart", decided, restore_from)
        )
        phases.append(Phase("restore", restore_from, f.resumed_at))
        last = f.resumed_at
        if f.stepped_at is not None and f.stepped_at > last:
            phases.append(Phase("first step", last, f.stepped_at))
            last = f.stepped_at
        steps = f.recomputed_steps()
        if steps and step_s:
            phases.append(Phase("recompute", last, last + steps * step_s))
    path = f.mode
    if f.kind == "node" and f.from_replica:
        path = "node replaced"
    return Recovery(f, path, _source(f), [p for p in phases if p.end > p.start] or phases[:1])


def _tiers(events: list[dict], progress: list[tuple[float, int]]) -> list[TierLane]:
    lanes: dict[str, TierLane] = {}
    times = [t for t, _ in progress]
    down: dict[str, tuple[float, str]] = {}
    for e in events:
        tier = e.get("tier")
        if e["kind"] not in ("tier_committed", "tier_failed") or not isinstance(tier, str):
            continue
        lane = lanes.setdefault(tier, TierLane(tier))
        if e["kind"] == "tier_failed":
            down.setdefault(tier, (e["time"], str(e.get("error", ""))))
            continue
        step = _int(e.get("step"))
        if step is None:
            continue
        i = bisect.bisect_right(times, e["time"])
        newest = progress[i - 1][1] if i else step
        seconds, size = e.get("seconds"), _int(e.get("bytes"))
        lane.commits.append(Commit(e["time"], step, max(0, newest - step),
                                   float(seconds) if isinstance(seconds, (int, float)) else 0.0,
                                   size or 0))  # fmt: skip
        if tier in down:
            start, error = down.pop(tier)
            lane.outages.append((start, e["time"], error))
    end = events[-1]["time"] if events else 0.0
    for tier, (start, error) in down.items():  # still failing when the logs end
        lanes[tier].outages.append((start, end, error))
    return sorted(lanes.values(), key=lambda lane: lane.tier)


def build(events: list[dict], report: Report) -> Timeline:
    """The timeline of ``events`` (any order) and the report made from them."""
    events = sorted(events, key=lambda e: e["time"])
    times = [e["time"] for e in events]
    progress = _progress(events)
    recoveries = [_recovery(f, events, times, report.step_s) for f in report.failures]
    start = times[0] if times else 0.0
    end = max([times[-1] if times else 0.0, *(r.end for r in recoveries)])
    return Timeline(start, end, progress, recoveries, _tiers(events, progress))


def thin(points: list[tuple[float, object]], start: float, end: float,
         columns: int) -> list[tuple[float, object, int]]:  # fmt: skip
    """``points`` (time-ordered) cut to at most one per column of ``columns`` across
    [start, end]: each column's last point, with how many points it stands for."""
    if len(points) <= columns or end <= start:
        return [(t, v, 1) for t, v in points]
    width = (end - start) / columns
    out: list[tuple[float, object, int]] = []
    column, count, last = None, 0, points[0]
    for t, v in points:
        c = min(columns - 1, int((t - start) / width))
        if c != column and column is not None:
            out.append((*last, count))
            count = 0
        column, last, count = c, (t, v), count + 1
    if column is not None:
        out.append((*last, count))
    return out
