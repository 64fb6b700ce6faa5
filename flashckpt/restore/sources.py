"""Where a rank can restore from: its shared-memory slots, then each tier, fastest first.

Each source says which steps it holds for this rank and loads one into a state. The
Checkpointer picks the newest step every rank can get from some source, and each rank loads
it from its fastest source, falling back to the next on a corrupt or unreadable copy.

Everything a source reads back is checked before use (slot headers in ``slot.py``, manifests
in ``manifest.py``, commit markers in ``layout.py``, stored sizes in ``tier_io.py``); a copy
that fails a check, or a checksum, is logged and skipped. Errors that are not about the copy
(the state does not match it, a pickle not allowed) propagate. Checksums: a tier copy always
carries them (one without is refused); a shared-memory snapshot the sealer has not reached yet
has none and restores unverified, as its writer published it complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .. import config, group
from ..errors import (
    CheckpointNotFoundError,
    ChecksumError,
    ManifestError,
    SharedMemoryError,
    TierUnavailableError,
)
from ..format import fence, layout, tier_io
from ..format.lineage import Lineage, newest
from ..format.sealed import bare_entries
from ..format.slot import Slot
from ..snapshot.slots import N_SLOTS, SlotPair, header_or_none, read_locked, slot_path
from .entry_copy import Source
from .into_state import plan, run
from .reshard import MemoryShards, Resharder, per_rank, portable

log = logging.getLogger(__name__)
T = TypeVar("T")

CORRUPT_COPY = (
    ManifestError,
    ChecksumError,
    SharedMemoryError,
    CheckpointNotFoundError,
    TierUnavailableError,
)
"""What a bad or missing copy raises: the restore moves on to the next source or step."""


Key = tuple[int, int]
"""A snapshot's (generation, step)."""

_SHARD = operator.attrgetter("shard")
_STORED_AT = operator.attrgetter("stored_at")


def steps_of(held: dict[Key, Lineage], lineage: Lineage | None) -> set[int]:
    """The steps of ``held`` in ``lineage``'s history (default: the newest branch held)."""
    lineage = newest(list(held.values())) if lineage is None else lineage
    return {s for g, s in held if lineage.holds(g, s)}


def has_shards(m: Any) -> bool:
    """Whether ``m`` holds shards (DTensor or Megatron blocks) a restore may reshard."""
    return any(map(_SHARD, bare_entries(m.entries)))


def _resharded(m: Any, world: int) -> bool:
    """Whether ``m`` holds shards saved at another world size than ``world``."""
    return m.world_size not in (None, world) and has_shards(m)


_TOLD_MOVED: set[Any] = set()
"""Job folders whose ranks were said to have moved (said once a process)."""


