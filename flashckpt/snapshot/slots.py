"""A rank's two slots: where they live, which one the next snapshot goes to, how to read one.

Files: ``<shm_dir>/<job>/rank-<R>.slot-<0|1>`` and ``rank-<R>.owner`` (held by the live writer;
an owner killed whose kill has not taken, which never writes again, gives it up to the next).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..errors import FlashCkptError, ManifestError, RankBusyError, SharedMemoryError

# Against the layers, by design: a rank's files in shared memory are freed together, and the
# heartbeat page and stack dump among them are named where they are written (faults/).
from ..faults.heartbeat import heartbeat_path, stacks_path
from ..faults.proc import parent_and_state
from ..format.kept import Kept
from ..format.manifest import Manifest
from ..format.slot import Slot, SlotHeader, SlotState, shm_space_error
from ..pidfile import PidFileBusy, lock_pidfile, release_doomed
from ..safe_paths import private_dir
from . import host_memory

log = logging.getLogger(__name__)

N_SLOTS = 6
"""The most slot files a rank may have: two in use, plus spares made only when persistence
lags, up to one per tier storing the job (each tier's round holds at most one of a rank's
slots, so with that many spares no reader can make a save skip its snapshot)."""
N_STEADY = 2
_CLAIM_ATTEMPTS = 20
_CLAIM_GRACE_S = 1.0  # an agent freeing a closed rank's slots holds its owner lock briefly
_SLOT_RE = re.compile(r"rank-([0-9]+)\.slot-([0-9]+)")


def job_dir(shm_dir: Path, job: str) -> Path:
    return shm_dir / job


def slot_path(shm_dir: Path, job: str, rank: int, index: int) -> Path:
    return job_dir(shm_dir, job) / f"rank-{rank}.slot-{index}"


def owner_path(shm_dir: Path, job: str, rank: int) -> Path:
    return job_dir(shm_dir, job) / f"rank-{rank}.owner"


def closed_marker_path(shm_dir: Path, job: str, rank: int) -> Path:
    """Written by a trainer that closed before every tier had its last step; the agent frees
    the slots once they do. It belongs to that trainer's lifetime: the next claim removes it."""
    return job_dir(shm_dir, job) / f"rank-{rank}.closed"


@contextlib.contextmanager
def unowned(shm_dir: Path, job: str, rank: int) -> Iterator[bool]:
    """Hold rank ``rank``'s owner lock if no live process does: yields True, and no trainer can
    claim the rank until the block ends; yields False while a trainer owns it."""
    path = owner_path(shm_dir, job, rank)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        yield same  # a file unlinked and recreated meanwhile is not the one a trainer locks
    finally:
        os.close(fd)


def free_rank(shm_dir: Path, job: str, rank: int) -> None:
    """Remove a rank's slots, closed marker, heartbeat page, stack dump and owner file (the
    caller holds its owner lock)."""
    for i in range(N_SLOTS):
        slot_path(shm_dir, job, rank, i).unlink(missing_ok=True)
    closed_marker_path(shm_dir, job, rank).unlink(missing_ok=True)
    heartbeat_path(shm_dir, job, rank).unlink(missing_ok=True)
    stacks_path(shm_dir, job, rank).unlink(missing_ok=True)
    owner_path(shm_dir, job, rank).unlink(missing_ok=True)


def ranks_in(shm_dir: Path, job: str) -> list[int]:
    d = job_dir(shm_dir, job)
    if not d.is_dir():
        return []
    return sorted({int(m.group(1)) for p in d.iterdir() if (m := _SLOT_RE.fullmatch(p.name))})


@dataclass(frozen=True)
class Snapshot:
    """A READY slot as seen by a reader holding its shared lock."""

    slot: Slot
    header: SlotHeader
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def generation(self) -> int:
        return self.header.generation

    def intact(self) -> bool:
        """True if nothing was rewritten since the read began (the seqlock check)."""
        return self.slot.seq() == self.header.seq


