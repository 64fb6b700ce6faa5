"""The node's host-memory cap: what flashckpt may hold in shared memory on a node, every rank's
slots and the replicas it holds for other nodes together (``FLASHCKPT_HOST_MEMORY``).

What counts is what the files under the shm dir hold now (their allocated pages), so a
process never needs to know what the others hold. Every process that adds to it (a rank
making or growing a slot, the agent taking another node's replica) checks and allocates
under one lock in the shm dir, so two of them cannot both take the last room. At the cap:

- a rank's first slot that does not fit is an error at ``save()`` naming the cap;
- a rank makes no more slots than fit. With one slot it overwrites its newest snapshot only
  once every tier the agent stores the job to holds that step (a crash mid-copy then loses
  no step) and skips the save otherwise (counted in ``skipped``, with a warning);
- a spare slot (persistence lagging) is not made: the save skips;
- another node's replica is refused (its put fails with the reason); that node's newest
  step is then in its storage tiers only, where its restore finds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import config
from ..errors import HostMemoryCapError
from ..safe_paths import write_atomic

ENV = "FLASHCKPT_HOST_MEMORY"
LOCK_NAME = ".host-memory.lock"
CAP_NAME = ".host-memory.cap"  # the cap the node's processes enforce, for ``flashckpt status``


def cap() -> int | None:
    """The cap in bytes, or None (unset or 0: no cap)."""
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "0"):
        return None
    return config.parse_size(raw, ENV)


def used(shm_dir: Path) -> int:
    """Bytes the files under ``shm_dir`` hold in memory (allocated pages), every job's."""
    total = 0
    stack = [Path(shm_dir)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # removed meanwhile
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


@contextlib.contextmanager
def reserving(shm_dir: Path, more: int, what: str,
              keep: Callable[[], int] = lambda: 0) -> Iterator[None]:  # fmt: skip
    """Hold the node's lock while ``what`` allocates ``more`` bytes under ``shm_dir``;
    ``HostMemoryCapError`` first if they do not fit the cap with ``keep()`` bytes left over
    (for what others need first; asked only under a cap). No cap: no lock, nothing asked."""
    limit = cap()
    if limit is None or more <= 0:
        yield
        return
    fd = os.open(Path(shm_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            write_atomic(Path(shm_dir) / CAP_NAME, str(limit).encode())
        now, kept = used(shm_dir), keep()
        if now + more + kept > limit:
            said = (
                f", and {_mib(kept)} are kept for the first slots of the node's other ranks"
                if kept
                else ""
            )
            raise HostMemoryCapError(
                f"{what} needs {_mib(more)} more, but this node's flashckpt memory holds "
                f"{_mib(now)} of its {ENV} cap of {_mib(limit)} (slots of every rank and the "
                f"replicas held for other nodes, in {shm_dir}){said}; raise the cap, or give "
                "the node fewer ranks or a smaller state"
            )
        yield
    finally:
        os.close(fd)


def fits(shm_dir: Path, more: int) -> str:
    """Why ``more`` bytes would not fit the cap now ("" if they do, or there is none)."""
    limit = cap()
    if limit is None:
        return ""
    now = used(shm_dir)
    if now + more <= limit:
        return ""
    return f"holds {_mib(now)} of its {ENV} cap of {_mib(limit)}: no room for {_mib(more)} more"


class EveryFew:
    """A warning logged at most once every ``seconds``, with how many went unsaid: at the cap
    a save may skip every step."""

    def __init__(self, log: logging.Logger, seconds: float):
        self.log, self.seconds = log, seconds
        self._last, self._unsaid = -math.inf, 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.seconds:
            self._unsaid += 1
            return
        more = f" ({self._unsaid} more since it was last said)" if self._unsaid else ""
        self._last, self._unsaid = now, 0
        self.log.warning(msg + more, *args)


def enforced(shm_dir: Path) -> int | None:
    """The cap the node's ranks and agent last enforced (else this process's setting)."""
    try:
        return int((Path(shm_dir) / CAP_NAME).read_text())
    except (OSError, ValueError):
        return cap()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
