"""Copying a snapshot's stored bytes into the tensors of a live state, verified on every core.

A ``Source`` is the data region of one rank's snapshot, wherever it is (a slot, a buffer read
from a tier). Its entries are copied into their target tensors chunk by chunk, each chunk's
crc32c checked against the manifest:

* into host tensors at once: large entries are split over the restore workers; each copies a
  piece and checksums the bytes that landed while they are still in its cache, so verifying
  costs a second read of cache, not of memory;
* into device tensors queued, then run together by ``flush()``: each worker copies a piece into
  one of its own page-locked staging buffers, checksums it there and uploads it from there on
  a copy stream of the device, reusing a buffer once its upload has landed; so checksums, host
  copies and the DMA all run at once. A source that is page-locked already (a slot this process
  registered) is uploaded from directly, checksummed beside the upload. ``flush()`` returns
  once every byte has landed and every checksum matched.

A mismatch raises ChecksumError; the caller falls back to another source, which rewrites every
entry.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from . import device
from .checksum import chunk_mismatch, crc, verify_entry
from .errors import ManifestError
from .flatten import copy_into
from .manifest import Entry, dtype_from_name

_PARALLEL_MIN = 1 << 20  # host entries this large are copied and verified on every core
_PIECE = 1 << 20  # checked right after its copy, while it is still in the core's cache
_STAGE = 4 << 20  # one staging buffer of a device upload
_RING = 3  # staging buffers per worker: one filling, the others uploading
_N_WORKERS = max(1, min(8, os.cpu_count() or 1))

Bad = tuple[int, int, int]  # (queued upload, chunk, crc found)


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


def _byte_copyable(dst: torch.Tensor, nbytes: int) -> bool:
    return (
        dst.is_contiguous() and not dst.is_conj() and not dst.is_neg()
        and dst.numel() * dst.element_size() == nbytes
    )  # fmt: skip


def _bytes_of(dst: torch.Tensor) -> torch.Tensor:
    return dst.detach().reshape(-1).view(torch.uint8)


def _spread(n: int) -> list[tuple[int, int]]:
    """``range(n)`` cut into one contiguous run per worker."""
    bounds = [k * n // _N_WORKERS for k in range(_N_WORKERS + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]


@dataclass
class Source:
    """The bytes of one rank's snapshot, wherever they are (a slot, a file, a buffer)."""

    data: torch.Tensor  # uint8, the whole data region
    where: str
    verify: bool = True
    pinned: bool = False  # page-locked: device uploads read it directly
    _uploads: list[tuple[torch.Tensor, Entry, int]] = field(default_factory=list, repr=False)

    def _raw(self, entry: Entry) -> torch.Tensor:
        raw = self.data[entry.offset : entry.offset + entry.nbytes]
        return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)

    def _check(self, entry: Entry, chunk_size: int) -> None:
        verify_entry(memoryview(self.data.numpy()), entry, chunk_size, self.where)

    def view(self, entry: Entry, chunk_size: int) -> torch.Tensor:
        """The entry's bytes as a tensor, verified first."""
        if self.verify:
            self._check(entry, chunk_size)
        return self._raw(entry)

    def copy_to(self, dst: torch.Tensor, entry: Entry, chunk_size: int) -> None:
        """Copy the entry into ``dst``, verified: at once into host memory, at ``flush()``
        into a device tensor."""
        if device.runtime().is_device_tensor(dst):
            if entry.nbytes:
                self._bounds(entry, chunk_size)
                self._uploads.append((dst, entry, chunk_size))
            return
        self._into_host(dst, entry, chunk_size)

    def _into_host(self, dst: torch.Tensor, entry: Entry, chunk_size: int) -> None:
        checked = self.verify and entry.checksums is not None
        small = entry.nbytes < _PARALLEL_MIN
        if (
            not checked
            or small
            or dst.device.type != "cpu"
            or not _byte_copyable(dst, entry.nbytes)
        ):
            copy_into(dst, self.view(entry, chunk_size))
            return
        self._bounds(entry, chunk_size)
        out = _bytes_of(dst)
        landed = memoryview(out.numpy())
        src_at, dst_at = self.data.data_ptr() + entry.offset, out.data_ptr()

        def work(first: int, last: int) -> Bad | None:
            for i in range(first, last):
                lo, hi = i * chunk_size, min((i + 1) * chunk_size, entry.nbytes)
                value = 0
                for p in range(lo, hi, _PIECE):
                    q = min(p + _PIECE, hi)
                    ctypes.memmove(dst_at + p, src_at + p, q - p)  # releases the GIL
                    value = crc(landed[p:q], value)
                if value != entry.checksums[i]:  # type: ignore[index]
                    return 0, i, value
            return None

        n = entry.n_chunks(chunk_size)
        self._raise_first([_workers().submit(work, a, b) for a, b in _spread(n)],
                          lambda _: entry, chunk_size)  # fmt: skip

    def flush(self) -> None:
        """Run the queued device copies; returns once they have landed, verified."""
        queued, self._uploads = self._uploads, []
        by_device: dict[Hashable, list[tuple[torch.Tensor, Entry, int]]] = {}
        rt = device.runtime()
        for dst, entry, cs in queued:
            if _byte_copyable(dst, entry.nbytes):
                by_device.setdefault(rt.device_of(dst), []).append((dst, entry, cs))
            else:  # strided or lazily conjugated: verified into host memory, then a typed copy
                host = torch.empty(entry.nbytes, dtype=torch.uint8)
                self._into_host(host, entry, cs)
                raw = host.view(dtype_from_name(entry.dtype)).view(entry.shape)
                dst.copy_(raw)
        for dev, items in by_device.items():
            self._upload(rt, dev, items)

    def _upload(self, rt: device.DeviceRuntime, dev: Hashable,
                items: list[tuple[torch.Tensor, Entry, int]]) -> None:  # fmt: skip
        streams = _streams.setdefault(rt, {})
        stream = streams.get(dev)
        if stream is None:
            stream = streams[dev] = rt.new_stream(dev)
        stream.wait_stream(rt.current_stream(dev))  # after what the caller queued (a zero step)
        units = [(k, i) for k, (_, e, cs) in enumerate(items) for i in range(e.n_chunks(cs))]
        outs = [_bytes_of(dst) for dst, _, _ in items]
        data = memoryview(self.data.numpy())
        base = self.data.data_ptr()

        def work(first: int, last: int) -> Bad | None:
            rt.use_device(dev)  # a pool thread has no current device: never make one on GPU 0
            ring, turn, bad = (None if self.pinned else _staging(rt)), 0, None
            for k, i in units[first:last]:
                _, entry, cs = items[k]
                lo, hi = entry.offset + i * cs, entry.offset + min((i + 1) * cs, entry.nbytes)
                check = self.verify and entry.checksums is not None
                value = 0
                for p in range(lo, hi, _STAGE):
                    q = min(p + _STAGE, hi)
                    to = outs[k][p - entry.offset : q - entry.offset]
                    if ring is None:
                        rt.copy(stream, to, self.data[p:q])
                        if check:
                            value = crc(data[p:q], value)
                        continue
                    slot = ring[turn % _RING]
                    turn += 1
                    if slot[1] is not None:
                        slot[1].synchronize()  # its last upload has landed: the buffer is free
                    ctypes.memmove(slot[0].data_ptr(), base + p, q - p)  # releases the GIL
                    rt.copy(stream, to, slot[0][: q - p])
                    slot[1] = rt.new_event()
                    slot[1].record(stream)
                    if check:
                        value = crc(memoryview(slot[0].numpy())[: q - p], value)
                if check and bad is None and value != entry.checksums[i]:  # type: ignore[index]
                    bad = (k, i, value)
            return bad

        futures = [_workers().submit(work, a, b) for a, b in _spread(len(units))]
        try:
            self._raise_first(futures, lambda k: items[k][1], items[0][2])
        finally:
            done = rt.new_event()
            done.record(stream)
            done.synchronize()

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

    def _raise_first(self, futures: list, entry_of: Callable[[int], Entry],
                     chunk_size: int) -> None:  # fmt: skip
        """Wait for every worker; raise the first mismatch (or error) any found."""
        wait(futures)
        bad = [r for f in futures if (r := f.result()) is not None]
        if bad:
            k, i, value = bad[0]
            raise chunk_mismatch(self.where, entry_of(k), i, value, chunk_size)