_PARSED: Kept[Manifest] = Kept(4)  # by (manifest bytes, checksums' bytes)


def _parsed(raw: bytes, sums: bytes | None, slot: Slot, h: SlotHeader) -> Manifest:
    """The manifest of ``raw`` with checksums ``sums`` (as stored: ``Slot.checksum_bytes``),
    parsed and checked once per distinct bytes: a restore reads each slot's manifest when it
    lists the snapshots and again when it loads one, and at thousands of entries a parse
    costs tens of milliseconds. The same bytes parse to the same manifest, so what was
    checked stands (a failure is never kept); the header is checked against it on every
    read."""
    key = (raw, sums)
    manifest = _PARSED.get(key)
    fresh = manifest is None
    if fresh:
        manifest = Manifest.from_json(raw, source=f"{slot.path}")
    found = (manifest.step, manifest.data_len, manifest.n_chunks, manifest.generation)
    if found != (h.step, h.data_len, h.n_chunks, h.generation):
        raise ManifestError(
            f"{slot.path}: the header says step {h.step}, {h.data_len} bytes, {h.n_chunks} "
            f"chunks, generation {h.generation}; its manifest says step {found[0]}, "
            f"{found[1]} bytes, {found[2]} chunks, generation {found[3]}"
        )
    if fresh:
        if sums is not None:
            manifest = manifest.with_checksums(struct.unpack(f"<{len(sums) // 4}I", sums))
        _PARSED.put(key, manifest)
    return manifest


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
        manifest = _parsed(raw, slot.checksum_bytes(h), slot, h)
        yield Snapshot(slot, h, manifest)
    finally:
        slot.unlock()


def header_or_none(slot: Slot) -> SlotHeader | None:
    """The slot's header, or None (logged) if it is not valid: it then holds no snapshot."""
    try:
        return slot.header()
    except SharedMemoryError as exc:
        log.debug("%s", exc)  # polled (wait()); the owner warns when it reinitialises the file
        return None


