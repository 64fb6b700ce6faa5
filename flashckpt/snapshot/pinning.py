"""Page-locking a rank's slots (``cudaHostRegister``) so device copies into them are DMA.

Registration costs about as much as faulting the memory in, so it never runs on the training
thread: the slot preparer's own thread does it, after making the device the state lives on
its current device (a thread with none would create a context on device 0, and a GPU in
exclusive-process mode refuses that). A refused registration leaves the runtime's error in
that thread alone, where nothing launches kernels (and the runtime clears it); the slot stays
pageable for now, copies into it are synchronous, and it is tried again later (after
``RETRY_S``, doubling with each refusal of that mapping) or once its mapping changes. A
mapping is always unregistered before it is grown or unmapped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

from ..format.slot import Slot
from .device import DeviceRuntime

log = logging.getLogger(__name__)

Extent = tuple[int, int]  # (address, bytes) of a slot's mapping
RETRY_S = 30.0  # a refused registration is tried again after this, then twice as long...
MAX_RETRY_S = 600.0


def _extent(slot: Slot) -> Extent:
    return (slot.buf.data_ptr(), slot.capacity) if slot.buf is not None else (0, 0)


class Pinner:
    def __init__(self, rt: DeviceRuntime) -> None:
        self.rt = rt
        self._pinned: dict[int, Extent] = {}  # id(slot) -> the mapping registered
        # id(slot) -> the mapping the runtime refused, when it may be tried again, refusals
        self._refused: dict[int, tuple[Extent, float, int]] = {}
        self._warned = False

    def pinned(self, slot: Slot) -> bool:
        """Whether ``slot``'s current mapping is page-locked."""
        return self._pinned.get(id(slot)) == _extent(slot)

    def wanted(self, slot: Slot) -> bool:
        """Whether ``slot`` should be page-locked now: not yet, and not refused as it is mapped
        too recently to try again."""
        ext = _extent(slot)
        if ext[1] == 0 or self._pinned.get(id(slot)) == ext:
            return False
        refused = self._refused.get(id(slot))
        return refused is None or refused[0] != ext or time.monotonic() >= refused[1]

    def pin(self, slot: Slot, device: Hashable) -> None:
        """Register ``slot``'s mapping for every device (on the preparation thread)."""
        if not self.wanted(slot):
            return
        self.rt.use_device(device)
        ext = _extent(slot)
        error = self.rt.host_register(*ext)
        if error is None:
            self._pinned[id(slot)] = ext
            return
        before = self._refused.get(id(slot))
        times = before[2] + 1 if before is not None and before[0] == ext else 1
        wait = min(RETRY_S * 2 ** (times - 1), MAX_RETRY_S)
        self._refused[id(slot)] = (ext, time.monotonic() + wait, times)
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "page-locking %s (%d MiB) was refused: %s; snapshots into it copy "
                "through pageable memory, blocking save() for the whole copy; tried again in "
                "%.0fs", slot.path, ext[1] >> 20, error, wait)  # fmt: skip

    def unpin(self, slot: Slot) -> None:
        """Unregister ``slot``'s mapping if it is registered (on the preparation thread)."""
        self._refused.pop(id(slot), None)
        ext = self._pinned.pop(id(slot), None)
        if ext is None:
            return
        error = self.rt.host_unregister(ext[0])
        if error is not None:
            log.warning("unregistering %s failed: %s; its pages stay locked until the process "
                        "exits", slot.path, error)  # fmt: skip
