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
    hashing them. With ``identity``, a key is found only as the same object, or a tuple of
    the same objects and equal numbers (a layout's results, kept while its objects live)."""

    def __init__(self, size: int, identity: bool = False) -> None:
        self._size = size
        self._same = _same_objects if identity else _equal
        self._held: list[tuple[Any, V]] = []  # least recently used first
        self._lock = threading.Lock()

    def get(self, key: Any) -> V | None:
        with self._lock:
            for i in range(len(self._held) - 1, -1, -1):
                held, value = self._held[i]
                if self._same(held, key):
                    self._held.append(self._held.pop(i))
                    return value
            return None

    def put(self, key: Any, value: V) -> None:
        with self._lock:
            self._held = [kv for kv in self._held if not self._same(kv[0], key)]
            self._held.append((key, value))
            del self._held[: -self._size]


def _equal(a: Any, b: Any) -> bool:
    return a is b or a == b


_VALUES = (int, float, str, bool)  # compared by value: equal numbers are not one object


def _same_objects(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (type(a) is tuple and type(b) is tuple and len(a) == len(b)
            and all(x is y or (type(x) in _VALUES and type(y) is type(x) and x == y)
                    for x, y in zip(a, b, strict=True)))  # fmt: skip
