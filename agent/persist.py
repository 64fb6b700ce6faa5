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
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashckpt.storage_tiers.registry import option

from flashckpt import tier_io
from flashckpt.checksum import chunk_checksums
from flashckpt.manifest import Manifest
from flashckpt.slot import Slot
from flashckpt.slots import N_SLOTS, Snapshot, ranks_in, read_locked, slot_path

from .trainers import Trainers

log = logging.getLogger(__name__)


@dataclass
class TierState:
    """What GetTierStatus and the metrics report for one tier."""

    url: str
    scope: str
    healthy: bool = True
    last_committed: int = -1
    bytes_persisted: int = 0
    snapshots_persisted: int = 0
    last_error: str = ""
    newest_in_memory: int = -1
    newest_published_at: float = 0.0
    last_persist_seconds: float = 0.0
    last_persist_bytes: int = 0
    committed_at: dict[int, float] = field(default_factory=dict)

    @property
    def lag_steps(self) -> int:
        return (
            max(0, self.newest_in_memory - self.last_committed) if self.newest_in_memory >= 0 else 0
        )

    @property
    def lag_seconds(self) -> float:
        if self.lag_steps == 0:
            return 0.0
        return max(0.0, time.time() - self.newest_published_at)


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

    def held(self) -> dict[int, dict[int, Slot]]:
        """{rank: {step: slot}} of the job's READY slots, from headers (no locks); every rank
        with slot files is a key, with no steps while it holds none READY."""
        out: dict[int, dict[int, Slot]] = {}
        for rank in ranks_in(self.shm_dir, self.job):
            out[rank] = {}
            for i in range(N_SLOTS):
                slot = self.slot(slot_path(self.shm_dir, self.job, rank, i))
                if slot is not None and (h := slot.header()).readable:
                    out[rank][h.step] = slot
        return out

    def _drop(self, path: Path) -> None:
        cached = self._open.pop(path, None)
        if cached:
            cached[1].close()

    def close(self) -> None:
        for path in list(self._open):
            self._drop(path)


