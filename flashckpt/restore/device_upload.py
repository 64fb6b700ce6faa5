"""Uploading a snapshot's chunks into device tensors, each checked on its way.

A restore into device tensors is bounded by the host-to-device copies, so the checks must
run beside them, not between them. The chunks to upload are rows (``chunk_rows.HostChunks``:
offset in the source, size, crc32c expected) with a byte view of its device target each:

* from a page-locked source (a slot this process registered), every row is uploaded straight
  from where it is in one call (``copy_many``), and its bytes are checked where they are
  while the device reads them;
* from any other source, the rows are staged a buffer at a time into page-locked buffers
  (a ring of three), each chunk checked as it is copied there (the compiled verified copy on
  every core), and each buffer's rows are uploaded in one call; a buffer is reused once its
  upload has landed, so staging, checks and the DMA all run at once.

One Python call a buffer, not a few a chunk: at thousands of small tensors the calls were what
a restore cost. Only the restoring thread talks to the device (its streams, its events); the
pool threads that share a copy out never make a device current. Every upload queued has landed
when ``upload`` returns or raises, so a chunk found bad never lands after its report.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..snapshot import device

STAGE = 16 << 20  # one staging buffer (more where a chunk is larger)
RING = 3  # staging buffers: one filling, the others uploading
_ALIGN = 64  # where a row starts in a staging buffer: a cache line (whole-line stores)

_local = threading.local()  # the restoring thread's staging buffers, per device runtime
_streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> device -> stream


def staging(rt: device.DeviceRuntime, need: int) -> list[list[Any]]:
    """This thread's ring of [page-locked buffer, event of its last upload], each buffer
    holding at least ``need`` bytes (a larger chunk than before replaces the ring, once its
    uploads have landed)."""
    rings = _local.__dict__.setdefault("rings", weakref.WeakKeyDictionary())
    ring = rings.get(rt)
    if ring is not None and ring[0][0].numel() < need:
        for _, done in ring:
            if done is not None:
                done.synchronize()
        ring = None
    if ring is None:
        size = max(STAGE, -(-need // _ALIGN) * _ALIGN)
        ring = rings[rt] = [[rt.pinned_empty(size), None] for _ in range(RING)]
    return ring


def stream_of(rt: device.DeviceRuntime, dev: Hashable) -> Any:
    """The device's upload stream (one per runtime and device, made on first use)."""
    streams = _streams.setdefault(rt, {})
    if dev not in streams:
        streams[dev] = rt.new_stream(dev)
    return streams[dev]


def upload(
    rows: Any, outs: list[torch.Tensor], whole: torch.Tensor, pinned: bool,
    rt: device.DeviceRuntime, dev: Hashable,
    stage: Callable[[Any], None], check: Callable[[Any], None],
) -> None:  # fmt: skip
    """Upload every row of ``rows`` (a ``HostChunks`` of offsets into ``whole``, the
    source's bytes) into its byte view in ``outs``, on ``dev``'s upload stream, after what
    the caller queued on its current stream. ``stage(batch)`` copies a batch of rows to their
    ``to`` addresses, checked (raising for the first bad one); ``check(rows)`` checks rows in
    place at their ``to`` addresses. Returns, or raises, once every upload queued has landed."""
    if not rows.size:
        return
    stream = stream_of(rt, dev)
    stream.wait_stream(rt.current_stream(dev))
    try:
        if pinned:
            _direct(rows, outs, whole, rt, stream, check)
        else:
            _staged(rows, outs, whole, rt, stream, stage)
    finally:  # nothing queued lands after this returns or raises
        done = rt.new_event()
        done.record(stream)
        done.synchronize()


def _direct(rows: Any, outs: list[torch.Tensor], whole: torch.Tensor,
            rt: device.DeviceRuntime, stream: Any, check: Callable[[Any], None]) -> None:  # fmt: skip
    """From a page-locked source: every row uploaded from where it is, then checked there
    while the device reads it."""
    rt.copy_many(stream, outs, [whole[a : a + n] for a, n in zip(rows.frm, rows.size, strict=True)])
    base = whole.data_ptr()
    rows.to = [base + a for a in rows.frm]
    check(rows)


def _staged(rows: Any, outs: list[torch.Tensor], whole: torch.Tensor,
            rt: device.DeviceRuntime, stream: Any, stage: Callable[[Any], None]) -> None:  # fmt: skip
    """Through the ring of page-locked buffers: a buffer's worth of rows staged (checked as
    copied), then uploaded in one call."""
    size = rows.size
    ring = staging(rt, max(size))
    cap = ring[0][0].numel()
    first, n, turn = 0, len(size), 0
    while first < n:
        buf, turn = ring[turn % len(ring)], turn + 1
        if buf[1] is not None:  # its last upload has landed before it is written again
            buf[1].synchronize()
        at, used, last = [], 0, first
        while last < n and used + size[last] <= cap:  # a buffer holds the largest row
            at.append(used)
            used += -(-size[last] // _ALIGN) * _ALIGN
            last += 1
        base = buf[0].data_ptr()
        stage(rows.rows(first, last, [base + a for a in at]))
        staged = buf[0]
        rt.copy_many(stream, outs[first:last],
                     [staged[a : a + m] for a, m in zip(at, size[first:last], strict=True)])  # fmt: skip
        buf[1] = rt.new_event()
        buf[1].record(stream)
        first = last