class SlotPair:
    """The writer's view of its rank's slots."""

    def __init__(self, shm_dir: Path, job: str, rank: int):
        self.dir = job_dir(shm_dir, job)
        self.paths = [slot_path(shm_dir, job, rank, i) for i in range(N_SLOTS)]
        self.slots: list[Slot | None] = [None] * N_SLOTS
        self.busy: set[int] = set()  # slots being prepared in the background: not to be touched
        self.pinning: set[int] = set()  # slots being page-locked: readable, not to be written
        self.writing: set[int] = set()  # slots a snapshot is being written into (copies in flight)
        # Slots in use: two, and a spare each time readers held every slot but the newest
        # (persistence lags), or the spares found from an earlier run.
        self.in_use = N_STEADY
        self.max_in_use = N_STEADY + 1  # the owner raises it to two plus one per tier
        self._owner_fd: int | None = None
        self.shm_dir, self.job, self.rank = shm_dir, job, rank

    # ---- ownership -------------------------------------------------------------------
    def claim(self) -> None:
        """Become the one writer of this rank; a second live one is refused, in this process
        too (a Checkpointer still open for the same job and rank)."""
        if self._owner_fd is not None:
            return
        deadline = time.monotonic() + _CLAIM_GRACE_S
        vanished = 0
        while vanished < _CLAIM_ATTEMPTS:
            self._make_dir()
            try:
                self._owner_fd = lock_pidfile(self._owner_path)
            except FileNotFoundError:
                vanished += 1  # a closing owner removed the emptied job directory meanwhile
                continue
            except PidFileBusy as busy:
                if busy.pid != os.getpid() and self._take_from_doomed():
                    vanished += 1  # bounds the takeovers too
                    continue
                if busy.pid != os.getpid() and time.monotonic() < deadline:
                    time.sleep(0.01)  # perhaps an agent freeing the rank's old slots
                    continue
                hint = (
                    "close() the other Checkpointer (or keep using it) before creating a new one"
                    if busy.pid == os.getpid()
                    else "give each process its own rank (or job), or stop the other process first"
                )
                raise RankBusyError(
                    f"rank {self.rank} of job {self.job!r} is already saving from "
                    f"{busy.holder()}; {hint}"
                ) from None
            # A marker left by an earlier trainer of this rank is not ours: the agent must not
            # free the slots this trainer is about to use.
            closed_marker_path(self.shm_dir, self.job, self.rank).unlink(missing_ok=True)
            return
        raise RankBusyError(
            f"rank {self.rank} of job {self.job!r}: {self.dir} kept disappearing while it was "
            "being claimed; another process is creating and closing this rank in a loop"
        )

    def _take_from_doomed(self) -> bool:
        """Free the rank from an owner killed whose kill has not taken (``pidfile.doomed``: it
        never writes again) for this claim; whether it was."""
        pid = release_doomed(self._owner_path)
        if pid is None:
            return False
        log.warning("rank %d of job %r: its owner (pid %d) was killed and is held in the kernel "
                    "(its SIGKILL pending, state %s); it never runs again: this process (pid %d) "
                    "takes the rank over", self.rank, self.job, pid,
                    parent_and_state(pid)[1] or "?", os.getpid())  # fmt: skip
        return True

    def release(self) -> None:
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    @property
    def _owner_path(self) -> Path:
        return self.dir / f"rank-{self.rank}.owner"

    def _make_dir(self) -> None:
        private_dir(
            self.dir, f"the directory of job {self.job!r} in the shm dir",
            fix="set FLASHCKPT_SHM_DIR (or shm_dir) to a directory of your own",
        )  # fmt: skip

    # ---- mapping ---------------------------------------------------------------------
    def open_existing(self) -> None:
        owner = self._owner_fd is not None  # only the owner may reinitialise an invalid file
        found = [i for i, path in enumerate(self.paths) if path.exists()]
        if found:  # spares an earlier run made turn with the rest
            self.in_use = max(self.in_use, found[-1] + 1)
        for i, path in enumerate(self.paths):
            if self.slots[i] is None and i not in self.busy and path.exists():
                # A reader leaves a file that is not a valid slot alone: its owner reinitialises it.
                with contextlib.suppress(SharedMemoryError):
                    self.slots[i] = Slot.create(path, 0, owner=owner)

    def check_space(self, capacity: int) -> None:
        """Fail now, naming the size, if the slots cannot grow to ``capacity`` each."""
        need = 0
        for path in self.paths[: self.in_use]:
            have = path.lstat().st_size if path.exists() else 0
            need += max(0, capacity - have)
        if need == 0:
            return
        self._make_dir()
        st = os.statvfs(self.dir)
        if st.f_bavail * st.f_frsize < need:
            raise shm_space_error(self.paths[0], need, OSError(errno.ENOSPC, "no space"))

    def prepare_slot(self, i: int, capacity: int, prefault: bool = True) -> Slot:
        """Create or grow slot ``i`` to ``capacity`` bytes, reserved (and pre-faulted, so the
        snapshots written into it pay no page faults, unless ``prefault`` is False). The
        caller owns the rank."""
        slot = self.slots[i]
        more = capacity - (slot.capacity if slot is not None else 0)

        def keep() -> int:
            # A rank's second slot never takes the room of another rank's first: the node's
            # ranks that have none yet are counted at this one's size.
            if i == 0:
                return 0
            others = config.local_world_size() - len(ranks_in(self.shm_dir, self.job))
            return capacity * max(0, others)

        with host_memory.reserving(self.shm_dir, more, f"slot {i} of rank {self.rank}", keep):
            if slot is None:
                slot = self.slots[i] = Slot.create(
                    self.paths[i], capacity, owner=True, prefault=prefault
                )
            elif slot.capacity < capacity:
                slot.grow(capacity, prefault)
        return slot

    def cap_at(self, count: int) -> None:
        """Make no more than ``count`` slots (the node's host-memory cap fits no more)."""
        self.max_in_use = self.in_use = max(1, min(self.in_use, count))

    @property
    def capped(self) -> bool:
        """Whether the cap left this rank fewer than the two slots it turns between."""
        return self.max_in_use < N_STEADY

    def acquire_newest(self, need: int) -> Slot | None:
        """Lock the slot holding the newest snapshot for writing over it (only for a rank the
        cap left one slot, once that snapshot is stored everywhere); None if a reader holds
        it or it is too small."""
        order = self.write_order()
        i = order[-1]
        slot = self.slots[i]
        if slot is None or i in self.busy or i in self.pinning or slot.capacity < need:
            return None
        if not slot.try_lock(exclusive=True):
            return None
        self.writing.add(i)
        return slot

    def ready(self) -> list[Slot]:
        """Slots holding a READY snapshot, newest first."""
        out = [
            (h, s)
            for i, s in enumerate(self.slots)
            if s is not None and i not in self.busy and (h := header_or_none(s)) and h.readable
        ]
        out.sort(key=lambda hs: (hs[0].step, hs[0].published_at), reverse=True)
        return [s for _, s in out]

    def _age(self, i: int) -> tuple:
        """Sort key of slot ``i``: what it holds, oldest first; a missing slot, one being
        prepared or an invalid one holds nothing and comes first."""
        slot = self.slots[i]
        h = None if slot is None or i in self.busy else header_or_none(slot)
        if h is None or h.state != SlotState.READY:
            return (False, -1, -1, 0.0)
        return (True, h.generation, h.step, h.published_at)

    def write_order(self) -> list[int]:
        """Slot indices in the order the next snapshot goes to: a slot with no READY snapshot,
        then the older READY one; the newest READY snapshot last, and never overwritten."""
        return sorted(range(self.in_use), key=self._age)

    def acquire_for_write(self, need: int) -> Slot | None:
        """Lock and return the slot the next snapshot of ``need`` bytes goes to (in
        ``write_order``, among slots that exist, hold ``need`` bytes and are not being
        prepared), or None if a reader holds every such slot but the newest READY one.

        The newest READY snapshot is never written over: a crash mid-copy would then leave only
        an older one, and lose a step ``save()`` returned for. Skipping the new snapshot (the
        caller counts it) loses nothing that was promised."""
        order = self.write_order()
        newest = order[-1] if self._age(order[-1])[0] else None
        for i in order:
            slot = self.slots[i]
            if i == newest or slot is None or i in self.busy or i in self.pinning:
                continue
            if slot.capacity < need:
                continue
            if slot.try_lock(exclusive=True):
                self.writing.add(i)
                return slot
        if self.in_use < self.max_in_use:
            self.in_use += 1  # the caller readies a spare; from then on it turns with the rest
        return None

    def written(self, slot: Slot) -> None:
        """The write into ``slot`` is over (published or given up): others may touch it."""
        self.writing.difference_update(i for i, s in enumerate(self.slots) if s is slot)

    def close(self, remove: bool) -> None:
        """Unmap the slots; with ``remove``, delete them and the owner file, but only while
        holding the claim (a writer that has since taken the rank keeps its files)."""
        if remove and self._owner_fd is None:
            try:
                if self.dir.is_dir():
                    self.claim()
            except (FlashCkptError, OSError):
                pass
            remove = self._owner_fd is not None
        for i, slot in enumerate(self.slots):
            if slot is not None:
                slot.close()
                self.slots[i] = None
            if remove:
                self.paths[i].unlink(missing_ok=True)
        if remove:
            # Unlinked while still locked: a contender that opened it re-checks after locking.
            self._owner_path.unlink(missing_ok=True)
        self.release()
        if remove:
            with contextlib.suppress(OSError):
                self.dir.rmdir()
