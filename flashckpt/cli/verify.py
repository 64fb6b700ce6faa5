"""``flashckpt verify URL... [--step N] [--rank R]``: re-read a stored step as a restore would
and report every problem: each bad chunk with its object (or slot file), byte range and
entry, each manifest, size, replica or commit problem. Exit 1 if any is found. Whichever
step it verifies, it also reports each step of a tier that is no checkpoint (commit markers
naming ranks with no stored manifest, or markers a newer run fenced out; see ``_Leftover``).

A tier copy is read chunk by chunk (memory stays bounded whatever the size). An entry another
rank stores for this one (``stored_at``, a replicated entry stored once) is checked against
that rank's manifest and its bytes are verified once, where they are stored. In shared
memory, a slot the sealer has not reached has no checksums: it is reported as unverified
(a restore takes it as it is), not as a problem.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..errors import FlashCkptError
from ..format import layout, tier_io
from ..format.checksum import chunk_mismatch, crc
from ..format.manifest import Entry, Manifest
from ..format.slot import HEADER_SIZE
from ..snapshot.slots import Snapshot
from .common import (
    OK,
    PROBLEM,
    Output,
    Problem,
    Progress,
    add_dirs,
    add_job,
    chosen_job,
    describe_error,
    locations,
    rank_arg,
    ranks_text,
    shm_dir,
    step_arg,
)
from .locations import (
    Key,
    ShmLocation,
    TierLocation,
    committed_in,
    job_at,
    newest_key,
    open_location,
    stray_line,
)

NAME = "verify"
HELP = "re-read a stored step and check every chunk against its checksum"
BLOCK = 8 * 2**20  # bytes of whole chunks read in one request
READS_IN_FLIGHT = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="*", metavar="URL",
                   help="tier URL or 'shm'; several are verified one after the other")  # fmt: skip
    p.add_argument("--tier", action="append", default=[], metavar="URL",
                   help="a location to verify, as a URL argument does (repeatable)")  # fmt: skip
    add_job(p)
    p.add_argument("--step", type=step_arg, default=None, metavar="N",
                   help="the step to verify (default: the newest committed one)")  # fmt: skip
    p.add_argument("--rank", type=rank_arg, default=None, metavar="R",
                   help="verify only this rank (default: every committed rank)")  # fmt: skip
    add_dirs(p)


@dataclass
class Report:
    """Everything found at one location."""

    location: str
    job: str | None = None
    step: int | None = None
    generation: int = 0
    ranks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, kind: str, message: str, **where: Any) -> None:
        self.problems.append({"kind": kind, "message": message, **where})

    @property
    def ok(self) -> bool:
        return not self.problems

    def doc(self) -> dict[str, Any]:
        return {"location": self.location, "job": self.job, "step": self.step,
                "generation": self.generation, "ok": self.ok, "ranks": self.ranks,
                "problems": self.problems, "notes": self.notes}  # fmt: skip


class _Checker:
    """Verifies the ranks of one step at one location into ``report``."""

    def __init__(self, loc: TierLocation | ShmLocation, job: str, key: tuple[int, int],
                 report: Report, progress: Progress, incarnation: int | None = None):  # fmt: skip
        self.loc, self.job, self.key, self.report, self.progress = loc, job, key, report, progress
        self.incarnation = incarnation  # the run the step's commit markers name
        self.seen: set[tuple[int, str]] = set()  # (rank storing the bytes, entry path) checked
        self.manifests: dict[int, asyncio.Task] = {}
        self.reads = asyncio.Semaphore(READS_IN_FLIGHT)

    async def rank(self, rank: int) -> None:
        if isinstance(self.loc, ShmLocation):
            try:
                m = self.loc.with_rank(self.job, self.key, rank, lambda s: self._slot(rank, s))
            except Problem as exc:
                self.report.problem("missing", str(exc), rank=rank)
                return
            except (FlashCkptError, OSError) as exc:
                self.report.problem("manifest", describe_error(exc), rank=rank)
                return
        else:
            m = await self._tier_rank(rank)
        if m is None:
            return
        self.report.ranks.append({"rank": rank, "entries": len(m.entries), "chunks": m.n_chunks})

    # ---- shared memory ---------------------------------------------------------------------
    def _slot(self, rank: int, snap: Snapshot) -> Manifest:
        m = snap.manifest
        if not snap.header.sealed:
            self.report.notes.append(f"rank {rank}: {snap.slot.path} is not sealed yet, so it "
                                     "has no checksums to verify (a restore takes it as is)")  # fmt: skip
            return m
        data = snap.slot.data(snap.header)
        where = f"{snap.slot.path} (data from byte {HEADER_SIZE})"
        for e in m.entries:
            self.progress.add_total(e.nbytes)
            self._compare(data, 0, e, m.chunk_size, 0, e.chunk_ranges(m.chunk_size),
                          (rank, str(snap.slot.path), HEADER_SIZE, where))  # fmt: skip
            self.progress.update(e.nbytes)
        return m

    def _compare(self, buf, buf_start: int, e: Entry, chunk_size: int, first: int,
                 ranges: list[tuple[int, int]], at: tuple[int, str, int, str]) -> None:  # fmt: skip
        """Check chunks ``first``... of ``e`` (byte ``ranges`` in data coordinates, held in
        ``buf`` from data byte ``buf_start``); ``at``: the rank storing them, the object or
        file, where its data starts in it, and how to name it in messages."""
        rank, key, base, where = at
        for i, (a, b) in enumerate(ranges, start=first):
            got = crc(buf[a - buf_start : b - buf_start])
            if got != e.checksums[i]:
                self.report.problem("chunk", str(chunk_mismatch(where, e, i, got, chunk_size)),
                                    rank=rank, key=key, offset=base + a, end=base + b,
                                    entry=e.path, chunk=i)  # fmt: skip

    # ---- a tier ----------------------------------------------------------------------------
    async def _manifest(self, rank: int) -> Manifest:
        """Rank ``rank``'s stored manifest, read once however many ranks refer to it."""
        if rank not in self.manifests:
            gen, step = self.key
            read = tier_io.read_manifest(self.loc.tier, self.job, step, rank, gen,
                                         self.incarnation)  # fmt: skip
            self.manifests[rank] = asyncio.ensure_future(read)
        return await asyncio.shield(self.manifests[rank])

    def _data_key(self, rank: int) -> str:
        return layout.data_key(self.job, self.key[1], rank, self.key[0])

    async def _tier_rank(self, rank: int) -> Manifest | None:
        try:
            m = await self._manifest(rank)
        except (FlashCkptError, OSError) as exc:
            mkey = layout.manifest_key(self.job, self.key[1], rank, self.key[0])
            self.report.problem("manifest", describe_error(exc), rank=rank, key=mkey)
            return None
        todo: list[tuple[int, Entry, int]] = []
        if await self._size_ok(rank, m.data_len):
            todo += [(rank, e, m.chunk_size) for e in m.entries if e.stored_at is None]
        for e in m.entries:
            if e.stored_at is not None and (found := await self._stored(rank, e)) is not None:
                todo.append(found)
        fresh = []
        for owner, e, chunk in todo:  # no await in here: the check and the claim are one step
            if (owner, e.path) not in self.seen:
                self.seen.add((owner, e.path))
                fresh.append((owner, e, chunk))
        self.progress.add_total(sum(e.nbytes for _, e, _ in fresh))
        await asyncio.gather(*(self._blocks(*t) for t in fresh))
        return m

    async def _size_ok(self, rank: int, size: int) -> bool:
        """Whether the data object holds exactly ``size`` bytes (what a restore checks first)."""
        dkey = self._data_key(rank)
        where = f"{self.loc.shown}/{dkey}"
        try:
            tail = await self.loc.tier.get(dkey, max(size - 1, 0), size + 1)
        except (FlashCkptError, OSError) as exc:
            self.report.problem("size", describe_error(exc), rank=rank, key=dkey)
            return False
        if len(tail) == min(size, 1):
            return True
        found = "more" if len(tail) > min(size, 1) else "fewer"
        self.report.problem("size", f"{where} holds {found} than the {size} bytes its "
                            "manifest's data_len says; the copy is truncated or corrupt, restore "
                            "from another tier or an older step", rank=rank, key=dkey)  # fmt: skip
        return False

    async def _stored(self, rank: int, e: Entry) -> tuple[int, Entry, int] | None:
        """The entry rank ``e.stored_at`` stores for ``rank``, checked to be the same array."""
        where = f"{self.loc.shown} step {self.key[1]} rank {rank} stores {e.path!r} at rank {e.stored_at}"
        try:
            other = await self._manifest(e.stored_at)
        except (FlashCkptError, OSError) as exc:
            self.report.problem("replica", f"{where}, whose manifest cannot be read: "
                                f"{describe_error(exc)}", rank=rank, entry=e.path)  # fmt: skip
            return None
        src = next((o for o in other.entries if o.path == e.path and o.stored_at is None), None)
        if src is None or (src.kind, src.dtype, src.shape) != (e.kind, e.dtype, e.shape):
            found = "no such entry" if src is None else f"{src.dtype} {list(src.shape)}"
            self.report.problem("replica", f"{where}, whose copy has {found}; a restore of rank "
                                f"{rank} fails", rank=rank, entry=e.path)  # fmt: skip
            return None
        if src.checksums != e.checksums:
            self.report.notes.append(f"{where}: the checksums differ from that rank's; a "
                                     "restore uses that rank's copy")  # fmt: skip
        return e.stored_at, src, other.chunk_size

    async def _blocks(self, owner: int, e: Entry, chunk_size: int) -> None:
        ranges = e.chunk_ranges(chunk_size)
        per = max(1, BLOCK // chunk_size)
        await asyncio.gather(*(self._block(owner, e, chunk_size, ranges, first, per)
                               for first in range(0, len(ranges), per)))  # fmt: skip

    async def _block(self, owner: int, e: Entry, chunk_size: int,
                     ranges: list[tuple[int, int]], first: int, per: int) -> None:  # fmt: skip
        dkey = self._data_key(owner)
        group = ranges[first : first + per]
        start, end = group[0][0], group[-1][1]
        async with self.reads:
            try:
                raw = await self.loc.tier.get(dkey, start, end)
            except (FlashCkptError, OSError) as exc:
                self.report.problem("read", describe_error(exc), rank=owner, key=dkey,
                                    offset=start, end=end, entry=e.path)  # fmt: skip
                return
        where = f"{self.loc.shown}/{dkey}"
        whole = [(a, b) for a, b in group if b - start <= len(raw)]
        if len(whole) < len(group):
            a, b = group[len(whole)]
            self.report.problem("size", f"{where} ends at byte {start + len(raw)}, inside chunk "
                                f"{first + len(whole)} of {e.path!r} (bytes {a}-{b})", rank=owner,
                                key=dkey, offset=a, end=b, entry=e.path)  # fmt: skip
        at = (owner, dkey, 0, where)
        await asyncio.to_thread(self._compare, raw, start, e, chunk_size, first, whole, at)
        self.progress.update(end - start)


async def verify_at(url: str, args: argparse.Namespace, progress: Progress) -> Report:
    loc = open_location(url, shm_dir(args))
    report = Report(loc.shown)
    try:
        async with loc:
            await _verify(loc, args, report, progress)
    except Problem as exc:
        report.problem("missing", str(exc))
    except (FlashCkptError, OSError) as exc:
        report.problem("location", describe_error(exc))
    return report


async def _verify(loc, args: argparse.Namespace, report: Report, progress: Progress) -> None:
    job = report.job = await job_at(loc, chosen_job(args))
    report.notes += [stray_line(loc.shown, name) for name in await loc.strays(job)]
    listing = await loc.listing(job)
    leftovers = await _leftovers(loc, job, listing)
    try:
        await _verify_step(loc, job, listing, leftovers, args, report, progress)
    except Problem as exc:  # no such step: said first, then the leftovers
        report.problem("missing", str(exc))
    finally:  # reported also where no step can be verified
        chosen = (report.generation, report.step) if report.step is not None else None
        for left in leftovers:
            report.problems.append(left.problem(loc, job, chosen))


async def _verify_step(loc, job: str, listing: tier_io.Listing, leftovers: list[_Leftover],
                       args: argparse.Namespace, report: Report, progress: Progress) -> None:  # fmt: skip
    done = committed_in(listing)
    key = newest_key(listing, args.step)
    c = listing.get(key) if key is not None else None
    report.step = args.step if key is None else key[1]
    if c is None or not (c.ranks or c.problems):
        if args.step is None:
            raise Problem(f"job {job} has no committed step in {loc.shown}")
        raise Problem(f"step {args.step} is not committed in {loc.shown} (committed: {done})")
    report.generation = key[0]
    said = next((left for left in leftovers if left.key == key and left.missing), None)
    for problem in c.problems:
        if said is not None and "manifests are not stored" in problem:
            continue  # the step's own report (``_Leftover``) says it, and what it looks like
        report.problem("commit", problem)
    if not c.world_size and getattr(c, "fenced", ()):  # the others are corrupt
        report.problem("commit", f"{loc.shown} step {key[1]}: no commit marker of it counts "
                       "(each is empty, corrupt or a fenced-out stale writer's, see the other "
                       "messages), so no rank of it is committed; a restore cannot use this "
                       "step, restore an older one or from another tier")  # fmt: skip
    elif not c.world_size:  # no marker could be read: none names a rank or a world size
        report.problem("commit", f"{loc.shown} step {key[1]}: none of its commit markers can be "
                       "read (each is empty or corrupt, see above), so no rank of it is "
                       "committed; a restore cannot use this step, restore an older one or "
                       "from another tier")  # fmt: skip
    elif not c.complete:
        report.problem("commit", f"{loc.shown} step {key[1]}: only ranks {sorted(c.ranks)} of "
                       f"{c.world_size} are committed; a restore cannot use this step")  # fmt: skip
    ranks = sorted(c.ranks)
    if args.rank is not None:
        if args.rank not in c.ranks:
            report.problem("commit", f"rank {args.rank} is not committed in step {key[1]} at "
                           f"{loc.shown} (committed ranks: {ranks})", rank=args.rank)  # fmt: skip
        ranks = [r for r in ranks if r == args.rank]
    checker = _Checker(loc, job, key, report, progress, c.incarnation)
    await asyncio.gather(*(checker.rank(r) for r in ranks))
    bad = {p.get("rank") for p in report.problems}
    for r in sorted(report.ranks, key=lambda r: r["rank"]):
        r["ok"] = r["rank"] not in bad
    report.ranks.sort(key=lambda r: r["rank"])


# ---- steps that are no checkpoint ----------------------------------------------------------
# Commit markers naming ranks whose manifests are not stored (``tier_io.list_steps`` counts
# those ranks as not committed), or markers whose writer a newer run of the job fenced out
# (``CommittedStep.fenced``): restore and retention take the step as uncommitted and go on,
# but the location holds something that is no checkpoint, so verify reports it (exit 1),
# whichever step it verifies, saying what it looks like and what to do about it.


@dataclass
class _Leftover:
    """A step of the listing that looks like a stray, a cut-short copy or a stale writer's."""

    key: Key
    step: tier_io.CommittedStep
    missing: list[int]  # ranks the counted markers name whose manifest is not stored
    present: list[int]  # ranks they name whose manifest is stored
    fenced: tuple[str, ...]  # markers that do not count: a newer run fenced their writer out
    older: list[str]  # nodes whose markers are of an earlier run than the counted ones
    newest: Key | None  # the newest step committed at the location

    @property
    def stray(self) -> bool:
        """Markers naming ranks none of whose manifests exist: no copy the agent wrote (it
        puts a node's marker only after its ranks' manifests) nor one a writer was cut in."""
        return bool(self.missing) and not (self.present or self.fenced or self.older)

    def problem(self, loc, job: str, chosen: Key | None) -> dict[str, Any]:
        gen, step = self.key
        where = f"{loc.shown}/{layout.step_prefix(job, step, gen)}"
        name = f"step {step}" + (f" (generation {gen})" if gen else "")
        facts = []
        if self.missing:
            named = _ranks(sorted(self.missing + self.present))
            if self.present:
                many = len(self.missing) > 1
                facts.append(f"its commit markers name {named}, but the manifest{'s' * many} of "
                             f"{_ranks(self.missing)} {'are' if many else 'is'} not stored there")  # fmt: skip
            else:
                facts.append(f"its commit markers name {named}, and no manifest of "
                             f"{'any of them' if len(self.missing) > 1 else 'it'} is stored there")  # fmt: skip
        if self.fenced:
            facts.append("commit markers there do not count, a newer run of the job having "
                         f"fenced their writer out: {'; '.join(self.fenced)}")  # fmt: skip
        elif self.older:
            facts.append(f"the commit markers of nodes {', '.join(self.older)} are of an earlier "
                         f"run of the job than run {self.step.incarnation}'s")  # fmt: skip
        if self.fenced:
            kind = "stale-step"
            looks = "a stale writer's leftover"
        elif self.stray:
            kind = "stray-step"
            looks = ("a stray, not a copy flashckpt's agent wrote (it puts a node's commit "
                     "marker only after every one of its ranks' manifests): markers copied or "
                     "written by hand, or a copy cut short before any manifest")  # fmt: skip
        else:
            kind = "stale-step"
            looks = ("a stale writer's leftover (an agent of an earlier run still uploading, a "
                     "second job under the same name) or a cut-short copy (a copy of the tier "
                     "interrupted, or a step being removed: run verify again to tell)")  # fmt: skip
        if self.step.complete and not self.missing:  # fenced beside markers that commit it
            check = "" if chosen == self.key else f"check it with `verify --step {step}`, and "
            todo = (f"the step counts only run {self.step.incarnation}'s markers, which commit it; "
                    f"{check}remove the stale markers in {where} by hand once their writer is "
                    "stopped")  # fmt: skip
        elif self.newest is not None and self.key < self.newest:
            todo = ("restore and retention take it as uncommitted; retention removes it with "
                    "the steps older than the newest committed one (at the agent's next pass, "
                    f"or now: `flashckpt gc {loc.shown} --job {job} --keep-last K`), or remove "
                    f"{where} by hand")  # fmt: skip
        else:
            todo = ("restore and retention take it as uncommitted, and retention keeps it (it "
                    "is newer than the newest committed step, as an upload in flight is): "
                    f"remove {where} by hand once no writer of job {job} is at work there")  # fmt: skip
        message = f"{where}: {name}: {'; '.join(facts)}; it looks like {looks}; {todo}"
        return {"kind": kind, "message": message, "step": step, "generation": gen,
                "missing_ranks": self.missing}  # fmt: skip


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"


async def _leftovers(loc, job: str, listing: tier_io.Listing) -> list[_Leftover]:
    """The steps of ``listing`` whose commit markers name ranks with no stored manifest, or
    that hold markers of a fenced-out writer. A step with neither costs no request: only a
    step the listing found a problem in has its markers read again, to name its ranks."""
    suspect = {k: c for k, c in listing.items() if c is not None and c.problems}
    found = {}
    if suspect and isinstance(loc, TierLocation):
        found = layout.scan(job, await loc.tier.list(f"{job}/"))
    done = tier_io.complete(listing)
    newest = max(done, default=None)
    out = []
    for key, c in sorted(listing.items(), key=lambda kc: (kc[0][1], kc[0][0])):
        if c is None:
            continue
        fenced = tuple(getattr(c, "fenced", ()) or ())
        missing: list[int] = []
        present: list[int] = []
        older: list[str] = []
        if key in suspect and key in found:
            named, older = await _named(loc.tier, found[key].markers, key[0], c.incarnation)
            missing = sorted(named - found[key].manifests)
            present = sorted(named & found[key].manifests)
        if missing or fenced:
            out.append(_Leftover(key, c, missing, present, fenced, older, newest))
    return out


async def _named(tier, markers: tuple[str, ...], generation: int,
                 incarnation: int) -> tuple[set[int], list[str]]:  # fmt: skip
    """The ranks the counted commit markers (of ``incarnation``) name, and the nodes whose
    markers are of an earlier run. A marker that cannot be read is left out: the listing's
    problems name it already."""

    async def read(key: str) -> layout.CommitMarker | None:
        try:
            raw = await tier.get(key, 0, tier_io.MAX_MARKER_BYTES + 1)
            if not raw or len(raw) > tier_io.MAX_MARKER_BYTES:
                return None
            return layout.CommitMarker.from_json(raw, key)
        except (FlashCkptError, OSError):
            return None

    read_back = await asyncio.gather(*(read(k) for k in markers))
    ours = [m for m in read_back if m is not None and m.lineage.generation == generation]
    named = {r for m in ours if m.incarnation == incarnation for r in m.ranks}
    return named, sorted(m.node for m in ours if m.incarnation < incarnation)


def show(report: Report, out: Output) -> None:
    gen = f" (generation {report.generation})" if report.generation else ""
    step = f"step {report.step}{gen} in " if report.step is not None else ""
    for r in report.ranks:
        if r["ok"]:
            out.line(f"step {report.step} rank {r['rank']}: {r['entries']} entries, "
                     f"{r['chunks']} chunks OK")  # fmt: skip
    for note in report.notes:
        out.problem(f"note: {note}")
    for p in report.problems:
        out.problem(p["message"])
    chosen = (report.generation, report.step)
    elsewhere = [p for p in report.problems
                 if "step" in p and (p["generation"], p["step"]) != chosen]  # fmt: skip
    steps = ", ".join(f"step {p['step']}" + (f" (generation {p['generation']})" if p["generation"]
                                             else "") for p in elsewhere)  # fmt: skip
    if report.problems and len(elsewhere) == len(report.problems) and report.ranks:
        out.problem(f"{step}{report.location}: {len(report.ranks)} rank(s) verified, no problem "
                    f"found in it; {len(elsewhere)} problem(s) found in other steps ({steps})")  # fmt: skip
    elif report.problems:
        also = f", {len(elsewhere)} of them in other steps ({steps})" if elsewhere else ""
        out.problem(f"{step}{report.location}: {len(report.problems)} problem(s) found{also}")
    else:
        out.line(f"{step}{report.location}: {len(report.ranks)} rank(s) verified, no "
                 "problem found")  # fmt: skip


def run(args: argparse.Namespace, out: Output) -> int:
    urls = locations(args)

    async def go() -> list[Report]:
        reports = []
        with Progress("verifying") as progress:
            for url in urls:
                reports.append(await verify_at(url, args, progress))
        return reports

    reports = asyncio.run(go())
    for report in reports:
        show(report, out)
    ok = all(r.ok for r in reports)
    out.document({"command": NAME, "ok": ok, "results": [r.doc() for r in reports]})
    return OK if ok else PROBLEM
