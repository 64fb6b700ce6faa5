"""Background thread that seals published slots with their chunk checksums.

Checksumming a snapshot costs about as much as copying it, so it runs after ``save()`` has
returned. A slot the trainer wants to overwrite is unsealed work thrown away: the writer
cancels it first, which costs at most one chunk. A restore pauses sealing while it runs (a
restore right after a save would otherwise share the cores and memory with it), and sealing
carries on where it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator

from ..format.checksum import chunk_checksums
from ..format.manifest import Manifest
from ..format.slot import Slot

log = logging.getLogger(__name__)

_cpu_lock = threading.Lock()
_cpu_s = 0.0


def cpu_seconds() -> float:
    """CPU time every sealer of this process has spent checksumming so far: off the training
    thread, on a core of its own, and part of the process's CPU time."""
    with _cpu_lock:
        return _cpu_s


class Sealer:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Slot, int, Manifest] | None] = queue.Queue()
        self._busy_lock = threading.Lock()
        self._busy: Slot | None = None
        self._blocked: Slot | None = None  # the slot the writer owns right now
        self._cancel = threading.Event()
        self._running = threading.Event()  # cleared while a restore runs
        self._running.set()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="flashckpt-sealer", daemon=True)
        self._thread.start()

    def submit(self, slot: Slot, seq: int, manifest: Manifest) -> None:
        self._idle.clear()
        self._queue.put((slot, seq, manifest))

    def cancel(self, slot: Slot) -> None:
        """Stop (or skip) sealing ``slot`` until ``release``; returns once it is untouched."""
        with self._busy_lock:
            self._blocked = slot
            if self._busy is slot:
                self._cancel.set()
        while True:
            with self._busy_lock:
                if self._busy is not slot:
                    return
            self._idle.wait(0.001)

    def release(self) -> None:
        with self._busy_lock:
            self._blocked = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold sealing between chunks for the block."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def is_set(self) -> bool:
        """Whether to give up the slot being sealed, checked between chunks; while paused,
        it waits here (a cancel still ends the wait)."""
        while not self._running.wait(0.05):
            if self._cancel.is_set():
                return True
        return self._cancel.is_set()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted slot is sealed (or skipped)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            if self._queue.empty():
                self._idle.set()
            item = self._queue.get()
            if item is None:
                self._idle.set()
                return
            slot, seq, manifest = item
            with self._busy_lock:
                try:
                    stale = slot is self._blocked or slot.seq() != seq  # overwritten meanwhile
                except ValueError:  # unmapped meanwhile (closed, or mapped anew larger)
                    stale = True
                if stale:
                    continue
                self._busy = slot
                self._cancel.clear()
            began = time.thread_time()
            try:
                h = slot.header()
                sums = chunk_checksums(slot.data(h), manifest.entries, manifest.chunk_size, self)
                with self._busy_lock:
                    if sums is not None and slot is not self._blocked and slot.seq() == seq:
                        slot.write_checksums(sums)
            except Exception:  # sealing is best effort: an unsealed slot is still a snapshot
                log.exception("sealing %s failed", slot.path)
            finally:
                with self._busy_lock:
                    self._busy = None
                _spent(time.thread_time() - began)


def _spent(seconds: float) -> None:
    global _cpu_s
    with _cpu_lock:
        _cpu_s += seconds
