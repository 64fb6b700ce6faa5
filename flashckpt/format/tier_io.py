"""Snapshots in a storage tier: write a rank's shard, commit a step, find and read them back.

The agent writes with these; ``Checkpointer.restore`` and the CLI read with them, so the
layout (``layout.py``) and the commit rule live in one place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .. import config
from ..errors import CheckpointNotFoundError, ConfigError, ManifestError, ObjectExistsError
from ..storage_tiers.base import TEMP_GRACE_S, Leftover, Scope
from . import fence, layout
from .lineage import Lineage, newest
from .manifest import Entry, Manifest
from .retention import Common, Held, kept
from .slot import align

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WRITE_CHUNK = 8 * 2**20
MAX_MANIFEST_BYTES = 256 * 2**20
"""A stored manifest larger than this is corrupt: one of 100,000 tensors is a few tens of MiB."""
MAX_MARKER_BYTES = 16 * 2**20
"""A commit marker larger than this is corrupt: one naming two million ranks is 16 MiB."""


def _chunks(data: memoryview, size: int = WRITE_CHUNK) -> Iterator[memoryview]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


Primaries = int | Mapping[str, int]
"""Where a rank's replicated entries are stored in a tier: one rank for all of them (the
manifest's replica group), or a rank by entry path (entries with their own groups)."""


def _stored_at(primary: Primaries, rank: int) -> Callable[[Entry], int | None]:
    """The rank storing each entry for ``rank``, None where ``rank`` stores it itself."""
    if isinstance(primary, int):
        at = None if primary == rank else primary
        return lambda e: at if e.replicated else None
    return lambda e: at if e.replicated and (at := primary.get(e.path, rank)) != rank else None


def without_replicas(
    manifest: Manifest, data: memoryview, primary: Primaries
) -> tuple[Manifest, memoryview]:
    """The copy of a rank's shard to store when other ranks (``primary``) store some of its
    replicated entries: those point at their rank (``stored_at``), the rest are packed into
    new data. Where the rank stores every entry itself, its shard as it is."""
    where = _stored_at(primary, manifest.rank)
    elsewhere = [where(e) for e in manifest.entries]
    if all(r is None for r in elsewhere):
        return manifest, data
    packed = bytearray(sum(align(e.nbytes) for e, r in zip(manifest.entries, elsewhere,
                                                           strict=True) if r is None))  # fmt: skip
    entries, at = [], 0
    for e, r in zip(manifest.entries, elsewhere, strict=True):
        if r is not None:
            entries.append(replace(e, offset=0, stored_at=r))
            continue
        packed[at : at + e.nbytes] = data[e.offset : e.offset + e.nbytes]
        entries.append(replace(e, offset=at))
        at = align(at + e.nbytes)
    return replace(manifest, entries=tuple(entries), data_len=len(packed)), memoryview(packed)


async def write_rank(
    tier, manifest: Manifest, data: memoryview, primary: Primaries | None = None
) -> int:
    """Put one rank's data, then its manifest (which commits the rank). With ``primary``
    (the other ranks of its replica groups that store replicated entries in this tier), only
    what the rank stores itself is put. Returns bytes written.

    Both are fenced (``fence.py``): in a shared tier a run older than the newest that claimed
    the job writes nothing (StaleWriterError), and neither object ever replaces one that a run
    as new or newer wrote: a rank this run stored already is left as it is (0 bytes written)."""
    job, step, rank, gen = manifest.job, manifest.step, manifest.rank, manifest.generation
    run = manifest.incarnation
    if not manifest.sealed:
        raise ManifestError(
            f"step {step} rank {rank}: a manifest must carry its checksums before it is stored"
        )
    if primary is not None and primary != rank:
        manifest, data = without_replicas(manifest, data, primary)
    await _fence(tier, job, run, step)
    mkey = layout.manifest_key(job, step, rank, gen)

    async def rank_run() -> int | None:  # who stored what is there: its manifest says
        try:
            return (await read_manifest(tier, job, step, rank, gen)).incarnation
        except (ManifestError, CheckpointNotFoundError):
            return None  # not committed: data of a put cut short, anyone's

    dkey = layout.data_key(job, step, rank, gen)
    written = await _create(tier, dkey, list(_chunks(data)), len(data), job, run, step, rank_run)
    raw = manifest.to_json()
    written += await _create(tier, mkey, [memoryview(raw)], len(raw), job, run, step, rank_run)
    return written


