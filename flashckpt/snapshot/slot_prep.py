"""Readying a rank's slots: sized, reserved, pre-faulted and, for device states, page-locked.

Preparing a slot costs about as much as filling it, so it happens off the training step where
it can: after ``restore()`` every slot is readied in the background, the one the first save
goes to first, and slots that already exist (a restarted process finds its old ones) are
page-locked there too; a job's first save without ``restore()`` reserves only the slot it
writes into (its copy faults the pages in, through pageable memory for a device state) and
everything else is readied after it returns. A save waits only for what is left of its own
slot's preparation. Page-locking runs on the background thread alone (``pinning``), and
nothing touches a slot while a snapshot is being written into it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import HostMemoryCapError
from ..format.slot import Slot
from .device import DeviceRuntime
from .pinning import Pinner
from .slots import SlotPair

log = logging.getLogger(__name__)


class SlotPreparer:
    def __init__(self, pair: SlotPair, rt: DeviceRuntime):
        self.pair = pair
        self.pinner = Pinner(rt)
        self.pending: dict[int, Future] = {}  # slot index -> its preparation in the background
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-prep")

    def ready_target(self, need: int, capacity: int) -> None:
        """Make sure the slot the next snapshot goes to holds ``need`` bytes, waiting only for
        what is left of its own background preparation, or preparing it now (left for the
        copy to fault in). The other slots are readied after the snapshot, in the
        background (``the_rest_in_background``)."""
        for i, fut in list(self.pending.items()):
            if fut.done():  # surface a failed background preparation (e.g. /dev/shm full)
                del self.pending[i]
                fut.result()
        while True:  # the order may change once the target's background work is done
            target = self.pair.write_order()[0]
            fut = self.pending.pop(target, None)
            if fut is None:
                break
            fut.result()
        if self._free(target) and _short(self.pair.slots[target], need):
            self.pair.check_space(capacity)
            try:
                self._prepare(target, capacity, prefault=False)
            except HostMemoryCapError as exc:
                made = sum(s is not None for s in self.pair.slots)
                if not made:  # not even one slot: the cap is too small for this rank
                    raise
                self._capped(made, exc)

    def wait(self, raise_errors: bool = True) -> None:
        """Finish the background work in flight (before the slots are read or freed)."""
        for i, fut in list(self.pending.items()):
            del self.pending[i]
            error = fut.exception()
            if error is not None and raise_errors:
                raise error
            if error is not None:
                log.warning("readying slot %d failed: %s", i, error)

    def ready_spare(self, capacity: int) -> None:
        """Ready the spare slot now (its copy faults the pages in). Named by index, not by
        write order: the slot first in that order may be the invalid one a reader still holds
        (the agent was storing it when it broke), and the spare must not wait behind it."""
        spare = self.pair.in_use - 1
        if _short(self.pair.slots[spare], capacity):
            self.pair.check_space(capacity)
            self._prepare(spare, capacity, prefault=False)

    def the_rest_in_background(self, capacity: int, device: Hashable | None) -> None:
        """Ready every slot in use that is missing or smaller than ``capacity``, and page-lock
        every one a device state copies into, in the order snapshots go to them, one after
        the other on the background thread."""
        for i in self.pair.write_order():
            slot = self.pair.slots[i]
            if not self._free(i):
                continue
            if _short(slot, capacity):
                self._in_background(i, capacity, device)
            elif device is not None and self.pinner.wanted(slot):
                self._busy_while(i, lambda slot=slot: self.pinner.pin(slot, device),
                                 self.pair.pinning)  # fmt: skip

    def _free(self, i: int) -> bool:
        """Whether nothing else is at slot ``i``: no background work, and no snapshot being
        written into it (an overlapped copy still lands there)."""
        return i not in self.pending and i not in self.pair.busy and i not in self.pair.writing

    def _in_background(self, i: int, capacity: int, device: Hashable | None) -> None:
        def prepare() -> None:
            try:
                self._prepare(i, capacity, background=True, device=device)
            except HostMemoryCapError as exc:
                self._capped(i, exc)

        self._busy_while(i, prepare)

    def _capped(self, count: int, exc: HostMemoryCapError) -> None:
        """The node's host-memory cap fits ``count`` slots of this rank: no more are made."""
        self.pair.cap_at(count)
        log.warning(
            "rank %d keeps %d slot(s): %s. %s", self.pair.rank, self.pair.in_use, exc,
            "With one slot, a save overwrites the newest snapshot only once every tier holds "
            "it, and skips otherwise" if self.pair.capped else "A save skips while "
            "persistence lags",
        )  # fmt: skip

    def _busy_while(self, i: int, work: Callable[[], None], marks: set[int] | None = None) -> None:
        """Run ``work`` on slot ``i`` in the background, with ``i`` in ``marks`` meanwhile:
        ``pair.busy`` (the slot is being made or grown: nothing reads or writes it) by
        default, ``pair.pinning`` (page-locked: it is not chosen for a write, and what it
        holds can still be read)."""
        marks = self.pair.busy if marks is None else marks

        def run() -> None:
            try:
                work()
            finally:
                marks.discard(i)

        marks.add(i)
        self.pending[i] = self._executor.submit(run)

    def _prepare(self, i: int, capacity: int, prefault: bool = True, background: bool = False,
                 device: Hashable | None = None) -> None:  # fmt: skip
        """Create or grow slot ``i``; in the ``background``, also page-lock it for ``device``.
        A registered mapping is unregistered before it grows, on the background thread."""
        old = self.pair.slots[i]
        if old is not None and old.capacity < capacity and self.pinner.pinned(old):
            if background:
                self.pinner.unpin(old)
            else:  # the training thread: registration calls stay off it
                self._executor.submit(self.pinner.unpin, old).result()
        slot = self.pair.prepare_slot(i, capacity, prefault)
        if background and device is not None:
            self.pinner.pin(slot, device)

    def close(self) -> None:
        """Finish what is being prepared and unpin every slot (before they are unmapped)."""

        def unpin_all() -> None:  # after the work queued before it: every slot it made
            for slot in self.pair.slots:
                if slot is not None:
                    self.pinner.unpin(slot)

        self._executor.submit(unpin_all)
        self._executor.shutdown(wait=True)


def _short(slot: Slot | None, need: int) -> bool:
    return slot is None or slot.capacity < need
