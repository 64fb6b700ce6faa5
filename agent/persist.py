"""One tier's persistence loop: stream the newest snapshot every local rank holds, commit it.

The loop takes the newest step that every rank of the job on this node holds READY, so a
slow tier skips ahead rather than queueing. Every rank's slot of that step is held under a
shared lock for the whole round (the trainers write into their other slot meanwhile), and the
ranks are stored concurrently, straight from the mappings. The node's commit marker is put
only after every rank's manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from flashckpt.storage_tiers.base import TEMP_GRACE_S, Scope
from flashckpt.storage_tiers.registry import option, redact
from flashckpt.storage_tiers.threads import in_thread

from flashckpt.errors import SharedMemoryError, StaleWriterError
from flashckpt.faults.events import EventLog
from flashckpt.format import layout, tier_io
from flashckpt.format.checksum import chunk_checksums
from flashckpt.format.manifest import Entry, Manifest
from flashckpt.format.retention import takes_part
from flashckpt.format.sealed import bare_entries
from flashckpt.format.slot import Slot
from flashckpt.snapshot.slots import N_SLOTS, Snapshot, ranks_in, read_locked, slot_path

from .node_retention import LearnedCommon
from .trainers import Trainers

log = logging.getLogger(__name__)
T = TypeVar("T")

OUTAGE_RETRY_S = 10.0
"""How long at most a failing tier waits before it is tried again, by default."""

Key = tuple[int, int]
"""A snapshot's (generation, step): a newer generation is newer whatever its step."""
NONE: Key = (0, -1)


@dataclass
class TierState:
    """What GetTierStatus and the metrics report for one tier."""

    url: str
    scope: str
    healthy: bool = True
    last_committed: Key = NONE  # (generation, step)
    bytes_persisted: int = 0
    snapshots_persisted: int = 0
    last_error: str = ""
    newest_in_memory: Key = NONE
    newest_published_at: float = 0.0
    last_persist_seconds: float = 0.0
    last_persist_bytes: int = 0
    committed_at: dict[int, float] = field(default_factory=dict)
    held: set[Key] = field(default_factory=set)  # steps complete in the tier, as far as known

    @property
    def lag_steps(self) -> int:
        """Steps in memory not yet committed (at least 1 when a newer branch is waiting)."""
        if self.newest_in_memory <= self.last_committed:
            return 0
        return max(1, self.newest_in_memory[1] - self.last_committed[1])

    @property
    def lag_seconds(self) -> float:
        if self.lag_steps == 0:
            return 0.0
        return max(0.0, time.time() - self.newest_published_at)