async def commit_step(
    tier, job: str, step: int, node: str, ranks: list[int], world_size: int,
    lineage: Lineage | None = None, incarnation: int = 0,
) -> None:  # fmt: skip
    """Put ``node``'s commit marker of ``step``, fenced as ``write_rank``'s puts are."""
    lineage = lineage or Lineage()
    marker = layout.CommitMarker(
        node, tuple(sorted(ranks)), world_size, lineage, incarnation
    ).to_json()
    key = layout.commit_key(job, step, node, lineage.generation)
    await _fence(tier, job, incarnation, step)

    async def marker_run() -> int | None:
        found = await _marker(tier, key)
        return found.incarnation if isinstance(found, layout.CommitMarker) else None

    await _create(tier, key, [memoryview(marker)], len(marker), job, incarnation, step,
                  marker_run)  # fmt: skip


async def _fence(tier, job: str, run: int, step: int) -> None:
    """StaleWriterError where run ``run`` may not write ``step`` into this shared tier."""
    if tier.spec.scope is Scope.SHARED:
        await fence.check(tier, job, run, step)


async def _create(tier, key: str, views: list[memoryview], size: int, job: str, run: int,
                  step: int, stored_by: Callable[[], Awaitable[int | None]]) -> int:  # fmt: skip
    """Put ``key`` where nothing is under it; bytes written. What is there already is left as
    it is where this run stored it (a retry, a restarted agent: 0), refused where a newer run
    did (StaleWriterError), and replaced only where an older run's leftover or a cut-short
    put's holds the name (``stored_by`` says which run wrote it; None: none can be told)."""
    try:
        await tier.put(key, views, size, exclusive=True)
        return size
    except ObjectExistsError:
        pass
    await _fence(tier, job, run, step)  # a newer run's object: its claim came before its put
    there = await stored_by()
    if there == run:
        return 0
    if there is not None and there > run:
        raise fence.stale(tier, job, run, there, step)
    log.info("%s/%s: replacing what a put cut short or an earlier run (%s) left there",
             tier.spec.url, key, there)  # fmt: skip
    await tier.put(key, views, size)
    return size


@dataclass(frozen=True)
class CommittedStep:
    """What a step's commit markers say; ``problems`` names the markers that do not parse or
    belong to another generation, and the ranks they name whose manifests are not stored
    (those ranks count as not committed). ``node_local``: the markers are of a node-local
    tier, which holds only its node's ranks of the job.

    ``incarnation``: the newest run of the job that committed ranks of the step. Only its
    markers count: a writer of an earlier run (a partitioned node's agent still uploading, a
    second job under the same name) never completes a step together with a newer run, and
    every shard read for the step must carry this incarnation too.

    ``fenced``: the markers that do not count because a newer run claimed the job before the
    step (``fence.Limits``): a stale writer's, the step above what that run had seen."""

    step: int
    ranks: frozenset[int]
    world_size: int
    problems: tuple[str, ...] = ()
    lineage: Lineage = Lineage()
    node_local: bool = False
    incarnation: int = 0
    fenced: tuple[str, ...] = ()

    @property
    def generation(self) -> int:
        return self.lineage.generation

    @property
    def complete(self) -> bool:
        """Committed for every rank the tier is to hold: the whole world in a shared tier; in
        a node-local tier, the ranks its node ran, which its marker names (the agent writes
        it once every one of them is stored, so a readable marker is the node's commit)."""
        if self.node_local:
            return bool(self.ranks) and not self.problems
        # Markers are checked to name only ranks below their world_size, so covering the
        # world is a count (a range of a corrupt world size is never built).
        return self.world_size > 0 and len(self.ranks) >= self.world_size


