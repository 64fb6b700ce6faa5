"""Per-chunk crc32c: computed once per snapshot, stored with the manifest, checked on read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import crc32c as _crc32c

from ..errors import ChecksumError
from .manifest import Entry

ALGORITHM = "crc32c"


def compiled() -> Any:
    """The compiled verified copy (``flashckpt/_verified_copy.c``), or None where it was not
    built or this CPU lacks the crc32c instruction."""
    try:
        from .. import _verified_copy
    except ImportError:
        return None
    return _verified_copy if _verified_copy.available() else None


# Its crc32c where this CPU folds (AVX-512 with VPCLMULQDQ: about twice the ``crc32c``
# package's speed), else the package's.
_native = compiled()
_crc = _native.crc32c if _native is not None and _native.kernel() == "fold" else _crc32c.crc32c


def crc(data: memoryview | bytes, value: int = 0) -> int:
    """crc32c of ``data``; the GIL is released, so threads overlap."""
    return _crc(data, value)


class Cancel(Protocol):
    def is_set(self) -> bool: ...


def chunk_checksums(
    data: memoryview,
    entries: Iterable[Entry],
    chunk_size: int,
    cancel: Cancel | None = None,
) -> list[int] | None:
    """Checksums of every chunk of every entry, in manifest order; None if ``cancel`` is set
    between two chunks."""
    out: list[int] = []
    for entry in entries:
        for start, end in entry.chunk_ranges(chunk_size):
            if cancel is not None and cancel.is_set():
                return None
            out.append(crc(data[start:end]))
    return out


def chunk_mismatch(where: str, entry: Entry, i: int, got: int, chunk_size: int,
                   expected: int | None = None) -> ChecksumError:  # fmt: skip
    """The error for chunk ``i`` of ``entry`` reading as ``got`` (``expected``: where the
    entry does not hold its checksums)."""
    start, end = entry.chunk_ranges(chunk_size)[i]
    if expected is None:
        assert entry.checksums is not None
        expected = entry.checksums[i]
    return ChecksumError(
        f"{where}: chunk {i} of {entry.path!r} (bytes {start}-{end}) has crc32c {got:08x}, "
        f"the manifest recorded {expected:08x}; the copy is corrupt, restore "
        "from another tier or an older step"
    )


def bad_chunks(
    data: memoryview, entry: Entry, chunk_size: int, where: str
) -> Iterator[ChecksumError]:
    """One ChecksumError per chunk of ``entry`` whose bytes in ``data`` do not match, in order.

    An entry without checksums yields nothing: only a shared-memory snapshot the sealer has
    not reached yet has none (a tier copy without them is refused when its manifest is read).
    """
    if entry.checksums is None:
        return
    for i, (start, end) in enumerate(entry.chunk_ranges(chunk_size)):
        got = crc(data[start:end])
        if got != entry.checksums[i]:
            yield chunk_mismatch(where, entry, i, got, chunk_size)


def verify_entry(data: memoryview, entry: Entry, chunk_size: int, where: str) -> None:
    """Raise ChecksumError naming the entry and chunk if ``data`` does not match ``entry``."""
    for error in bad_chunks(data, entry, chunk_size, where):
        raise error
