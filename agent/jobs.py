"""The agent's view of one job: its trainers, its tiers and their persistence loops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from flashckpt.storage_tiers import open_tier
from flashckpt.storage_tiers.peer import PeerTier
from flashckpt.storage_tiers.registry import redact

from flashckpt.faults.events import EventLog
from flashckpt.snapshot.slots import closed_marker_path, free_rank, ranks_in, unowned

from .node_retention import LearnedCommon
from .persist import TierWorker
from .trainers import Trainers

log = logging.getLogger(__name__)


async def _started(worker: TierWorker) -> None:
    """Learn what the tier holds, then persist to it until stopped."""
    await worker.start()
    await worker.run()


class Job:
    def __init__(self, name: str, shm_dir: Path, node: str, metrics=None,
                 events: EventLog | None = None):  # fmt: skip
        self.name, self.shm_dir, self.node, self.metrics = name, shm_dir, node, metrics
        self.events = events  # the job's event log on this node: tier commits and failures
        self.trainers = Trainers()
        self.common = LearnedCommon()  # the steps every node holds, from the controller
        self.workers: dict[str, TierWorker] = {}
        self._tasks: list[asyncio.Task] = []
        # Whether this node may write to shared tiers and peers' memory now: False once its
        # lease from the controller lapsed (the controller may have handed its ranks to a
        # spare); the controller link sets it (``link.Lease``).
        self.may_write: Callable[[], bool] = lambda: True

    async def add_tier(self, url: str) -> TierWorker:
        """Start persisting to ``url`` (idempotent per URL)."""
        if url in self.workers:
            return self.workers[url]
        tier = open_tier(url)
        if isinstance(tier, PeerTier):  # another node's memory: written under the lease too
            tier.may_write = lambda: self.may_write()
        worker = TierWorker(
            self.name, tier, self.shm_dir, self.node, self.metrics,
            trainers=self.trainers, owned=self.owned, common=self.common, events=self.events,
            may_write=lambda: self.may_write(),
        )  # fmt: skip
        self.workers[url] = worker
        # Started in its own task: a tier slow to list (a holder that hangs, a throttled
        # store) never holds up the trainer registering, and so its restore.
        self._tasks.append(asyncio.create_task(_started(worker), name=f"persist {redact(url)}"))
        log.info("job %s: persisting to %s (%s)", self.name, redact(url), worker.state.scope)
        return worker

    def preempt(self, why: str) -> None:
        """From now on, the newest step every rank here holds goes to every tier past its
        throttles (``every_steps``, ``every_seconds``, the duty cycle)."""
        if self.trainers.preempting:
            return
        self.trainers.preempting = True
        log.warning("job %s: %s: persisting the newest step every rank here holds to every "
                    "tier, past their throttles", self.name, why)  # fmt: skip
        if self.events is not None:
            self.events.record("preempt_flush", why=why)
        self.wake()

    def wake(self) -> None:
        for w in self.workers.values():
            w.wake.set()

    def idle(self, give_up_after: float, cut_off: bool = False) -> bool:
        """Every tier holds the newest snapshot, or has been behind for ``give_up_after`` s.
        With ``cut_off`` (the lease lapsed and nothing will renew it), the tiers written under
        the lease count as idle: nothing more can be written there."""
        return all(w.idle(give_up_after) or (cut_off and leased(w))
                   for w in self.workers.values())  # fmt: skip

    def cut_off(self) -> list[TierWorker]:
        """The tiers written under the lease while it does not hold (nothing goes to them)."""
        return [] if self.may_write() else [w for w in self.workers.values() if leased(w)]

    def owned(self, rank: int) -> bool:
        """Whether a live trainer holds ``rank``'s slots right now."""
        with unowned(self.shm_dir, self.name, rank) as free:
            return not free

    def reclaim(self) -> None:
        """Free slots no live trainer will use again: a closed rank's once every tier (a
        failing one too) has its last step, and a stale rank's (one the live job does not run
        on this node) at once. Each is freed under the rank's owner lock, so a trainer that
        claims the rank meanwhile keeps its slots."""
        done = min((w.state.last_committed for w in self.workers.values()), default=None)
        with_slots = ranks_in(self.shm_dir, self.name)
        for rank in self.trainers.stale(with_slots, self.owned):
            with unowned(self.shm_dir, self.name, rank) as free:
                if free:
                    free_rank(self.shm_dir, self.name, rank)
                    log.warning(
                        "job %s: rank %d's slots in %s belong to no live trainer (the job runs "
                        "ranks %s of %d on this node now): removed them",
                        self.name, rank, self.shm_dir / self.name, sorted(self.trainers.pids),
                        self.trainers.world_size,
                    )  # fmt: skip
        for rank in with_slots:
            marker = closed_marker_path(self.shm_dir, self.name, rank)
            if done is None or not marker.exists():
                continue
            with unowned(self.shm_dir, self.name, rank) as free:
                try:
                    step = _closed_at(marker.read_text()) if free else None
                except (OSError, ValueError):
                    continue
                if step is None or done < step:
                    continue  # a trainer owns the rank again, or a tier is still behind
                free_rank(self.shm_dir, self.name, rank)
            log.info(
                "job %s: rank %d closed and step %d is in every tier; its slots are freed",
                self.name, rank, step[1],
            )  # fmt: skip

    async def drain(self, timeout: float) -> None:
        """Persist what is in flight and the newest snapshot (up to ``timeout``), then stop."""
        for w in self.workers.values():
            w.stop()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=timeout)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for w in self.workers.values():
            await w.close()


def leased(worker: TierWorker) -> bool:
    """Whether the worker's tier is written only under the lease: a shared tier, a peer's
    memory."""
    return worker.state.scope == "shared" or isinstance(worker.tier, PeerTier)


def _closed_at(text: str) -> tuple[int, int]:
    """The (generation, step) a closed marker names: ``"<step> <generation>"``."""
    step, _, gen = text.strip().partition(" ")
    return int(gen or 0), int(step)
