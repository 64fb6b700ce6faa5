"""Snapshots in a storage tier: write a rank's shard, commit a step, find and read them back.

The agent writes with these; ``Checkpointer.restore`` and the CLI read with them, so the
layout (``layout.py``) and the commit rule live in one place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import layout
from .errors import ManifestError
from .manifest import Manifest

log = logging.getLogger(__name__)

WRITE_CHUNK = 8 * 2**20


def _chunks(data: memoryview, size: int = WRITE_CHUNK) -> Iterator[memoryview]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def write_rank(tier, manifest: Manifest, data: memoryview) -> int:
    """Put one rank's data, then its manifest (which commits the rank). Returns bytes written."""
    job, step, rank = manifest.job, manifest.step, manifest.rank
    if not manifest.sealed:
        raise ManifestError(
            f"step {step} rank {rank}: a manifest must carry its checksums before it is stored"
        )
    await tier.put(layout.data_key(job, step, rank), list(_chunks(data)), len(data))
    raw = manifest.to_json()
    await tier.put(layout.manifest_key(job, step, rank), [memoryview(raw)], len(raw))
    return len(data) + len(raw)


async def commit_step(
    tier, job: str, step: int, node: str, ranks: list[int], world_size: int
) -> None:
    marker = layout.CommitMarker(node, tuple(sorted(ranks)), world_size).to_json()
    await tier.put(layout.commit_key(job, step, node), [memoryview(marker)], len(marker))


@dataclass(frozen=True)
class CommittedStep:
    step: int
    ranks: frozenset[int]
    world_size: int

    @property
    def complete(self) -> bool:
        return self.ranks >= frozenset(range(self.world_size))


async def list_steps(tier, job: str) -> dict[int, CommittedStep | None]:
    """Every step the tier has anything of; None for steps with no commit marker."""
    keys = await tier.list(f"{job}/")
    out: dict[int, CommittedStep | None] = {}
    for step, markers in layout.parse_keys(job, keys).items():
        if not markers:
            out[step] = None
            continue
        raws = await asyncio.gather(*(tier.get(k) for k in markers))
        parsed = [layout.CommitMarker.from_json(r) for r in raws]
        ranks = frozenset(r for m in parsed for r in m.ranks)
        out[step] = CommittedStep(step, ranks, max(m.world_size for m in parsed))
    return out


async def committed_steps(tier, job: str) -> list[int]:
    """Steps committed for the whole world, oldest first."""
    steps = await list_steps(tier, job)
    return sorted(s for s, c in steps.items() if c is not None and c.complete)


async def read_rank(tier, job: str, step: int, rank: int) -> tuple[Manifest, torch.Tensor]:
    """The manifest and data bytes of one rank's shard (checksums are verified at restore)."""
    mkey = layout.manifest_key(job, step, rank)
    manifest = Manifest.from_json(await tier.get(mkey), source=f"{tier.spec.url}/{mkey}")
    if (manifest.job, manifest.step, manifest.rank) != (job, step, rank):
        raise ManifestError(
            f"{tier.spec.url}/{mkey} describes job {manifest.job} step {manifest.step} rank "
            f"{manifest.rank}, not job {job} step {step} rank {rank}"
        )
    data = torch.empty(manifest.data_len, dtype=torch.uint8)
    if manifest.data_len:
        await tier.get_into(layout.data_key(job, step, rank), memoryview(data.numpy()), 0)
    return manifest, data


async def apply_retention(
    tier, job: str, keep_last: int | None, keep_every: int | None
) -> list[int]:
    """Delete committed steps beyond the policy, and uncommitted leftovers older than the
    newest committed step (a crashed upload). Returns the steps deleted."""
    steps = await list_steps(tier, job)
    committed = sorted((s for s, c in steps.items() if c is not None and c.complete), reverse=True)
    if not committed:
        return []
    keep = set(committed[:keep_last] if keep_last else committed)
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    newest = committed[0]
    doomed = [s for s in steps if s not in keep and (s in committed or s < newest)]
    for s in doomed:
        await tier.delete(layout.step_prefix(job, s))
    if doomed:
        log.info("%s: retention removed steps %s of job %s", tier.spec.url, sorted(doomed), job)
    return sorted(doomed)