async def _marker(tier, key: str) -> layout.CommitMarker | str:
    """The marker at ``key``, or why it cannot be had: a corrupt one, or one gone since the
    listing (retention on another node, a store's lagging listing), makes its step lack that
    node's ranks, never hides the tier's other steps."""
    source = f"{tier.spec.url}/{key}"
    try:
        raw = await _read_bounded(tier, key, source, "commit marker", MAX_MARKER_BYTES)
        return layout.CommitMarker.from_json(raw, source)
    except ManifestError as exc:
        log.warning("%s", exc)
        return str(exc)
    except CheckpointNotFoundError as exc:
        log.info("%s: the commit marker went away after the listing (%s)", source, exc)
        return f"{source}: the commit marker went away after the listing"


async def _read_bounded(tier, key: str, source: str, what: str, cap: int) -> bytes:
    """The object at ``key``, read whole only if it holds at most ``cap`` bytes: a larger one
    is a ManifestError (a corrupt or hostile copy), never a read that exhausts memory."""
    raw = await tier.get(key, 0, cap + 1)
    if len(raw) > cap:
        raise ManifestError(
            f"{source}: the {what} is larger than {cap} bytes, more than any flashckpt "
            "writes; the copy is corrupt, restore from another tier or an older step"
        )
    return _filled(raw, source, what)


def allocate(nbytes: int, where: str) -> torch.Tensor:
    """``nbytes`` of memory for bytes a tier's metadata sized (checked against the bytes that
    exist first): if it cannot be had, the copy is treated as corrupt, not the process."""
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (MemoryError, RuntimeError) as exc:
        raise ManifestError(
            f"{where}: {nbytes} bytes sized by its metadata cannot be allocated ({exc}); "
            "restore from another tier or an older step"
        ) from None


def _filled(raw: bytes, source: str, what: str) -> bytes:
    """``raw`` read back from ``source``; an empty object is a ManifestError that says so."""
    if not raw:
        raise ManifestError(
            f"{source}: the {what} is empty (0 bytes), so its write was cut short or the copy "
            "is corrupt; restore from another tier or an older step"
        )
    return raw


Listing = dict[tuple[int, int], CommittedStep | None]
"""A tier's steps of one job by (generation, step); None for a step with no commit marker."""


async def list_jobs(tier) -> dict[str, int]:
    """The jobs a tier holds steps of (committed or not), with how many steps each has."""
    by_job: dict[str, list[str]] = {}
    for key in await tier.list(""):
        by_job.setdefault(key.split("/", 1)[0], []).append(key)
    out = {}
    for job, keys in by_job.items():
        try:
            config.validate_name("job", job)
        except ConfigError:  # not a job's folder
            continue
        if steps := layout.parse_keys(job, keys):
            out[job] = len(steps)
    return out


async def list_steps(tier, job: str) -> Listing:
    """Every step the tier has anything of, by (generation, step)."""
    keys = await tier.list(f"{job}/")
    node_local = tier.spec.scope is Scope.NODE
    out: Listing = {}
    scanned = layout.scan(job, keys)
    read_all = [await asyncio.gather(*(_marker(tier, k) for k in found.markers))
                for found in scanned.values()]  # fmt: skip
    limits = await _limits(tier, job, keys, read_all)
    for ((gen, step), found), read in zip(scanned.items(), read_all, strict=True):
        if not found.markers:
            out[gen, step] = None
            continue
        parsed = [m for m in read if isinstance(m, layout.CommitMarker)]
        problems = [m for m in read if isinstance(m, str)]
        for m in [m for m in parsed if m.lineage.generation != gen]:
            problems.append(f"the commit marker of node {m.node} in step {step} generation "
                            f"{gen} names generation {m.lineage.generation}")  # fmt: skip
            parsed.remove(m)
        stale = [m for m in parsed if limits.fenced(m.incarnation, step)]
        fenced = tuple(_fenced(tier, job, step, gen, m, limits) for m in stale)
        parsed = [m for m in parsed if m not in stale]
        incarnation = max((m.incarnation for m in parsed or stale), default=0)
        superseded = [m.node for m in parsed if m.incarnation != incarnation]
        if superseded:
            log.info("%s: step %d of job %s: the commit markers of nodes %s are of an earlier "
                     "run of the job (incarnation < %d) and do not count", tier.spec.url, step,
                     job, superseded, incarnation)  # fmt: skip
            parsed = [m for m in parsed if m.incarnation == incarnation]
        ranks = frozenset(r for m in parsed for r in m.ranks)
        if missing := sorted(ranks - found.manifests):
            problems.append(_no_manifests(tier, step, gen, missing))
            ranks &= found.manifests
        world = max((m.world_size for m in parsed), default=0)
        lineage = parsed[0].lineage if parsed else Lineage()
        out[gen, step] = CommittedStep(step, ranks, world, tuple(problems), lineage, node_local,
                                       incarnation, fenced)  # fmt: skip
    return out


