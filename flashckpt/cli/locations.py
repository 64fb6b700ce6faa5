"""Where a ``flashckpt`` subcommand looks: a storage tier named by its URL, or this node's
shared memory (``shm``), behind one interface: the jobs there, a job's steps (committed or
not, which ranks, size, age) and one rank's copy of a step, read as a restore reads it.

A tier's steps are what ``tier_io.list_steps`` says (commit markers); shared memory has no
commit, so a step there counts as held by the job ("complete") once READY slots of every
rank of its world size hold it. Both give a ``tier_io.Listing`` so the same lineage rules
pick "the newest step" everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FlashCkptError, SharedMemoryError
from ..format import layout, tier_io
from ..format.lineage import Lineage
from ..format.manifest import Manifest
from ..format.slot import Slot
from ..snapshot.slots import N_SLOTS, Snapshot, ranks_in, read_locked, slot_path
from .common import SHM, Problem, Progress, describe_error, shown

if TYPE_CHECKING:
    import torch

Key = tuple[int, int]
"""A stored step: (generation, step)."""
READ_CONCURRENCY = 16


@dataclass
class StepInfo:
    """What ``ls`` shows of one step."""

    generation: int
    step: int
    present: list[int]  # ranks with anything of the step there
    committed: tier_io.CommittedStep | None
    bytes: int = 0
    created_at: float | None = None
    sealed: bool | None = None  # shared memory: every rank's checksums computed
    problems: list[str] = field(default_factory=list)

    def state(self, memory: bool) -> str:
        c = self.committed
        if c is None:
            return "uncommitted"
        if c.complete:
            return "complete" if memory else "committed"
        return "partial"


def newest_key(listing: tier_io.Listing, step: int | None) -> Key | None:
    """The (generation, step) a restore would take: ``step`` (or the newest one) committed in
    the branch of the newest generation; None if there is no such step."""
    lineage = tier_io.head(listing)
    done = tier_io.in_lineage(listing, lineage)
    if step is None:
        step = max(done, default=None)
        if step is None:
            return None
    ours = [k for k in listing if k[1] == step and lineage.holds(*k)]
    return max(ours) if ours else None


def committed_in(listing: tier_io.Listing) -> list[int]:
    return sorted(tier_io.in_lineage(listing, tier_io.head(listing)))


class TierLocation:
    kind = "tier"

    def __init__(self, url: str):
        self.url, self.shown = url, shown(url)
        self.tier: Any = None

    async def __aenter__(self) -> TierLocation:
        from ..storage_tiers import open_tier

        self.tier = open_tier(self.url)
        try:  # a directory that is not there, a root that is a file, a store out of reach
            await self.tier.check_location()
        except (FlashCkptError, OSError) as exc:
            await self.tier.close()
            raise Problem(describe_error(exc)) from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tier.close()

    async def jobs(self) -> dict[str, int]:
        """The jobs stored here, with how many steps each has."""
        return await tier_io.list_jobs(self.tier)

    async def listing(self, job: str) -> tier_io.Listing:
        return await tier_io.list_steps(self.tier, job)

    async def strays(self, job: str) -> list[str]:
        """The names under the job that are no part of a step (``layout.strays``)."""
        return layout.strays(job, await self.tier.list(f"{job}/"))

    async def steps(self, job: str, progress: Progress) -> tuple[list[StepInfo], list[str]]:
        found = layout.scan(job, await self.tier.list(f"{job}/"))
        listing = await self.listing(job)
        infos = []
        for (gen, step), c in sorted(listing.items(), key=lambda kc: (kc[0][1], kc[0][0])):
            present = sorted(found[gen, step].manifests) if (gen, step) in found else []
            problems = list(c.problems) if c is not None else []
            infos.append(StepInfo(gen, step, present, c, problems=problems))
        progress.add_total(sum(len(i.present) for i in infos))
        limit = asyncio.Semaphore(READ_CONCURRENCY)

        async def size(info: StepInfo, rank: int) -> None:
            async with limit:
                try:
                    m = await tier_io.read_manifest(self.tier, job, info.step, rank,
                                                    info.generation)  # fmt: skip
                except (FlashCkptError, OSError) as exc:
                    info.problems.append(describe_error(exc))
                else:
                    info.bytes += m.data_len
                    info.created_at = max(info.created_at or 0.0, m.created_at) or None
                progress.update()

        await asyncio.gather(*(size(i, r) for i in infos for r in i.present))
        return infos, []

    async def read_rank(self, job: str, key: Key, rank: int,
                        incarnation: int | None = None) -> tuple[Manifest, torch.Tensor]:  # fmt: skip
        return await tier_io.read_rank(self.tier, job, key[1], rank, key[0], incarnation)


@dataclass
class Held:
    """One READY slot of a rank, as read under its lock."""

    rank: int
    path: Path
    key: Key
    manifest: Manifest
    sealed: bool
    published_at: float


class ShmLocation:
    kind = SHM

    def __init__(self, shm_dir: Path):
        self.dir = shm_dir
        self.url = SHM
        self.shown = f"shared memory ({shm_dir})"

    async def __aenter__(self) -> ShmLocation:
        if not self.dir.is_dir():
            raise Problem(f"{self.shown} does not exist: no job has saved on this node with "
                          "it; check --shm-dir or FLASHCKPT_SHM_DIR")  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def jobs(self) -> dict[str, int]:
        out = {}
        for d in sorted(self.dir.iterdir()):
            if d.is_dir() and not d.is_symlink() and (ranks := ranks_in(self.dir, d.name)):
                out[d.name] = len(ranks)
        return out

    async def strays(self, job: str) -> list[str]:
        """None: slot files are found by their own names (``ranks_in``)."""
        return []

    def held(self, job: str) -> tuple[list[Held], list[str]]:
        """Every READY slot of the job, and why the slots that hold none cannot be read."""
        out, problems = [], []
        for rank in ranks_in(self.dir, job):
            for i in range(N_SLOTS):
                try:
                    with self.snapshot_at(slot_path(self.dir, job, rank, i)) as snap:
                        if snap is not None:
                            out.append(Held(rank, snap.slot.path, (snap.generation, snap.step),
                                            snap.manifest, snap.header.sealed,
                                            snap.header.published_at))  # fmt: skip
                except FileNotFoundError:
                    continue
                except (FlashCkptError, OSError) as exc:
                    problems.append(f"rank {rank} slot {i}: corrupt ({describe_error(exc)})")
        return out, problems

    @contextlib.contextmanager
    def snapshot_at(self, path: Path) -> Iterator[Snapshot | None]:
        slot = Slot.open_readonly(path)
        try:
            with read_locked(slot) as snap:
                yield snap
        finally:
            slot.close()

    async def listing(self, job: str) -> tier_io.Listing:
        return _as_listing(self.held(job)[0])

    async def steps(self, job: str, progress: Progress) -> tuple[list[StepInfo], list[str]]:
        held, problems = self.held(job)
        listing = _as_listing(held)
        infos = []
        for key, c in sorted(listing.items(), key=lambda kc: (kc[0][1], kc[0][0])):
            mine = [h for h in held if h.key == key]
            infos.append(StepInfo(
                key[0], key[1], sorted({h.rank for h in mine}), c,
                bytes=sum(h.manifest.data_len for h in mine),
                created_at=max(h.published_at for h in mine), sealed=all(h.sealed for h in mine),
            ))  # fmt: skip
        return infos, problems

    def with_rank(self, job: str, key: Key, rank: int, fn: Callable[[Snapshot], Any]) -> Any:
        """``fn(snapshot)`` of the rank's slot holding ``key``, under the slot's lock; Problem
        if none holds it, or if the slot was rewritten meanwhile."""
        for i in range(N_SLOTS):
            path = slot_path(self.dir, job, rank, i)
            with (
                contextlib.suppress(FileNotFoundError, SharedMemoryError),
                self.snapshot_at(path) as snap,
            ):
                if snap is None or (snap.generation, snap.step) != key:
                    continue
                result = fn(snap)
                if snap.intact():
                    return result
                raise Problem(f"{path} was overwritten while it was read: a trainer of job "
                              f"{job} is running; try again, or stop it first")  # fmt: skip
        raise Problem(f"no slot of rank {rank} of job {job} in {self.shown} holds step {key[1]}")

    async def read_rank(self, job: str, key: Key, rank: int,
                        incarnation: int | None = None) -> tuple[Manifest, torch.Tensor]:  # fmt: skip
        def copy(snap: Snapshot) -> tuple[Manifest, torch.Tensor]:
            if incarnation is not None and snap.manifest.incarnation != incarnation:
                raise Problem(f"rank {rank}'s step {key[1]} in {self.shown} was saved by run "
                              f"{snap.manifest.incarnation} of job {job}, not run {incarnation} "
                              "like the other ranks' copies of it")  # fmt: skip
            return snap.manifest, snap.slot.data_tensor(snap.header).clone()

        return self.with_rank(job, key, rank, copy)


def _as_listing(held: list[Held]) -> tier_io.Listing:
    by_key: dict[Key, list[Held]] = {}
    for h in held:
        by_key.setdefault(h.key, []).append(h)
    out: tier_io.Listing = {}
    for key, hs in by_key.items():
        world = max(h.manifest.world_size or 1 for h in hs)
        lineage = max((h.manifest.lineage for h in hs), key=lambda lin: lin.generation,
                      default=Lineage())  # fmt: skip
        # As in a tier: only the newest run's copies of the step count.
        incarnation = max(h.manifest.incarnation for h in hs)
        ranks = frozenset(h.rank for h in hs
                          if h.rank < world and h.manifest.incarnation == incarnation)  # fmt: skip
        out[key] = tier_io.CommittedStep(key[1], ranks, world, (), lineage,
                                         incarnation=incarnation)  # fmt: skip
    return out


def stray_line(where: str, name: str) -> str:
    """What the CLI says of a stray name (``layout.strays``) under a job."""
    return (f"stray {name} in {where}: not a name flashckpt writes (steps are "
            "step-<12 digits>[.g<G>]/rank-<R>/...); ignored: it is no step, never restored and "
            "never removed by retention or gc; remove it by hand if nothing needs it")  # fmt: skip


def open_location(url: str, shm_dir: Path) -> TierLocation | ShmLocation:
    return ShmLocation(shm_dir) if url == SHM else TierLocation(url)


async def require_job(loc: TierLocation | ShmLocation, job: str) -> None:
    """Problem unless ``job`` has anything at ``loc`` (naming the jobs that do)."""
    jobs = await loc.jobs()
    if job not in jobs:
        there = f"jobs there: {', '.join(sorted(jobs))}" if jobs else "it holds no job"
        raise Problem(f"{loc.shown} has no job {job!r} ({there}); check --job or the location")


def age(created_at: float | None) -> float | None:
    return None if not created_at else max(0.0, time.time() - created_at)


async def job_at(loc: TierLocation | ShmLocation, named: str | None) -> str:
    """The job a command is about at ``loc``: the one named (``--job``, FLASHCKPT_JOB), which
    must be there, else the only one stored there."""
    from .common import only_job

    if named is None:
        return only_job(sorted(await loc.jobs()), loc.shown)
    await require_job(loc, named)
    return named
