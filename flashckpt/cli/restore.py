"""``flashckpt restore URL... [--step N] --to DIR|URL|shm [--rank R]``: copy a stored step
somewhere a job can restore it from, checked on the way.

The step (default: the newest committed in any location given) is read from the first
location that has it committed; a rank whose copy there is unreadable or fails a checksum is
read from the next one. Ranks are fetched in parallel, each verified chunk by chunk before
anything of it is written.

``--to DIR`` (or any tier URL) writes the step in the tier layout, data and manifests then a
commit marker, so ``file://DIR`` is a tier holding the committed step. ``--to shm`` fills
this node's slot files for the job as a trainer's ``save()`` leaves them (READY, sealed), so
trainers started afterwards restore it from memory; it refuses while a live process owns a
rank of the job, and the restored step replaces what the ranks' slots held, only once every
rank is in (a failure leaves them as they were).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import config
from ..errors import ConfigError, FlashCkptError, RankBusyError
from ..format import tier_io
from ..format.checksum import bad_chunks, chunk_checksums
from ..format.manifest import Manifest
from ..format.slot import HEADER_SIZE, Slot, required_capacity
from ..snapshot.slots import SlotPair
from .common import (
    OK,
    PROBLEM,
    SECRETS,
    SHM,
    Output,
    Problem,
    Progress,
    UsageError,
    add_dirs,
    add_job,
    chosen_job,
    describe_error,
    human_bytes,
    locations,
    rank_arg,
    shm_dir,
    shown,
    step_arg,
)
from .locations import Key, committed_in, job_at, newest_key, open_location

if TYPE_CHECKING:
    import torch

NAME = "restore"
HELP = "copy a stored step, verified, into a directory, a tier or this node's shared memory"
RANKS_IN_FLIGHT = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="+", metavar="URL",
                   help="where to read from: tier URLs or 'shm', preferred in this order")  # fmt: skip
    p.add_argument("--to", required=True, metavar="DIR|URL|shm",
                   help="where to write: a directory (written in the tier layout), a tier URL, "
                        "or 'shm' for this node's slot files")  # fmt: skip
    add_job(p)
    p.add_argument("--step", type=step_arg, default=None, metavar="N",
                   help="the step (default: the newest committed in any location given)")  # fmt: skip
    p.add_argument("--rank", type=rank_arg, default=None, metavar="R",
                   help="restore only this rank (default: every rank of the step)")  # fmt: skip
    add_dirs(p)


async def _sources(args: argparse.Namespace, stack: contextlib.AsyncExitStack,
                   out: Output) -> tuple[str, int, list[tuple[Any, Key, tier_io.CommittedStep]]]:  # fmt: skip
    """The job, the step and every (location, key, commit) that holds it, in the order given."""
    named, found = chosen_job(args), []
    for url in locations(args):
        loc = open_location(url, shm_dir(args))
        try:
            await stack.enter_async_context(loc)
            job = await job_at(loc, named)
            named = named or job  # the first location's only job is the one looked for after
            found.append((loc, await loc.listing(job)))
        except (Problem, FlashCkptError, OSError) as exc:
            out.note(f"skipping {loc.shown}: {describe_error(exc)}")
    if not found:
        raise Problem("no location given can be read; see the lines above")
    step = args.step
    if step is None:
        step = max((committed_in(listing)[-1] for _, listing in found if committed_in(listing)),
                   default=None)  # fmt: skip
        if step is None:
            raise Problem(
                f"job {named} has no committed step in {', '.join(loc.shown for loc, _ in found)}"
            )
    sources = []
    for loc, listing in found:
        key = newest_key(listing, step)
        c = listing.get(key) if key is not None else None
        if c is not None and (
            c.complete
            if args.rank is None
            else args.rank in c.ranks or (c.complete and not c.node_local)
        ):
            sources.append((loc, key, c))
    if not sources:
        shown_all = ", ".join(loc.shown for loc, _ in found)
        raise Problem(f"step {step} of job {named} is not committed in {shown_all}; "
                      "'flashckpt ls URL' shows the steps there")  # fmt: skip
    return named, step, sources


def _verified(manifest: Manifest, data: torch.Tensor, where: str) -> tuple[Manifest, list[str]]:
    """The manifest with checksums (computed now for an unsealed slot) and every bad chunk."""
    view = memoryview(data.numpy())
    if not manifest.sealed:  # only a slot the sealer had not reached: nothing to check against
        sums = chunk_checksums(view, manifest.entries, manifest.chunk_size)
        return manifest.with_checksums(sums), []
    bad = [str(err) for e in manifest.entries
           for err in bad_chunks(view, e, manifest.chunk_size, where)]  # fmt: skip
    return manifest, bad


class _ShmTarget:
    """This node's slot files of the job: every rank claimed first, written into a free slot,
    and the ranks' other slots removed only once every rank is written."""

    def __init__(self, shm: Path, job: str, ranks: list[int]):
        self.pairs: dict[int, SlotPair] = {}
        self.new: dict[int, Path] = {}
        self.shown = f"shared memory ({shm})"
        try:
            for r in ranks:
                self.pairs[r] = SlotPair(shm, job, r)
                self.pairs[r].claim()
        except RankBusyError as exc:
            self.close(keep=False)
            raise Problem(f"{exc}; stop the job's trainers before restoring into shared "
                          "memory") from None  # fmt: skip

    async def write(self, manifest: Manifest, data: torch.Tensor) -> str:
        return await asyncio.to_thread(self._write, manifest, data)

    def _write(self, manifest: Manifest, data: torch.Tensor) -> str:
        pair = self.pairs[manifest.rank]
        free = [i for i, path in enumerate(pair.paths) if not path.exists()]
        if not free:
            raise Problem(f"rank {manifest.rank} has {len(pair.paths)} slot files already; "
                          "remove them ('flashckpt gc shm') and try again")  # fmt: skip
        bare = replace(
            manifest, entries=tuple(replace(e, checksums=None) for e in manifest.entries)
        )
        raw = bare.to_json()
        need = required_capacity(manifest.data_len, len(raw), manifest.n_chunks)
        slot: Slot = pair.prepare_slot(free[0], need, prefault=False)
        self.new[manifest.rank] = slot.path
        if not slot.try_lock(exclusive=True):  # a slot file nobody else has seen yet
            raise Problem(f"{slot.path} is locked by another process; try again")
        try:
            slot.begin_write()
            slot.buf[HEADER_SIZE : HEADER_SIZE + manifest.data_len].copy_(data)
            slot.publish(manifest.step, manifest.data_len, raw, manifest.n_chunks,
                         manifest.generation)  # fmt: skip
            slot.write_checksums([c for e in manifest.entries for c in e.checksums or ()])
        finally:
            slot.unlock()
        return str(slot.path)

    async def commit(self, *_: object) -> None:
        """Every rank is in: the step replaces what their slots held before."""
        for rank, pair in self.pairs.items():
            for path in pair.paths:
                if path != self.new.get(rank):
                    path.unlink(missing_ok=True)

    def close(self, keep: bool) -> None:
        for rank, pair in self.pairs.items():
            pair.close(remove=False)
            if not keep and rank in self.new:
                self.new[rank].unlink(missing_ok=True)


