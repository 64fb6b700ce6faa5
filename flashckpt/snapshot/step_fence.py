"""Which tensors only an optimizer step writes, and the moment before the next step begins.

An overlapped snapshot copies those tensors while forward and backward run, and makes the
next ``optimizer.step()`` wait for the copies (on the device, not the CPU). One global
optimizer step pre-hook per process does both jobs: it learns which optimizers step (their
parameters and state are what only a step writes) and it calls the fences of the
Checkpointers waiting for that moment. An optimizer whose step is captured in a CUDA graph is
noted too: its replays skip every hook, so its tensors are never deferred again.

Tensors are matched by storage, so a DTensor is matched through its local shard, and the
detached views a ``state_dict()`` returns match the parameters they view.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .flatten import is_dtensor

Fence = Callable[[bool], None]
"""Called before any optimizer step, with whether the step is being captured in a graph."""

_lock = threading.Lock()
_fences: dict[int, Fence] = {}
_seen: weakref.WeakSet = weakref.WeakSet()  # optimizers whose step() ran while watched
_captured: weakref.WeakSet = weakref.WeakSet()  # ... of which a step was graph-captured
_hook: Any = None
_capturing: Callable[[], bool] = lambda: False  # noqa: E731  (the device runtime's, once known)


def storage_key(t: torch.Tensor) -> int:
    """The address of the storage under ``t`` (0 for a tensor without one). Asked for every
    tensor of every save, so worked out from the tensor's own data pointer and offset (no
    storage object is made); a DTensor's is its local shard's."""
    if type(t) not in _PLAIN:
        if is_dtensor(t):
            t = t.to_local()
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a subclass without plain storage
            return 0
    try:
        return t.data_ptr() - t.storage_offset() * t.element_size()
    except RuntimeError:  # no storage (e.g. a functional tensor)
        return 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    captured = _capturing()
    with _lock:
        _seen.add(optimizer)
        if captured:
            _captured.add(optimizer)
        fences = list(_fences.values())
    for fence in fences:
        fence(captured)


class Watch:
    """One subscriber of the process's optimizer step pre-hook (installed while any is)."""

    def __init__(self, fence: Fence, capturing: Callable[[], bool]) -> None:
        global _hook, _capturing
        with _lock:
            _capturing = capturing
            _fences[id(self)] = fence
            if _hook is None:
                _hook = register_optimizer_step_pre_hook(_before_step)

    def close(self) -> None:
        global _hook
        with _lock:
            if _fences.pop(id(self), None) is not None and not _fences and _hook is not None:
                _hook.remove()
                _hook = None

    @staticmethod
    def step_written(extra: Iterable[torch.Tensor] = ()) -> set[int]:
        """Storage keys of what only an optimizer step writes: the parameters and state of
        every optimizer seen stepping (not graph-captured), and ``extra``."""
        with _lock:
            optimizers = [o for o in _seen if o not in _captured]
        with torch.no_grad():  # a DTensor's to_local() then builds no autograd node
            keys = {storage_key(t) for t in extra}
            for opt in optimizers:
                for group in opt.param_groups:
                    keys.update(storage_key(p) for p in group["params"])
                for st in list(opt.state.values()):
                    keys.update(storage_key(v) for v in st.values() if isinstance(v, torch.Tensor))
        keys.discard(0)
        return keys
