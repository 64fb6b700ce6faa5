"""Copying a snapshot's stored bytes into the tensors of a live state, verified on every core.

A ``Source`` is the data region of one rank's snapshot, wherever it is (a slot, a buffer read
from a tier). ``copy_to`` (``copy_many`` for a whole state) queues entries for their target
tensors; ``flush()`` copies everything queued in one pass over all its chunks, split evenly
over the restore workers, each chunk's crc32c checked against the manifest, and returns once
every byte has landed:

* into host tensors: one call of the compiled verified copy (``flashckpt/_verified_copy.c``,
  without the GIL) shares the chunks out over threads (torch's own OpenMP team where the
  process has one, whose threads are awake right after a training step; else the restore
  workers, a share each) and checks each chunk's bytes as they are copied: in the
  registers they pass through (AVX-512 carry-less folding), or a block at a time where it
  landed while still in the core's cache. One read of memory, and no Python per chunk,
  which at thousands of small tensors is what a restore would cost. The offsets and sizes
  of a layout's chunks are planned once (``chunk_rows.HostPlan``).
  Where the compiled copy is not built, a worker copies a chunk (a piece at a time for a
  large one) and checksums the bytes it just read while they are still in its cache. The
  source is read under its reader's lock (a slot's, or a private buffer), so the bytes
  checked are the bytes copied;
* into device tensors (``device_upload``): a buffer's worth of chunks at a time is copied
  into a page-locked staging buffer by the same compiled copy, each chunk checked as it is
  copied, and uploaded in one call, while the next buffer fills; from a source that is
  page-locked already (a slot this process registered) every chunk is uploaded from where it
  is, and checked there while the device reads it. A state's device targets are queued in a
  few C-level passes, as host ones are.

Targets that are not plain bytes (strided, lazily conjugated) are verified, then copied with
a typed copy at once. A mismatch raises ChecksumError; the caller falls back to another
source, which rewrites every entry. ``writes()`` counts the copies begun, so that a restore
that found every copy bad can say the state holds part of one.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import operator
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ManifestError
from ..format.checksum import compiled, crc, verify_entry
from ..format.manifest import Entry, dtype_from_name
from ..snapshot import device
from ..snapshot.flatten import copy_into
from . import device_upload
from .chunk_rows import HostChunks

_PIECE = 1 << 19  # host copies: checked right after its copy, while still in the core's cache
_N_WORKERS = max(1, min(8, os.cpu_count() or 1))
_SHARED_MIN = 48 << 10  # host chunks smaller on average are copied by one thread


_native = compiled()  # None: chunks are copied from Python
if _native is not None:  # a forked child's OpenMP team stayed in its parent
    os.register_at_fork(after_in_child=_native.forbid_team)
_written = threading.local()  # per restoring thread: how often targets began to be written


def writes() -> int:
    """How many times this thread began writing a copy's bytes into targets (a restore
    that finds a copy corrupt part way has written part of it)."""
    return getattr(_written, "n", 0)


def _writing() -> None:
    _written.n = writes() + 1


Queued = tuple[torch.Tensor, Entry, int]  # (target, entry, chunk size)
Bad = tuple[int, int]  # (the chunk's row, the crc32c found)


@functools.cache
def _workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_N_WORKERS, thread_name_prefix="flashckpt-restore")


# A forked child makes pools of its own: its parent's threads stayed behind, and a pool that
# counts them as idle would queue work no thread takes.
os.register_at_fork(after_in_child=_workers.cache_clear)


def _byte_copyable(dst: torch.Tensor, nbytes: int) -> bool:
    return (
        dst.is_contiguous() and not dst.is_conj() and not dst.is_neg()
        and dst.numel() * dst.element_size() == nbytes
    )  # fmt: skip


_NBYTES = operator.attrgetter("nbytes")
_IS_CPU = operator.attrgetter("is_cpu")


def _plain_bytes(dsts: list[torch.Tensor]) -> bool:
    """Whether every tensor of ``dsts`` is contiguous, with no conjugate or negative bit."""
    return (all(map(torch.Tensor.is_contiguous, dsts))
            and not any(map(torch.Tensor.is_conj, dsts))
            and not any(map(torch.Tensor.is_neg, dsts)))  # fmt: skip


def _bytes_of(dst: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (a parameter's ``reshape`` costs three times a
    ``detach``: a 1-D one is not reshaped)."""
    flat = dst.detach()
    return (flat if flat.dim() == 1 else flat.reshape(-1)).view(torch.uint8)