async def _limits(tier, job: str, keys: list[str], markers: list[list]) -> fence.Limits:
    """The fence's limits for the runs whose markers the listing holds: only the claims newer
    than the oldest of them are read (none while one run writes alone)."""
    runs = [m.incarnation for read in markers for m in read if isinstance(m, layout.CommitMarker)]
    if not runs:
        return fence.Limits({})
    oldest = min(runs)
    newer = [e for e in layout.claims(job, keys) if e > oldest]
    return fence.Limits(await fence.read_claims(tier, job, newer) if newer else {})


def _fenced(tier, job: str, step: int, generation: int, marker: layout.CommitMarker,
            limits: fence.Limits) -> str:  # fmt: skip
    """Why a marker a stale writer landed does not count."""
    message = (f"{tier.spec.url}: {layout.step_dir(step, generation)}: the commit marker of node "
               f"{marker.node} is of run {marker.incarnation} of job {job}, but a newer run "
               f"claimed the job after step {int(limits.limit(marker.incarnation))}: a stale "
               "writer's step (an agent of an earlier run, stopped or cut off, that wrote on), "
               "never restored; retention removes it once older than the newest committed step")  # fmt: skip
    log.warning("%s", message)
    return message


def _no_manifests(tier, step: int, generation: int, ranks: list[int]) -> str:
    """Why ranks a commit marker names do not count: their manifests are not stored."""
    shown = ranks if len(ranks) <= 8 else f"{ranks[:8]} and {len(ranks) - 8} more"
    message = (f"{tier.spec.url}: {layout.step_dir(step, generation)}: the commit markers name ranks {shown}, whose "
               "manifests are not stored there; those ranks do not count as committed (a stray "
               "or cut-short copy), restore from another tier or an older step")  # fmt: skip
    log.warning("%s", message)
    return message


def complete(listing: Listing) -> dict[tuple[int, int], CommittedStep]:
    """The steps committed for every rank the tier is to hold (``CommittedStep.complete``)."""
    return {k: c for k, c in listing.items() if c is not None and c.complete}


def head(listing: Listing) -> Lineage:
    """The branch of the newest generation with a committed step (generation 0 if none)."""
    return newest([c.lineage for c in complete(listing).values()])


def in_lineage(listing: Listing, lineage: Lineage) -> dict[int, CommittedStep]:
    """The committed steps of ``lineage``'s history, by step number."""
    return {s: c for (g, s), c in complete(listing).items() if lineage.holds(g, s)}


async def committed_steps(tier, job: str, lineage: Lineage | None = None) -> list[int]:
    """Steps committed for the whole world in ``lineage`` (default: the branch of the newest
    generation the tier has committed), oldest first."""
    listing = await list_steps(tier, job)
    return sorted(in_lineage(listing, head(listing) if lineage is None else lineage))


async def read_manifest(tier, job: str, step: int, rank: int, generation: int = 0,
                        incarnation: int | None = None) -> Manifest:  # fmt: skip
    """One rank's stored manifest, parsed, checked and with checksums (and written by run
    ``incarnation`` of the job, the one the step's commit markers name, where given); a
    ManifestError naming the object otherwise."""
    mkey = layout.manifest_key(job, step, rank, generation)
    where = f"{tier.spec.url}/{mkey}"
    raw = await _read_bounded(tier, mkey, where, "manifest", MAX_MANIFEST_BYTES)
    manifest = Manifest.from_json(raw, source=where, require_checksums=True)
    found = (manifest.job, manifest.step, manifest.rank, manifest.generation)
    if found != (job, step, rank, generation):
        raise ManifestError(
            f"{where} describes job {manifest.job} step {manifest.step} rank {manifest.rank} "
            f"generation {manifest.generation}, not job {job} step {step} rank {rank} "
            f"generation {generation}"
        )
    if incarnation is not None and manifest.incarnation != incarnation:
        raise ManifestError(
            f"{where} was written by run {manifest.incarnation} of the job, but the step is "
            f"committed by run {incarnation}: a writer of another run (an agent of an earlier "
            "run still uploading, or a second job under the same name) replaced it; restore "
            "from another tier or an older step"
        )
    return manifest


