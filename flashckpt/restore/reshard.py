"""Restore DTensor shards saved at another world size or mesh (resharding).

Every DTensor entry of a manifest records where its local shard sits in the global tensor
(``ShardInfo``: global shape and offset). A rank restoring into a DTensor laid out another way
asks for its new local block; the block is assembled from every old rank's shard that
overlaps it. Only the bytes needed are read from the tier: along the first dimension a shard's
rows are contiguous, so each overlap is one ranged read, widened to whole checksum chunks so
every byte read is verified before it is used.

The old shards come from this node's shared memory when it holds the step of every rank
that saved it (a single-node job restarted at another size after a crash), else from a tier
that holds them all (a shared tier, or a node-local one on a single node). Plain tensors, and
everything else of the state, come from one old rank's copy (the rank's own when it had one).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..errors import CheckpointNotFoundError, ManifestError
from ..format import layout, tier_io
from ..format.checksum import verify_entry
from ..format.manifest import Entry, Manifest, ShardInfo, dtype_from_name


@dataclass(frozen=True)
class Want:
    """A rank's new local block of one DTensor."""

    path: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def portable(manifest: Manifest, world: int) -> bool:
    """Whether a rank that did not save this step may restore from ``manifest`` (of a job of
    ``world`` ranks): its tensors are replicas of every rank, or DTensor shards that any
    layout can be rebuilt from."""
    whole = manifest.replicas == (0, world, 1)
    return any(e.shard is not None or (e.replicated and whole) for e in manifest.entries)


def per_rank(manifest: Manifest) -> list[str]:
    """The tensors of ``manifest`` that are neither replicas nor shards: the saving rank's own."""
    return [e.path for e in manifest.entries if e.shard is None and not e.replicated]


class Resharder:
    """Collects the new blocks a restore needs, then reads them from a tier's old shards."""

    def __init__(self) -> None:
        self.wants: dict[str, Want] = {}
        self.blocks: dict[str, torch.Tensor] = {}

    def want(self, path: str, saved: Entry, target: ShardInfo, shape: tuple[int, ...]) -> str:
        """Ask for ``target``'s block of the tensor saved as ``saved``; what does not match."""
        assert saved.shard is not None
        if tuple(saved.shard.global_shape) != tuple(target.global_shape):
            return (f"global shape {list(saved.shard.global_shape)} in snapshot, "
                    f"{list(target.global_shape)} in state")  # fmt: skip
        self.wants[path] = Want(path, saved.dtype, target.global_shape, target.global_offset, shape)
        return ""

    def want_block(self, path: str, dtype: str, target: ShardInfo, shape: tuple[int, ...]) -> None:
        """Ask for ``target``'s block of a tensor this rank's snapshot does not hold (the old
        ranks that do are found when fetching)."""
        self.wants[path] = Want(path, dtype, target.global_shape, target.global_offset, shape)

    def block(self, path: str) -> torch.Tensor:
        return self.blocks[path]

    async def fetch(self, tier, job: str, step: int, generation: int, world: int,
                    incarnation: int | None = None) -> None:  # fmt: skip
        """Read every wanted block from the ``world`` old ranks' shards of ``step`` in a tier
        (written by run ``incarnation`` of the job, where given)."""
        await self.fetch_from(TierShards(tier, job, step, generation, incarnation), world)

    async def fetch_from(self, shards: Shards, world: int) -> None:
        manifests = await asyncio.gather(*(shards.manifest(r) for r in range(world)))
        by_path = [{e.path: e for e in m.entries} for m in manifests]
        for want in self.wants.values():
            self.blocks[want.path] = await self._assemble(shards, want, manifests, by_path)

    async def _assemble(self, shards: Shards, want: Want, manifests, by_path) -> torch.Tensor:
        covered = _covered(want, by_path)
        if covered != math.prod(want.shape):
            raise ManifestError(
                f"{shards.name}: the shards of {want.path!r} saved at step {manifests[0].step} cover "
                f"{covered} of the {math.prod(want.shape)} elements of the block at "
                f"{list(want.offset)} this rank needs; restore at the world size that saved it"
            )
        # Sized only once the shards, whose bytes exist, are known to cover it.
        dtype = dtype_from_name(want.dtype)
        try:
            out = torch.empty(want.shape, dtype=dtype)
        except (MemoryError, RuntimeError) as exc:
            raise ManifestError(f"{shards.name}: the block of {want.path!r} cannot be allocated "
                                f"({exc}); restore from another tier or an older step") from None  # fmt: skip
        seen = set()
        for m, entries in zip(manifests, by_path, strict=True):
            e = entries.get(want.path)
            if not _usable(e, want):
                continue
            box = (tuple(e.shard.global_offset), tuple(e.shape))
            if box in seen:  # a replica of a shard already used
                continue
            seen.add(box)
            if (overlap := _overlap(e, want)) is None:
                continue
            lo, hi = overlap
            rows = await _rows(shards, m, e, lo, hi)
            old = e.shard.global_offset
            src = rows[(slice(None), *(slice(a - o, b - o) for a, b, o in
                                      zip(lo[1:], hi[1:], old[1:], strict=True)))]  # fmt: skip
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, want.offset, strict=True))
            out[dst] = src
        return out


