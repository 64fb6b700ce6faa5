"""One shared-memory snapshot slot: a file under the shm directory, mapped by every process.

File layout (all integers little-endian)::

    [0, 4096)                 header (see ``_HEADER``)
    [4096, 4096 + data_len)   tensor bytes, each entry at the offset its manifest entry names
    [manifest_off, +len)      the manifest (JSON, UTF-8)
    [checksum_off, +4*n)      one crc32c per chunk, filled in after publish ("sealed")

A snapshot is readable only when ``state == READY`` and ``seq`` is even and unchanged across
the read (a seqlock). The writer also holds an exclusive ``flock`` while writing and readers a
shared one while reading, so a slot being read is never overwritten; the kernel drops a dead
process's lock, so neither a SIGKILLed trainer nor a SIGKILLed reader wedges a slot.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import math
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptSlotError, SharedMemoryError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAGIC = b"FLCKSLOT"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
ALIGN = 64
# magic, layout, state, seq, step, data_len, manifest_off, manifest_len, capacity,
# writer_pid, sealed, published_at, checksum_off, n_chunks, generation (zero in slots written
# before generations existed: generation 0)
_HEADER = struct.Struct("<8sIIqqqqqqIIdqqq")
_STATE_OFF = 12  # offset of (state) inside the header
_SEQ_OFF = 16
_CAPACITY_OFF = 56
_SEALED_OFF = 68


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    READY = 2


_STATES = frozenset(int(v) for v in SlotState)


@dataclass(frozen=True)
class SlotHeader:
    state: SlotState
    seq: int
    step: int
    data_len: int
    manifest_off: int
    manifest_len: int
    capacity: int
    writer_pid: int
    sealed: bool
    published_at: float
    checksum_off: int
    n_chunks: int
    generation: int = 0  # the branch of the job's history the step belongs to

    @property
    def readable(self) -> bool:
        return self.state == SlotState.READY and self.seq % 2 == 0


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def shm_space_error(path: Path, need: int, exc: OSError | None = None) -> SharedMemoryError:
    directory = path.parent
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = -1
    msg = (
        f"cannot reserve {need / 2**20:.1f} MiB of shared memory for {path.name} in {directory} "
        f"({free / 2**20:.1f} MiB free). flashckpt needs two slots per rank, each the size of the "
        "rank's state (three while persistence lags behind training): enlarge /dev/shm (docker --shm-size, a Kubernetes emptyDir with "
        "medium: Memory) or point FLASHCKPT_SHM_DIR at a larger tmpfs."
    )
    err = SharedMemoryError(exc.errno if exc else errno.ENOSPC, msg)
    return err


class Slot:
    """A mapped slot file. Not thread-safe: one owner thread writes, readers take locks."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, writable: bool):
        self.path = path
        self._fd = fd
        self._mm = mm
        self.writable = writable
        self.capacity = len(mm)
        self._buf: Any = _LAZY
        self._view = memoryview(mm)

    @property
    def buf(self) -> torch.Tensor | None:
        """A uint8 tensor over the whole mapping, so torch copies go straight into shared
        memory; None once unmapped. Made on first use: a reader of headers and bytes alone
        (the node agent) never loads torch."""
        if self._buf is _LAZY:
            import torch

            with warnings.catch_warnings():  # read-only mappings: torch warns, we never write
                warnings.simplefilter("ignore", UserWarning)
                self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._buf

    # ---- opening ---------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, capacity: int, owner: bool = False, prefault: bool = True) -> Slot:
        """Open or create ``path`` with at least ``capacity`` bytes, reserved, and pre-faulted
        unless ``prefault`` is False (the caller is about to write every page anyway: then the
        write faults them in, which costs less than mapping them all first).

        ``owner``: the caller holds the rank's owner lock, so no other process writes this
        file. Then a file that is not a valid slot (a writer killed between reserving it and
        writing its header, one overwritten since, or one of a newer layout) is reinitialised
        EMPTY: this flashckpt cannot read what it held anyway. Without ``owner`` such a file
        raises SharedMemoryError (CorruptSlotError if invalid) and is left as it is.
        """
        capacity = align(max(capacity, HEADER_SIZE + ALIGN), mmap.PAGESIZE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fd).st_size
            if not owner and size < capacity:
                # Only the owner may grow (or initialise) a slot file.
                raise CorruptSlotError(
                    f"{path} holds {size} bytes, less than a slot's {capacity}; it is not a "
                    "flashckpt slot (yet): its owner reinitialises it on its next save()"
                )
            if size < capacity:
                try:
                    # Reserve now: a tmpfs that runs out under an mmap write kills with SIGBUS.
                    os.posix_fallocate(fd, 0, capacity)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                        if size < HEADER_SIZE:
                            os.ftruncate(fd, 0)
                        raise shm_space_error(path, capacity, exc) from exc
                    raise
            else:
                capacity = size
            populate = _POPULATE if prefault else 0
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm, writable=True)
        try:
            slot.header()
        except SharedMemoryError as exc:  # not a valid slot, or of a newer layout
            if not owner:
                slot.close()
                raise
            if size >= HEADER_SIZE:  # not a fresh file: say what is being thrown away
                log.warning("%s; its owner reinitialises it", exc)
            slot._reset()
        except BaseException:
            slot.close()
            raise
        return slot

    @classmethod
    def open_readonly(cls, path: Path) -> Slot:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise CorruptSlotError(
                    f"{path} holds {size} bytes, shorter than a slot header ({HEADER_SIZE}); it "
                    "is not a flashckpt slot"
                )
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm, writable=False)
        try:
            slot.header()
        except BaseException:
            slot.close()
            raise
        return slot

    def refresh(self) -> None:
        """Remap a read-only slot whose file the writer has grown since it was mapped."""
        size = os.fstat(self._fd).st_size
        if self.writable or size <= self.capacity:
            return
        mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._unmap()
        self._mm, self.capacity = mm, size
        self._buf = _LAZY
        self._view = memoryview(mm)

    def _reset(self) -> None:
        """Write an EMPTY header (a new slot, or an invalid one its owner starts over)."""
        self._put_header(SlotState.EMPTY, 0, -1, 0, 0, 0, self.capacity, 0, 0, 0.0, 0, 0, 0)

    def _put_header(self, *fields: object) -> None:
        """Write the whole header in one copy. ``pack_into`` would zero it first, and a reader
        looking without the lock would see a header that was never written."""
        self._mm[: _HEADER.size] = _HEADER.pack(MAGIC, LAYOUT_VERSION, *fields)

    def grow(self, capacity: int, prefault: bool = True) -> None:
        """Enlarge the file and remap it (the writer holds no tensors into the old mapping)."""
        capacity = align(capacity, mmap.PAGESIZE)
        if capacity <= self.capacity:
            return
        try:
            os.posix_fallocate(self._fd, 0, capacity)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise shm_space_error(self.path, capacity - self.capacity, exc) from exc
            raise
        mm = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED | (_POPULATE if prefault else 0))
        self._unmap()
        self._mm, self.capacity = mm, capacity
        self._buf = _LAZY
        self._view = memoryview(mm)
        struct.pack_into("<q", mm, _CAPACITY_OFF, capacity)

    def _unmap(self) -> None:
        self._buf = None
        try:
            self._view.release()
            self._mm.close()
        except BufferError:  # a view handed out earlier still lives; GC unmaps it later
            pass

    def close(self) -> None:
        self._unmap()
        os.close(self._fd)

    # ---- header ----------------------------------------------------------------------
    def header(self) -> SlotHeader:
        """The header, checked: CorruptSlotError if it is not one a flashckpt writer left.

        Every field a reader acts on is bounded here, once: a READY header's regions must lie
        inside the file in the order the layout gives, so nothing read through it can run
        past the mapping. EMPTY and WRITING headers carry stale regions nobody reads.
        """
        size = os.fstat(self._fd).st_size  # first: a page past a truncated file is a SIGBUS
        if size < HEADER_SIZE or self.capacity < HEADER_SIZE:
            raise self._corrupt(f"the file holds {size} bytes, less than its header")
        f = _HEADER.unpack_from(self._mm, 0)
        magic, layout, state, seq = f[0], f[1], f[2], f[3]
        if magic != MAGIC:
            raise self._corrupt(f"magic {magic!r}, expected {MAGIC!r}")
        if layout > LAYOUT_VERSION:
            raise SharedMemoryError(
                errno.EINVAL,
                f"{self.path} has slot layout {layout}, newer than the {LAYOUT_VERSION} this "
                "flashckpt reads; upgrade flashckpt, or remove the file",
            )
        if layout < 1 or state not in _STATES or seq < 0 or f[10] not in (0, 1):
            raise self._corrupt(f"layout {layout}, state {state}, seq {seq}, sealed {f[10]}")
        h = SlotHeader(SlotState(state), *f[3:10], bool(f[10]), *f[11:])
        if h.state == SlotState.READY:
            self._check_regions(h, size)
        return h

    def _check_regions(self, h: SlotHeader, size: int) -> None:
        manifest_end = h.manifest_off + h.manifest_len
        end = h.checksum_off + 4 * h.n_chunks
        ok = (
            h.step >= 0 and h.generation >= 0 and h.data_len >= 0 and h.manifest_len > 0
            and h.n_chunks >= 0
            and HEADER_SIZE + h.data_len <= h.manifest_off and manifest_end <= h.checksum_off
            and end <= size and h.n_chunks <= h.data_len and math.isfinite(h.published_at)
        )  # fmt: skip
        if not ok:
            raise self._corrupt(
                f"READY step {h.step} (generation {h.generation}) with data_len {h.data_len}, manifest at {h.manifest_off}"
                f"+{h.manifest_len}, {h.n_chunks} checksums at {h.checksum_off}, in a file of "
                f"{size} bytes (expected data, manifest and checksums in that order inside it)"
            )

    def _corrupt(self, found: str) -> CorruptSlotError:
        return CorruptSlotError(
            f"{self.path} is not a valid flashckpt slot: {found}. It holds no readable "
            "snapshot; restore falls back to a tier or an older step, and the rank's next "
            "save() overwrites it"
        )

    def _within(self, h: SlotHeader, end: int) -> None:
        """A region of ``h`` must lie inside this mapping (a reader maps the file as it was;
        ``refresh`` catches up with a writer that grew it)."""
        if end > self.capacity:
            raise self._corrupt(
                f"a region of step {h.step} ends at {end}, past the mapped {self.capacity} bytes"
            )

    def seq(self) -> int:
        return struct.unpack_from("<q", self._mm, _SEQ_OFF)[0]

    # ---- locking ---------------------------------------------------------------------
    def try_lock(self, exclusive: bool) -> bool:
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        try:
            fcntl.flock(self._fd, op)
            return True
        except BlockingIOError:
            return False

    def lock_shared(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.try_lock(exclusive=False):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- writing (caller holds the exclusive lock) -----------------------------------
    def begin_write(self) -> None:
        if os.fstat(self._fd).st_size < self.capacity:
            # Shortened under our mapping: writing past the file's end would be a SIGBUS.
            log.warning("%s was truncated; its owner restores its size", self.path)
            os.posix_fallocate(self._fd, 0, self.capacity)
        # The raw seq, not header(): an owner overwrites a slot whose header is invalid, and
        # publish() then writes all of it.
        seq = max(self.seq(), 0)
        seq = seq + 1 if seq % 2 == 0 else seq + 2
        struct.pack_into("<I", self._mm, _STATE_OFF, SlotState.WRITING)
        struct.pack_into("<q", self._mm, _SEQ_OFF, seq)
        struct.pack_into("<I", self._mm, _SEALED_OFF, 0)

    def publish(
        self, step: int, data_len: int, manifest: bytes, n_chunks: int, generation: int = 0
    ) -> None:
        """Write the manifest after the data and flip the header to READY(step)."""
        manifest_off = align(HEADER_SIZE + data_len)
        checksum_off = align(manifest_off + len(manifest), 8)
        end = checksum_off + 4 * n_chunks
        if end > self.capacity:
            raise ValueError(f"slot {self.path.name} holds {self.capacity} bytes, needs {end}")
        self._mm[manifest_off : manifest_off + len(manifest)] = manifest
        seq = self.seq() + 1
        self._put_header(
            SlotState.WRITING, seq - 1, step, data_len, manifest_off, len(manifest),
            self.capacity, os.getpid(), 0, time.time(), checksum_off, n_chunks, generation,
        )  # fmt: skip
        # The READY state and even seq go last: x86 and the kernel's page sharing keep
        # store order, so a reader that sees them sees everything written before.
        struct.pack_into("<I", self._mm, _STATE_OFF, SlotState.READY)
        struct.pack_into("<q", self._mm, _SEQ_OFF, seq)

    def write_checksums(self, checksums: list[int]) -> None:
        h = self.header()
        struct.pack_into(f"<{len(checksums)}I", self._mm, h.checksum_off, *checksums)
        struct.pack_into("<I", self._mm, _SEALED_OFF, 1)

    # ---- reading ---------------------------------------------------------------------
    def manifest_bytes(self, h: SlotHeader) -> bytes:
        self._within(h, h.manifest_off + h.manifest_len)
        return bytes(self._mm[h.manifest_off : h.manifest_off + h.manifest_len])

    def checksums(self, h: SlotHeader) -> tuple[int, ...] | None:
        raw = self.checksum_bytes(h)
        return None if raw is None else struct.unpack(f"<{h.n_chunks}I", raw)

    def checksum_bytes(self, h: SlotHeader) -> bytes | None:
        """The sealed snapshot's chunk checksums as stored (little-endian uint32s); None if
        it is not sealed. Compared as bytes, they cost a memcmp, not an int a chunk."""
        if not h.sealed:
            return None
        self._within(h, h.checksum_off + 4 * h.n_chunks)
        return bytes(self._mm[h.checksum_off : h.checksum_off + 4 * h.n_chunks])

    def data(self, h: SlotHeader) -> memoryview:
        """Zero-copy view of the tensor bytes of the snapshot ``h`` describes."""
        self._within(h, HEADER_SIZE + h.data_len)
        return self._view[HEADER_SIZE : HEADER_SIZE + h.data_len]

    def data_tensor(self, h: SlotHeader) -> torch.Tensor:
        """Zero-copy uint8 tensor over the snapshot's tensor bytes."""
        self._within(h, HEADER_SIZE + h.data_len)
        return self.buf[HEADER_SIZE : HEADER_SIZE + h.data_len]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_LAZY = object()  # Slot.buf not made yet


def required_capacity(data_len: int, manifest_len: int, n_chunks: int) -> int:
    return align(align(HEADER_SIZE + data_len) + manifest_len, 8) + 4 * n_chunks