async def read_rank(
    tier, job: str, step: int, rank: int, generation: int = 0, incarnation: int | None = None
) -> tuple[Manifest, torch.Tensor]:
    """The manifest and data bytes of one rank's shard, checked to belong together (checksums
    are verified at restore), with the entries another rank stores for it read from there. A
    manifest that does not parse or lacks checksums, or data of another size than the
    manifest says, is a ManifestError naming the object. ``incarnation``: the run the step's
    commit markers name (see ``read_manifest``)."""
    manifest = await read_manifest(tier, job, step, rank, generation, incarnation)
    return await data_of(tier, manifest)


async def data_of(tier, manifest: Manifest) -> tuple[Manifest, torch.Tensor]:
    """``read_rank`` for a manifest read already."""
    data = await read_data(tier, manifest)
    if any(e.stored_at is not None for e in manifest.entries):
        return await _with_replicas(tier, manifest, data)
    return manifest, data


async def check_data_size(tier, manifest: Manifest) -> str:
    """Check that a rank's stored data holds exactly the manifest's ``data_len`` bytes (before
    anything is sized from it); its key."""
    dkey = layout.data_key(manifest.job, manifest.step, manifest.rank, manifest.generation)
    size = manifest.data_len
    # One small ranged read settles the size: the byte before data_len must exist, the one
    # at data_len must not.
    tail = await tier.get(dkey, max(size - 1, 0), size + 1)
    if len(tail) != min(size, 1):
        raise _size_mismatch(tier, dkey, size, "more" if len(tail) > min(size, 1) else "fewer")
    return dkey


async def read_data(tier, manifest: Manifest) -> torch.Tensor:
    """A rank's whole data region, sized and checked against ``manifest``."""
    dkey = await check_data_size(tier, manifest)
    size = manifest.data_len
    data = allocate(size, f"{tier.spec.url}/{dkey}")
    if size:
        try:
            await tier.get_into(dkey, memoryview(data.numpy()), 0)
        except ValueError as exc:  # shortened since the size was read: the tier says so
            raise _size_mismatch(tier, dkey, size, "fewer") from exc
    return data


async def _with_replicas(
    tier, manifest: Manifest, data: torch.Tensor
) -> tuple[Manifest, torch.Tensor]:
    """``manifest`` and ``data`` completed with the replicated entries other ranks store for
    it: each is read from that rank's data, where that rank's manifest must hold the same
    entry, and is verified at restore with that rank's checksums."""
    job, step, gen = manifest.job, manifest.step, manifest.generation
    others: dict[int, dict[str, Entry]] = {}
    for r in sorted({e.stored_at for e in manifest.entries if e.stored_at is not None}):
        other = await read_manifest(tier, job, step, r, gen, manifest.incarnation)
        await check_data_size(tier, other)  # its entries lie in bytes that exist
        others[r] = {e.path: e for e in other.entries if e.stored_at is None}
    # Every entry stored elsewhere is matched to the copy that holds it before anything is
    # sized from the manifest: the sizes allocated are those of bytes that exist.
    for e in manifest.entries:
        if e.stored_at is None:
            continue
        src = others[e.stored_at].get(e.path)
        if src is None or (src.kind, src.dtype, src.shape) != (e.kind, e.dtype, e.shape):
            found = "no such entry" if src is None else f"{src.dtype} {list(src.shape)}"
            raise ManifestError(
                f"{tier.spec.url}: step {step} rank {manifest.rank} stores {e.path!r} at rank "
                f"{e.stored_at}, whose copy has {found}; restore from another tier or an older "
                "step"
            )
    extra = sum(align(e.nbytes) for e in manifest.entries if e.stored_at is not None)
    out = allocate(manifest.data_len + extra, f"{tier.spec.url}: step {step} rank {manifest.rank}")
    out[: manifest.data_len] = data
    entries, at, differ = [], manifest.data_len, []
    for e in manifest.entries:
        if e.stored_at is None:
            entries.append(e)
            continue
        src = others[e.stored_at][e.path]
        where = (f"{tier.spec.url}: step {step} rank {manifest.rank} stores {e.path!r} at rank "
                 f"{e.stored_at}")  # fmt: skip
        dkey = layout.data_key(job, step, e.stored_at, gen)
        await get_range(tier, dkey, memoryview(out[at : at + e.nbytes].numpy()), src.offset, where)
        differ += [e.path] if e.checksums != src.checksums else []
        entries.append(replace(e, offset=at, stored_at=None, checksums=src.checksums))
        at = align(at + e.nbytes)
    if differ:
        log.warning("step %d rank %d: %d replicated entries (the first %r) differed from the "
                    "copy another rank stored when they were saved; restoring that copy", step,
                    manifest.rank, len(differ), differ[0])  # fmt: skip
    return replace(manifest, entries=tuple(entries), data_len=len(out)), out