def _spread(sizes: list[int]) -> list[tuple[int, int]]:
    """Indices of ``sizes`` cut into one contiguous run per worker, of about equal bytes."""
    ends = list(itertools.accumulate(sizes))
    cuts = [0]
    for k in range(1, _N_WORKERS):
        cuts.append(max(cuts[-1], bisect.bisect_left(ends, ends[-1] * k / _N_WORKERS)))
    cuts.append(len(sizes))
    return [(a, b) for a, b in itertools.pairwise(cuts) if a < b]


def _settle(chunks: HostChunks, where: str, futures: list) -> None:
    """Wait for every worker's share; raise for the first chunk found bad."""
    wait(futures)
    found = [r for f in futures if (r := f.result()) is not None]
    if found:
        j, value = found[0]
        raise chunks.mismatch(where, j, value)


def _run_native(chunks: HostChunks, where: str, fn: Callable, *extra: int) -> None:
    """Run the compiled ``fn`` (``copy_checked``, ``checked_at``, ``read_checked``) over
    every chunk, shared out over ``_N_WORKERS`` threads where there is more than a piece's
    worth of bytes: in one call on torch's OpenMP team, else a share per restore worker."""
    cols = chunks.arrays()
    n, small = len(chunks.size), sum(chunks.size) <= _PIECE

    def share(first: int, last: int, threads: int = 1) -> Bad | None:
        j, value = fn(*cols, first, last, *extra, threads)
        return None if j < 0 else (j, value)

    if small or _N_WORKERS == 1 or _native.team():
        found = share(0, n, 1 if small else _N_WORKERS)
        if found is not None:
            raise chunks.mismatch(where, found[0], found[1])
        return
    _settle(chunks, where, [_workers().submit(share, a, b) for a, b in _spread(chunks.size)])


Scatter = Callable[[list[tuple[int, int, int]]], None]
"""Receives a stored data region in one pass: (offset, address, bytes) of each piece wanted,
in offset order, written straight to its address; what lies between is read past."""


