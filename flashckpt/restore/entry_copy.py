"""Copying a snapshot's stored bytes into the tensors of a live state, verified on every core.

A ``Source`` is the data region of one rank's snapshot, wherever it is (a slot, a buffer read
from a tier). ``copy_to`` (``copy_many`` for a whole state) queues entries for their target
tensors; ``flush()`` copies everything queued in one pass over all its chunks, split evenly
over the restore workers, each chunk's crc32c checked against the manifest, and returns once
every byte has landed:

* into host tensors: a worker copies a chunk (a piece at a time for a large one) and
  checksums the source bytes it just read while they are still in its cache, so verifying
  costs a second read of cache, not of memory. The source is read under its reader's lock
  (a slot's, or a private buffer), so the bytes checked are the bytes copied. Per chunk the
  worker does a copy and a checksum call and nothing else: at thousands of small tensors the
  Python around them is what a restore costs;
* into device tensors: a worker copies a piece into one of its own page-locked staging
  buffers, checksums it there and uploads it from there on a copy stream of the device,
  reusing a buffer once its upload has landed; so checksums, host copies and the DMA all run
  at once. A source that is page-locked already (a slot this process registered) is uploaded
  from directly, checksummed beside the upload.

Targets that are not plain bytes (strided, lazily conjugated) are verified, then copied with
a typed copy at once. A mismatch raises ChecksumError; the caller falls back to another
source, which rewrites every entry.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import operator
import os
import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ManifestError
from ..format.checksum import chunk_mismatch, crc, verify_entry
from ..format.manifest import Entry, dtype_from_name
from ..format.sealed import bare_entries, one_per_entry
from ..snapshot import device
from ..snapshot.flatten import copy_into

_PIECE = 1 << 19  # host copies: checked right after its copy, while still in the core's cache
_STAGE = 4 << 20  # one staging buffer of a device upload
_RING = 3  # staging buffers per worker: one filling, the others uploading
_N_WORKERS = max(1, min(8, os.cpu_count() or 1))
_SHARED_MIN = 48 << 10  # host chunks smaller on average are copied by one thread

Queued = tuple[torch.Tensor, Entry, int]  # (target, entry, chunk size)
Bad = tuple[int, int, int]  # (queued item, chunk, crc found)


@functools.cache
def _workers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_N_WORKERS, thread_name_prefix="flashckpt-restore")


_local = threading.local()  # a worker's staging buffers, per device runtime
_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> device -> stream


def _staging(rt: device.DeviceRuntime) -> list[list[Any]]:
    """This worker thread's ring of [page-locked buffer, event of its last upload]."""
    rings = _local.__dict__.setdefault("rings", weakref.WeakKeyDictionary())
    ring = rings.get(rt)
    if ring is None:
        ring = rings[rt] = [[rt.pinned_empty(_STAGE), None] for _ in range(_RING)]
    return ring


def _upload_stream(rt: device.DeviceRuntime, dev: Hashable) -> Any:
    streams = _streams.setdefault(rt, {})
    if dev not in streams:
        streams[dev] = rt.new_stream(dev)
    return streams[dev]


def _byte_copyable(dst: torch.Tensor, nbytes: int) -> bool:
    return (
        dst.is_contiguous() and not dst.is_conj() and not dst.is_neg()
        and dst.numel() * dst.element_size() == nbytes
    )  # fmt: skip


_NBYTES = operator.attrgetter("nbytes")
_OFFSET = operator.attrgetter("offset")
_CHECKSUMS = operator.attrgetter("checksums")
_FIRST = operator.itemgetter(0)
_IS_CPU = operator.attrgetter("is_cpu")


def _bytes_of(dst: torch.Tensor) -> torch.Tensor:
    return dst.detach().reshape(-1).view(torch.uint8)


def _spread(sizes: list[int]) -> list[tuple[int, int]]:
    """Indices of ``sizes`` cut into one contiguous run per worker, of about equal bytes."""
    ends = list(itertools.accumulate(sizes))
    cuts = [0]
    for k in range(1, _N_WORKERS):
        cuts.append(max(cuts[-1], bisect.bisect_left(ends, ends[-1] * k / _N_WORKERS)))
    cuts.append(len(sizes))
    return [(a, b) for a, b in itertools.pairwise(cuts) if a < b]


