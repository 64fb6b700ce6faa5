"""A restore's chunks as rows: where each comes from, where it goes, how many bytes and which
crc32c it must have, one column per field (``HostChunks``), so that thousands of one-chunk
entries are queued in a few C-level passes and handed to the compiled verified copy as arrays.
A layout's offsets and sizes are planned once (``HostPlan``), and so is their order by offset
with the check that no two overlap (``in_order``)."""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np
import torch

from ..format.checksum import chunk_mismatch
from ..format.kept import Kept
from ..format.manifest import Entry
from ..format.sealed import bare_entries, one_per_entry

UNCHECKED = -1  # the crc32c expected of a chunk that is not checked
_NBYTES = operator.attrgetter("nbytes")
_OFFSET = operator.attrgetter("offset")
_CHECKSUMS = operator.attrgetter("checksums")
_FIRST = operator.itemgetter(0)


class HostPlan:
    """What a restore into host tensors needs of a layout's entries when every one is a
    single chunk: their offsets and sizes, checked against the data region once. A state
    restored again (a rollback, a restore after each fault) finds its layout's plan made."""

    _kept: Kept[HostPlan] = Kept(4, identity=True)  # by (entries, chunk size, data length)

    def __init__(self, entries: Any, cs: int, data_len: int, frm: list[int], size: list[int]):
        self.entries, self.key = entries, (cs, data_len)
        self.frm, self.size = frm, size
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._in_order: tuple[np.ndarray, int | None] | None = None

    def in_order(self) -> tuple[np.ndarray, int | None]:
        """``in_order`` of the plan's chunks, found once."""
        if self._in_order is None:
            self._in_order = in_order(*self.arrays)
        return self._in_order

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``frm`` and ``size`` as int64 arrays, made on first use."""
        if self._arrays is None:
            self._arrays = (np.array(self.frm, dtype=np.int64), np.array(self.size, dtype=np.int64))
        return self._arrays

    @classmethod
    def of(cls, entries: Any, cs: int, data_len: int) -> HostPlan | None:
        """The plan of ``entries`` (a layout's, kept while it is used: the same object), or
        None where an entry is not one chunk within ``data_len``."""
        found = cls._kept.get((entries, cs, data_len))
        if found is not None:
            return found
        size, frm = list(map(_NBYTES, entries)), list(map(_OFFSET, entries))
        if not size or min(size) <= 0 or max(size) > cs or min(frm) < 0:
            return None
        if max(map(operator.add, frm, size)) > data_len:
            return None
        plan = cls(entries, cs, data_len, frm, size)
        if len(size) >= 64:  # a layout's (one entry at a time, as node by node, is not kept)
            cls._kept.put((entries, cs, data_len), plan)
        return plan


class HostChunks:
    """Chunks queued for host targets, one column per field (the usual state's thousands of
    one-chunk entries are queued in a few C-level passes, and copied without a tuple each)."""

    def __init__(self) -> None:
        self.entry: list[Entry] = []  # whose chunk: entry, chunk size, index in the entry
        self.cs: list[int] = []
        self.index: list[int] = []
        self.to: list[int] = []  # target address
        self.frm: list[int] = []  # offset in the source's data
        self.size: list[int] = []
        self.want: list[int] = []  # crc32c expected; UNCHECKED: not checked
        self.targets: list[torch.Tensor] = []  # held until copied: ``to`` is their memory
        self.plan: HostPlan | None = None  # where every column but to and want is a plan's

    def add(self, dst: torch.Tensor, e: Entry, cs: int, sums: tuple[int, ...] | None) -> None:
        self.targets.append(dst)
        ptr = dst.data_ptr()
        for i, lo in enumerate(range(0, e.nbytes, cs)):
            self.entry.append(e)
            self.cs.append(cs)
            self.index.append(i)
            self.to.append(ptr + lo)
            self.frm.append(e.offset + lo)
            self.size.append(min(cs, e.nbytes - lo))
            self.want.append(UNCHECKED if sums is None else sums[i])

    def add_small(self, dsts: list[torch.Tensor], entries: tuple[Entry, ...] | list[Entry],
                  cs: int, data_len: int, verify: bool) -> bool:  # fmt: skip
        """``add`` in C-level passes for the usual case: every entry one chunk, within
        ``data_len``, with its checksum (or unverified); False (nothing added) otherwise."""
        plan = HostPlan.of(bare_entries(entries), cs, data_len)
        if plan is None:
            return False
        n = len(plan.size)
        if verify:
            flat = one_per_entry(entries)  # every entry is one chunk: they are its own
            if flat is not None:
                self.want.extend(flat)
            else:
                sums = list(map(_CHECKSUMS, entries))
                if None in sums or set(map(len, sums)) != {1}:
                    return False
                self.want.extend(map(_FIRST, sums))
        else:
            self.want.extend(itertools.repeat(UNCHECKED, n))
        self.plan = plan if not self.size else None  # the columns are the plan's alone
        self.entry.extend(plan.entries)
        self.cs.extend(itertools.repeat(cs, n))
        self.index.extend(itertools.repeat(0, n))
        self.targets.extend(dsts)
        self.to.extend(map(torch.Tensor.data_ptr, dsts))
        self.frm.extend(plan.frm)
        self.size.extend(plan.size)
        return True

    def arrays(self) -> list[np.ndarray]:
        """The columns to, frm, size and want as int64 arrays (a plan's own where it can)."""
        if self.plan is not None and len(self.size) == len(self.plan.size):
            frm, size = self.plan.arrays
        else:
            frm, size = np.array(self.frm, dtype=np.int64), np.array(self.size, dtype=np.int64)
        return [np.array(self.to, dtype=np.int64), frm, size, np.array(self.want, dtype=np.int64)]

    def in_order(self) -> tuple[np.ndarray, int | None]:
        """``in_order`` of the chunks (a plan's, found once for its layout)."""
        if self.plan is not None and len(self.size) == len(self.plan.size):
            return self.plan.in_order()
        return in_order(np.array(self.frm, dtype=np.int64), np.array(self.size, dtype=np.int64))

    def rows(self, first: int, last: int, to: list[int]) -> HostChunks:
        """Rows [first, last) as chunks of their own, bound for addresses ``to``."""
        part = HostChunks()
        part.entry, part.cs = self.entry[first:last], self.cs[first:last]
        part.index, part.frm = self.index[first:last], self.frm[first:last]
        part.size, part.want = self.size[first:last], self.want[first:last]
        part.to = to
        return part

    def mismatch(self, where: str, j: int, found: int) -> Exception:
        """The error for chunk ``j`` reading as ``found``."""
        return chunk_mismatch(where, self.entry[j], self.index[j], found, self.cs[j], self.want[j])


def in_order(frm: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, int | None]:
    """The rows by offset, and the offset of the first that overlaps the one before it in
    that order (None: none does; then no two overlap)."""
    order = np.argsort(frm, kind="stable")
    start, end = frm[order], (frm + size)[order]
    bad = np.flatnonzero(start[1:] < end[:-1])
    return order, (int(start[bad[0] + 1]) if bad.size else None)