class _TierTarget:
    """A tier (a directory is a ``file://`` one): ranks put as the agent puts them, then one
    commit marker naming them."""

    def __init__(self, url: str):
        from ..storage_tiers import open_tier

        self.tier = open_tier(url)
        self.shown = shown(url)

    async def write(self, manifest: Manifest, data: torch.Tensor) -> str:
        await tier_io.write_rank(self.tier, manifest, memoryview(data.numpy()))
        return f"{self.shown}/{tier_io.layout.data_key(manifest.job, manifest.step, manifest.rank, manifest.generation)}"

    async def commit(self, job: str, step: int, ranks: list[int], c: tier_io.CommittedStep) -> None:
        await tier_io.commit_step(self.tier, job, step, config.node_name(), ranks, c.world_size,
                                  c.lineage, c.incarnation)  # fmt: skip


async def _rank(rank: int, sources: list, job: str, target, progress: Progress,
                limit: asyncio.Semaphore) -> dict[str, Any]:  # fmt: skip
    """Fetch, verify and write one rank from the first source whose copy is good."""
    failures = []
    async with limit:
        for loc, key, c in sources:
            where = f"{loc.shown} step {key[1]} rank {rank}"
            try:
                manifest, data = await loc.read_rank(job, key, rank, c.incarnation)
                manifest, bad = await asyncio.to_thread(_verified, manifest, data, where)
            except (Problem, FlashCkptError, OSError) as exc:
                failures.append(describe_error(exc))
                continue
            if bad:
                failures.append(f"{len(bad)} bad chunk(s), the first: {bad[0]}")
                continue
            written = await target.write(manifest, data)
            progress.update()
            return {"rank": rank, "ok": True, "source": loc.shown, "bytes": manifest.data_len,
                    "written": written, "skipped": failures}  # fmt: skip
    progress.update()
    return {"rank": rank, "ok": False, "source": None, "bytes": 0, "written": None,
            "skipped": failures}  # fmt: skip


