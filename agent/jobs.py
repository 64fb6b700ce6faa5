"""The agent's view of one job: its trainers, its tiers and their persistence loops."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from flashckpt.storage_tiers import open_tier

from flashckpt.slots import N_SLOTS, slot_path

from .persist import TierWorker
from .trainers import Trainers

log = logging.getLogger(__name__)


class Job:
    def __init__(self, name: str, shm_dir: Path, node: str, metrics=None):
        self.name, self.shm_dir, self.node, self.metrics = name, shm_dir, node, metrics
        self.trainers = Trainers()
        self.workers: dict[str, TierWorker] = {}
        self._tasks: list[asyncio.Task] = []

    async def add_tier(self, url: str) -> TierWorker:
        """Start persisting to ``url`` (idempotent per URL)."""
        if url in self.workers:
            return self.workers[url]
        worker = TierWorker(
            self.name, open_tier(url), self.shm_dir, self.node, self.metrics,
            trainers=self.trainers,
        )  # fmt: skip
        self.workers[url] = worker
        await worker.start()
        self._tasks.append(asyncio.create_task(worker.run(), name=f"persist {url}"))
        log.info("job %s: persisting to %s (%s)", self.name, url, worker.state.scope)
        return worker

    def wake(self) -> None:
        for w in self.workers.values():
            w.wake.set()

    def idle(self) -> bool:
        return all(w.idle for w in self.workers.values())

    def release_closed_ranks(self) -> None:
        """Free the slots of ranks whose trainer closed, once every healthy tier has them."""
        done = min(
            (w.state.last_committed for w in self.workers.values() if w.state.healthy), default=None
        )
        for marker in self.shm_dir.joinpath(self.name).glob("rank-*.closed"):
            rank = int(marker.name.split("-")[1].split(".")[0])
            try:
                step = int(marker.read_text() or -1)
            except (OSError, ValueError):
                continue
            if done is None or done < step:
                continue
            for i in range(N_SLOTS):
                slot_path(self.shm_dir, self.name, rank, i).unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
            log.info(
                "job %s: rank %d closed and step %d is persisted; its slots are freed",
                self.name,
                rank,
                step,
            )

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
