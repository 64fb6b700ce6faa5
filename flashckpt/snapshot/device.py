"""The device runtime under the snapshot copies and device restores: streams, events,
asynchronous copies and page-locking, behind one small interface.

``CudaRuntime`` is the one flashckpt ships. Everything above it (the per-device fences of
``device_copy``, page-locking on its own thread in ``pinning``, the staged uploads of
``upload``) is written against the interface, so the same code runs on CPU against a
simulated device in the test suite, and ``CudaRuntime`` looks up every torch attribute it
uses when it is made: a name missing from the installed torch fails there, on any machine,
not at a GPU user's first save.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, Protocol

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device of the process


class Stream(Protocol):
    def wait_stream(self, other: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...


class Event(Protocol):
    def record(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DeviceRuntime(Protocol):
    """What the device path needs of a device runtime. Stream work is queued, not run: a
    caller's later work on a stream waits for the events it was told to wait for."""

    name: str

    def is_device_tensor(self, t: torch.Tensor) -> bool: ...

    def device_of(self, t: torch.Tensor) -> Hashable: ...

    def current_stream(self, device: Hashable) -> Stream: ...

    def new_stream(self, device: Hashable) -> Stream: ...

    def new_event(self) -> Event:
        """An event whose ``synchronize()`` sleeps until it fires (no spinning core)."""
        ...

    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (its device made current for the call)."""
        ...

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a graph."""
        ...

    def use_device(self, device: Hashable) -> None:
        """Make ``device`` the calling thread's current device."""
        ...

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 host buffer of ``nbytes``."""
        ...

    def host_register(self, ptr: int, nbytes: int) -> str | None:
        """Page-lock ``nbytes`` at ``ptr`` for every device; None, or the runtime's error."""
        ...

    def host_unregister(self, ptr: int) -> str | None: ...


class CudaRuntime:
    """``DeviceRuntime`` over ``torch.cuda``."""

    name = "cuda"

    def __init__(self) -> None:
        cuda = torch.cuda
        self._stream_cls, self._event_cls = cuda.Stream, cuda.Event
        self._current_stream, self._stream_ctx = cuda.current_stream, cuda.stream
        self._device_ctx, self._set_device = cuda.device, cuda.set_device
        self._is_capturing, self._cudart = cuda.is_current_stream_capturing, cuda.cudart
        self._initialized = cuda.is_initialized

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def device_of(self, t: torch.Tensor) -> Hashable:
        return t.device

    def current_stream(self, device: Hashable) -> Stream:
        return self._current_stream(device)

    def new_stream(self, device: Hashable) -> Stream:
        return self._stream_cls(device=device)

    def new_event(self) -> Event:
        return self._event_cls(blocking=True)

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._device_ctx(stream.device), self._stream_ctx(stream):
            dst.copy_(src, non_blocking=True)

    def capturing(self) -> bool:
        # Called on every optimizer step, CPU jobs too: before CUDA is initialized nothing can
        # be capturing (and a CPU build cannot ask).
        return self._initialized() and bool(self._is_capturing())

    def use_device(self, device: Hashable) -> None:
        self._set_device(device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_register(self, ptr: int, nbytes: int) -> str | None:
        return self._error(self._cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))

    def host_unregister(self, ptr: int) -> str | None:
        return self._error(self._cudart().cudaHostUnregister(ptr))

    def _error(self, code: Any) -> str | None:
        if int(code) == 0:
            return None
        return f"{self._cudart().cudaGetErrorString(code)} (error {int(code)})"


_lock = threading.Lock()
_active: DeviceRuntime | None = None


def runtime() -> DeviceRuntime:
    """The process's device runtime (made on first use)."""
    global _active
    with _lock:
        if _active is None:
            _active = CudaRuntime()
        return _active
