"""The mark a preempted job's launcher leaves in the node's run directory.

``flashckpt-run`` writes it when the scheduler asks the job to go (SIGTERM, the signal or
file set by ``FLASHCKPT_PREEMPT_SIGNAL`` / ``FLASHCKPT_PREEMPT_FILE``): the node's agent then
persists the newest step every rank here holds past every tier's throttle, and
``Checkpointer.preempted()`` answers True so a training loop can stop at a step boundary.
A launcher starting the job removes a mark left by an earlier run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .safe_paths import write_atomic


@dataclass(frozen=True)
class Mark:
    why: str  # what asked the job to go: "SIGTERM", "file /run/preempt"...
    since: float  # wall-clock time of the request
    deadline: float  # wall-clock time by which the launcher exits


def path(run_dir: Path, job: str) -> Path:
    return Path(run_dir) / f"{job}.preempted"


def write(run_dir: Path, job: str, why: str, budget_s: float) -> Mark:
    now = time.time()
    mark = Mark(why, now, now + budget_s)
    write_atomic(path(run_dir, job), json.dumps(mark.__dict__).encode())
    return mark


def read(run_dir: Path, job: str) -> Mark | None:
    """The job's mark on this node, or None. A mark that cannot be read still says the job
    is being preempted (written by nobody else): its times are then unknown (0)."""
    try:
        raw = path(run_dir, job).read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return Mark("unknown", 0.0, 0.0)
    try:
        fields = json.loads(raw)
        return Mark(str(fields["why"]), float(fields["since"]), float(fields["deadline"]))
    except (ValueError, KeyError, TypeError):
        return Mark("unknown", 0.0, 0.0)


def clear(run_dir: Path, job: str) -> None:
    path(run_dir, job).unlink(missing_ok=True)