class TierWorker:
    """Persists one job's snapshots into one tier."""

    def __init__(
        self, job: str, tier, shm_dir: Path, node: str, metrics=None, poll_s: float = 0.5,
        trainers: Trainers | None = None,
    ) -> None:  # fmt: skip
        """``trainers`` is the job's registry on this node, shared by all its tiers."""
        self.job, self.tier, self.node = job, tier, node
        self.trainers = trainers if trainers is not None else Trainers()
        self.reader = SlotReader(shm_dir, job)
        self.state = TierState(tier.spec.url, tier.spec.scope.value)
        self.metrics = metrics
        self.poll_s = poll_s
        self.wake = asyncio.Event()
        spec = tier.spec  # options were checked when the URL was parsed
        self.every_steps = option(spec, "every_steps", 0, int)
        self.every_seconds = option(spec, "every_seconds", 0.0, float)
        self.keep_last = option(spec, "keep_last", 0, int) or None
        self.keep_every = option(spec, "keep_every", 0, int) or None
        # ranks of one step stored at once (each upload is itself parallel for S3)
        self.rank_concurrency = option(spec, "rank_concurrency", 0, int) or 4
        self._last_persist_time = 0.0
        self._busy = False
        self._stopping = False

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing newer in memory than what is committed (or failing)."""
        return not self._busy and (self.state.lag_steps == 0 or not self.state.healthy)

    async def start(self) -> None:
        """Learn what the tier already holds, so a restarted agent does not redo it."""
        try:
            committed = await tier_io.committed_steps(self.tier, self.job)
            self.state.last_committed = committed[-1] if committed else -1
        except Exception as exc:  # an unreachable tier still starts; the loop retries
            self._failed(exc)

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
                backoff = min(30.0, max(1.0, backoff * 2))
            finally:
                self._busy = False
            if stopping:
                return

    def _failed(self, exc: BaseException) -> None:
        self.state.healthy = False
        self.state.last_error = f"{type(exc).__name__}: {exc}"
        log.error("tier %s: %s", self.state.url, self.state.last_error)
        if self.metrics:
            self.metrics.error(self.state.url)

    async def persist_newest(self) -> int | None:
        """Persist and commit the newest step all local ranks hold; the step, or None."""
        held = self.reader.held()
        newest = max((s for steps in held.values() for s in steps), default=None)
        if newest is None:
            return None
        if newest > self.state.newest_in_memory:
            self.state.newest_in_memory = newest
            self.state.newest_published_at = max(
                slot.header().published_at
                for steps in held.values()
                for s, slot in steps.items()
                if s == newest
            )
        required = self.trainers.required()
        if required is None:
            self._report()
            return None
        # Every local rank with slots or a live registered trainer must hold the step: a step
        # stored without one of them could never be completed later.
        common = set.intersection(*(set(held.get(r, ())) for r in required | set(held)))
        step = max(common, default=None)
        if step is None or step <= self.state.last_committed or self._throttled(step):
            self._report()
            return None
        t0 = time.monotonic()
        # Every rank's copy of the step is locked before any is read, for the whole round:
        # trainers go on saving into their other slot, and no rank's copy can be overwritten
        # while the agent is busy with another rank's (which would starve a slow tier).
        with contextlib.ExitStack() as locks:
            snaps = []
            for rank in sorted(held):
                snap = locks.enter_context(read_locked(held[rank][step], timeout=0.05))
                if snap is None or snap.step != step:
                    return None  # the trainer took the slot back meanwhile; try next round
                snaps.append(snap)
            limit = asyncio.Semaphore(self.rank_concurrency)
            done = await asyncio.gather(*(self._persist_snapshot(s, limit) for s in snaps))
        written = sum(n for n, _ in done)
        world = max((w or 0 for _, w in done), default=0) or len(held)
        await tier_io.commit_step(self.tier, self.job, step, self.node, sorted(held), world)
        self.state.last_committed = step
        self.state.healthy, self.state.last_error = True, ""
        self.state.bytes_persisted += written
        self.state.snapshots_persisted += 1
        self._last_persist_time = time.monotonic()
        self.state.last_persist_seconds = self._last_persist_time - t0
        self.state.last_persist_bytes = written
        log.info(
            "tier %s: committed step %d of job %s (%d ranks, %.1f MiB in %.2fs)",
            self.state.url, step, self.job, len(held), written / 2**20, time.monotonic() - t0,
        )  # fmt: skip
        if self.metrics:
            self.metrics.persisted(self.state.url, written)
        self._report()
        if self.keep_last or self.keep_every:
            await tier_io.apply_retention(self.tier, self.job, self.keep_last, self.keep_every)
        return step

    def _throttled(self, step: int) -> bool:
        if step <= self.trainers.final_step:  # a closing trainer's last step always goes out
            return False
        if (
            self.every_steps
            and self.state.last_committed >= 0
            and step - self.state.last_committed < self.every_steps
        ):
            return True
        return (
            bool(self.every_seconds)
            and time.monotonic() - self._last_persist_time < self.every_seconds
        )

    async def _persist_snapshot(
        self, snap: Snapshot, limit: asyncio.Semaphore
    ) -> tuple[int, int | None]:
        """Store one rank's locked snapshot, straight from the mapping; (bytes, world size)."""
        async with limit:
            manifest: Manifest = snap.manifest
            data = snap.slot.data(snap.header)
            try:
                if not manifest.sealed:  # the trainer died (or is slow) before its sealer ran
                    sums = await asyncio.to_thread(
                        chunk_checksums, data, manifest.entries, manifest.chunk_size
                    )
                    manifest = manifest.with_checksums(sums)
                return await tier_io.write_rank(self.tier, manifest, data), manifest.world_size
            finally:
                del data  # no export of the mapping outlives the round

    def _report(self) -> None:
        if self.metrics:
            self.metrics.lag(self.state.url, self.state.lag_steps, self.state.lag_seconds)

    async def close(self) -> None:
        self.reader.close()
        await self.tier.close()