async def _tier_target(dest: str, stack: contextlib.AsyncExitStack) -> _TierTarget:
    """The tier ``--to`` names, checked before anything is read: its root must be a directory
    or be creatable as one, and its store reachable."""
    target = _TierTarget(dest)
    stack.push_async_callback(target.tier.close)
    try:
        await target.tier.check_location(create=True)
    except (FlashCkptError, OSError) as exc:
        raise Problem(f"--to: {describe_error(exc)}") from exc
    return target


async def _restore(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    dest = args.to
    SECRETS.learn(dest)
    async with contextlib.AsyncExitStack() as stack:
        tier_target = None if dest == SHM else await _tier_target(dest, stack)
        job, step, sources = await _sources(args, stack, out)
        c = sources[0][2]
        ranks = [args.rank] if args.rank is not None else list(range(c.world_size))
        if dest == SHM:
            if all(loc.url == SHM for loc, _, _ in sources):
                raise UsageError("the step is only in shared memory already; restore into a "
                                 "directory or tier instead")  # fmt: skip
            target: Any = _ShmTarget(config.shm_dir(getattr(args, "shm_dir", None)), job, ranks)
            sources = [s for s in sources if s[0].url != SHM]
        else:
            target = tier_target
        ok = False
        try:
            limit = asyncio.Semaphore(RANKS_IN_FLIGHT)
            with Progress(f"restoring step {step}", total=len(ranks), unit="ranks") as progress:
                done = await asyncio.gather(*(_rank(r, sources, job, target, progress, limit)
                                              for r in ranks))  # fmt: skip
            ok = all(d["ok"] for d in done)
            if ok:
                await target.commit(job, step, ranks, c)
        finally:
            if isinstance(target, _ShmTarget):
                target.close(keep=ok)
    return {"job": job, "step": step, "generation": sources[0][1][0], "to": target.shown,
            "ok": ok, "ranks": done}  # fmt: skip


def run(args: argparse.Namespace, out: Output) -> int:
    if args.to != SHM:
        from ..storage_tiers.registry import check_writable

        try:
            check_writable(args.to)  # parses it too
        except (ConfigError, ImportError) as exc:
            raise UsageError(f"--to: {describe_error(exc)}") from exc
    doc = asyncio.run(_restore(args, out))
    for r in doc["ranks"]:
        for why in r["skipped"]:
            out.problem(f"rank {r['rank']}: not from there: {why}")
        if r["ok"]:
            out.line(f"rank {r['rank']}: step {doc['step']} from {r['source']}, "
                     f"{human_bytes(r['bytes'])}, verified, written to {r['written']}")  # fmt: skip
        else:
            out.problem(f"rank {r['rank']}: no good copy of step {doc['step']} in any location")
    if doc["ok"]:
        out.line(f"step {doc['step']} of job {doc['job']} restored into {doc['to']}")
    else:
        out.problem(f"step {doc['step']} of job {doc['job']} was not restored into {doc['to']}: "
                    "no good copy of some rank; nothing was committed there (ranks written stay "
                    "uncommitted)")  # fmt: skip
    out.document({"command": NAME, **doc})
    return OK if doc["ok"] else PROBLEM
