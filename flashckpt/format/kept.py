"""The last few results of a check that passed, by what the check read.

A restore reads the same manifest bytes several times (each slot's when the snapshots are
listed and again when one is loaded), and the saves of one layout write the same entries and
often the same tree: at thousands of tensors, checking them again costs more than copying.
What passed for some bytes holds for the same bytes; a failure is never kept.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class Kept(Generic[V]):
    """At most ``size`` results, the least recently used dropped first; thread-safe.

    Found by equality, not by hash: the keys are megabytes of bytes read anew each time, and
    comparing them with a few held keys (lengths first, then memcmp) costs a fraction of
    hashing them."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._held: list[tuple[Any, V]] = []  # least recently used first
        self._lock = threading.Lock()

    def get(self, key: Any) -> V | None:
        with self._lock:
            for i in range(len(self._held) - 1, -1, -1):
                held, value = self._held[i]
                if held is key or held == key:
                    self._held.append(self._held.pop(i))
                    return value
            return None

    def put(self, key: Any, value: V) -> None:
        with self._lock:
            self._held = [kv for kv in self._held if not (kv[0] is key or kv[0] == key)]
            self._held.append((key, value))
            del self._held[: -self._size]
