"""A rank's two slots: where they live, which one the next snapshot goes to, how to read one.

Files: ``<shm_dir>/<job>/rank-<R>.slot-<0|1>`` and ``rank-<R>.owner`` (held by the live writer).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import ManifestError, RankBusyError, SharedMemoryError
from .manifest import Manifest
from .pidfile import PidFileBusy, lock_pidfile
from .slot import Slot, SlotHeader, SlotState, shm_space_error

N_SLOTS = 2
_SLOT_RE = re.compile(r"^rank-(\d+)\.slot-(\d+)$")


def job_dir(shm_dir: Path, job: str) -> Path:
    return shm_dir / job


def slot_path(shm_dir: Path, job: str, rank: int, index: int) -> Path:
    return job_dir(shm_dir, job) / f"rank-{rank}.slot-{index}"


def ranks_in(shm_dir: Path, job: str) -> list[int]:
    d = job_dir(shm_dir, job)
    if not d.is_dir():
        return []
    return sorted({int(m.group(1)) for p in d.iterdir() if (m := _SLOT_RE.match(p.name))})


@dataclass(frozen=True)
class Snapshot:
    """A READY slot as seen by a reader holding its shared lock."""

    slot: Slot
    header: SlotHeader
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.header.step

    def intact(self) -> bool:
        """True if nothing was rewritten since the read began (the seqlock check)."""
        return self.slot.seq() == self.header.seq


@contextlib.contextmanager
def read_locked(slot: Slot, timeout: float = 5.0) -> Iterator[Snapshot | None]:
    """Yield the slot's READY snapshot under a shared lock, or None if it has none."""
    if not slot.lock_shared(timeout):
        yield None
        return
    try:
        slot.refresh()
        h = slot.header()
        if not h.readable:
            yield None
            return
        raw = slot.manifest_bytes(h)
        manifest = Manifest.from_json(raw, source=f"{slot.path}")
        sums = slot.checksums(h)
        if sums is not None:
            manifest = manifest.with_checksums(sums)
        if manifest.step != h.step:
            raise ManifestError(f"{slot.path}: header says step {h.step}, manifest {manifest.step}")
        yield Snapshot(slot, h, manifest)
    finally:
        slot.unlock()


class SlotPair:
    """The writer's view of its rank's slots."""

    def __init__(self, shm_dir: Path, job: str, rank: int):
        self.dir = job_dir(shm_dir, job)
        self.paths = [slot_path(shm_dir, job, rank, i) for i in range(N_SLOTS)]
        self.slots: list[Slot | None] = [None] * N_SLOTS
        self._owner_fd: int | None = None
        self.job, self.rank = job, rank

    # ---- ownership -------------------------------------------------------------------
    def claim(self) -> None:
        """Become the one writer of this rank; a second live one is refused."""
        if self._owner_fd is not None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise SharedMemoryError(exc.errno, f"cannot create {self.dir}: {exc.strerror}") from exc
        try:
            fd = lock_pidfile(self.dir / f"rank-{self.rank}.owner")
        except PidFileBusy as busy:
            raise RankBusyError(
                f"rank {self.rank} of job {self.job!r} is already saving from pid {busy.pid}; "
                "give each process its own rank (or job), or stop the other process first"
            ) from None
        self._owner_fd = fd

    def release(self) -> None:
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    # ---- mapping ---------------------------------------------------------------------
    def open_existing(self) -> None:
        for i, path in enumerate(self.paths):
            if self.slots[i] is None and path.exists():
                try:
                    self.slots[i] = Slot.create(path, 0)
                except SharedMemoryError:
                    path.unlink(missing_ok=True)  # not ours (bad magic): start over

    def check_space(self, capacity: int) -> None:
        """Fail now, naming the size, if the slots cannot grow to ``capacity`` each."""
        need = 0
        for path in self.paths:
            have = path.stat().st_size if path.exists() else 0
            need += max(0, capacity - have)
        if need == 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.statvfs(self.dir)
        if st.f_bavail * st.f_frsize < need:
            raise shm_space_error(self.paths[0], need, OSError(errno.ENOSPC, "no space"))

    def prepare(self, capacity: int) -> None:
        """Create, grow and pre-fault both slots so the next snapshots pay no page faults."""
        self.check_space(capacity)
        for i, path in enumerate(self.paths):
            slot = self.slots[i]
            if slot is None:
                self.slots[i] = Slot.create(path, capacity)
            elif slot.capacity < capacity:
                slot.grow(capacity)

    def ready(self) -> list[Slot]:
        """Slots holding a READY snapshot, newest first."""
        out = [(s.header(), s) for s in self.slots if s is not None]
        out = [(h, s) for h, s in out if h.readable]
        out.sort(key=lambda hs: (hs[0].step, hs[0].published_at), reverse=True)
        return [s for _, s in out]

    def acquire_for_write(self) -> Slot | None:
        """Lock and return the slot the next snapshot goes to, or None if all are held.

        Order: a slot with no READY snapshot, then the older READY one, then the newest (only
        when a reader holds the other, which then stays READY throughout).
        """
        slots = [s for s in self.slots if s is not None]

        def rank_of(s: Slot) -> tuple:
            h = s.header()
            return (h.state == SlotState.READY, h.step, h.published_at)

        for slot in sorted(slots, key=rank_of):
            if slot.try_lock(exclusive=True):
                return slot
        return None

    def close(self, remove: bool) -> None:
        for i, slot in enumerate(self.slots):
            if slot is not None:
                slot.close()
                self.slots[i] = None
            if remove:
                self.paths[i].unlink(missing_ok=True)
        if remove:
            (self.dir / f"rank-{self.rank}.owner").unlink(missing_ok=True)
        self.release()
        if remove:
            with contextlib.suppress(OSError):
                self.dir.rmdir()
