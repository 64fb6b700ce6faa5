"""Readying a rank's slots: sized, reserved, pre-faulted and, for CUDA states, page-locked.

Preparing a slot costs about as much as filling it, so it happens off the training step where
it can: after ``restore()`` both slots are readied in the background, the one the first save
goes to first; a job's first save without ``restore()`` reserves only the slot it writes into
(its copy faults the pages in) and the others are readied after it returns. A save waits only
for what is left of its own slot's preparation.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import cuda
from .slot import Slot
from .slots import SlotPair


class SlotPreparer:
    def __init__(self, pair: SlotPair):
        self.pair = pair
        self.pending: dict[int, Future] = {}  # slot index -> its preparation in the background
        self.pinned: dict[int, torch.Tensor] = {}  # id(slot) -> its page-locked buffer
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-prep")

    def ready_target(self, need: int, capacity: int, on_device: bool) -> None:
        """Make sure the slot the next snapshot goes to holds ``need`` bytes, waiting only for
        what is left of its own background preparation (or preparing it now, left for the copy
        to fault in); a slot to grow is grown now too (its sealer and readers may be at it)."""
        for i, fut in list(self.pending.items()):
            if fut.done():  # surface a failed background preparation (e.g. /dev/shm full)
                del self.pending[i]
                fut.result()
        order = self.pair.write_order()
        fut = self.pending.pop(order[0], None)
        if fut is not None:
            fut.result()
        todo = [i for i in order if i not in self.pending and _short(self.pair.slots[i], need)]
        if todo:
            self.pair.check_space(capacity)
        for i in todo:
            if i == order[0] or self.pair.slots[i] is not None:
                self.prepare(i, capacity, on_device, prefault=i != order[0])

    def ready_spare(self, capacity: int, on_device: bool) -> None:
        """Ready the spare slot now (its copy faults the pages in). Named by index, not by
        write order: the slot first in that order may be the invalid one a reader still holds
        (the agent was storing it when it broke), and the spare must not wait behind it."""
        spare = self.pair.in_use - 1
        if _short(self.pair.slots[spare], capacity):
            self.pair.check_space(capacity)
            self.prepare(spare, capacity, on_device, prefault=False)

    def the_rest_in_background(self, capacity: int, on_device: bool) -> None:
        """Ready every slot in use that is missing or smaller than ``capacity``, in the order
        snapshots go to them, one after the other on a background thread."""
        for i in self.pair.write_order():
            if i not in self.pending and _short(self.pair.slots[i], capacity):
                self._in_background(i, capacity, on_device)

    def _in_background(self, i: int, capacity: int, on_device: bool) -> None:
        def prepare() -> None:
            try:
                self.prepare(i, capacity, on_device)
            finally:
                self.pair.busy.discard(i)

        self.pair.busy.add(i)  # no one else touches the slot until it is ready
        self.pending[i] = self._executor.submit(prepare)

    def prepare(self, i: int, capacity: int, on_device: bool, prefault: bool = True) -> None:
        old = self.pair.slots[i]
        if old is not None and old.capacity < capacity:
            self._unpin(old)
        slot = self.pair.prepare_slot(i, capacity, prefault)
        if on_device and id(slot) not in self.pinned and cuda.host_register(slot.buf):
            self.pinned[id(slot)] = slot.buf

    def _unpin(self, slot: Slot) -> None:
        buf = self.pinned.pop(id(slot), None)
        if buf is not None:
            cuda.host_unregister(buf)

    def close(self) -> None:
        """Finish what is being prepared and unpin every slot (before they are unmapped)."""
        self._executor.shutdown(wait=True)
        for slot in self.pair.slots:
            if slot is not None:
                self._unpin(slot)


def _short(slot: Slot | None, need: int) -> bool:
    return slot is None or slot.capacity < need