@dataclass
class Source:
    """The bytes of one rank's snapshot, wherever they are (a slot, a file, a buffer), or
    still to be fetched from a tier: then ``fetch`` reads them whole when an entry is asked
    for, and ``scatter``, where given, receives the host chunks queued straight into their
    targets instead (a restore from a peer's memory: no buffer to fault in and copy out of;
    each chunk is checked where it landed). ``opener``, where given, opens the data region's
    file (a directory tier's): with the compiled copy, each host chunk is read from it
    straight into its target and checked there while in cache."""

    data: torch.Tensor | None  # uint8, the whole data region; None: not fetched yet
    where: str
    verify: bool = True
    pinned: bool = False  # page-locked: device uploads read it directly
    size: int = -1  # the data region's bytes (``data``'s where it is given)
    fetch: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    scatter: Scatter | None = field(default=None, repr=False)
    opener: Callable[[], int] | None = field(default=None, repr=False)  # a file's descriptor
    _queued: list[Queued] = field(default_factory=list, repr=False)  # device targets
    # Device targets queued a layout at a time: (device, rows, each row's target bytes).
    _uploads: list[tuple[Hashable, HostChunks, list[torch.Tensor]]] = field(
        default_factory=list, repr=False
    )
    _chunks: HostChunks = field(default_factory=lambda: HostChunks(), repr=False)

    def __post_init__(self) -> None:
        if self.data is not None:
            self.size = self.data.numel()
        elif self.fetch is None or self.size < 0:
            raise ValueError("a Source without its data needs its size and a fetch")

    def bytes(self) -> torch.Tensor:
        """The whole data region, fetched now if it was not."""
        if self.data is None:
            assert self.fetch is not None
            self.data = self.fetch()
            if self.data.numel() != self.size:
                raise ManifestError(f"{self.where}: {self.data.numel()} bytes read, the manifest "
                                    f"says {self.size}; restore from another tier or an older step")  # fmt: skip
        return self.data

    def _received_into(self, chunks: HostChunks) -> None:
        """``scatter`` the queued host chunks into their targets, then check each there."""
        order, overlap = chunks.in_order()
        if overlap is not None:  # entries never overlap in a checked manifest; refuse if they do
            raise ManifestError(f"{self.where}: entries overlap at byte {overlap}")
        if self.opener is not None and _native is not None:
            self._read_into(chunks)
            return
        assert self.scatter is not None
        frm, to, size = chunks.frm, chunks.to, chunks.size
        self.scatter([(frm[j], to[j], size[j]) for j in order.tolist()])
        self._check_in_place(chunks)

    def _check_in_place(self, chunks: HostChunks) -> None:
        """Check every chunk where it is, at its ``to`` address; raise for the first bad."""
        if _native is not None:
            _run_native(chunks, self.where, _native.checked_at)
            return
        to, size, want = chunks.to, chunks.size, chunks.want

        def check(first: int, last: int) -> Bad | None:
            for j in range(first, last):
                if want[j] >= 0 and size[j]:
                    view = memoryview((ctypes.c_char * size[j]).from_address(to[j])).cast("B")
                    if (value := crc(view)) != want[j]:
                        return j, value
            return None

        _settle(chunks, self.where, [_workers().submit(check, a, b) for a, b in _spread(size)])

    def _read_into(self, chunks: HostChunks) -> None:
        """Read every chunk from the data region's file into its target, checked as it lands
        (the compiled copy), one share of the chunks per worker."""
        assert self.opener is not None and _native is not None
        fd = self.opener()
        try:
            size = os.fstat(fd).st_size
            if size != self.size:  # changed since it was checked against the manifest
                raise ManifestError(f"{self.where}: the data holds {size} bytes, the manifest "
                                    f"says {self.size}; restore from another tier or an older step")  # fmt: skip

            def read(*cols_rows_threads: Any) -> tuple[int, int]:
                *cols_and_rows, threads = cols_rows_threads
                row, value, short = _native.read_checked(*cols_and_rows, fd, threads)
                if short:
                    raise ManifestError(f"{self.where}: the data ended before its chunks did (it "
                                        "was cut short while read); restore from another tier "
                                        "or an older step")  # fmt: skip
                return row, value

            _run_native(chunks, self.where, read)
        finally:
            os.close(fd)

    def _raw(self, entry: Entry) -> torch.Tensor:
        raw = self.bytes()[entry.offset : entry.offset + entry.nbytes]
        return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)

    def view(self, entry: Entry, chunk_size: int) -> torch.Tensor:
        """The entry's bytes as a tensor, verified first."""
        if self.verify:
            verify_entry(memoryview(self.bytes().numpy()), entry, chunk_size, self.where)
        return self._raw(entry)

    def copy_block_to(self, dst: torch.Tensor, entry: Entry, chunk_size: int,
                      box: tuple[slice, ...]) -> None:  # fmt: skip
        """Copy the block ``box`` of the entry into ``dst``, verified, at once."""
        view = self.view(entry, chunk_size)
        _writing()
        copy_into(dst, view[box])

    def copy_to(self, dst: torch.Tensor, entry: Entry, chunk_size: int) -> None:
        """Copy the entry into ``dst``, verified, by the next ``flush()`` (at once for a
        target that is not plain bytes)."""
        on_device = device.runtime().is_device_tensor(dst)
        plain = on_device or dst.device.type == "cpu"
        if not plain or not _byte_copyable(dst, entry.nbytes):
            view = self.view(entry, chunk_size)
            _writing()
            copy_into(dst, view)
        elif not on_device:
            self._add_units([dst], [entry], chunk_size)
        elif entry.nbytes:
            self._bounds(entry, chunk_size)
            self._queued.append((dst, entry, chunk_size))

    def copy_many(self, dsts: list[torch.Tensor], entries: tuple[Entry, ...] | list[Entry],
                  chunk_size: int, host_sized: bool = False, plain: bool = False,
                  on_device: Hashable | None = None) -> None:  # fmt: skip
        """``copy_to`` for every pair of ``dsts`` and ``entries`` (equal lengths); targets
        that are plain bytes are queued in a few C-level passes, not one by one.
        ``host_sized``: the caller knows every target is a host tensor of its entry's size;
        ``on_device``: that every target is a tensor of that device of its entry's size;
        ``plain``: that every target is contiguous, with no conjugate or negative bit."""
        if len(dsts) != len(entries):
            raise ValueError(f"{len(dsts)} targets for {len(entries)} entries")
        plain = plain or _plain_bytes(dsts)
        if on_device is not None and plain:
            rows = HostChunks()
            if rows.add_small(dsts, entries, chunk_size, self.size, self.verify):
                self._uploads.append((on_device, rows, list(map(_bytes_of, dsts))))
                return
        if (
            (host_sized or (all(map(_IS_CPU, dsts))
                            and not any(map(device.runtime().is_device_tensor, dsts))))
            and plain
            and (host_sized or list(map(_NBYTES, dsts)) == list(map(_NBYTES, entries)))
        ):  # fmt: skip
            self._add_units(dsts, entries, chunk_size)
            return
        for dst, entry in zip(dsts, entries, strict=True):
            self.copy_to(dst, entry, chunk_size)

    def _add_units(self, dsts: list[torch.Tensor], entries: tuple[Entry, ...] | list[Entry],
                   cs: int) -> None:  # fmt: skip
        """Queue the chunks of host targets that are plain bytes of the entries' sizes."""
        chunks = self._chunks
        if chunks.add_small(dsts, entries, cs, self.size, self.verify):
            return
        size = self.size
        for dst, e in zip(dsts, entries, strict=True):
            n, at, sums = e.nbytes, e.offset, e.checksums
            if not n:
                continue
            if at < 0 or at + n > size or (sums is not None and len(sums) != -(-n // cs)):
                self._bounds(e, cs)  # raises, naming what is wrong
            chunks.add(dst, e, cs, sums if self.verify else None)

    def flush(self) -> None:
        """Copy everything queued, verified; returns once it has landed."""
        chunks, self._chunks = self._chunks, HostChunks()
        queued, self._queued = self._queued, []
        uploads, self._uploads = self._uploads, []
        if chunks.size or queued or uploads:
            _writing()
        if chunks.size:
            self._copy_host(chunks)
        if not queued and not uploads:
            return
        rt = device.runtime()
        by_device: dict[Hashable, list[Queued]] = {}
        for item in queued:
            by_device.setdefault(rt.device_of(item[0]), []).append(item)
        uploads += [(dev, *self._device_rows(items)) for dev, items in by_device.items()]
        for dev, rows, outs in uploads:
            self._upload(rows, outs, rt, dev)

    def _device_rows(self, items: list[Queued]) -> tuple[HostChunks, list[torch.Tensor]]:
        """The chunks of device targets ``items`` as rows, and each row's byte view of its
        target."""
        rows, outs = HostChunks(), []
        for dst, e, cs in items:
            out = _bytes_of(dst)
            rows.add(dst, e, cs, e.checksums if self.verify else None)
            if e.nbytes <= cs:
                outs.append(out)
            else:
                outs.extend(out[lo : lo + cs] for lo in range(0, e.nbytes, cs))
        return rows, outs

    def _copy_host(self, chunks: HostChunks) -> None:
        """Copy and check every chunk of ``chunks`` into host memory: each chunk's bytes are
        checked as they are copied, by the compiled copy on every worker at once (it runs
        without the GIL), or from Python where it is not built."""
        if self.data is None and (
            self.scatter is not None or (self.opener is not None and _native is not None)
        ):
            self._received_into(chunks)
            return
        self._copy_bytes(chunks, self.bytes())

    def _copy_bytes(self, chunks: HostChunks, whole: torch.Tensor) -> None:
        """Copy every chunk from ``whole`` (the data region) to its ``to`` address, checked
        as it is copied; raise for the first bad."""
        if _native is not None:
            _run_native(chunks, self.where, _native.copy_checked, whole.data_ptr())
            return
        self._copy_host_python(chunks, whole)

    def _copy_host_python(self, chunks: HostChunks, whole: torch.Tensor) -> None:
        """``_copy_host`` in Python: spread over the workers where the chunks are large;
        chunks smaller than ``_SHARED_MIN`` on average are done here in turn (two threads
        handing the GIL back and forth per small chunk cost more than they share)."""
        data, base = memoryview(whole.numpy()), whole.data_ptr()
        memmove = ctypes.memmove
        to, frm, size, want = chunks.to, chunks.frm, chunks.size, chunks.want

        def work(first: int, last: int) -> Bad | None:
            for j, ptr, at, n, crc_ in zip(itertools.count(first), to[first:last],
                                           frm[first:last], size[first:last],
                                           want[first:last]):  # fmt: skip
                if n <= _PIECE:
                    memmove(ptr, base + at, n)  # frees the GIL
                    if crc_ >= 0 and (value := crc(data[at : at + n])) != crc_:
                        return j, value
                    continue
                value = 0
                for p in range(0, n, _PIECE):
                    q = min(p + _PIECE, n)
                    memmove(ptr + p, base + at + p, q - p)
                    if crc_ >= 0:
                        value = crc(data[at + p : at + q], value)
                if crc_ >= 0 and value != crc_:
                    return j, value
            return None

        spread = _spread(size) if sum(size) >= _SHARED_MIN * len(size) else [(0, len(size))]
        if len(spread) == 1:  # one share: run it here, no hand-off
            found = work(*spread[0])
            if found is not None:
                raise chunks.mismatch(self.where, found[0], found[1])
            return
        _settle(chunks, self.where, [_workers().submit(work, a, b) for a, b in spread])

    def _upload(self, rows: HostChunks, outs: list[torch.Tensor], rt: device.DeviceRuntime,
                dev: Hashable) -> None:  # fmt: skip
        """Every row of ``rows`` uploaded into its byte view in ``outs`` on ``dev``, checked on
        its way (``device_upload``); raises for the first bad chunk once nothing is in flight."""
        device_upload.upload(rows, outs, self.bytes(), self.pinned, rt, dev,
                             lambda batch: self._copy_bytes(batch, self.bytes()),
                             self._check_in_place)  # fmt: skip

    def _bounds(self, entry: Entry, chunk_size: int) -> None:
        if entry.offset < 0 or entry.offset + entry.nbytes > self.size:
            raise ManifestError(
                f"{self.where}: {entry.path!r} claims bytes {entry.offset}-"
                f"{entry.offset + entry.nbytes}, past the {self.size} bytes stored; "
                "the manifest is corrupt, restore from another tier or an older step"
            )
        n = entry.n_chunks(chunk_size)
        if entry.checksums is not None and len(entry.checksums) != n:
            raise ManifestError(
                f"{self.where}: {entry.path!r} has {len(entry.checksums)} checksums for {n} "
                "chunks; the manifest is corrupt, restore from another tier or an older step"
            )
