"""A sealed manifest's entries: the layout's entries and one flat list of chunk checksums.

A snapshot in shared memory is sealed after it is published: its chunk checksums sit beside
the manifest, which lists its entries without them. A restore attaches them, and a state of
thousands of tensors then makes thousands of entry copies for every step it reads, although
the entries themselves are the same for every save of a layout (and parsed once). So the
sealed entries are kept as the two parts: the steady restore reads the parts
(``bare_entries``, ``chunk_sums``) and copies nothing per entry, and anything else that reads
them as a sequence of entries gets entries with their checksums, made once, on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from .manifest import Entry


class SealedEntries(Sequence["Entry"]):
    """``bare`` (entries without checksums) with the flat per-chunk ``sums`` (entry order)
    attached, as a sequence of entries. ``len(sums)`` is the entries' chunk count."""

    __slots__ = ("bare", "sums", "chunk_size", "_whole")

    def __init__(self, bare: tuple[Entry, ...], sums: tuple[int, ...], chunk_size: int):
        self.bare, self.sums, self.chunk_size = bare, sums, chunk_size
        self._whole: tuple[Entry, ...] | None = None

    def whole(self) -> tuple[Entry, ...]:
        """Every entry with its checksums, made on the first call."""
        if self._whole is None:
            bare, flat, cs = self.bare, self.sums, self.chunk_size
            if len(flat) == len(bare) and all(0 < e.nbytes <= cs for e in bare):
                # One chunk each (the usual state of many small tensors): in entry order.
                self._whole = tuple(e.but(checksums=(c,)) for e, c in zip(bare, flat, strict=True))
            else:
                self._whole = tuple(
                    e.but(checksums=tuple(flat[e.first_chunk : e.first_chunk - (-e.nbytes // cs)]))
                    for e in bare
                )
        return self._whole

    def __len__(self) -> int:
        return len(self.bare)

    @overload
    def __getitem__(self, i: int) -> Entry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Entry, ...]: ...
    def __getitem__(self, i: Any) -> Any:
        return self.whole()[i]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.whole())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SealedEntries):
            return self.bare == other.bare and self.sums == other.sums
        if isinstance(other, tuple):
            return self.whole() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.whole())

    def __repr__(self) -> str:
        return f"SealedEntries({len(self.bare)} entries, {len(self.sums)} chunk checksums)"


def bare_entries(entries: Sequence[Entry]) -> Sequence[Entry]:
    """The entries without making any: for what reads no checksum (paths, shapes, shards)."""
    return entries.bare if isinstance(entries, SealedEntries) else entries


def one_per_entry(entries: Sequence[Entry]) -> tuple[int, ...] | None:
    """The sealed checksums where there are as many as entries, else None (read each
    entry's ``checksums``). They are the entries' own, in order, only where every entry is
    one chunk (``0 < nbytes <= chunk_size``), which the caller checks."""
    if isinstance(entries, SealedEntries) and len(entries.sums) == len(entries.bare):
        return entries.sums
    return None
