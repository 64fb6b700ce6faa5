"""The job's event log: detections, stack dumps, kills, restarts and restores, one JSON
object a line, appended by the launcher and by the trainers of one node.

Its path is ``<run_dir>/<job>.events.jsonl`` (``flashckpt-run`` prints it and passes it to the
workers as ``FLASHCKPT_EVENTS``); ``flashckpt report`` reads it. Each line is written with one
``write`` to a file opened ``O_APPEND``, so the writers of a node never interleave inside a line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from .. import config
from ..safe_paths import open_file

log = logging.getLogger(__name__)

ENV = "FLASHCKPT_EVENTS"


def events_path(run_dir: Path, job: str) -> Path:
    return run_dir / f"{job}.events.jsonl"


class EventLog:
    def __init__(self, path: Path):
        self.path = path
        self._node = config.node_name()

    @classmethod
    def of_launched(cls, run_dir: Path, job: str) -> EventLog | None:
        """The log of ``job`` on this node if ``flashckpt-run`` started one there (the agent
        adds its tiers' commits to it); None for a job run without it."""
        path = events_path(run_dir, job)
        return cls(path) if path.is_file() else None

    @classmethod
    def from_env(cls) -> EventLog | None:
        """The log a launcher named for this worker, if any."""
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def record(self, kind: str, **fields: object) -> None:
        """Append one event; a log that cannot be written is reported, never raised."""
        doc = {"time": time.time(), "kind": kind, "node": self._node, "pid": os.getpid()}
        doc.update(fields)
        line = (json.dumps(doc, default=str) + "\n").encode()
        try:
            fd = open_file(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot append to the event log %s: %s", self.path, exc)


def read_events(path: Path) -> list[dict]:
    """Every well-formed event of ``path``, in file order; a torn or foreign line (or one
    without a finite time) is skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("kind"), str):
                t = doc.get("time")
                if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
                    out.append(doc)
    return out