class Shards(Protocol):
    """Where the old ranks' shards of one step are read from."""

    name: str

    async def manifest(self, rank: int) -> Manifest: ...

    async def read(self, m: Manifest, e: Entry, start: int, n: int) -> bytearray:
        """``n`` bytes of ``e``'s data from byte ``start`` of the entry."""
        ...


def _overlap(e: Entry, want: Want) -> tuple[list[int], list[int]] | None:
    """The box (low and high corners, global coordinates) where shard ``e`` overlaps ``want``'s
    block, or None."""
    assert e.shard is not None
    lo = [max(a, b) for a, b in zip(e.shard.global_offset, want.offset, strict=True)]
    hi = [
        min(a + n, b + k)
        for a, n, b, k in zip(e.shard.global_offset, e.shape, want.offset, want.shape, strict=True)
    ]
    return None if any(h <= low for low, h in zip(lo, hi, strict=True)) else (lo, hi)


def _usable(e: Entry | None, want: Want) -> bool:
    """Whether ``e`` is a shard of ``want``'s tensor whose bytes its rank stores (a replica
    stored once is read from the rank that stores it, whose entry is another of these)."""
    return (
        e is not None and e.shard is not None and tuple(e.shard.global_shape) == want.global_shape
        and e.dtype == want.dtype and e.stored_at is None
    )  # fmt: skip


def _covered(want: Want, by_path) -> int:
    """How many elements of ``want``'s block the distinct shards of ``by_path`` cover."""
    covered, seen = 0, set()
    for entries in by_path:
        e = entries.get(want.path)
        if not _usable(e, want):
            continue
        box = (tuple(e.shard.global_offset), tuple(e.shape))
        if box in seen:
            continue
        seen.add(box)
        if (overlap := _overlap(e, want)) is not None:
            covered += math.prod(b - a for a, b in zip(*overlap, strict=True))
    return covered


class TierShards:
    """The old ranks' shards of one step in a tier: manifests and ranged reads."""

    def __init__(self, tier, job: str, step: int, generation: int, incarnation: int | None = None):
        self.tier, self.job, self.step, self.generation = tier, job, step, generation
        self.incarnation = incarnation
        self.name = tier.spec.url

    async def manifest(self, rank: int) -> Manifest:
        m = await tier_io.read_manifest(self.tier, self.job, self.step, rank, self.generation,
                                        self.incarnation)  # fmt: skip
        await tier_io.check_data_size(self.tier, m)  # its shards lie in bytes that exist
        return m

    async def read(self, m: Manifest, e: Entry, start: int, n: int) -> bytearray:
        key = layout.data_key(m.job, m.step, m.rank, m.generation)
        raw = bytearray(n)
        await tier_io.get_range(self.tier, key, memoryview(raw), e.offset + start,
                                f"{self.name}: {e.path!r} of rank {m.rank}")  # fmt: skip
        return raw


class MemoryShards:
    """The old ranks' snapshots of one step in this node's shared memory, read while the
    caller holds their shared locks (``{rank: Snapshot}``)."""

    def __init__(self, snaps: dict):
        self.snaps = snaps
        self.name = "shared memory"

    async def manifest(self, rank: int) -> Manifest:
        if rank not in self.snaps:
            raise CheckpointNotFoundError(f"shared memory holds no snapshot of rank {rank}")
        return self.snaps[rank].manifest

    async def read(self, m: Manifest, e: Entry, start: int, n: int) -> bytearray:
        snap = self.snaps[m.rank]
        return bytearray(snap.slot.data(snap.header)[e.offset + start : e.offset + start + n])


async def _rows(
    shards: Shards, m: Manifest, e: Entry, lo: list[int], hi: list[int]
) -> torch.Tensor:
    """Rows ``lo[0]:hi[0]`` (global) of the saved shard ``e`` of rank ``m.rank``, verified."""
    if e.stored_at is not None:
        raise ManifestError(f"{shards.name}: {e.path!r} of rank {m.rank} is a shard stored as "
                            "a replica; the copy is corrupt")  # fmt: skip
    cs = m.chunk_size
    itemsize = dtype_from_name(e.dtype).itemsize
    if e.shape:
        row = math.prod(e.shape[1:]) * itemsize
        first, last = lo[0] - e.shard.global_offset[0], hi[0] - e.shard.global_offset[0]
    else:
        row, first, last = itemsize, 0, 1
    start, end = first * row, last * row
    c0, c1 = start // cs, -(-end // cs)
    span = min(c1 * cs, e.nbytes) - c0 * cs
    raw = await shards.read(m, e, c0 * cs, span) if span else bytearray()
    part = replace(e, offset=0, nbytes=span, checksums=(e.checksums or ())[c0:c1] or None)
    verify_entry(memoryview(raw), part, cs, f"{shards.name} rank {m.rank}")
    data = torch.frombuffer(raw, dtype=torch.uint8) if span else torch.empty(0, dtype=torch.uint8)
    picked = data[start - c0 * cs : end - c0 * cs].view(dtype_from_name(e.dtype))
    return picked.view(last - first, *e.shape[1:]) if e.shape else picked.view(())
