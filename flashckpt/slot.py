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
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SharedMemoryError

MAGIC = b"FLCKSLOT"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
ALIGN = 64
# magic, layout, state, seq, step, data_len, manifest_off, manifest_len, capacity,
# writer_pid, sealed, published_at, checksum_off, n_chunks
_HEADER = struct.Struct("<8sIIqqqqqqIIdqq")
_STATE_OFF = 12  # offset of (state) inside the header
_SEQ_OFF = 16
_CAPACITY_OFF = 56
_SEALED_OFF = 68


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    READY = 2


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
        "rank's state: enlarge /dev/shm (docker --shm-size, a Kubernetes emptyDir with "
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
        # A uint8 tensor over the whole mapping: torch copies go straight into shared memory.
        with warnings.catch_warnings():  # read-only mappings: torch warns, but we never write
            warnings.simplefilter("ignore", UserWarning)
            self.buf: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)
        self._view = memoryview(mm)

    # ---- opening ---------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, capacity: int) -> Slot:
        """Open or create ``path`` with at least ``capacity`` bytes, reserved and pre-faulted."""
        capacity = align(max(capacity, HEADER_SIZE + ALIGN), mmap.PAGESIZE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            fresh = size < HEADER_SIZE
            if size < capacity:
                try:
                    # Reserve now: a tmpfs that runs out under an mmap write kills with SIGBUS.
                    os.posix_fallocate(fd, 0, capacity)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                        if fresh:
                            os.ftruncate(fd, 0)
                        raise shm_space_error(path, capacity, exc) from exc
                    raise
            else:
                capacity = size
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm, writable=True)
        if fresh:
            _HEADER.pack_into(
                mm,
                0,
                MAGIC,
                LAYOUT_VERSION,
                SlotState.EMPTY,
                0,
                -1,
                0,
                0,
                0,
                capacity,
                0,
                0,
                0.0,
                0,
                0,
            )
        else:
            slot._check_magic()
        return slot

    @classmethod
    def open_readonly(cls, path: Path) -> Slot:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise SharedMemoryError(errno.EINVAL, f"{path} is not a flashckpt slot (too short)")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm, writable=False)
        slot._check_magic()
        return slot

    def refresh(self) -> None:
        """Remap a read-only slot whose file the writer has grown since it was mapped."""
        size = os.fstat(self._fd).st_size
        if self.writable or size <= self.capacity:
            return
        mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._unmap()
        self._mm, self.capacity = mm, size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._view = memoryview(mm)

    def _check_magic(self) -> None:
        magic, layout = struct.unpack_from("<8sI", self._mm, 0)
        if magic != MAGIC or layout > LAYOUT_VERSION:
            raise SharedMemoryError(
                errno.EINVAL,
                f"{self.path} is not a flashckpt slot of layout <= {LAYOUT_VERSION} "
                f"(magic {magic!r}, layout {layout}); remove it or upgrade flashckpt",
            )

    def grow(self, capacity: int) -> None:
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
        mm = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
        self._unmap()
        self._mm, self.capacity = mm, capacity
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._view = memoryview(mm)
        struct.pack_into("<q", mm, _CAPACITY_OFF, capacity)

    def _unmap(self) -> None:
        self.buf = None
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
        f = _HEADER.unpack_from(self._mm, 0)
        return SlotHeader(
            SlotState(f[2]),
            f[3],
            f[4],
            f[5],
            f[6],
            f[7],
            f[8],
            f[9],
            bool(f[10]),
            f[11],
            f[12],
            f[13],
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
        h = self.header()
        seq = h.seq + 1 if h.seq % 2 == 0 else h.seq + 2
        struct.pack_into("<I", self._mm, _STATE_OFF, SlotState.WRITING)
        struct.pack_into("<q", self._mm, _SEQ_OFF, seq)
        struct.pack_into("<I", self._mm, _SEALED_OFF, 0)

    def publish(self, step: int, data_len: int, manifest: bytes, n_chunks: int) -> None:
        """Write the manifest after the data and flip the header to READY(step)."""
        manifest_off = align(HEADER_SIZE + data_len)
        checksum_off = align(manifest_off + len(manifest), 8)
        end = checksum_off + 4 * n_chunks
        if end > self.capacity:
            raise ValueError(f"slot {self.path.name} holds {self.capacity} bytes, needs {end}")
        self._mm[manifest_off : manifest_off + len(manifest)] = manifest
        seq = self.seq() + 1
        _HEADER.pack_into(
            self._mm, 0, MAGIC, LAYOUT_VERSION, SlotState.WRITING, seq - 1, step, data_len,
            manifest_off, len(manifest), self.capacity, os.getpid(), 0, time.time(),
            checksum_off, n_chunks,
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
        return bytes(self._mm[h.manifest_off : h.manifest_off + h.manifest_len])

    def checksums(self, h: SlotHeader) -> tuple[int, ...] | None:
        if not h.sealed:
            return None
        return struct.unpack_from(f"<{h.n_chunks}I", self._mm, h.checksum_off)

    def data(self, h: SlotHeader) -> memoryview:
        """Zero-copy view of the tensor bytes of the snapshot ``h`` describes."""
        return self._view[HEADER_SIZE : HEADER_SIZE + h.data_len]

    def data_tensor(self, h: SlotHeader) -> torch.Tensor:
        """Zero-copy uint8 tensor over the snapshot's tensor bytes."""
        return self.buf[HEADER_SIZE : HEADER_SIZE + h.data_len]


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def required_capacity(data_len: int, manifest_len: int, n_chunks: int) -> int:
    return align(align(HEADER_SIZE + data_len) + manifest_len, 8) + 4 * n_chunks
