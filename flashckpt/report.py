"""``flashckpt report``: effective training time from a job's event logs.

    lost = failures x (detect + restart + restore + recomputed steps) + steady save stall

A failure is a hang the watchdog detected, a worker that exited before closing, or a node the
controller lost (its agent went silent). Its parts:
detect, from the failing rank's last heartbeat to the detection; restart, from the detection
to the first restore starting; restore, the slowest rank's restore; recomputed, the steps
between the newest one a rank had saved and the one restored, plus the step in progress, at
the job's typical step time. The save stall is the time ``save()`` blocked, over all saves.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Failure:
    at: float
    kind: str  # "hang", "exit" or "node"
    ranks: list[int]
    detect_s: float
    last_step: int | None
    restart_s: float | None = None
    restore_s: float | None = None
    restored_step: int | None = None

    def recomputed_steps(self) -> int | None:
        if self.restored_step is None or self.last_step is None:
            return None
        return max(0, self.last_step - self.restored_step) + 1


@dataclass
class Report:
    wall_s: float
    failures: list[Failure] = field(default_factory=list)
    step_s: float | None = None
    save_stall_s: float = 0.0

    def lost_s(self) -> float:
        lost = self.save_stall_s
        for f in self.failures:
            lost += f.detect_s + (f.restart_s or 0) + (f.restore_s or 0)
            steps = f.recomputed_steps()
            if steps and self.step_s:
                lost += steps * self.step_s
        return lost

    def to_dict(self) -> dict:
        return {
            "wall_s": self.wall_s, "lost_s": self.lost_s(), "step_s": self.step_s,
            "effective": (1 - self.lost_s() / self.wall_s) if self.wall_s > 0 else None,
            "save_stall_s": self.save_stall_s,
            "failures": [{**f.__dict__, "recomputed_steps": f.recomputed_steps()}
                         for f in self.failures],
        }  # fmt: skip


_FAILURE = {"hang_detected": "hang", "worker_exited": "exit", "node_lost": "node"}


def summarize(events: list[dict]) -> Report:
    events = sorted(events, key=lambda e: e["time"])
    times = [e["time"] for e in events]
    report = Report(wall_s=(times[-1] - times[0]) if times else 0.0)
    open_failure: Failure | None = None
    killed: set[int] = set()  # worker pids the watchdog killed: their exit is that failure's
    step_times: list[float] = []
    for e in events:
        kind = e["kind"]
        if kind in ("hang_detected", "node_lost") or (
            kind == "worker_exited" and e.get("worker_pid") not in killed
        ):
            if kind == "hang_detected":
                killed.add(e.get("worker_pid"))
            if open_failure is None or open_failure.restore_s is not None:
                open_failure = Failure(
                    at=e["time"], kind=_FAILURE[kind], ranks=[],
                    detect_s=_num(e.get("silent_s")), last_step=_int(e.get("step")),
                )  # fmt: skip
                report.failures.append(open_failure)
            if kind == "node_lost":
                open_failure.kind = "node"  # the exits seen first were its consequences
                open_failure.ranks = [r for r in e.get("ranks") or [] if isinstance(r, int)]
                open_failure.detect_s = max(open_failure.detect_s, _num(e.get("silent_s")))
                continue
            if kind == "hang_detected" or not open_failure.ranks:
                open_failure.ranks.append(e.get("rank"))  # later exits: the restart's kills
            step = _int(e.get("step"))
            if step is not None:
                open_failure.last_step = max(step, open_failure.last_step or step)
        elif kind == "restored" and open_failure is not None:
            took = _num(e.get("seconds"))
            began = e["time"] - took
            if open_failure.restart_s is None:
                open_failure.restart_s = max(0.0, began - open_failure.at)
            open_failure.restore_s = max(open_failure.restore_s or 0.0, took)
            open_failure.restored_step = _int(e.get("step"))
        elif kind == "closed":
            report.save_stall_s += _num(e.get("save_stall_s"))
            if _num(e.get("step_s")) > 0:
                step_times.append(_num(e["step_s"]))
    report.step_s = statistics.median(step_times) if step_times else None
    return report


def render(report: Report) -> str:
    lines = [f"wall time {report.wall_s:.1f}s, {len(report.failures)} failure(s)"]
    for i, f in enumerate(report.failures, 1):
        steps = f.recomputed_steps()
        lines.append(
            f"  {i}. {'lost node' if f.kind == 'node' else f.kind} of rank(s) "
            f"{sorted(set(r for r in f.ranks if r is not None))}: "
            f"detect {f.detect_s:.1f}s, restart {_s(f.restart_s)}, restore {_s(f.restore_s)}, "
            f"restored step {f.restored_step}, recomputed {steps if steps is not None else '?'} "
            "step(s)"
        )
    step = f"{report.step_s * 1000:.1f} ms" if report.step_s else "unknown"
    lines.append(f"typical step {step}; save stall {report.save_stall_s:.2f}s in all")
    if report.wall_s > 0:
        lines.append(
            f"lost {report.lost_s():.1f}s of {report.wall_s:.1f}s: effective training time "
            f"{100 * (1 - report.lost_s() / report.wall_s):.1f}%"
        )
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}s"


def _num(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