async def get_range(tier, key: str, out: memoryview, start: int, where: str) -> None:
    """Fill ``out`` from byte ``start`` of ``key``; a shorter object is a ManifestError."""
    try:
        await tier.get_into(key, out, start)
    except ValueError as exc:
        raise ManifestError(f"{where}, whose data is truncated (shorter than its manifest says); "
                            "restore from another tier or an older step") from exc  # fmt: skip


def _size_mismatch(tier, key: str, size: int, found: str) -> ManifestError:
    return ManifestError(
        f"{tier.spec.url}/{key} holds {found} than the {size} bytes its manifest's data_len "
        "says; the copy is truncated or corrupt, restore from another tier or an older step"
    )


@dataclass(frozen=True)
class Retired:
    """What a retention pass removed (or, dry, would remove)."""

    steps: list[tuple[int, int]]  # (generation, step)
    leftovers: list[Leftover]  # temporaries and unfinished uploads of crashed writes
    committed: list[tuple[int, int]] = field(default_factory=list)  # the committed steps left


async def apply_retention(
    tier,
    job: str,
    keep_last: int | None,
    keep_every: int | None,
    temp_grace_s: float = TEMP_GRACE_S,
    retire_abandoned: bool = False,
    dry_run: bool = False,
    common: Common | None = None,
) -> Retired:
    """Delete committed steps of the current branch beyond the policy, uncommitted leftovers
    older than the newest committed step, and what crashed uploads left (with the step
    directories that held only that) once older than ``temp_grace_s`` (a live writer on
    another node may be filling younger ones). Committed steps of abandoned branches (left by
    a rollback) are kept unless ``retire_abandoned``. ``common``: for a node-local tier of a
    multi-node job, the steps every node holds (see ``retention.kept``); None where the
    tier's committed steps are job-wide. ``dry_run`` removes nothing."""
    leftovers = await tier.clean_temporaries(f"{job}/", temp_grace_s, dry_run=dry_run)
    steps = await list_steps(tier, job)
    done = complete(steps)
    if not done:
        return Retired([], leftovers)
    held = {k: Held(len(c.ranks), c.world_size) for k, c in done.items()}
    keep = kept(held, head(steps), keep_last, keep_every, retire_abandoned, common)
    newest = max(done)
    doomed = sorted(k for k in steps if k not in keep and (k in done or k < newest))
    left = sorted(set(done) - set(doomed))
    if not dry_run:
        for gen, step in doomed:
            await tier.delete(layout.step_prefix(job, step, gen))
    if doomed and not dry_run:
        every = "" if common is None else f"; newest held by every node: {sorted(common.keys)[-4:]}"
        log.info("%s: retention removed steps %s of job %s, kept %s%s", tier.spec.url, doomed,
                 job, left, every)  # fmt: skip
    return Retired(doomed, leftovers, left)