class MemorySource:
    name = "shared memory"

    def __init__(self, pair: SlotPair, verify: bool,
                 pinned: Callable[[Slot], bool] = lambda slot: False):  # fmt: skip
        """``pinned``: whether this process has page-locked a slot (device uploads then read
        it directly)."""
        self.pair, self.verify, self.pinned = pair, verify, pinned
        self.incarnation = 0  # the newest run of the job the last look saw

    def snapshots(self) -> dict[Key, Lineage]:
        """This rank's READY snapshots, with the branch each belongs to. One of DTensor shards
        saved at another world size counts only if this node holds that step of every rank
        that saved it (otherwise the resharding reads them from a tier)."""
        out: dict[Key, Lineage] = {}
        world = group.world_size()
        ready = self.pair.ready()
        for slot in ready:
            try:
                with read_locked(slot) as snap:
                    if snap is None:
                        continue
                    m, key = snap.manifest, (snap.generation, snap.step)
                    self.incarnation = max(self.incarnation, m.incarnation)
                    if _resharded(m, world) and not self._holds_every_rank(key, m.world_size):
                        log.info("step %d in shared memory was saved by %d ranks, not %d, and "
                                 "this node lacks some of their shards: they are resharded "
                                 "from a tier", m.step, m.world_size, world)  # fmt: skip
                        continue
                    out[key] = m.lineage
            except CORRUPT_COPY as exc:  # holds nothing readable: not a candidate
                log.warning("%s", exc)
        if not ready and self.pair.dir not in _TOLD_MOVED:
            self._tell_if_moved()
        return out

    def _tell_if_moved(self) -> None:
        """Say so, once, when this node's memory holds none of this rank's snapshots but some of
        ranks it no longer runs: the ranks moved between nodes across a restart, and this one
        restores from a peer or a tier."""
        try:  # the launcher's view: this node runs LOCAL_WORLD_SIZE ranks from RANK - LOCAL_RANK
            env = os.environ
            first = int(env["RANK"]) - int(env["LOCAL_RANK"])
            ours = range(first, first + int(env["LOCAL_WORLD_SIZE"]))
        except (KeyError, ValueError):
            return
        with contextlib.suppress(OSError):
            names = (p.name.partition(".")[0] for p in self.pair.dir.glob("rank-*.slot-*"))
            gone = sorted({int(n[5:]) for n in names if n[5:].isdigit()} - set(ours))
            if gone:
                _TOLD_MOVED.add(self.pair.dir)
                log.warning("this node's shared memory holds snapshots of ranks %s, but it runs "
                            "ranks %s now: the ranks moved between nodes at the restart, and "
                            "rank %d restores from a peer or a tier. torch's rendezvous orders "
                            "nodes by address, then by launcher pid: give each node its own "
                            "address (torchrun --local-addr) so that it keeps its ranks",
                            gone, list(ours), self.pair.rank)  # fmt: skip

    def steps(self, lineage: Lineage | None = None) -> set[int]:
        return steps_of(self.snapshots(), lineage)

    def load(self, state: Mapping[str, Any], key: Key, allow_pickle: bool, **opts: Any) -> bool:
        """Load snapshot ``key`` into ``state``; False if no intact copy. ``opts`` go to
        ``plan`` (``unmatched``, ``key_map``)."""
        ready = self.pair.ready()
        for slot in ready:
            try:
                with read_locked(slot) as snap:
                    if snap is None or (snap.generation, snap.step) != key:
                        continue
                    # Blocks laid out otherwise (another world size, or another parallel
                    # layout at the same size) are assembled from every old rank's snapshot.
                    resharder = Resharder() if has_shards(snap.manifest) else None
                    producer = plan(snap.manifest, state, allow_pickle, resharder, **opts)
                    if (
                        resharder is not None
                        and resharder.wants
                        and not self._reshard(resharder, snap)
                    ):
                        log.info("step %d: this node lacks some old ranks' shards to reshard "
                                 "from; they are read from a tier", snap.step)  # fmt: skip
                        continue
                    where = f"shared memory {slot.path}"
                    data = slot.data_tensor(snap.header)
                    run(producer, Source(data, where, self.verify, self.pinned(slot)))
                    if snap.intact():
                        return True
            except CORRUPT_COPY as exc:  # a corrupt copy: try the next
                log.warning("%s", exc)
        return False

    def _old_slots(self, key: Key, rank: int) -> list[Slot]:
        """Rank ``rank``'s slots on this node whose header says snapshot ``key`` (opened
        read-only; the caller closes them)."""
        found = []
        for i in range(N_SLOTS):
            try:
                slot = Slot.open_readonly(slot_path(self.pair.shm_dir, self.pair.job, rank, i))
            except (OSError, SharedMemoryError):
                continue
            h = header_or_none(slot)
            if h is not None and h.readable and (h.generation, h.step) == key:
                found.append(slot)
            else:
                slot.close()
        return found

    def _holds_every_rank(self, key: Key, world: int) -> bool:
        for r in range(world):
            if r == self.pair.rank:
                continue
            slots = self._old_slots(key, r)
            for slot in slots:
                slot.close()
            if not slots:
                return False
        return True

    def _reshard(self, resharder: Resharder, own: Any) -> bool:
        """Fetch the resharded blocks from every old rank's snapshot on this node, each read
        under its shared lock; False if one is missing or rewritten meanwhile."""
        key, world = (own.generation, own.step), own.manifest.world_size
        with contextlib.ExitStack() as stack:
            snaps = {own.manifest.rank: own}
            for r in range(world):
                if r in snaps:
                    continue
                for slot in self._old_slots(key, r):
                    stack.callback(slot.close)
                    snap = stack.enter_context(read_locked(slot))
                    if snap is not None and (snap.generation, snap.step) == key:
                        snaps[r] = snap
                        break
                else:
                    return False
            run_private(resharder.fetch_from(MemoryShards(snaps), world))
            return all(s.intact() for s in snaps.values())


