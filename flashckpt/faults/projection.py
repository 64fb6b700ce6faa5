"""``flashckpt report --project``: the effective training time a job of G GPUs can expect,
projected from measured parts and a failure rate, for full restarts and in-process recovery.

The model. Interruptions arrive at a rate proportional to the GPUs (default: Llama 3's 419
unexpected interruptions in 54 days on 16,384 GPUs). Each costs

    detect(kind) + recover(policy) + recomputed steps x step time

and the steady state costs the save stall: ``stall per save / (save interval x step time)``
of every step. Over a long run, with ``lost = rate x mean cost`` (a fraction of the time):

    effective = (1 - lost) x (1 - stall fraction)

Kinds: a worker that exits, a hang (detected after the hang timeout) and a lost node
(detected after the node timeout). A lost node takes a full restart under either policy, plus
the wait for a spare node and its restore from a shared tier. Under in-process recovery a
fault that leaves the node unusable (a dead GPU: the replacement cannot start on it) also
restarts - the ``in-place`` share says how many exits and hangs in-process recovery can take;
the rest pay a failed in-process attempt, the wait up to the recovery deadline, then the
restart. Recomputed steps follow the save interval: the step in progress and, on average,
half the steps since the last save.

Every part comes from the event logs when they hold it (medians over their failures), else
from an option, else from a default that says where it comes from; the output names the
source of each.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .report import Report

LLAMA3 = (419, 54.0, 16384)  # interruptions, days, GPUs (Llama 3 paper, section 3.3.4)
DEFAULT_MIX = {"exit": 0.6, "hang": 0.2, "node": 0.2}
TARGET = 0.988
KINDS = ("exit", "hang", "node")
POLICIES = ("restart", "in-process")


@dataclass
class Part:
    value: float
    source: str  # "measured", "given" or "default: why"


@dataclass
class Model:
    gpus: int
    rate_per_h: float
    step_s: Part
    save_every: Part
    stall_s: Part  # per save
    recomputed: Part  # steps per failure
    detect: dict[str, Part]
    recover: dict[str, Part]
    mix: dict[str, float]  # kind -> share of interruptions
    in_place: Part  # share of exits and hangs in-process recovery can take where they are
    deadline_s: Part = field(default_factory=lambda: Part(30.0, "default"))  # a failed attempt
    node_extra_s: Part = field(default_factory=lambda: Part(0.0, "default"))  # spare + restore
    mix_source: str = "given"
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # policy -> where lost

    def cost(self, policy: str, kind: str) -> dict[str, float]:
        """Seconds one interruption of ``kind`` costs under ``policy``, by where they go."""
        redo = self.recomputed.value * self.step_s.value
        out = {"detection": self.detect[kind].value, "recovery": 0.0, "recomputed": redo}
        restart = self.recover["restart"].value
        if kind == "node":  # a restart either way, on a spare node, from a shared tier
            out["recovery"] = restart + self.node_extra_s.value
        elif policy == "restart":
            out["recovery"] = restart
        else:
            p = self.in_place.value  # the rest fall back after a failed attempt
            fallback = self.deadline_s.value + restart
            out["recovery"] = self.recover["in-process"].value + (1 - p) * fallback
        return out

    def project(self, policy: str) -> dict[str, float]:
        """Fractions of the run lost, by where, and the effective training time."""
        per_s = self.rate_per_h / 3600
        lost = {"detection": 0.0, "recovery": 0.0, "recomputed": 0.0}
        for kind, share in self.mix.items():
            for where, s in self.cost(policy, kind).items():
                lost[where] += per_s * share * s
        stall = self.stall_s.value / (self.save_every.value * self.step_s.value)
        out = {"save stall": stall, **lost}
        out["effective"] = (1 - sum(lost.values())) * (1 - stall)
        return out


def rate_per_hour(gpus: int, interruptions: int, days: float, at_gpus: int) -> float:
    return interruptions / (days * 24) * gpus / at_gpus


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _part(measured: float | None, given: float | None, default: float, why: str) -> Part:
    if given is not None:
        return Part(given, "given")
    if measured is not None:
        return Part(measured, "measured")
    return Part(default, f"default: {why}")


def build(report: Report | None, args) -> Model:
    """The model of ``args`` (the CLI's options), with the parts ``report`` measured."""
    fails = report.failures if report else []
    by_mode = {m: [f for f in fails if f.mode == m and f.fallback is None] for m in POLICIES}
    recover = {
        m: _median([f.resume_s for f in by_mode[m]]) for m in POLICIES
    }  # fmt: skip
    detect = {k: _median([f.detect_s for f in fails if f.kind == k]) for k in KINDS}
    redo = _median([f.recomputed_steps() for f in fails])
    mix = dict(args.mix or DEFAULT_MIX)
    total = sum(mix.values())
    if args.recomputed is None and args.save_every is not None:
        recomputed = Part((args.save_every + 1) / 2, "derived from --save-every: the step in "
                          "progress and half the steps since the last save")  # fmt: skip
    else:
        recomputed = _part(redo, args.recomputed, 1.0, "the step in progress (a save a step)")
    return Model(
        gpus=args.gpus,
        rate_per_h=rate_per_hour(args.gpus, args.interruptions, args.days, args.at_gpus),
        step_s=_part(report.step_s if report else None, args.step_s, 5.0, "a 5 s step"),
        save_every=_part(None, args.save_every, 1, "a save every step"),
        stall_s=_part(report.stall_per_save_s if report else None, args.stall_s, 0.0,
                      "no stall: give --stall-s or event logs"),  # fmt: skip
        recomputed=recomputed,
        detect={
            "exit": _part(detect["exit"], args.detect_exit_s, 0.1, "the launcher's poll"),
            "hang": _part(detect["hang"], args.hang_timeout_s, 30.0, "a 30 s hang timeout"),
            "node": _part(detect["node"], args.node_timeout_s and args.node_timeout_s + 0.25,
                          5.25, "node timeout 5 s + a tick; benchmarks/scale.py"),
        },  # fmt: skip
        recover={
            "restart": _part(recover["restart"], args.restart_s, 60.0,
                             "a minute: measure your cluster's and give --restart-s"),
            "in-process": _part(recover["in-process"], args.inprocess_s, 1.0,
                                "benchmarks/recovery.py, 2 nodes"),
        },  # fmt: skip
        mix={k: v / total for k, v in mix.items()},
        in_place=_part(None, args.in_place, 0.22,
                       "Llama 3 blames about 78% of its interruptions on hardware"),
        deadline_s=_part(None, args.recovery_deadline_s, 30.0,
                         "FLASHCKPT_RECOVERY_DEADLINE's default"),
        node_extra_s=_part(None, args.node_extra_s, 120.0, "an assumption: a spare node in a "
                           "minute and its state from a shared tier in another; give "
                           "--node-extra-s"),
        mix_source="given" if args.mix else "default: an assumption, no published split of "
                   "interruptions into these kinds; give --mix from your incident log",
    )  # fmt: skip


def render(m: Model) -> str:
    every_h = 1 / m.rate_per_h if m.rate_per_h > 0 else float("inf")
    lines = [
        f"projected for {m.gpus} GPUs: {m.rate_per_h * 24:.2f} interruptions a day (one every "
        f"{every_h:.1f} h)",
        "parts:",
        f"  step {m.step_s.value:.3f}s ({m.step_s.source}); a save every "
        f"{m.save_every.value:g} step(s) ({m.save_every.source}); save stall "
        f"{m.stall_s.value * 1000:.1f} ms a save ({m.stall_s.source})",
    ]
    for k in KINDS:
        lines.append(f"  detect {k}: {m.detect[k].value:.2f}s ({m.detect[k].source}); "
                     f"{100 * m.mix.get(k, 0):.0f}% of interruptions")  # fmt: skip
    for p in POLICIES:
        lines.append(f"  recover, {p}: {m.recover[p].value:.2f}s ({m.recover[p].source})")
    lines.append(f"  recomputed: {m.recomputed.value:g} step(s) a failure ({m.recomputed.source})")
    lines.append(f"  in-process takes {100 * m.in_place.value:.0f}% of exits and hangs where they "
                 f"are ({m.in_place.source}); the rest wait up to the recovery deadline, "
                 f"{m.deadline_s.value:g}s ({m.deadline_s.source}), then restart")  # fmt: skip
    lines.append(f"  a lost node also waits for a spare and restores from a shared tier: "
                 f"{m.node_extra_s.value:g}s ({m.node_extra_s.source})")  # fmt: skip
    lines.append(f"  the mix of kinds: {m.mix_source}")
    got = {p: m.project(p) for p in POLICIES}
    lines.append(f"{'lost to':<16}{'restart':>12}{'in-process':>12}")
    for where in ("save stall", "detection", "recovery", "recomputed"):
        lines.append(f"  {where:<14}" + "".join(f"{100 * got[p][where]:>11.3f}%" for p in POLICIES))
    lines.append(f"{'effective':<16}" + "".join(f"{100 * got[p]['effective']:>11.2f}%"
                                               for p in POLICIES)
                 + f"   target {100 * TARGET:.1f}%")  # fmt: skip
    return "\n".join(lines)


def to_dict(m: Model) -> dict:
    return {
        "gpus": m.gpus, "interruptions_per_hour": m.rate_per_h,
        "parts": {
            "step_s": m.step_s.__dict__, "save_every": m.save_every.__dict__,
            "stall_per_save_s": m.stall_s.__dict__, "recomputed_steps": m.recomputed.__dict__,
            "detect_s": {k: v.__dict__ for k, v in m.detect.items()},
            "recover_s": {k: v.__dict__ for k, v in m.recover.items()},
            "mix": m.mix, "mix_source": m.mix_source, "in_place": m.in_place.__dict__,
            "recovery_deadline_s": m.deadline_s.__dict__, "node_extra_s": m.node_extra_s.__dict__,
        },
        "projection": {p: m.project(p) for p in POLICIES}, "target": TARGET,
    }  # fmt: skip
