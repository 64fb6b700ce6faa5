"""``flashckpt.load``: a stored step as plain Python, without the training code.

``restore()`` fills a live state of the same structure; ``load`` needs none. It reads one
committed step from a tier and rebuilds the structure that was saved — dicts, lists, tuples,
tensors, numpy arrays and scalars (a module or optimizer comes back as its state dict) — every
chunk verified. Pickled leaves come back only with ``allow_pickle=True``.

With ``rank=None`` a DTensor entry comes back as the full tensor, assembled from every rank's
shard by its shard metadata, and everything else is rank 0's; with a rank, that rank's state
as it saved it (its local shards as plain tensors).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointNotFoundError, ConfigError, ManifestError
from ..format import tier_io
from ..storage_tiers.registry import redact
from .entry_copy import Source
from .into_state import Planner, refuse_pickles
from .reshard import Resharder
from .sources import run_with_tier


def load(
    url: str, job: str | None = None, step: int | None = None, rank: int | None = None, *,
    allow_pickle: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The state saved at ``step`` (default: the newest committed) of ``job`` (default: the
    only job in the tier) in tier ``url``, as plain Python, verified."""
    return run_with_tier(url, lambda tier: load_from(tier, job, step, rank, allow_pickle))


async def resolve_job(tier, job: str | None) -> str:
    """``job``, or the only job the tier holds; ConfigError naming them if there are several,
    CheckpointNotFoundError if there is none."""
    if job is not None:
        return job
    found = sorted(await tier_io.list_jobs(tier))
    where = redact(tier.spec.url)
    if not found:
        raise CheckpointNotFoundError(f"{where} holds no job; check the URL")
    if len(found) > 1:
        raise ConfigError(f"{where} holds several jobs ({', '.join(found)}); name one with job=")
    return found[0]


async def committed(tier, job: str, step: int | None) -> tier_io.CommittedStep:
    """The committed ``step`` of ``job`` (default: the newest) in the tier's current branch."""
    listing = await tier_io.list_steps(tier, job)
    done = tier_io.in_lineage(listing, tier_io.head(listing))
    where = f"{redact(tier.spec.url)} job {job!r}"
    if not done:
        raise CheckpointNotFoundError(
            f"{where} has no committed step; `flashckpt ls` shows what it holds"
        )
    if step is None:
        return done[max(done)]
    if step not in done:
        newest = sorted(done)[-5:]
        raise CheckpointNotFoundError(
            f"{where} has no committed step {step}; the newest committed are {newest}"
        )
    return done[step]


async def load_from(
    tier, job: str | None, step: int | None, rank: int | None, allow_pickle: bool
) -> dict[str, Any]:
    job = await resolve_job(tier, job)
    c = await committed(tier, job, step)
    if rank is not None and not 0 <= rank < c.world_size:
        raise ConfigError(f"rank {rank} is not one of the {c.world_size} ranks of step {c.step}")
    manifest, data = await tier_io.read_rank(tier, job, c.step, rank or 0, c.generation,
                                             c.incarnation)  # fmt: skip
    resharder = Resharder() if rank is None else None
    planner = Planner(manifest, allow_pickle, resharder, assemble=True)
    producer = planner.fresh(manifest.tree, "")
    where = f"{redact(tier.spec.url)} job {job!r} step {c.step} rank {manifest.rank}"
    refuse_pickles(planner.pickled, where)
    if planner.mismatches:  # shard metadata that cannot make a full tensor
        raise ManifestError(f"{where}: {planner.mismatches[0].detail}")
    if resharder is not None and resharder.wants:
        await resharder.fetch(tier, job, c.step, c.generation, c.world_size, c.incarnation)
    source = Source(data, where)
    value = producer(source)
    source.flush()
    return value
