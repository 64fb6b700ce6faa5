"""Device-to-host snapshot copies: side streams, one fence per device, overlap with the step.

Copies go on a side stream of each device the state lives on, after the work already queued
on that device's current stream. Two events per device split them:

* ``fenced``: tensors something other than an optimizer step may write next (buffers such as
  BatchNorm's running stats, anything no optimizer owns). The device's current stream waits
  for it at once, on the device, without blocking the CPU.
* ``done``: everything. Blocking mode waits for it before ``save()`` returns. Overlapped mode
  defers what only an optimizer step writes (``step_fence``): the copies run while forward
  and backward do, and the next ``optimizer.step()`` (or ``Checkpointer.fence()``) makes each
  device's current stream wait for its ``done``.

The snapshot is published once every ``done`` has fired. Until then the sources are kept
referenced, so no tensor freed meanwhile (an optimizer recreated, ``p.data = ...``,
``model.to(dtype)``) hands its memory to other kernels under the copy. A deferred source
written in place before the fence (its version counter moved: an ``nn.Embedding(max_norm=)``
forward, a hand-written update) makes the snapshot torn: it is dropped, never published, and
the warning names the tensor. Writes through ``.data`` or from other streams escape that
check; they need ``fence()`` first (see the README).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from typing import Any

import torch

from .device import DeviceRuntime, Event
from .step_fence import Watch, storage_key

log = logging.getLogger(__name__)

Pair = tuple[torch.Tensor, torch.Tensor, str]
"""(host destination, device source, the entry's path)"""


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def _writes_in_forward(module: torch.nn.Module) -> set[int]:
    """Storage keys of parameters that ``module`` writes during forward."""
    return {
        storage_key(m.weight)  # renormalised in place by the lookups
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and m.max_norm is not None
    }


def _pinned_sources(pairs: list[Pair]) -> list[Pair]:
    """``pairs`` with each parameter source replaced by a detached alias of it. The walks take
    a module's parameters as themselves, and a parameter's storage can be swapped out from
    under the object (``p.data = ...``, ``model.to(dtype)``) while its copy is in flight:
    the alias keeps the storage the copy reads, and is what the copy is queued from. Any
    other tensor holds its own storage."""
    out = list(pairs)
    srcs = [src for _, src, _ in pairs]
    for i in compress(count(), map(isinstance, srcs, repeat(torch.nn.Parameter))):
        dst, src, path = pairs[i]
        out[i] = (dst, src.detach(), path)
    return out


@dataclass
class PendingCopy:
    """The copies of one snapshot, from queued until their bytes have landed."""

    done: dict[Hashable, Event]
    sources: list[torch.Tensor]  # referenced until the copies land
    watched: list[tuple[str, torch.Tensor, int]]  # deferred sources, versions at save()
    learned: set[int] = field(default_factory=set)  # where a torn source's key is noted
    torn: str | None = None
    _checked: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, why: str = "") -> None:
        """Compare the deferred sources with save() time, once: the first call decides."""
        with self._lock:
            if self._checked:
                return
            self._checked = True
            if why:
                self.torn = why
                return
            for path, t, version in self.watched:
                if t._version != version:
                    self.learned.add(storage_key(t))  # from now on copied before save() returns
                    self.torn = (
                        f"{path!r} was written in place after save() returned, before any "
                        "optimizer step"
                    )
                    return

    def wait(self) -> None:
        """Block (sleeping) until every copy has landed; then release the sources."""
        for ev in self.done.values():
            ev.synchronize()
        self.check()
        self.sources.clear()