def transient(exc: BaseException) -> bool:
    """Whether a tier's error may pass by itself (a connection, a timeout, a store's
    throttling), so a listing is worth trying again; a missing or forbidden path, a bad
    setting or a corrupt object is not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, NotADirectoryError)):
        return False
    return isinstance(exc, OSError) and not isinstance(exc, CheckpointNotFoundError)


class Retrying:
    """Tries within a budget of ``budget_s`` seconds: waits of 0.5, 1, 2, 4 s between them,
    none past the budget."""

    def __init__(self, budget_s: float):
        self.budget_s, self.tries = budget_s, 1
        self.deadline, self.delay = time.monotonic() + budget_s, 0.5

    def again(self, what: str) -> bool:
        """Wait before one more try; False (no wait) once the budget would be passed."""
        if time.monotonic() + self.delay > self.deadline:
            return False
        log.info("%s; trying again in %.1f s", what, self.delay)
        time.sleep(self.delay)
        self.delay = min(4.0, self.delay * 2)
        self.tries += 1
        return True

    def spent(self) -> str:
        """What was tried, for a message: empty after a single try."""
        if self.tries == 1:
            return ""
        return f"; {self.tries} tries for {self.budget_s:g} s (FLASHCKPT_LIST_RETRY_S)"


class _KeptPool(ThreadPoolExecutor):
    """A pool that outlives the event loops it serves: closing a loop shuts its default
    executor down, which this one ignores (its threads end with the interpreter)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


@functools.cache
def _blocking_pool() -> ThreadPoolExecutor:
    """The threads a private loop's blocking calls (a tier's reads, listings) run on, kept
    from one restore to the next: a loop's own pool started a thread per call and joined
    them at its end, and on a busy node each start waited for a core (a few milliseconds a
    restore from a tier). Its threads are all started at once, so a process's thread count
    stays level from one restore to the next (a pool growing lazily looks like a leak). A
    forked child makes its own (its parent's threads stayed behind)."""
    n = min(8, (os.cpu_count() or 1) + 4)
    pool = _KeptPool(n, thread_name_prefix="flashckpt-tier-io")
    started = threading.Barrier(n)
    for _ in range(n):  # each call finds every thread before it busy: a new one starts
        pool.submit(started.wait, 30)
    return pool


os.register_at_fork(after_in_child=_blocking_pool.cache_clear)


def run_private(main: Awaitable[T]) -> T:
    """Run ``main`` to its end on a private event loop (sync callers), as ``asyncio.run``
    does but for its SIGINT handler: in the main thread that handler holds the task, and
    putting the old one back formats it, with its result, in an error it drops; a result
    holding a manifest of thousands of entries cost tens of milliseconds a call. Its blocking
    calls run on ``_blocking_pool``; a tier's calls that read or write the caller's memory
    wait for their thread even when cancelled (``storage_tiers.threads.in_thread``)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(_blocking_pool())
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            if left := asyncio.all_tasks(loop):
                for task in left:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def run_with_tier(url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Open ``url`` on a private event loop, run ``fn(tier)``, close it (sync callers)."""
    from ..storage_tiers import open_tier

    async def go() -> T:
        tier = open_tier(url)
        try:
            return await fn(tier)
        finally:
            await tier.close()

    return run_private(go())


def claim_run(urls: list[str], job: str, at_least: int, seen: int) -> int:
    """Claim the epoch of a new run of ``job`` in the shared tiers ``urls`` (``fence.claim``),
    transient errors tried again within ``list_retry_s``; the epoch. A tier where it cannot
    be claimed stops the restore: the run's saves would not be fenced there."""
    from ..storage_tiers import open_tier
    from ..storage_tiers.registry import redact

    async def go() -> int:
        tiers = [open_tier(url) for url in urls]
        try:
            return await fence.claim(tiers, job, at_least, seen, config.node_name())
        finally:
            for tier in tiers:
                await tier.close()

    retry = Retrying(config.list_retry_s())
    while True:
        try:
            return run_private(go())
        except Exception as exc:
            if transient(exc) and retry.again(f"the run of job {job} cannot be claimed ({exc})"):
                continue
            raise TierUnavailableError(
                f"job {job}: the new run could not claim its epoch in {', '.join(map(redact, urls))} "
                f"({type(exc).__name__}: {exc}{retry.spent()}); its saves could not be told from a "
                "stale writer's there: make the tier reachable and writable and restart, or leave "
                "it out of the tiers"
            ) from exc


async def _manifest_sized(tier: Any, job: str, step: int, rank: int, gen: int,
                          run_: int | None) -> tuple[Any, Any]:  # fmt: skip
    """A rank's manifest, its data's size checked against it; (manifest, None): the data
    itself is read when the restore asks for it. Entries another rank stores for this one
    need the whole data read: then (manifest, data)."""
    manifest = await tier_io.read_manifest(tier, job, step, rank, gen, run_)
    if not set(map(_STORED_AT, bare_entries(manifest.entries))) <= {None}:
        return await tier_io.data_of(tier, manifest)
    await tier_io.check_data_size(tier, manifest)
    return manifest, None