class _HostChunks:
    """Chunks queued for host targets, one column per field (the usual state's thousands of
    one-chunk entries are queued in a few C-level passes, and copied without a tuple each)."""

    def __init__(self) -> None:
        self.entry: list[Entry] = []  # whose chunk: entry, chunk size, index in the entry
        self.cs: list[int] = []
        self.index: list[int] = []
        self.to: list[int] = []  # target address
        self.frm: list[int] = []  # offset in the source's data
        self.size: list[int] = []
        self.want: list[int | None] = []  # crc32c expected; None: not checked
        self.targets: list[torch.Tensor] = []  # held until copied: ``to`` is their memory

    def add(self, dst: torch.Tensor, e: Entry, cs: int, sums: tuple[int, ...] | None) -> None:
        self.targets.append(dst)
        ptr = dst.data_ptr()
        for i, lo in enumerate(range(0, e.nbytes, cs)):
            self.entry.append(e)
            self.cs.append(cs)
            self.index.append(i)
            self.to.append(ptr + lo)
            self.frm.append(e.offset + lo)
            self.size.append(min(cs, e.nbytes - lo))
            self.want.append(None if sums is None else sums[i])

    def add_small(self, dsts: list[torch.Tensor], entries: tuple[Entry, ...] | list[Entry],
                  cs: int, data_len: int, verify: bool) -> bool:  # fmt: skip
        """``add`` in C-level passes for the usual case: every entry one chunk, within
        ``data_len``, with its checksum (or unverified); False (nothing added) otherwise."""
        bare = bare_entries(entries)
        ns, ats = list(map(_NBYTES, bare)), list(map(_OFFSET, bare))
        if not ns or min(ns) <= 0 or max(ns) > cs or min(ats) < 0:
            return False
        if max(map(operator.add, ats, ns)) > data_len:
            return False
        if verify:
            flat = one_per_entry(entries)  # every entry is one chunk: they are its own
            if flat is not None:
                self.want.extend(flat)
            else:
                sums = list(map(_CHECKSUMS, entries))
                if None in sums or set(map(len, sums)) != {1}:
                    return False
                self.want.extend(map(_FIRST, sums))
        else:
            self.want.extend(itertools.repeat(None, len(ns)))
        self.entry.extend(bare)
        self.cs.extend(itertools.repeat(cs, len(ns)))
        self.index.extend(itertools.repeat(0, len(ns)))
        self.targets.extend(dsts)
        self.to.extend(map(torch.Tensor.data_ptr, dsts))
        self.frm.extend(ats)
        self.size.extend(ns)
        return True

    def mismatch(self, where: str, j: int, found: int) -> Exception:
        """The error for chunk ``j`` reading as ``found``."""
        return chunk_mismatch(where, self.entry[j], self.index[j], found, self.cs[j], self.want[j])


Scatter = Callable[[list[tuple[int, int, int]]], None]
"""Receives a stored data region in one pass: (offset, address, bytes) of each piece wanted,
in offset order, written straight to its address; what lies between is read past."""


