"""``flashckpt report EVENTS.jsonl... [--json]``: effective training time from the event logs
``flashckpt-run`` writes (one per node): failures and what each cost in detection, restart,
restore and recomputed steps (see ``flashckpt.faults.report``). With ``--project``, the effective
training time those parts project to at ``--gpus`` GPUs under a failure rate, for full
restarts and in-process recovery (see ``flashckpt.faults.projection``); the logs are optional then."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..faults import projection
from ..faults.events import read_events
from ..faults.report import render, summarize
from .common import OK, Output, Problem

NAME = "report"
HELP = "effective training time from flashckpt-run event logs, measured or projected"


def _number(lo: float = 0.0, hi: float = float("inf"), kind=float):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text} is not in [{lo:g}, {hi:g}]")
        return v

    return parse


def _mix(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        kind, _, share = item.partition("=")
        if kind.strip() not in projection.KINDS:
            raise argparse.ArgumentTypeError(
                f"{kind.strip()!r} is not one of {', '.join(projection.KINDS)} "
                f"(write e.g. exit=0.6,hang=0.2,node=0.2)"
            )
        out[kind.strip()] = _number()(share)
    if sum(out.values()) <= 0:
        raise argparse.ArgumentTypeError("the shares add up to 0")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("events", nargs="*", metavar="EVENTS.jsonl",
                   help="event logs, one per node (<run_dir>/<job>.events.jsonl)")  # fmt: skip
    p.add_argument("--html", metavar="FILE",
                   help="also write the job's timeline as one self-contained page (needs the "
                        "report extra: pip install 'flashckpt[report]')")  # fmt: skip
    p.add_argument("--svg", metavar="FILE", help="also write the timeline as one SVG image")
    g = p.add_argument_group("projection (--project)")
    g.add_argument("--project", action="store_true",
                   help="project the effective training time at --gpus GPUs from the parts "
                        "the logs measured (and the options below)")  # fmt: skip
    g.add_argument(
        "--gpus",
        type=_number(1, kind=int),
        default=16384,
        help="GPUs of the job projected (default 16384)",
    )
    g.add_argument(
        "--interruptions",
        type=_number(0, kind=int),
        default=projection.LLAMA3[0],
        help="failure rate: this many interruptions (default 419) ...",
    )
    g.add_argument(
        "--days",
        type=_number(1e-6),
        default=projection.LLAMA3[1],
        help="... in this many days (default 54) ...",
    )
    g.add_argument(
        "--at-gpus",
        type=_number(1, kind=int),
        default=projection.LLAMA3[2],
        help="... on this many GPUs (default 16384: Llama 3's report)",
    )
    g.add_argument("--step-s", type=_number(1e-6), help="step time (default: measured, else 5)")
    g.add_argument("--save-every", type=_number(1), help="steps between saves (default 1)")
    g.add_argument("--stall-s", type=_number(), help="seconds save() blocks (default: measured)")
    g.add_argument("--recomputed", type=_number(), help="steps recomputed a failure")
    g.add_argument("--detect-exit-s", type=_number(), help="detection of an exited worker")
    g.add_argument("--hang-timeout-s", type=_number(), help="detection of a hang (default 30)")
    g.add_argument("--node-timeout-s", type=_number(), help="FLASHCKPT_NODE_TIMEOUT (default 5)")
    g.add_argument(
        "--restart-s",
        type=_number(),
        help="a full restart to every rank training (default: measured, else 60)",
    )
    g.add_argument(
        "--inprocess-s",
        type=_number(),
        help="an in-process recovery to every rank training (default: measured)",
    )
    g.add_argument(
        "--in-place",
        type=_number(0, 1),
        help="share of exits and hangs in-process recovery can take (default 0.22)",
    )
    g.add_argument(
        "--mix",
        type=_mix,
        default=None,
        help="interruptions by kind (default exit=0.6,hang=0.2,node=0.2: an assumption)",
    )
    g.add_argument("--recovery-deadline-s", type=_number(),
                   help="what a failed in-process attempt waits before restarting (default 30)")  # fmt: skip
    g.add_argument("--node-extra-s", type=_number(),
                   help="a lost node's wait for a spare and restore from a shared tier "
                        "(default 120)")  # fmt: skip


def run(args: argparse.Namespace, out: Output) -> int:
    events = [e for path in args.events for e in read_events(path)]
    if not args.project and not args.events:
        raise Problem("give the event logs to report on, or --project to project without them")
    if args.events and not events:
        raise Problem(f"no events in {', '.join(args.events)}")
    if (args.html or args.svg) and not events:
        raise Problem("--html and --svg draw the event logs: give them")
    report = summarize(events) if events else None
    model = projection.build(report, args) if args.project else None
    if model is not None:
        if args.json:
            print(json.dumps(projection.to_dict(model), indent=2))
        else:
            out.line(projection.render(model))
    elif args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        out.line(render(report))
    if report is not None and (args.html or args.svg):
        _draw(events, report, model, args, out)
    return OK


def _draw(events: list[dict], report, model, args: argparse.Namespace, out: Output) -> None:
    """Write the page and the image asked for (each whole, or not at all)."""
    from ..faults import timeline
    from . import report_svg

    tl = timeline.build(events, report)
    if args.html:
        from . import report_page

        _write(args.html, report_page.render(tl, report, model))
        out.line(f"wrote the job's timeline page to {args.html}")
    if args.svg:
        _write(args.svg, report_svg.draw(tl, report_svg.headline(report)))
        out.line(f"wrote the job's timeline image to {args.svg}")


def _write(path: str, text: str) -> None:
    target = Path(path)
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, target)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise Problem(f"cannot write {path}: {exc.strerror or exc}") from None