async def _all_or_none(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``aws`` together; if one fails, cancel the others and wait until they have stopped
    before raising. The uploads of a round read slots its locks guard: none may go on reading
    once the round is over and a trainer writes into them again."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class SlotReader:
    """Read-only mappings of a job's slots, reopened when a trainer recreates a file."""

    def __init__(self, shm_dir: Path, job: str):
        self.shm_dir, self.job = shm_dir, job
        self._open: dict[Path, tuple[int, Slot]] = {}

    def slot(self, path: Path) -> Slot | None:
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            self._drop(path)
            return None
        cached = self._open.get(path)
        if cached and cached[0] == ino:
            return cached[1]
        self._drop(path)
        try:
            slot = Slot.open_readonly(path)
        except (OSError, ValueError):
            return None
        self._open[path] = (ino, slot)
        return slot

    def held(self) -> dict[int, dict[Key, Slot]]:
        """{rank: {(generation, step): slot}} of the job's READY slots, from headers (no
        locks); every rank with slot files is a key, with none while it holds none READY."""
        out: dict[int, dict[Key, Slot]] = {}
        for rank in ranks_in(self.shm_dir, self.job):
            out[rank] = {}
            for i in range(N_SLOTS):
                slot = self.slot(slot_path(self.shm_dir, self.job, rank, i))
                try:
                    h = slot.header() if slot is not None else None
                except SharedMemoryError as exc:  # holds no snapshot; its owner rewrites it
                    log.debug("%s", exc)  # polled: the owner's reinitialisation is what warns
                    continue
                if h is not None and h.readable:
                    out[rank][h.generation, h.step] = slot
        return out

    def _drop(self, path: Path) -> None:
        cached = self._open.pop(path, None)
        if cached:
            cached[1].close()

    def close(self) -> None:
        for path in list(self._open):
            self._drop(path)


_OWN_GROUPS: dict[int, tuple[object, list]] = {}


def _own_groups(entries: Sequence[Entry]) -> list[tuple[str, tuple[int, int, int] | None]]:
    """(path, its own replica group or None) of every replicated entry, where some entry has
    a group of its own; else empty. Found once per layout (the entries a layout's steps
    share), not on every step."""
    bare = bare_entries(entries)
    found = _OWN_GROUPS.get(id(bare))
    if found is not None and found[0] is bare:
        return found[1]
    own = [(e.path, e.replicas) for e in bare if e.replicated]
    if all(g is None for _, g in own):
        own = []
    if len(_OWN_GROUPS) >= 256:
        _OWN_GROUPS.clear()
    _OWN_GROUPS[id(bare)] = (bare, own)
    return own


class TierWorker:
    """Persists one job's snapshots into one tier."""

    def __init__(
        self, job: str, tier, shm_dir: Path, node: str, metrics=None, poll_s: float = 0.5,
        trainers: Trainers | None = None, owned: Callable[[int], bool] | None = None,
        common: LearnedCommon | None = None, events: EventLog | None = None,
        may_write: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        """``trainers`` is the job's registry on this node, shared by all its tiers; ``owned``
        says whether a live trainer holds a rank's slots; ``common``, the steps every node of
        the job holds as this node learned them (a node-local tier's retention keeps them)."""
        self.job, self.tier, self.node = job, tier, node
        self.events = events
        self.trainers = trainers if trainers is not None else Trainers()
        self.owned = owned or (lambda rank: True)
        # Whether this node may write to a shared tier now (its lease from the controller
        # holds); a node-local tier is this node's alone and is always written.
        self.may_write = may_write or (lambda: True)
        self.reader = SlotReader(shm_dir, job)
        self.state = TierState(tier.spec.url, tier.spec.scope.value)
        self.metrics = metrics
        self.poll_s = poll_s
        self.wake = asyncio.Event()
        spec = tier.spec  # options were checked when the URL was parsed
        self.every_steps = option(spec, "every_steps", 0, int)
        self.every_seconds = option(spec, "every_seconds", 0.0, float)
        # At most this share of the time spent storing (0 or 1: no pause between rounds).
        self.duty = option(spec, "duty", 0.0, float)
        self.keep_last = option(spec, "keep_last", 0, int) or None
        self.keep_every = option(spec, "keep_every", 0, int) or None
        # ranks of one step stored at once (each upload is itself parallel for S3)
        self.rank_concurrency = option(spec, "rank_concurrency", 0, int) or 4
        self.retire_abandoned = bool(option(spec, "retire_abandoned", 0, int))
        self.learned = (common or LearnedCommon()) if takes_part(spec) else None
        self._retired_at = 0  # the version of ``learned`` the last retention pass had
        self._kept_why = ""  # why retention last kept every step (said once)
        self.temp_grace_s = option(spec, "temp_grace_s", TEMP_GRACE_S, float)
        # A failing tier is tried again after 1, 2, 4... seconds, never more than this apart:
        # the newest step reaches it within this long of its return, trainer alive or not.
        self.outage_retry_s = (
            option(spec, "outage_retry_s", OUTAGE_RETRY_S, float) or OUTAGE_RETRY_S
        )
        self._last_persist_time = -math.inf  # none yet: the first step is never throttled
        self._busy = False
        self._stopping = False
        self._refused: Key = NONE  # the last step refused for a job-size mismatch (warned once)
        self._older_warned: Key = NONE
        self._behind_since: float | None = None  # when the tier last fell behind memory
        self._stale: tuple[int, Key] = (-1, NONE)  # (run, step) a newer run's claim refused
        self._lease_warned = False

    def idle(self, give_up_after: float) -> bool:
        """Nothing in flight and nothing in memory newer than what is committed; or the tier
        has been behind (failing, or unable to progress) for ``give_up_after`` seconds. A
        failing tier with steps still in memory is not idle: it is retried with backoff."""
        if self._busy:
            return False
        if self.state.lag_steps == 0:
            self._behind_since = None
            return True
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        return now - self._behind_since >= give_up_after

    async def start(self) -> None:
        """Learn what the tier already holds, so a restarted agent does not redo it, and
        remove what a killed agent left half-written."""
        try:
            done = tier_io.complete(await tier_io.list_steps(self.tier, self.job))
            self.state.last_committed = max(done, default=NONE)
            self.state.held = set(done)
        except Exception as exc:  # an unreachable tier still starts; the loop retries
            self._failed(exc)
            return
        try:
            await self.tier.clean_temporaries(f"{self.job}/", self.temp_grace_s, self._ours())
        except Exception as exc:  # leftovers cost space, not correctness
            log.warning("tier %s: temporaries of crashed uploads stay: %s", self.state.url, exc)

    def _ours(self) -> Callable[[str], bool]:
        """Which keys this node writes: everything in a node-local tier; in a shared one, the
        shards of the ranks with slots here and this node's commit markers. No upload of
        those is in flight while this agent starts (one agent per job and node)."""
        if self.tier.spec.scope is Scope.NODE:
            return lambda key: True
        ranks = set(ranks_in(self.reader.shm_dir, self.job)) | set(self.trainers.pids)
        return lambda key: layout.written_by(self.job, key, self.node, ranks)

    def stop(self) -> None:
        """Finish the round in flight plus one more for the newest snapshot, then return."""
        self._stopping = True
        self.wake.set()

    async def run(self) -> None:
        backoff = 0.0
        while True:
            stopping = self._stopping
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(self.poll_s, backoff))
            self.wake.clear()
            try:
                self._busy = True
                await self.persist_newest()
                backoff = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                backoff = min(self.outage_retry_s, max(1.0, backoff * 2))
            finally:
                self._busy = False
            if stopping:
                return

    def _failed(self, exc: BaseException) -> None:
        was_healthy = self.state.healthy
        self.state.healthy = False
        self.state.last_error = f"{type(exc).__name__}: {exc}"
        log.error("tier %s: %s", self.state.url, self.state.last_error)
        if was_healthy and self.events is not None:  # the outage's start; its end, a commit
            self.events.record(
                "tier_failed", tier=redact(self.state.url), error=self.state.last_error
            )
        if self.metrics:
            self.metrics.error(self.state.url)

    async def persist_newest(self) -> Key | None:
        """Persist and commit the newest step all local ranks hold (the newest generation
        first); its (generation, step), or None."""
        held = self.reader.held()
        required = self.trainers.required(held.keys(), self.owned)
        ours = {r: held.get(r, {}) for r in required or ()}
        newest = max((s for steps in ours.values() for s in steps), default=None)
        # What memory holds now: slots freed or removed leave nothing to be behind on.
        if newest != self.state.newest_in_memory:
            self.state.newest_in_memory = newest or NONE
            self.state.newest_published_at = max(
                (slot.header().published_at for steps in ours.values()
                 for s, slot in steps.items() if s == newest), default=0.0,
            )  # fmt: skip
        if not required or newest is None:
            self._report()
            await self._retire_on_news()
            return None
        # Every rank the live job runs here must hold the step: a step stored without one of
        # them could never be completed later. Slots of other ranks are leftovers, not waited on.
        common = set.intersection(*(set(steps) for steps in ours.values()))
        step = max(common, default=None)
        if step is not None and self.every_steps and not self.trainers.flushes(step):
            # Only steps on the grid of every_steps: every node picks the same ones, so a shared
            # tier holds them whole (each node counting from its own first step would not).
            step = max((s for s in common if s[1] % self.every_steps == 0), default=None)
        if step is not None and self.trainers.preempting and self.trainers.world_size > len(ours):
            # Ranks train in lockstep, so another node's may have stopped one step behind
            # these: the step before the newest goes out first, and the newest step the whole
            # job holds is then whole in a shared tier.
            before = max((s for s in common if s < step), default=None)
            if before is not None and before > self.state.last_committed:
                step = before
        if newest < self.state.last_committed:  # not merely no newer step yet
            self._warn_older(newest)
        if step is None or step <= self.state.last_committed or self._throttled(step):
            self._report()
            await self._retire_on_news()
            return None
        if not self._may_write(step):
            self._report()
            return None
        t0 = time.monotonic()
        # Every rank's copy of the step is locked before any is read, for the whole round:
        # trainers go on saving into their other slot, and no rank's copy can be overwritten
        # while the agent is busy with another rank's (which would starve a slow tier).
        with contextlib.ExitStack() as locks:
            snaps = []
            for rank in sorted(required):
                snap = locks.enter_context(read_locked(ours[rank][step], timeout=0.05))
                if snap is None or (snap.generation, snap.step) != step:
                    return None  # the trainer took the slot back meanwhile; try next round
                snaps.append(snap)
            world = self.trainers.world_size or max(s.manifest.world_size or 0 for s in snaps)
            if world and any(
                (s.manifest.world_size or world) != world or s.manifest.rank >= world for s in snaps
            ):
                if step != self._refused:
                    self._refused = step
                    log.warning(
                        "tier %s: step %d of job %s was saved by ranks of another job size "
                        "(%s, the job has %d ranks now); not storing it", self.state.url,
                        step[1], self.job, sorted({s.manifest.world_size for s in snaps}), world,
                    )  # fmt: skip
                return None
            runs = {s.manifest.incarnation for s in snaps}
            if len(runs) > 1:  # a rank's slot still holds the step an earlier run saved
                if step != self._refused:
                    self._refused = step
                    log.warning(
                        "tier %s: step %d of job %s is held by ranks of different runs of the "
                        "job (%s); not storing it until every rank here saves it again",
                        self.state.url, step[1], self.job, sorted(runs),
                    )  # fmt: skip
                return None
            run = snaps[0].manifest.incarnation
            if (run, step) >= self._stale and run == self._stale[0]:
                return None  # refused already: a newer run claimed the job (see _refuse)
            limit = asyncio.Semaphore(self.rank_concurrency)
            try:
                done = await _all_or_none(
                    self._persist_snapshot(s, limit, self._primary(s.manifest, required))
                    for s in snaps
                )
                written = sum(done)
                await tier_io.commit_step(
                    self.tier, self.job, step[1], self.node, sorted(required),
                    world or len(required), snaps[0].manifest.lineage, run,
                )  # fmt: skip
            except StaleWriterError as exc:
                self._refuse(run, step, exc)
                return None
        self.state.last_committed = step
        self.state.held.add(step)
        self.state.healthy, self.state.last_error = True, ""
        self.state.bytes_persisted += written
        self.state.snapshots_persisted += 1
        self._last_persist_time = time.monotonic()
        self.state.last_persist_seconds = self._last_persist_time - t0
        self.state.last_persist_bytes = written
        log.info(
            "tier %s: committed step %d (generation %d) of job %s (%d ranks, %.1f MiB in %.2fs)",
            self.state.url, step[1], step[0], self.job, len(required), written / 2**20,
            self.state.last_persist_seconds,
        )  # fmt: skip
        if self.events is not None:
            self.events.record("tier_committed", tier=redact(self.state.url), scope=self.state.scope,
                               step=step[1], generation=step[0], bytes=written,
                               seconds=round(self.state.last_persist_seconds, 4))  # fmt: skip
        if self.metrics:
            self.metrics.persisted(self.state.url, written)
        self._report()
        await self._retire()
        return step

    def _may_write(self, step: Key) -> bool:
        """Whether this node may write now: a shared tier only while its lease holds (a node
        cut off from the controller may have had its ranks given to a spare)."""
        if self.tier.spec.scope is Scope.NODE or self.may_write():
            self._lease_warned = False
            return True
        if not self._lease_warned:
            self._lease_warned = True
            log.warning("tier %s: not storing step %d of job %s: this node's lease from the "
                        "controller lapsed (a spare may be taking its ranks); storing resumes "
                        "once the controller answers again", self.state.url, step[1],
                        self.job)  # fmt: skip
        return False

    def _refuse(self, run: int, step: Key, exc: StaleWriterError) -> None:
        """A newer run of the job claimed the tier before ``step``: this run's steps from it
        on are never written there (nothing more is tried for them)."""
        self._stale = (run, step)
        self.state.last_error = str(exc)
        log.warning("%s", exc)
        if self.events is not None:
            self.events.record("stale_writer_refused", tier=redact(self.state.url), run=run,
                               step=step[1], generation=step[0])  # fmt: skip

    async def _retire(self) -> None:
        """Apply the tier's retention policy. A node-local tier keeps what every node's
        retention must agree on: see ``node_retention``."""
        if not (self.keep_last or self.keep_every):
            return
        common, version = None, 0
        if self.learned is not None:
            common, version = self.learned.common(), self.learned.version
            self._kept_why = self.learned.explain(
                self.state.url, self.job, len(self.trainers.pids), self.trainers.world_size,
                self._kept_why,
            )  # fmt: skip
        retired = await tier_io.apply_retention(
            self.tier, self.job, self.keep_last, self.keep_every, self.temp_grace_s,
            self.retire_abandoned, common=common,
        )  # fmt: skip
        self.state.held = set(retired.committed)  # as listed: what another process removed too
        self._retired_at = version  # a pass that failed is made again on the next round

    async def _retire_on_news(self) -> None:
        """Retention again once the steps every node holds changed since its last pass: the
        job's last steps were committed before every node held them."""
        if self.learned is not None and self.learned.version != self._retired_at:
            await self._retire()

    def _warn_older(self, step: Key) -> None:
        """Trainers' newest step is older than one the tier has, in the same branch: a job
        that started over without restore() (restore() would have started a new branch)."""
        if step[0] == self.state.last_committed[0] and step != self._older_warned:
            self._older_warned = step
            log.warning(
                "tier %s: job %s saves step %d, but step %d is committed already; steps at or "
                "below it are not stored again. Call restore() at start (going back starts a new "
                "branch that is stored), or use a new job name", self.state.url, self.job,
                step[1], self.state.last_committed[1],
            )  # fmt: skip

    def _throttled(self, step: Key) -> bool:
        if self.trainers.flushes(step):  # a closing trainer's last step, a preempted job's newest
            return False
        last = self.state.last_committed
        same_branch = last[0] == step[0] and last[1] >= 0
        if self.every_steps and same_branch and step[1] - last[1] < self.every_steps:
            return True
        since = time.monotonic() - self._last_persist_time
        if 0 < self.duty < 1 and since < self.state.last_persist_seconds * (1 / self.duty - 1):
            return True  # the last round's cost, paid back in idle time before the next
        return bool(self.every_seconds) and since < self.every_seconds

    def _primary(self, manifest: Manifest, here: set[int]) -> tier_io.Primaries | None:
        """Which rank stores each replicated entry of ``manifest`` in this tier: its replica
        group's first rank in a shared tier, the group's first rank on this node in a
        node-local one (every rank here is stored in the same round, before the commit).
        One rank for the manifest's group; by entry where entries have groups of their own
        (Megatron blocks, each replicated across its own ranks)."""
        first = self._first_of(manifest.rank, here)
        own = _own_groups(manifest.entries)
        if not own:
            return first(manifest.replicas)
        return {path: r for path, group in own
                if (r := first(group or manifest.replicas)) is not None}  # fmt: skip

    def _first_of(
        self, rank: int, here: set[int]
    ) -> Callable[[tuple[int, int, int] | None], int | None]:
        node = self.tier.spec.scope is Scope.NODE

        @functools.cache
        def first(replicas: tuple[int, int, int] | None) -> int | None:
            if replicas is None:
                return None
            group = range(*replicas)
            if rank not in group:
                return None
            return min(r for r in group if r in here or r == rank) if node else group[0]

        return first

    async def _persist_snapshot(
        self, snap: Snapshot, limit: asyncio.Semaphore, primary: tier_io.Primaries | None
    ) -> int:
        """Store one rank's locked snapshot, straight from the mapping; the bytes written."""
        async with limit:
            manifest: Manifest = snap.manifest
            data = snap.slot.data(snap.header)
            try:
                if not manifest.sealed:  # the trainer died (or is slow) before its sealer ran
                    sums = await in_thread(  # reads the slot: waited for if cancelled
                        chunk_checksums, data, manifest.entries, manifest.chunk_size
                    )
                    manifest = manifest.with_checksums(sums)
                return await tier_io.write_rank(self.tier, manifest, data, primary)
            finally:
                del data  # no export of the mapping outlives the round

    def _report(self) -> None:
        if self.metrics:
            self.metrics.lag(self.state.url, self.state.lag_steps, self.state.lag_seconds)

    async def close(self) -> None:
        self.reader.close()
        await self.tier.close()
