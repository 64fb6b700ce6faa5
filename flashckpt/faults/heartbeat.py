"""Heartbeat pages: each trainer's progress in shared memory, read by the hang watchdog.

One small file per rank, ``<shm_dir>/<job>/rank-<R>.heartbeat``, that the rank's
``Checkpointer`` updates on every ``save()``, ``restore()`` and ``close()`` and, through a
global optimizer-step post-hook, on every optimizer step: a few stores into a mapped page, no
RPC and no system call on the training step. The watchdog of ``flashckpt-run`` reads the pages
of its workers and tells a slow rank from a hung one with the step times the page carries.

The page is written by one process and read by others, so a read is untrusted: a seqlock
guards torn reads, and anything that does not parse is treated as no page at all.
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import logging
import math
import mmap
import os
import signal
import statistics
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FlashCkptError
from ..pidfile import pid_alive
from ..safe_paths import open_file

log = logging.getLogger(__name__)

MAGIC = b"FCHBEAT2"
_FMT = struct.Struct("<8sQqIIqQdddd")
# magic, seq (odd while writing), pid, phase, budget_s (how long the rank said its phase may
# take, 0: not said), step, beats (progress count), updated_at, slowest recent step interval,
# started_at, phase_since: times are CLOCK_MONOTONIC, which every process of the node shares.
_ISSUED_AT = 128  # then a count and (group key, collectives issued) pairs: collectives.Sampler
_COUNT = struct.Struct("<I")
_PAIR = struct.Struct("<QQ")
MAX_GROUPS = 16
_READ = _ISSUED_AT + _COUNT.size + MAX_GROUPS * _PAIR.size
PAGE = 4096
_MAX_BUDGET = 2**32 - 1
WINDOW = 32
"""Step intervals kept to learn the step time: the slowest of the last WINDOW counts."""
STACK_SIGNAL = signal.SIGUSR2
"""Makes a trainer dump its Python stacks into its ``rank-<R>.stacks`` file (faulthandler)."""


class Phase(enum.IntEnum):
    UNSPECIFIED = 0
    STARTUP = 1
    TRAIN = 2
    SAVE = 3
    RESTORE = 4
    CLOSED = 5
    WAIT = 6  # for a snapshot to reach shared memory or a tier: wait(), close()


_SUFFIX = ".heartbeat"


def heartbeat_path(shm_dir: Path, job: str, rank: int) -> Path:
    return shm_dir / job / f"rank-{rank}{_SUFFIX}"


def stacks_path(shm_dir: Path, job: str, rank: int) -> Path:
    return shm_dir / job / f"rank-{rank}.stacks"


@dataclass(frozen=True)
class Beat:
    """One consistent read of a page."""

    pid: int
    phase: Phase
    step: int | None
    beats: int
    updated_at: float
    slowest_step_s: float  # 0 until one full step interval was seen in the train phase
    started_at: float
    phase_since: float
    budget_s: int = 0  # what the rank said its phase may take (a wait's timeout), 0: not said
    issued: dict[str, int] = field(default_factory=dict)  # group key (hex) -> collectives


class Heartbeat:
    """The writer side: one per Checkpointer. ``progress()`` is the per-step call."""

    def __init__(self, path: Path, stacks: Path):
        fd = open_file(path, os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, PAGE)
            self._mm = mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path
        self._lock = threading.Lock()
        self._seq = 0
        self._phase = Phase.STARTUP
        self._budget = 0
        self._step = -1
        self._beats = 0
        self._last_progress: float | None = None
        self._intervals: deque[float] = deque(maxlen=WINDOW)
        now = time.monotonic()
        self._started, self._phase_since = now, now
        self._stacks_path = stacks
        _register_stack_dump(stacks)
        _COUNT.pack_into(self._mm, _ISSUED_AT, 0)  # a page of an earlier process: not ours
        self._write(now)
        _live.add(self)

    def phase(self, phase: Phase, step: int | None = None, budget_s: float = 0.0) -> None:
        """Enter ``phase`` (a save, a restore, a wait, training again, closed); ``budget_s``:
        how long it may take, when the rank knows (a wait's timeout)."""
        with self._lock:
            now = time.monotonic()
            self._budget = math.ceil(min(max(0.0, budget_s), _MAX_BUDGET))
            if phase != self._phase:
                self._phase, self._phase_since = phase, now
            if phase == Phase.RESTORE:
                self._last_progress = None  # the step time restarts with the new run
            if step is not None:
                self._step = step
            self._write(now)

    @contextlib.contextmanager
    def waiting(self, budget_s: float | None) -> Iterator[None]:
        """The wait phase for the block (``budget_s``: the wait's timeout, None if it has
        none), the phase before it again after; the wait is no step interval."""
        with self._lock:
            before = self._phase
        self.phase(Phase.WAIT, budget_s=budget_s or 0.0)
        try:
            yield
        finally:
            with self._lock:
                self._last_progress = None
            if not self._mm.closed:
                self.phase(before)

    def progress(self, step: int | None = None) -> None:
        """One more step done (an optimizer step, a save): the rank is alive and training."""
        with self._lock:
            now = time.monotonic()
            if self._phase != Phase.TRAIN:
                self._phase, self._phase_since, self._budget = Phase.TRAIN, now, 0
            elif self._last_progress is not None:
                self._intervals.append(now - self._last_progress)
            self._last_progress = now
            self._beats += 1
            if step is not None:
                self._step = step
            self._write(now)

    def issued(self, counts: dict[int, int]) -> None:
        """The collectives this process issued so far, per process group (at most
        MAX_GROUPS): the evidence that tells a hung rank from those blocked behind it."""
        pairs = list(counts.items())[:MAX_GROUPS]
        with self._lock:
            if self._mm.closed:
                return
            with self._writing():
                _COUNT.pack_into(self._mm, _ISSUED_AT, len(pairs))
                for i, pair in enumerate(pairs):
                    _PAIR.pack_into(self._mm, _ISSUED_AT + _COUNT.size + i * _PAIR.size, *pair)

    def typical_step_s(self) -> float | None:
        """The median of the recent step intervals, None before two steps."""
        with self._lock:
            return statistics.median(self._intervals) if self._intervals else None

    def close(self) -> None:
        """Mark the rank closed and remove its page: the watchdog stops watching it, and a
        worker that exits afterwards has finished, not failed. Closing again does nothing."""
        if self._mm.closed:
            return
        self.phase(Phase.CLOSED)
        _live.discard(self)
        self.path.unlink(missing_ok=True)
        self._mm.close()
        _unregister_stack_dump(self._stacks_path)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """The page's sequence number odd while the block writes (a reader retries)."""
        self._seq += 1
        struct.pack_into("<Q", self._mm, 8, self._seq)
        yield
        self._seq += 1
        struct.pack_into("<Q", self._mm, 8, self._seq)

    def _write(self, now: float) -> None:
        slowest = max(self._intervals, default=0.0)
        with self._writing():
            _FMT.pack_into(
                self._mm, 0, MAGIC, self._seq, os.getpid(), int(self._phase), self._budget,
                self._step, self._beats, now, slowest, self._started, self._phase_since,
            )  # fmt: skip


def open_for_rank(shm_dir: Path, job: str, rank: int) -> Heartbeat | None:
    """The rank's page, with the optimizer hook installed; None (warned) if it cannot be
    made: saving goes on, and only a hang of the rank goes unnoticed."""
    try:
        hb = Heartbeat(heartbeat_path(shm_dir, job, rank), stacks_path(shm_dir, job, rank))
        install_optimizer_hook()
    except (OSError, FlashCkptError) as exc:
        log.warning("rank %d has no heartbeat page (%s); a hang of it goes unnoticed", rank, exc)
        return None
    return hb


def pages(shm_dir: Path, job: str) -> list[tuple[int, Beat]]:
    """(rank, beat) of every valid heartbeat page of ``job`` on this node, by rank."""
    try:
        names = sorted(os.listdir(shm_dir / job))
    except OSError:
        return []
    out = []
    for name in names:
        if not (name.startswith("rank-") and name.endswith(_SUFFIX)):
            continue
        try:
            rank = int(name[len("rank-") : -len(_SUFFIX)])
        except ValueError:
            continue
        beat = read(shm_dir / job / name)
        if beat is not None:
            out.append((rank, beat))
    return out


def remove_dead(shm_dir: Path, job: str) -> list[int]:
    """Remove the pages of ``job`` whose process is gone (left by an earlier run: killed, or
    its node restarted) and return their ranks. Only for one who knows no worker of the job
    runs here yet, such as a launcher before its first workers start: a page left behind
    would report a worker of an old run as failing in this one."""
    gone = [rank for rank, beat in pages(shm_dir, job) if not pid_alive(beat.pid)]
    for rank in gone:
        heartbeat_path(shm_dir, job, rank).unlink(missing_ok=True)
        stacks_path(shm_dir, job, rank).unlink(missing_ok=True)
    return gone


def forget(shm_dir: Path, job: str, pids: list[int]) -> None:
    """Remove the pages of ``job``'s workers ``pids`` (about to be stopped on purpose, as a
    preemption does): a worker stopped so has not failed, and neither this node's watch nor
    the job's controller is to act on its exit."""
    for rank, beat in pages(shm_dir, job):
        if beat.pid in pids:
            heartbeat_path(shm_dir, job, rank).unlink(missing_ok=True)


def read(path: Path) -> Beat | None:
    """The page's current beat, or None if there is no valid page (missing, foreign, torn)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = b""
        for _ in range(100):  # a seqlock: even and unchanged across the read, else torn
            raw = os.pread(fd, _READ, 0)
            if len(raw) < _READ:
                return None
            first = struct.unpack_from("<Q", raw, 8)[0]
            if first % 2 == 0 and os.pread(fd, 8, 8) == raw[8:16]:
                break
            time.sleep(0.0001)
        else:
            return None
    finally:
        os.close(fd)
    magic, _, pid, phase, budget, step, beats, updated, slowest, started, since = (
        _FMT.unpack_from(raw))  # fmt: skip
    (count,) = _COUNT.unpack_from(raw, _ISSUED_AT)
    ok = magic == MAGIC and pid > 0 and phase in Phase._value2member_map_ and count <= MAX_GROUPS
    times = (updated, slowest, started, since)
    if not ok or not all(t == t and 0 <= t < 1e12 for t in times):  # t == t: not NaN
        return None
    issued = dict(_PAIR.unpack_from(raw, _ISSUED_AT + _COUNT.size + i * _PAIR.size)
                  for i in range(count))  # fmt: skip
    return Beat(pid, Phase(phase), step if step >= 0 else None, beats, updated, slowest,
                started, since, budget, {f"{k:016x}": v for k, v in issued.items()})  # fmt: skip


# ---- per-process plumbing: the optimizer-step hook and the stack dump ----------------------

_live: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def recovering(budget_s: float) -> None:
    """Every live heartbeat of this process waits, for at most ``budget_s``, for a round of
    in-process recovery to form: a survivor of a fault waits there for the lost rank's
    replacement, and is not judged hung meanwhile (its next restore or step ends the wait)."""
    for hb in list(_live):
        with hb._lock:
            hb._last_progress = None  # the wait is no step interval
        if not hb._mm.closed:
            hb.phase(Phase.WAIT, budget_s=budget_s)


def record_issued(counts: dict[int, int]) -> None:
    """Every live heartbeat of this process carries ``counts`` (see ``Heartbeat.issued``)."""
    for hb in list(_live):
        hb.issued(counts)


def last_step() -> int | None:
    """The newest step a live heartbeat of this process carries (None before any)."""
    steps = [hb._step for hb in list(_live) if hb._step >= 0]
    return max(steps) if steps else None


_hook_lock = threading.Lock()
_hook = None


def install_optimizer_hook() -> None:
    """Every optimizer step of this process is progress for its live heartbeats, so a job
    that saves every N steps still beats every step (registered once per process)."""
    global _hook
    with _hook_lock:
        if _hook is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def beat(*_: object) -> None:
            for hb in list(_live):
                hb.progress()

        _hook = register_optimizer_step_post_hook(beat)


_stack_files: dict[str, object] = {}


def _register_stack_dump(path: Path):
    """Dump every thread's Python stack into ``path`` on STACK_SIGNAL (faulthandler writes
    from the signal handler, so a rank blocked in a collective still answers)."""
    key = str(path)
    if key in _stack_files:
        return _stack_files[key]
    try:
        fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        f = os.fdopen(fd, "w")
        faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=True)
    except (OSError, ValueError, RuntimeError):
        return None  # no stack dumps; hang detection still works
    _stack_files[key] = f
    return f


def _unregister_stack_dump(path: Path) -> None:
    f = _stack_files.pop(str(path), None)
    if f is None:
        return
    if not _stack_files:
        faulthandler.unregister(STACK_SIGNAL)
    f.close()
    path.unlink(missing_ok=True)
