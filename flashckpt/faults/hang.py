"""Hang detection: when has a rank been silent too long for the phase it is in.

A rank's timeout is learned from its own step times and bounded:
``clamp(FLASHCKPT_HANG_FACTOR x slowest recent step, FLASHCKPT_HANG_FLOOR, FLASHCKPT_HANG_CEILING)``
while it trains, with separate budgets while it starts up (until its first full step after a
start or a restore), saves and restores, so a slow first step or a large restore is not a hang.
A rank waiting for a snapshot to reach a tier (``wait()``, ``close()``) has the timeout it waits
with plus the save budget (the ceiling in place of a timeout it did not give).
A closed rank is not watched, nor a worker that never made a heartbeat page (it does not use
flashckpt).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import config
from ..errors import ConfigError
from .heartbeat import STACK_SIGNAL, Beat, Phase, heartbeat_path, read, stacks_path
from .proc import parent_and_state

log = logging.getLogger(__name__)

# A stack dump is read once it has stopped growing this long: a worker continued on a busy
# machine may pause that long between two threads of its dump (50 ms once cut a dump short).
DUMP_QUIET_S = 0.2


@dataclass(frozen=True)
class HangPolicy:
    """Seconds; each from ``FLASHCKPT_HANG_<NAME>`` when not given."""

    factor: float = 5.0
    floor: float = 30.0
    ceiling: float = 1800.0
    startup: float = 600.0
    save: float = 300.0
    restore: float = 900.0

    @classmethod
    def from_env(cls) -> HangPolicy:
        d = cls()
        policy = cls(**{
            name: config.setting_float(f"hang_{name}", None, getattr(d, name), lo=0.001)
            for name in ("factor", "floor", "ceiling", "startup", "save", "restore")
        })  # fmt: skip
        if policy.ceiling < policy.floor:
            raise ConfigError(
                f"FLASHCKPT_HANG_CEILING ({policy.ceiling}) is below FLASHCKPT_HANG_FLOOR "
                f"({policy.floor}); the ceiling must be at least the floor"
            )
        return policy

    def timeout(self, beat: Beat) -> float | None:
        """How long ``beat``'s rank may stay silent in its phase; None: not watched."""
        if beat.phase == Phase.CLOSED:
            return None
        if beat.phase == Phase.SAVE:
            return self.save
        if beat.phase == Phase.RESTORE:
            return self.restore
        if beat.phase == Phase.WAIT:
            return self.save + (beat.budget_s or self.ceiling)
        if beat.phase == Phase.TRAIN and beat.slowest_step_s > 0:
            return min(max(self.factor * beat.slowest_step_s, self.floor), self.ceiling)
        return max(self.startup, self.floor)  # start-up, or the first step after it


@dataclass(frozen=True)
class Hang:
    rank: int
    pid: int
    phase: str
    step: int | None
    silent_s: float
    timeout_s: float
    last_progress: float = 0.0  # wall clock (comparable across nodes)
    issued: dict[str, int] = field(default_factory=dict)  # see collectives
    stopped: bool = False  # the process is stopped (SIGSTOP, a debugger)


class Watchdog:
    """Reads the heartbeat pages of one node's workers of one job."""

    def __init__(self, shm_dir: Path, job: str, policy: HangPolicy):
        self.shm_dir, self.job, self.policy = shm_dir, job, policy

    def silences(self, workers: dict[int, int]) -> list[Hang]:
        """How long each watched one of ``workers`` ({global rank: pid}) has been silent,
        against its timeout. A page left by an earlier process of the rank (another pid) is
        not this worker's, and is ignored."""
        now, wall = time.monotonic(), time.time()
        out = []
        for rank, pid in sorted(workers.items()):
            beat = read(heartbeat_path(self.shm_dir, self.job, rank))
            if beat is None or beat.pid != pid:
                continue
            limit = self.policy.timeout(beat)
            if limit is not None:
                silent = now - beat.updated_at
                out.append(Hang(rank, pid, beat.phase.name.lower(), beat.step, silent, limit,
                                wall - silent, beat.issued, parent_and_state(pid)[1] == "T"))  # fmt: skip
        return out

    def check(self, workers: dict[int, int]) -> list[Hang]:
        """The hung ones among ``workers``: silent past their timeout."""
        return [h for h in self.silences(workers) if h.silent_s > h.timeout_s]

    def stacks(self, rank: int, pid: int, stopped: bool = False, wait_s: float = 2.0) -> str:
        """The Python stacks of a hung worker: py-spy when installed (it reads a stopped
        process as it is), else the faulthandler dump the library registered. A ``stopped``
        process is continued for it (it is killed right after)."""
        spy = shutil.which("py-spy")
        if spy:
            try:
                out = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10
                )
                if out.returncode == 0 and out.stdout.strip():
                    return out.stdout
            except (OSError, subprocess.SubprocessError) as exc:
                log.debug("py-spy failed on pid %d: %s", pid, exc)
        path = stacks_path(self.shm_dir, self.job, rank)
        before = _size(path)
        try:
            os.kill(pid, STACK_SIGNAL)
            if stopped:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + wait_s
        last, since = before, time.monotonic()
        while time.monotonic() < deadline:
            size = _size(path)
            if size != last:
                last, since = size, time.monotonic()
            elif size > before and time.monotonic() - since > DUMP_QUIET_S:
                break  # the dump grew and has stopped growing
            time.sleep(0.01)
        try:
            with open(path, "rb") as f:
                f.seek(before)
                return f.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