class DeviceCopier:
    """Queues a snapshot's device-to-host copies; one snapshot in flight at a time."""

    def __init__(self, rt: DeviceRuntime, overlap: bool) -> None:
        self.rt, self.overlap = rt, overlap
        self._streams: dict[Hashable, Any] = {}
        self._pending: PendingCopy | None = None  # copies the next step must wait for
        self._lock = threading.Lock()
        self._extra: list[torch.Tensor] = []  # also written only by a step (integrations)
        self._outside: set[int] = set()  # deferred once, then found written outside a step
        self._forward_writes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._watch: Watch | None = Watch(self._fence, rt.capturing) if overlap else None

    def also_step_written(self, tensors: Iterable[torch.Tensor]) -> None:
        self._extra.extend(tensors)

    def deferrable(self, objects: Iterable[Any]) -> set[int]:
        """Storage keys whose copies may overlap the next forward and backward: what only an
        optimizer step writes, less what the modules among ``objects`` write in forward and
        what an earlier snapshot found written outside a step."""
        if self._watch is None:
            return set()
        keys = Watch.step_written(self._extra) - self._outside
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                found = self._forward_writes.get(obj)
                if found is None:  # per module: the parameters its forward writes
                    found = self._forward_writes[obj] = _writes_in_forward(obj)
                keys -= found
        return keys

    def copy(self, pairs: list[Pair], deferred: set[int]) -> PendingCopy:
        """Queue every copy, those of ``deferred`` storages after the fence; ``wait()`` on the
        result blocks until all have landed."""
        pairs = _pinned_sources(pairs)
        devices = list(map(self.rt.device_of, [src for _, src, _ in pairs]))
        if len(set(devices)) <= 1:  # the usual case: one device a rank
            by_device = {devices[0]: pairs} if pairs else {}
        else:
            by_device = {}
            for dev, pair in zip(devices, pairs, strict=True):
                by_device.setdefault(dev, []).append(pair)
        pending = PendingCopy({}, [src for _, src, _ in pairs], [], self._outside)
        queued: list[Any] = []
        try:
            for dev, items in by_device.items():
                early: list[Pair] = []
                late: list[Pair] = []
                srcs = [src for _, src, _ in items]
                keys = list(map(storage_key, srcs)) if deferred else [0] * len(items)
                for p, key in zip(items, keys, strict=True):
                    defer = key in deferred and _version(p[1]) is not None
                    (late if defer else early).append(p)
                side = self._side(dev)
                caller = self.rt.current_stream(dev)
                side.wait_stream(caller)
                queued.append(side)
                pending.sources += self._copy_all(side, early)
                fenced = self.rt.new_event()
                fenced.record(side)
                pending.sources += self._copy_all(side, late)
                pending.done[dev] = done = self.rt.new_event()
                done.record(side)
                caller.wait_event(fenced)
                pending.watched += [(path, src, src._version) for _, src, path in late]
        except BaseException:
            self._drain(queued)  # nothing may still write into the slot once it is given up
            raise
        with self._lock:  # fence() makes the stream then current wait for all of it
            self._pending = pending
        return pending

    def _copy_all(self, side: Any, pairs: list[Pair]) -> list[torch.Tensor]:
        """Queue ``pairs`` on ``side`` in one call; the tensors made for it (referenced until
        the copies land). A lazily conjugated or negated source is resolved first, on the
        caller's stream: copied as it is into page-locked memory, torch would apply the bit
        to the host bytes right after queuing the copy, before the bytes land, and the
        snapshot would hold the source unconjugated."""
        if not pairs:
            return []
        srcs = [src for _, src, _ in pairs]
        made: list[torch.Tensor] = []
        if any(map(torch.Tensor.is_conj, srcs)) or any(map(torch.Tensor.is_neg, srcs)):
            srcs = made = [s.resolve_conj().resolve_neg() for s in srcs]
            side.wait_stream(self.rt.current_stream(self.rt.device_of(srcs[0])))
        self.rt.copy_many(side, [dst for dst, _, _ in pairs], srcs)
        return made

    def fence(self) -> None:
        """Make every device's current stream wait for the snapshot in flight."""
        self._fence(self.rt.capturing())

    def _fence(self, captured: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        if captured:  # a graph replay would write without waiting: the snapshot cannot stand
            pending.check("an optimizer step was captured in a CUDA graph while it was copied")
            return
        for dev, ev in pending.done.items():
            self.rt.current_stream(dev).wait_event(ev)
        pending.check()

    def _side(self, dev: Hashable) -> Any:
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = self.rt.new_stream(dev)
        return side

    def _drain(self, streams: list[Any]) -> None:
        for side in streams:
            try:
                ev = self.rt.new_event()
                ev.record(side)
                ev.synchronize()
            except Exception:  # the stream is broken as well: nothing more to wait for
                log.debug("draining a failed copy stream", exc_info=True)

    def close(self) -> None:
        self.fence()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
