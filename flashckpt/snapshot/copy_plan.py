"""A layout's copies into one slot, planned once and run in a few calls.

A real rank's state holds thousands of tensors. Viewing each entry's bytes in the slot and
copying tensor by tensor costs a few microseconds of Python per tensor, more than the copy of
a small tensor itself. While the layout is unchanged (the usual case: the same keys, shapes,
dtypes and devices every save) the slot's views are made once per slot and mapping, and the
host tensors go in one ``torch._foreach_copy_``; only dtypes without a copy kernel (the
sub-byte integers) go one by one, as bytes. The tensors themselves are still the ones the
state holds at this save: an optimizer's state is replaced by ``load_state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.manifest import Entry
from ..format.slot import HEADER_SIZE, Slot
from .flatten import Layout, copy_into

# Dtypes with no copy kernel: their bytes are copied as bytes (``copy_into``).
NO_COPY_KERNEL = frozenset(
    d for d in (getattr(torch, f"{s}int{n}", None) for s in ("", "u") for n in range(1, 8)) if d
)


def entry_view(buf: torch.Tensor, entry: Entry, like: torch.Tensor) -> torch.Tensor:
    """The slot bytes of ``entry`` in ``buf``, viewed with ``like``'s dtype and shape."""
    start = HEADER_SIZE + entry.offset
    return buf[start : start + entry.nbytes].view(like.dtype).view(like.shape)


@dataclass
class CopyPlan:
    """One layout in one slot mapping: every entry's view, and the leaves split by route."""

    buf: torch.Tensor  # the slot's mapping the views are into
    layout: Layout
    views: list[torch.Tensor]
    batched: list[int]  # host leaves copied together
    one_by_one: list[int]  # host leaves of a dtype without a copy kernel
    on_device: list[int]  # leaves the device copier takes

    def host_copy(self, tensors: list[torch.Tensor]) -> None:
        """Copy the host tensors (``tensors``: this save's, in entry order) into the slot."""
        views = self.views
        with torch.no_grad():
            if self.batched:
                torch._foreach_copy_([views[i] for i in self.batched],
                                     [tensors[i] for i in self.batched])  # fmt: skip
            for i in self.one_by_one:
                copy_into(views[i], tensors[i])

    def device_pairs(
        self, tensors: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        views, entries = self.views, self.layout.entries
        return [(views[i], tensors[i], entries[i].path) for i in self.on_device]


class CopyPlans:
    """The plan of the current layout for each slot, remade when the layout or the slot's
    mapping changes (a grown slot is mapped anew)."""

    def __init__(self, is_device) -> None:
        self._is_device = is_device
        self._plans: dict[int, CopyPlan] = {}

    def plan(self, slot: Slot, layout: Layout, tensors: list[torch.Tensor]) -> CopyPlan:
        """``tensors``: this save's, in entry order (their dtypes, shapes and devices are the
        layout's)."""
        plan = self._plans.get(id(slot))
        if plan is not None and plan.buf is slot.buf and plan.layout is layout:
            return plan
        self._plans.pop(id(slot), None)  # its views go before the new ones are made
        batched, one_by_one, on_device, views = [], [], [], []
        for i, (e, t) in enumerate(zip(layout.entries, tensors, strict=True)):
            views.append(entry_view(slot.buf, e, t))
            if self._is_device(t):
                on_device.append(i)
            elif t.dtype in NO_COPY_KERNEL:
                one_by_one.append(i)
            else:
                batched.append(i)
        plan = self._plans[id(slot)] = CopyPlan(slot.buf, layout, views, batched, one_by_one,
                                                on_device)  # fmt: skip
        return plan

    def clear(self) -> None:
        """Drop every view (before the slots are unmapped)."""
        self._plans.clear()
