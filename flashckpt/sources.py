"""Where a rank can restore from: its shared-memory slots, then each tier, fastest first.

Each source says which steps it holds for this rank and loads one into a state. The
Checkpointer picks the newest step every rank can get from some source, and each rank loads
it from its fastest source, falling back to the next on a checksum or read error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from . import tier_io
from .errors import ChecksumError, ManifestError
from .restore import Source, plan, run
from .slots import SlotPair, read_locked

log = logging.getLogger(__name__)
T = TypeVar("T")


class MemorySource:
    name = "shared memory"

    def __init__(self, pair: SlotPair, verify: bool):
        self.pair, self.verify = pair, verify

    def steps(self) -> set[int]:
        return {s.header().step for s in self.pair.ready()}

    def load(self, state: Mapping[str, Any], step: int, allow_pickle: bool) -> bool:
        for slot in self.pair.ready():
            with read_locked(slot) as snap:
                if snap is None or snap.step != step:
                    continue
                producer = plan(snap.manifest, state, allow_pickle)
                try:
                    run(
                        producer,
                        Source(
                            slot.data_tensor(snap.header), f"shared memory {slot.path}", self.verify
                        ),
                    )
                except (ChecksumError, ManifestError) as exc:  # a corrupt copy: try the next
                    log.warning("%s", exc)
                    continue
                if snap.intact():
                    return True
        return False


def run_with_tier(url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Open ``url`` on a private event loop, run ``fn(tier)``, close it (sync callers)."""
    from .storage_tiers import open_tier

    async def go() -> T:
        tier = open_tier(url)
        try:
            return await fn(tier)
        finally:
            await tier.close()

    return asyncio.run(go())


class TierSource:
    def __init__(self, url: str, job: str, rank: int, verify: bool):
        self.name, self.job, self.rank, self.verify = url, job, rank, verify

    def steps(self) -> set[int]:
        """Committed steps that include this rank (a node-local tier holds only its node's)."""

        async def go(tier) -> set[int]:
            listing = await tier_io.list_steps(tier, self.job)
            return {s for s, c in listing.items() if c is not None and self.rank in c.ranks}

        try:
            return run_with_tier(self.name, go)
        except (OSError, ImportError) as exc:
            log.warning("tier %s cannot be listed (%s); restoring without it", self.name, exc)
            return set()

    def load(self, state: Mapping[str, Any], step: int, allow_pickle: bool) -> bool:
        try:
            manifest, data = run_with_tier(
                self.name, lambda t: tier_io.read_rank(t, self.job, step, self.rank)
            )
        except (OSError, ManifestError) as exc:
            log.warning(
                "tier %s: step %d rank %d cannot be read: %s", self.name, step, self.rank, exc
            )
            return False
        producer = plan(manifest, state, allow_pickle)
        try:
            run(producer, Source(data, f"{self.name} step {step} rank {self.rank}", self.verify))
        except (ChecksumError, ManifestError) as exc:  # a corrupt copy: try the next
            log.warning("%s", exc)
            return False
        return True
