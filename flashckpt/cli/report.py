"""``flashckpt report EVENTS.jsonl... [--json]``: effective training time from the event logs
``flashckpt-run`` writes (one per node): failures and what each cost in detection, restart,
restore and recomputed steps (see ``flashckpt.report``)."""

from __future__ import annotations

import argparse
import json

from ..events import read_events
from ..report import render, summarize
from .common import OK, Output, Problem

NAME = "report"
HELP = "effective training time from flashckpt-run event logs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("events", nargs="+", metavar="EVENTS.jsonl",
                   help="event logs, one per node (<run_dir>/<job>.events.jsonl)")  # fmt: skip


def run(args: argparse.Namespace, out: Output) -> int:
    events = [e for path in args.events for e in read_events(path)]
    if not events:
        raise Problem(f"no events in {', '.join(args.events)}")
    report = summarize(events)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        out.line(render(report))
    return OK
