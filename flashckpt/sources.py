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
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from . import tier_io
from .errors import (
    CheckpointNotFoundError,
    ChecksumError,
    ManifestError,
    SharedMemoryError,
    TierUnavailableError,
)
from .lineage import Lineage, newest
from .restore import Source, plan, run
from .slots import SlotPair, read_locked

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


def steps_of(held: dict[Key, Lineage], lineage: Lineage | None) -> set[int]:
    """The steps of ``held`` in ``lineage``'s history (default: the newest branch held)."""
    lineage = newest(list(held.values())) if lineage is None else lineage
    return {s for g, s in held if lineage.holds(g, s)}


class MemorySource:
    name = "shared memory"

    def __init__(self, pair: SlotPair, verify: bool):
        self.pair, self.verify = pair, verify

    def snapshots(self) -> dict[Key, Lineage]:
        """This rank's READY snapshots, with the branch each belongs to."""
        out: dict[Key, Lineage] = {}
        for slot in self.pair.ready():
            try:
                with read_locked(slot) as snap:
                    if snap is not None:
                        out[snap.generation, snap.step] = snap.manifest.lineage
            except CORRUPT_COPY as exc:  # holds nothing readable: not a candidate
                log.warning("%s", exc)
        return out

    def steps(self, lineage: Lineage | None = None) -> set[int]:
        return steps_of(self.snapshots(), lineage)

    def load(self, state: Mapping[str, Any], key: Key, allow_pickle: bool) -> bool:
        for slot in self.pair.ready():
            try:
                with read_locked(slot) as snap:
                    if snap is None or (snap.generation, snap.step) != key:
                        continue
                    producer = plan(snap.manifest, state, allow_pickle)
                    where = f"shared memory {slot.path}"
                    run(producer, Source(slot.data_tensor(snap.header), where, self.verify))
                    if snap.intact():
                        return True
            except CORRUPT_COPY as exc:  # a corrupt copy: try the next
                log.warning("%s", exc)
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
        from .storage_tiers.registry import redact

        self.url, self.job, self.rank, self.verify = url, job, rank, verify
        self.name = redact(url)  # in logs and errors: no credentials

    def snapshots(self, whole: bool = False) -> dict[Key, Lineage]:
        """Committed steps that include this rank (a node-local tier holds only its node's),
        or with ``whole`` those committed for every rank of the job, with the branch each
        belongs to."""

        async def go(tier) -> dict[Key, Lineage]:
            listing = await tier_io.list_steps(tier, self.job)
            return {k: c.lineage for k, c in listing.items()
                    if c and (c.complete if whole else self.rank in c.ranks)}  # fmt: skip

        try:
            return run_with_tier(self.url, go)
        except Exception as exc:
            # Whatever keeps a tier from being listed, the restore goes on without it: raising
            # here on one rank would leave the others waiting in the step agreement.
            log.warning("tier %s cannot be listed (%s); restoring without it", self.name, exc)
            return {}

    def steps(self, lineage: Lineage | None = None, whole: bool = False) -> set[int]:
        return steps_of(self.snapshots(whole), lineage)

    def load(self, state: Mapping[str, Any], key: Key, allow_pickle: bool) -> bool:
        gen, step = key
        where = f"{self.name} step {step} rank {self.rank}" + (f" generation {gen}" if gen else "")
        try:
            manifest, data = run_with_tier(
                self.url, lambda t: tier_io.read_rank(t, self.job, step, self.rank, gen)
            )
        except (*CORRUPT_COPY, OSError) as exc:  # OSError: the tier's own I/O failed
            log.warning("%s cannot be read: %s", where, exc)
            return False
        try:
            run(plan(manifest, state, allow_pickle), Source(data, where, self.verify))
        except CORRUPT_COPY as exc:  # a corrupt copy: try the next
            log.warning("%s", exc)
            return False
        return True