@dataclass
class Source:
    """The bytes of one rank's snapshot, wherever they are (a slot, a file, a buffer), or
    still to be fetched from a tier: then ``fetch`` reads them whole when an entry is asked
    for, and ``scatter``, where given, receives the host chunks queued straight into their
    targets instead (a restore from a peer's memory: no buffer to fault in and copy out of;
    each chunk is checked where it landed)."""

    data: torch.Tensor | None  # uint8, the whole data region; None: not fetched yet
    where: str
    verify: bool = True
    pinned: bool = False  # page-locked: device uploads read it directly
    size: int = -1  # the data region's bytes (``data``'s where it is given)
    fetch: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    scatter: Scatter | None = field(default=None, repr=False)
    _queued: list[Queued] = field(default_factory=list, repr=False)  # device targets
    _chunks: _HostChunks = field(default_factory=lambda: _HostChunks(), repr=False)

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

    def _received_into(self, chunks: _HostChunks) -> None:
        """``scatter`` the queued host chunks into their targets, then check each there."""
        order = sorted(range(len(chunks.frm)), key=chunks.frm.__getitem__)
        end = 0
        for j in order:  # entries never overlap in a checked manifest; refuse if they do
            if chunks.frm[j] < end:
                raise ManifestError(f"{self.where}: entries overlap at byte {chunks.frm[j]}")
            end = chunks.frm[j] + chunks.size[j]
        assert self.scatter is not None
        self.scatter([(chunks.frm[j], chunks.to[j], chunks.size[j]) for j in order])
        to, size, want = chunks.to, chunks.size, chunks.want

        def check(first: int, last: int) -> Bad | None:
            for j in range(first, last):
                if want[j] is not None and size[j]:
                    view = memoryview((ctypes.c_char * size[j]).from_address(to[j])).cast("B")
                    if (value := crc(view)) != want[j]:
                        return j, 0, value
            return None

        found = [r for f in [_workers().submit(check, a, b) for a, b in _spread(size)]
                 if (r := f.result()) is not None]  # fmt: skip
        if found:
            j, _, value = found[0]
            raise chunks.mismatch(self.where, j, value)

    def _raw(self, entry: Entry) -> torch.Tensor:
        raw = self.bytes()[entry.offset : entry.offset + entry.nbytes]
        return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)

    def view(self, entry: Entry, chunk_size: int) -> torch.Tensor:
        """The entry's bytes as a tensor, verified first."""
        if self.verify:
            verify_entry(memoryview(self.bytes().numpy()), entry, chunk_size, self.where)
        return self._raw(entry)

    def copy_to(self, dst: torch.Tensor, entry: Entry, chunk_size: int) -> None:
        """Copy the entry into ``dst``, verified, by the next ``flush()`` (at once for a
        target that is not plain bytes)."""
        on_device = device.runtime().is_device_tensor(dst)
        plain = on_device or dst.device.type == "cpu"
        if not plain or not _byte_copyable(dst, entry.nbytes):
            copy_into(dst, self.view(entry, chunk_size))
        elif not on_device:
            self._add_units([dst], [entry], chunk_size)
        elif entry.nbytes:
            self._bounds(entry, chunk_size)
            self._queued.append((dst, entry, chunk_size))

    def copy_many(self, dsts: list[torch.Tensor], entries: tuple[Entry, ...] | list[Entry],
                  chunk_size: int, host_sized: bool = False) -> None:  # fmt: skip
        """``copy_to`` for every pair of ``dsts`` and ``entries`` (equal lengths); host
        tensors that are plain bytes are checked in a few C-level passes, not one by one.
        ``host_sized``: the caller knows every target is a host tensor of its entry's size."""
        if len(dsts) != len(entries):
            raise ValueError(f"{len(dsts)} targets for {len(entries)} entries")
        if (
            (host_sized or (all(map(_IS_CPU, dsts))
                            and not any(map(device.runtime().is_device_tensor, dsts))))
            and all(map(torch.Tensor.is_contiguous, dsts))
            and not any(map(torch.Tensor.is_conj, dsts))
            and not any(map(torch.Tensor.is_neg, dsts))
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
        chunks, self._chunks = self._chunks, _HostChunks()
        queued, self._queued = self._queued, []
        if chunks.size:
            self._copy_host(chunks)
        if not queued:
            return
        rt = device.runtime()
        by_device: dict[Hashable, list[Queued]] = {}
        for item in queued:
            by_device.setdefault(rt.device_of(item[0]), []).append(item)
        for dev, items in by_device.items():
            self._copy(items, rt, dev)

    def _copy_host(self, chunks: _HostChunks) -> None:
        """Copy and check every chunk of ``chunks`` into host memory. Spread over the workers
        where the chunks are large; chunks smaller than ``_SHARED_MIN`` on average are done
        here in turn (two threads handing the GIL back and forth per small chunk cost more
        than they share)."""
        if self.data is None and self.scatter is not None:
            self._received_into(chunks)
            return
        whole = self.bytes()
        data, base = memoryview(whole.numpy()), whole.data_ptr()
        memmove = ctypes.memmove
        to, frm, size, want = chunks.to, chunks.frm, chunks.size, chunks.want

        def work(first: int, last: int) -> Bad | None:
            for j, ptr, at, n, crc_ in zip(itertools.count(first), to[first:last],
                                           frm[first:last], size[first:last],
                                           want[first:last]):  # fmt: skip
                if n <= _PIECE:
                    memmove(ptr, base + at, n)  # frees the GIL
                    if crc_ is not None and (value := crc(data[at : at + n])) != crc_:
                        return j, 0, value
                    continue
                value = 0
                for p in range(0, n, _PIECE):
                    q = min(p + _PIECE, n)
                    memmove(ptr + p, base + at + p, q - p)
                    if crc_ is not None:
                        value = crc(data[at + p : at + q], value)
                if crc_ is not None and value != crc_:
                    return j, 0, value
            return None

        whole = sum(size) >= _SHARED_MIN * len(size)
        spread = _spread(size) if whole else [(0, len(size))]
        if len(spread) == 1:  # one share: run it here, no hand-off
            found = [r for r in [work(*spread[0])] if r is not None]
        else:
            futures = [_workers().submit(work, a, b) for a, b in spread]
            wait(futures)
            found = [r for f in futures if (r := f.result()) is not None]
        if found:
            j, _, value = found[0]
            raise chunks.mismatch(self.where, j, value)

    def _copy(self, items: list[Queued], rt: device.DeviceRuntime, dev: Hashable) -> None:
        """One pass over every chunk of ``items`` uploaded to ``dev``, spread over the restore
        workers."""
        units = [(k, i) for k, (_, e, cs) in enumerate(items) for i in range(e.n_chunks(cs))]
        sizes = [min(items[k][2], items[k][1].nbytes - i * items[k][2]) for k, i in units]
        outs = [_bytes_of(dst) for dst, _, _ in items]
        whole = self.bytes()
        data, base = memoryview(whole.numpy()), whole.data_ptr()
        stream = _upload_stream(rt, dev)
        stream.wait_stream(rt.current_stream(dev))  # after what the caller queued there

        def work(first: int, last: int) -> Bad | None:
            rt.use_device(dev)  # a pool thread has no current device: never make one
            ring = None if self.pinned else _staging(rt)
            turn, bad = 0, None
            for k, i in units[first:last]:
                out, (_, entry, cs) = outs[k], items[k]
                check = self.verify and entry.checksums is not None
                lo, hi = i * cs, min((i + 1) * cs, entry.nbytes)
                value = 0
                for p in range(lo, hi, _STAGE):
                    q = min(p + _STAGE, hi)
                    at = entry.offset + p
                    if ring is None:  # uploaded straight from page-locked memory
                        rt.copy(stream, out[p:q], whole[at : at + q - p])
                        piece = data[at : at + q - p]
                    else:  # through a staging buffer, once its last upload has landed
                        buf = ring[turn % _RING]
                        turn += 1
                        if buf[1] is not None:
                            buf[1].synchronize()
                        ctypes.memmove(buf[0].data_ptr(), base + at, q - p)
                        rt.copy(stream, out[p:q], buf[0][: q - p])
                        buf[1] = rt.new_event()
                        buf[1].record(stream)
                        piece = memoryview(buf[0].numpy())[: q - p]
                    if check:
                        value = crc(piece, value)
                if check and bad is None and value != entry.checksums[i]:  # type: ignore[index]
                    bad = (k, i, value)
            return bad

        futures = [_workers().submit(work, a, b) for a, b in _spread(sizes)]
        wait(futures)
        done = rt.new_event()
        done.record(stream)
        done.synchronize()
        found = [r for f in futures if (r := f.result()) is not None]
        if found:
            k, i, value = found[0]
            raise chunk_mismatch(self.where, items[k][1], i, value, items[k][2])

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