async def _fd_of(tier: Any, key: str) -> int:
    return tier.open_fd(key)


class TierSource:
    """A tier's copies of this rank's steps. With ``together`` (a restore, where every rank
    asks at once), a tier every node shares is listed by rank 0 alone and the listing sent to
    the others: one listing per job instead of one per rank, which at thousands of ranks is
    what a store throttles."""

    def __init__(self, url: str, job: str, rank: int, verify: bool, together: bool = False):
        from ..storage_tiers import parse_spec
        from ..storage_tiers.posix import PosixTier
        from ..storage_tiers.registry import redact, tier_class

        self.url, self.job, self.rank, self.verify = url, job, rank, verify
        self.name = redact(url)  # in logs and errors: no credentials
        self.world = group.world_size()
        self.together = together and parse_spec(url).scope.value == "shared"
        # A peer's memory and a directory's files are received straight into the state
        # (see ``_source``).
        self.peer = parse_spec(url).scheme == "peer"
        # Where a new run of the job claims its epoch (``fence``): every tier all nodes write.
        self.claims = parse_spec(url).scope.value == "shared" and not self.peer
        self.streamed = self.peer or issubclass(tier_class(url), PosixTier)
        self._saved_by: dict[Key, tuple[int, int]] = {}  # step -> (rank to read, its world)
        self._incarnations: dict[Key, int] = {}  # step -> the run its commit markers name
        self.incarnation = 0  # the newest run of the job the last listing showed
        # A required tier that cannot be listed stops the restore (``unlisted``: why); an
        # optional one (``tier.optional``: a peer's memory) is skipped (``skipped``: why).
        self.optional = tier_class(url).optional
        self.unlisted = ""  # why the last listing failed: the tier may hold steps not seen
        self.skipped = ""  # the same, of an optional tier: the restore went on without it
        self.failures: list[tuple[str, str]] = []  # (when, why) an optional tier was passed by
        self.empty = False  # the last listing found nothing of the job there
        self._why = ""

    def _listing(self) -> tier_io.Listing | None:
        """The tier's steps of the job; None if it cannot be listed (``_why`` says why). A
        required tier's transient errors are retried within ``list_retry_s``; an optional
        tier gets one try, its waits bounded by the tier itself."""
        retry = Retrying(0.0 if self.optional else config.list_retry_s())
        while True:
            try:
                return run_with_tier(self.url, lambda tier: tier_io.list_steps(tier, self.job))
            except Exception as exc:
                # Whatever keeps a tier from being listed, nothing is raised here: raising on
                # one rank would leave the others waiting in the step agreement.
                if transient(exc) and retry.again(f"tier {self.name} cannot be listed ({exc})"):
                    continue
                self._why = f"{type(exc).__name__}: {exc}" + retry.spent()
                if self.optional:
                    log.warning("tier %s cannot be listed (%s); it only adds a newer copy of "
                                "what the other sources hold, so the restore goes on without "
                                "it", self.name, exc)  # fmt: skip
                else:
                    log.warning("tier %s cannot be listed (%s)", self.name, exc)
                return None

    def snapshots(self, whole: bool = False) -> dict[Key, Lineage]:
        """Committed steps that include this rank (a node-local tier holds only its node's),
        or with ``whole`` those committed for every rank of the job, with the branch each
        belongs to. A rank the job that saved a step did not have (it grew) holds the step
        if another rank's copy is portable: replicas of the whole job, or DTensor shards."""
        self._why = ""
        listing = group.from_first(self._listing) if self.together else self._listing()
        # Rank 0 says why, where it listed the tier for every rank.
        why = (self._why or "the first rank could not list it") if listing is None else ""
        self.unlisted, self.skipped = ("", why) if self.optional else (why, "")
        if self.skipped:
            self.failures.append(("listing", why))
        self.empty = listing == {}
        for k, c in (listing or {}).items():
            if c is not None:
                self._incarnations[k] = c.incarnation
                self.incarnation = max(self.incarnation, c.incarnation)
        out: dict[Key, Lineage] = {}
        stand_ins = []
        for k, c in (listing or {}).items():
            if c is None or (whole and not c.complete):
                continue
            if whole:
                out[k] = c.lineage
            elif self.rank in c.ranks:
                self._saved_by[k] = (self.rank, c.world_size)
                out[k] = c.lineage
            elif (
                c.complete
                and self.rank >= c.world_size
                and (not c.node_local or self.rank % c.world_size in c.ranks)
            ):
                stand_ins.append((k, c))
        if stand_ins:
            try:
                portable_copies = run_with_tier(self.url, lambda tier: asyncio.gather(
                    *(self._stand_in(tier, k, c.world_size) for k, c in stand_ins)))  # fmt: skip
            except Exception as exc:
                log.warning("tier %s: no step can stand in for rank %d (%s)", self.name,
                            self.rank, exc)  # fmt: skip
                portable_copies = [False] * len(stand_ins)
            for (k, c), ok in zip(stand_ins, portable_copies, strict=True):
                if ok:
                    self._saved_by[k] = (self.rank % c.world_size, c.world_size)
                    out[k] = c.lineage
        return out

    def steps(self, lineage: Lineage | None = None, whole: bool = False) -> set[int]:
        return steps_of(self.snapshots(whole), lineage)

    def _source(self, manifest: Any, data: Any, where: str) -> Source:
        """The rank's bytes read already, or (a peer's memory) to be received straight into
        the state's tensors as the restore asks for them."""
        if data is not None:
            return Source(data, where, self.verify)
        url, dkey = self.url, layout.data_key(manifest.job, manifest.step, manifest.rank,
                                              manifest.generation)  # fmt: skip
        fetch = lambda: run_with_tier(url, lambda t: tier_io.read_data(t, manifest))  # noqa: E731
        if self.peer:
            return Source(None, where, self.verify, size=manifest.data_len, fetch=fetch,
                          scatter=lambda pieces: run_with_tier(
                              url, lambda t: t.get_scatter(dkey, pieces, manifest.data_len)))  # fmt: skip
        return Source(None, where, self.verify, size=manifest.data_len, fetch=fetch,
                      opener=lambda: run_with_tier(url, lambda t: _fd_of(t, dkey)))  # fmt: skip

    async def _stand_in(self, tier, key: Key, world: int) -> bool:
        gen, step = key
        try:
            m = await tier_io.read_manifest(tier, self.job, step, self.rank % world, gen,
                                            self._incarnations.get(key))  # fmt: skip
        except (*CORRUPT_COPY, OSError) as exc:
            log.warning("%s: step %d cannot stand in for rank %d: %s", self.name, step,
                        self.rank, exc)  # fmt: skip
            return False
        return portable(m, world)

    def load(self, state: Mapping[str, Any], key: Key, allow_pickle: bool, **opts: Any) -> bool:
        gen, step = key
        rank, world = self._saved_by.get(key, (self.rank, self.world))
        where = f"{self.name} step {step} rank {rank}" + (f" generation {gen}" if gen else "")
        run_ = self._incarnations.get(key)
        opened = []

        def read(tier):
            opened.append(tier)
            if self.streamed:  # the data is received into the state later, not read here
                return _manifest_sized(tier, self.job, step, rank, gen, run_)
            return tier_io.read_rank(tier, self.job, step, rank, gen, run_)

        try:
            manifest, data = run_with_tier(self.url, read)
            # Blocks laid out otherwise than saved are fetched from the ranks that hold them.
            resharder = Resharder() if has_shards(manifest) else None
            producer = plan(manifest, state, allow_pickle, resharder, **opts)
            if resharder is not None and resharder.wants:
                run_with_tier(self.url,
                              lambda t: resharder.fetch(t, self.job, step, gen, world, run_))  # fmt: skip
            run(producer, self._source(manifest, data, where))
        except (*CORRUPT_COPY, OSError, CheckpointNotFoundError) as exc:  # a bad copy, the
            # tier's I/O failed, or it lacks an old rank's shards to reshard from
            log.warning("%s cannot be restored: %s", where, exc)
            if self.optional and not isinstance(exc, (ManifestError, ChecksumError)):
                self.failures.append(("load", f"{type(exc).__name__}: {exc}"))
            return False
        self.name = opened[0].describe() or self.name  # a peer's memory: which node served it
        if rank != self.rank and (own := per_rank(manifest)):
            log.warning("rank %d was not in the %d-rank job that saved step %d: it restored rank "
                        "%d's copy, whose %d per-rank tensors (the first %r) are rank %d's own",
                        self.rank, world, step, rank, len(own), own[0], rank)  # fmt: skip
        return True
