"""Device-to-host snapshot copies: page-locked slots, a side stream, and the overlap fence.

Slots are registered with ``cudaHostRegister`` so device-to-host copies run at full DMA speed
and truly asynchronously. Copies go on a side stream that first waits for the work already
queued on the caller's stream. Two events split them:

* ``fenced``: tensors the next forward/backward may change in place (buffers such as BatchNorm
  running stats, anything that is not a parameter or optimizer state). The caller's stream
  waits for this event at once, on the GPU, without blocking the CPU.
* ``done``: everything. In overlapped mode the caller's stream waits for it just before the
  next ``optimizer.step()`` (a global optimizer step pre-hook), so parameters and optimizer
  state are copied while forward and backward run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def host_register(t: torch.Tensor) -> bool:
    """Page-lock the memory under ``t`` (a slot's mapping). False if the driver refuses."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of %d bytes failed (%s); copies fall back to pageable", t.numel(), err
        )
        return False
    return True


def host_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def optimizer_owned(objects: Iterable[object]) -> set[int]:
    """data_ptrs of tensors only ``optimizer.step()`` changes: parameters and optimizer state."""
    ptrs: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            ptrs.update(p.data_ptr() for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for st in obj.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


class DeviceCopier:
    """Queues device-to-host copies on a side stream; one snapshot in flight at a time."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.stream = torch.cuda.Stream()
        self._pending: torch.cuda.Event | None = None
        self._lock = threading.Lock()
        self._hook = (
            torch.optim.optimizer.register_optimizer_step_pre_hook(self._before_step)
            if overlap
            else None
        )

    def copy(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], owned: set[int]
    ) -> torch.cuda.Event:
        """Queue ``dst.copy_(src)`` for every pair; returns the event that marks all done."""
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        first = [(d, s) for d, s in pairs if s.data_ptr() not in owned]
        later = [(d, s) for d, s in pairs if s.data_ptr() in owned]
        with torch.cuda.stream(self.stream):
            for dst, src in first:
                dst.copy_(src, non_blocking=True)
            fenced = torch.cuda.Event()
            fenced.record(self.stream)
            for dst, src in later:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        caller.wait_event(fenced)
        if not self.overlap:
            done.synchronize()
        else:
            with self._lock:
                self._pending = done
        return done

    def _before_step(self, optimizer: object, args: object, kwargs: object) -> None:
        with self._lock:
            ev, self._pending = self._pending, None
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
