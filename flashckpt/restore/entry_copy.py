"""Copying a snapshot's stored bytes into the tensors of a live state, verified on every core.

A ``Source`` is the data region of one rank's snapshot, wherever it is (a slot, a buffer read
from a tier). ``copy_to`` queues an entry for its target tensor; ``flush()`` copies everything
queued in one pass over all its chunks, split evenly over the restore workers, each chunk's
crc32c checked against the manifest, and returns once every byte has landed:

* into host tensors: a worker copies a piece and checksums the bytes that landed while they
  are still in its cache, so verifying costs a second read of cache, not of memory;
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
import os
import threading
import weakref
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ManifestError
from ..format.checksum import chunk_mismatch, crc, verify_entry
from ..format.manifest import Entry, dtype_from_name
from ..snapshot import device
from ..snapshot.flatten import copy_into

_PIECE = 1 << 19  # host copies: checked right after its copy, while still in the core's cache
_STAGE = 4 << 20  # one staging buffer of a device upload
_RING = 3  # staging buffers per worker: one filling, the others uploading
_N_WORKERS = max(1, min(8, os.cpu_count() or 1))

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


@dataclass
class Source:
    """The bytes of one rank's snapshot, wherever they are (a slot, a file, a buffer)."""

    data: torch.Tensor  # uint8, the whole data region
    where: str
    verify: bool = True
    pinned: bool = False  # page-locked: device uploads read it directly
    _queued: list[Queued] = field(default_factory=list, repr=False)

    def _raw(self, entry: Entry) -> torch.Tensor:
        raw = self.data[entry.offset : entry.offset + entry.nbytes]
        return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)

    def view(self, entry: Entry, chunk_size: int) -> torch.Tensor:
        """The entry's bytes as a tensor, verified first."""
        if self.verify:
            verify_entry(memoryview(self.data.numpy()), entry, chunk_size, self.where)
        return self._raw(entry)

    def copy_to(self, dst: torch.Tensor, entry: Entry, chunk_size: int) -> None:
        """Copy the entry into ``dst``, verified, by the next ``flush()`` (at once for a
        target that is not plain bytes)."""
        on_device = device.runtime().is_device_tensor(dst)
        plain = on_device or dst.device.type == "cpu"
        if not plain or not _byte_copyable(dst, entry.nbytes):
            copy_into(dst, self.view(entry, chunk_size))
        elif entry.nbytes:
            self._bounds(entry, chunk_size)
            self._queued.append((dst, entry, chunk_size))

    def flush(self) -> None:
        """Copy everything queued, verified; returns once it has landed."""
        queued, self._queued = self._queued, []
        rt = device.runtime()
        by_device: dict[Hashable, list[Queued]] = {}
        for item in queued:
            dev = rt.device_of(item[0]) if rt.is_device_tensor(item[0]) else None
            by_device.setdefault(dev, []).append(item)
        for dev, items in by_device.items():
            self._copy(items, None if dev is None else rt, dev)

    def _copy(self, items: list[Queued], rt: device.DeviceRuntime | None,
              dev: Hashable) -> None:  # fmt: skip
        """One pass over every chunk of ``items``, spread over the restore workers: into host
        memory (``rt`` None), or uploaded to ``dev``."""
        units = [(k, i) for k, (_, e, cs) in enumerate(items) for i in range(e.n_chunks(cs))]
        sizes = [min(items[k][2], items[k][1].nbytes - i * items[k][2]) for k, i in units]
        outs = [_bytes_of(dst) for dst, _, _ in items]
        data, base = memoryview(self.data.numpy()), self.data.data_ptr()
        stream = None
        if rt is not None:
            stream = _upload_stream(rt, dev)
            stream.wait_stream(rt.current_stream(dev))  # after what the caller queued there

        def work(first: int, last: int) -> Bad | None:
            if rt is not None:
                rt.use_device(dev)  # a pool thread has no current device: never make one
            ring = None if rt is None or self.pinned else _staging(rt)
            landed: dict[int, memoryview] = {}
            turn, bad = 0, None
            for k, i in units[first:last]:
                out, (_, entry, cs) = outs[k], items[k]
                check = self.verify and entry.checksums is not None
                lo, hi = i * cs, min((i + 1) * cs, entry.nbytes)
                value = 0
                for p in range(lo, hi, _PIECE if rt is None else _STAGE):
                    q = min(p + (_PIECE if rt is None else _STAGE), hi)
                    at = entry.offset + p
                    if rt is None:  # into host memory, checked where it landed
                        ctypes.memmove(out.data_ptr() + p, base + at, q - p)  # frees the GIL
                        if k not in landed:
                            landed[k] = memoryview(out.numpy())
                        piece = landed[k][p:q]
                    elif ring is None:  # uploaded straight from page-locked memory
                        rt.copy(stream, out[p:q], self.data[at : at + q - p])
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
        if rt is not None:
            done = rt.new_event()
            done.record(stream)
            done.synchronize()
        found = [r for f in futures if (r := f.result()) is not None]
        if found:
            k, i, value = found[0]
            raise chunk_mismatch(self.where, items[k][1], i, value, items[k][2])

    def _bounds(self, entry: Entry, chunk_size: int) -> None:
        if entry.offset < 0 or entry.offset + entry.nbytes > self.data.numel():
            raise ManifestError(
                f"{self.where}: {entry.path!r} claims bytes {entry.offset}-"
                f"{entry.offset + entry.nbytes}, past the {self.data.numel()} bytes stored; "
                "the manifest is corrupt, restore from another tier or an older step"
            )
        n = entry.n_chunks(chunk_size)
        if entry.checksums is not None and len(entry.checksums) != n:
            raise ManifestError(
                f"{self.where}: {entry.path!r} has {len(entry.checksums)} checksums for {n} "
                "chunks; the manifest is corrupt, restore from another tier or an older step"
            )
