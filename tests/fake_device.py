"""A simulated device, so the CPU test suite runs every line of the device path it can.

It stands in for the CUDA runtime calls only (``flashckpt.snapshot.device.DeviceRuntime``): every
copy, fence, registration and bookkeeping step above it is flashckpt's own code. Device
tensors are host tensors it claims. A side stream is a worker thread that runs what is queued
on it in order, so copies really are in flight while the caller goes on. The caller's stream
is the caller's own thread: its "device work" (a forward, an optimizer step) runs as it is
issued, so making it wait for an event blocks the caller until the event fires, which is
what the GPU does to the kernels queued after such a wait.

Tests hold a side stream (``hold(after_events=n)``) to keep copies in flight, fail a copy on
it (``fail_next_copy``), pretend a graph is being captured (``capture``), refuse
registrations (``refuse``), and read what happened on which thread and device.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Hashable

import torch

from flashckpt.snapshot import device as device_module
from flashckpt.snapshot.step_fence import storage_key

TIMEOUT = 60.0  # no wait in a test lasts longer: a lost release fails instead of hanging


class FakeEvent:
    def __init__(self, waits: list | None = None, device_of_thread=lambda: None) -> None:
        self._waits, self._device_of_thread = waits, device_of_thread
        self.recorded = False
        self.error: str | None = None
        self._fired = threading.Event()

    def record(self, stream) -> None:
        stream.record(self)

    def fire(self, error: str | None = None) -> None:
        self.error = error
        self._fired.set()

    def synchronize(self) -> None:
        if self._waits is not None:  # which thread waited, with which device current
            self._waits.append((threading.current_thread().name, self._device_of_thread()))
        if self.recorded:  # like CUDA: an event never recorded is complete
            assert self._fired.wait(TIMEOUT), "a fake device event never fired"
            if self.error:
                raise RuntimeError(f"fake device: {self.error}")

    def query(self) -> bool:
        return not self.recorded or self._fired.is_set()


class HostStream:
    """The caller's current stream: its work runs on the caller's thread as it is issued."""

    def __init__(self, device: Hashable) -> None:
        self.device = device
        self.waits = 0  # how often the caller was made to wait for another stream's event

    def record(self, ev: FakeEvent) -> None:
        ev.recorded = True
        ev.fire()

    def wait_stream(self, other) -> None:
        ev = FakeEvent()
        other.record(ev)
        self.wait_event(ev)

    def wait_event(self, ev: FakeEvent) -> None:
        self.waits += 1
        if ev.recorded:
            assert ev._fired.wait(TIMEOUT), "the caller waited for an event that never fired"


class SideStream:
    """A stream of the device: a thread running what is queued, in order."""

    def __init__(self, device: Hashable) -> None:
        self.device = device
        self.copies: list[tuple[int, str]] = []  # (bytes, thread) of each copy run
        self.error: str | None = None
        self.fail_next_copy = False
        self._events_fired = 0
        self._hold_after: int | None = None
        self._released = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"fake-{device}", daemon=True)
        self._thread.start()

    def hold(self, after_events: int = 0) -> None:
        """Stop running queued work once ``after_events`` more events have fired."""
        self._released.clear()
        self._hold_after = self._events_fired + after_events

    def release(self) -> None:
        self._hold_after = None
        self._released.set()

    def record(self, ev: FakeEvent) -> None:
        ev.recorded = True
        self._queue.put(("event", ev))

    def wait_stream(self, other) -> None:
        ev = FakeEvent()
        other.record(ev)
        self.wait_event(ev)

    def wait_event(self, ev: FakeEvent) -> None:
        self._queue.put(("wait", ev))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._queue.put(("copy", [dst], [src]))

    def copy_many(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self._queue.put(("copy", list(dsts), list(srcs)))

    def stop(self) -> None:
        self.release()
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._hold_after is not None and self._events_fired >= self._hold_after:
                self._released.wait(TIMEOUT)
            kind = item[0]
            if kind == "event":
                self._events_fired += 1
                item[1].fire(self.error)
            elif kind == "wait":
                if item[1].recorded:
                    item[1]._fired.wait(TIMEOUT)
            elif self.error is None:
                if self.fail_next_copy:
                    self.fail_next_copy = False
                    self.error = "an illegal memory access was encountered (simulated)"
                    continue
                with torch.no_grad():
                    torch._foreach_copy_(item[1], item[2])
                name = threading.current_thread().name
                self.copies += [(t.numel() * t.element_size(), name) for t in item[2]]


class FakeDevice:
    """``DeviceRuntime`` over simulated devices ``fake:0``, ``fake:1``..."""

    name = "fake"

    def __init__(self) -> None:
        self.capture = False  # pretend the current stream is capturing a graph
        self.refuse: str | None = None  # the error every registration gets
        self.registered: list[tuple[str, Hashable, int, int]] = []  # thread, device, ptr, bytes
        self.unregistered: list[tuple[str, int]] = []  # thread, ptr
        self.pinned_buffers = 0
        self.copy_calls = 0  # copy_many() calls: one per device and fence side of a snapshot
        self.gate = device_module.CaptureGate()  # begin_capture()/end_capture() drive it
        self.during_capture = 0  # registrations that ran while a capture was counted
        self.capture_wait_s = device_module.CAPTURE_WAIT_S
        self.waits: list[tuple[str, Hashable | None]] = []  # synchronize(): thread, device
        self.side: list[SideStream] = []
        self._host: dict[Hashable, HostStream] = {}
        self._placed: dict[int, str] = {}  # storage -> device, for tensors not on fake:0
        self._thread_device = threading.local()

    # ---- what tests arrange ----------------------------------------------------------
    def place(self, t: torch.Tensor, index: int) -> torch.Tensor:
        self._placed[storage_key(t)] = f"fake:{index}"
        return t

    def begin_capture(self, mode: str = "global") -> bool:
        """What torch's ``CUDAGraph.capture_begin`` does once gated (see ``CaptureGate``)."""
        return self.gate.capture_begins(mode)

    def end_capture(self) -> None:
        self.gate.capture_ends()

    def side_stream(self, dev: str = "fake:0") -> SideStream:
        return next(s for s in self.side if s.device == dev)

    def host_stream(self, dev: str = "fake:0") -> HostStream:
        return self.current_stream(dev)

    def stop(self) -> None:
        for s in self.side:
            s.stop()

    # ---- DeviceRuntime ---------------------------------------------------------------
    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def device_of(self, t: torch.Tensor) -> Hashable:
        return self._placed.get(storage_key(t), "fake:0")

    def current_stream(self, device: Hashable) -> HostStream:
        return self._host.setdefault(device, HostStream(device))

    def new_stream(self, device: Hashable) -> SideStream:
        stream = SideStream(device)
        self.side.append(stream)
        return stream

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.waits, self.current_device)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream.copy(dst, src)

    def copy_many(self, stream, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """One queued item, as one call queues every copy on a GPU."""
        self.copy_calls += 1
        assert not any(s.is_conj() or s.is_neg() for s in srcs), "a lazy bit reached the copy"
        stream.copy_many(dsts, srcs)

    def capturing(self) -> bool:
        return self.capture

    def use_device(self, device: Hashable) -> None:
        self._thread_device.value = device

    def current_device(self) -> Hashable | None:
        return getattr(self._thread_device, "value", None)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.pinned_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_register(self, ptr: int, nbytes: int) -> str | None:
        try:
            with self.gate.registering(self.capture_wait_s):
                name = threading.current_thread().name
                self.registered.append((name, self.current_device(), ptr, nbytes))
                self.during_capture += self.gate.capturing
                return self.refuse
        except TimeoutError as exc:
            return f"{exc}; not page-locked during it"

    def host_unregister(self, ptr: int) -> str | None:
        self.unregistered.append((threading.current_thread().name, ptr))
        return None


@contextlib.contextmanager
def installed() -> FakeDevice:
    """Make a FakeDevice the process's device runtime for the block."""
    fake = FakeDevice()
    before = device_module._active
    device_module._active = fake
    try:
        yield fake
    finally:
        device_module._active = before
        fake.stop()
