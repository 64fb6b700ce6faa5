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

import contextlib
import ctypes
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device of the process
CAPTURE_WAIT_S = 10.0  # how long a registration waits for a graph capture to end


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

    def copy_many(self, stream: Stream, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Queue every ``dsts[i].copy_(srcs[i])`` on ``stream``, in one call. Sources are
        plain (no lazy conjugate or negative bit: ``device_copy`` resolves those)."""
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
        """Page-lock ``nbytes`` at ``ptr`` for every device; None, or the runtime's error
        (then cleared: the calling thread's next runtime call does not see it). Never while a
        graph is captured in global mode anywhere in the process: it waits for the capture
        to end, and a capture beginning meanwhile waits for it (``CaptureGate``)."""
        ...

    def host_unregister(self, ptr: int) -> str | None: ...


class CaptureGate:
    """Page-locking and global-mode graph captures, never at once in one process.

    ``cudaHostRegister`` on any thread while a graph is captured in global mode (the default
    of ``torch.cuda.graph``) fails with error 900 and can invalidate the capture. Warm-up
    captures run right after a restore, which is when the slots are page-locked in the
    background, so the two are kept apart: a registration waits for running captures to end,
    and a capture that begins during a registration waits for it (seconds at most, for a
    slot of many GiB). Captures in thread-local or relaxed mode allow other threads'
    registrations and are not held."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._captures = 0
        self._registering = False

    def capture_begins(self, mode: str) -> bool:
        """Called as a capture begins; whether it was counted (call ``capture_ends``)."""
        if mode != "global":
            return False
        with self._cond:
            self._cond.wait_for(lambda: not self._registering)
            self._captures += 1
        return True

    def capture_ends(self) -> None:
        with self._cond:
            self._captures = max(0, self._captures - 1)
            self._cond.notify_all()

    @property
    def capturing(self) -> bool:
        with self._cond:
            return self._captures > 0

    @contextlib.contextmanager
    def registering(self, timeout: float = CAPTURE_WAIT_S) -> Iterator[None]:
        """Hold captures off for the block, once none runs; TimeoutError if one still runs
        after ``timeout`` (the registration is then tried again later: a capture that never
        ends, or one whose thread waits on this one, must not hang either)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._captures == 0 and not self._registering, timeout
            ):
                raise TimeoutError("a CUDA graph is being captured (global mode)")
            self._registering = True
        try:
            yield
        finally:
            with self._cond:
                self._registering = False
                self._cond.notify_all()


def gate_captures(graph_cls: Any, gate: CaptureGate) -> None:
    """Route ``graph_cls``'s ``capture_begin``/``capture_end`` (torch's ``CUDAGraph``, which
    ``torch.cuda.graph`` and ``make_graphed_callables`` use) through ``gate``, once."""
    if getattr(graph_cls, "_flashckpt_gate", None) is not None:
        return
    begin, end = graph_cls.capture_begin, graph_cls.capture_end

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
        counted = gate.capture_begins(mode)
        try:
            out = begin(self, *args, **kwargs)
        except BaseException:
            if counted:
                gate.capture_ends()
            raise
        self._flashckpt_counted = counted
        return out

    def capture_end(self: Any) -> Any:
        try:
            return end(self)
        finally:
            if getattr(self, "_flashckpt_counted", False):
                self._flashckpt_counted = False
                gate.capture_ends()

    graph_cls.capture_begin, graph_cls.capture_end = capture_begin, capture_end
    graph_cls._flashckpt_gate = gate


def _last_error_clearer() -> Callable[[], Any] | None:
    """``cudaGetLastError`` of the CUDA runtime library torch loaded (None when it is linked
    in statically: nothing outside torch can reach its state then)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None


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
        self._foreach_copy = torch._foreach_copy_
        self.gate = CaptureGate()
        gate_captures(cuda.graphs.CUDAGraph, self.gate)
        self._clear: Callable[[], Any] | None | bool = False  # looked up at the first error

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

    def copy_many(self, stream: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        with self._device_ctx(stream.device), self._stream_ctx(stream), torch.no_grad():
            self._foreach_copy(dsts, srcs, non_blocking=True)

    def capturing(self) -> bool:
        # Called on every optimizer step, CPU jobs too: before CUDA is initialized nothing can
        # be capturing (and a CPU build cannot ask).
        return self._initialized() and bool(self._is_capturing())

    def use_device(self, device: Hashable) -> None:
        self._set_device(device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_register(self, ptr: int, nbytes: int) -> str | None:
        try:
            with self.gate.registering():
                code = self._cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE)
        except TimeoutError as exc:
            return f"{exc}; not page-locked during it"
        error = self._error(code)
        if error is not None:
            self._clear_last_error()
        return error

    def host_unregister(self, ptr: int) -> str | None:
        error = self._error(self._cudart().cudaHostUnregister(ptr))
        if error is not None:
            self._clear_last_error()
        return error

    def _clear_last_error(self) -> None:
        if self._clear is False:
            self._clear = _last_error_clearer()
        if callable(self._clear):
            self._clear()

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
