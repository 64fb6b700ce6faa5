"""The last few results of a check that passed, by what the check read.

A restore reads the same manifest bytes several times (each slot's when the snapshots are
listed and again when one is loaded), and the saves of one layout write the same entries and
often the same tree: at thousands of tensors, checking them again costs more than copying.
What passed for some bytes holds for the same bytes; a failure is never kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Kept(Generic[V]):
    """At most ``size`` results, the least recently used dropped first; thread-safe."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._held: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            found = self._held.get(key)
            if found is not None:
                self._held.move_to_end(key)
            return found

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._held[key] = value
            self._held.move_to_end(key)
            while len(self._held) > self._size:
                self._held.popitem(last=False)
