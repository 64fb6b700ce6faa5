"""Runs of a job, and the fence that keeps a run that is over from writing into a newer one's.

Each run of a job (a launch, a restart, a requeue on other hosts) writes its steps under a
number, its epoch (the manifests' and commit markers' ``incarnation``). The epoch comes from
one authority that outlives every process: the job's shared tiers themselves. A run claims
epoch E by creating ``<job>/fence/epoch-<E>.json`` there with an exclusive put (a hard link
on a directory tier, ``If-None-Match: *`` on S3), so no two runs ever hold one epoch, and E
is above every epoch claimed before, whatever the run saw of the job's steps.

The claim records ``seen``: the newest step any source showed the run when it started. What
an older run wrote up to that step is the job's history as the newer run found it; whatever
an older run commits above it is a stale writer's (an agent wedged, cut off or draining after
its job was requeued elsewhere) and is fenced out twice over:

- where it lands: a writer of epoch e is refused (StaleWriterError) a step above the ``seen``
  of a claim newer than e, before anything of it is put, and every put of a snapshot only
  creates (``Tier.put(exclusive=True)``): what a run as new or newer wrote is never replaced;
- where it is read: a commit marker of epoch e naming a step above the ``seen`` of a claim
  newer than e never counts (``Limits``), whenever its bytes landed.

A committed step is therefore never rewritten in place, and a stale writer's bytes are never
restored as a newer run's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError, ManifestError, ObjectExistsError, StaleWriterError
from . import layout
from .manifest import load_json

log = logging.getLogger(__name__)

MAX_CLAIM_BYTES = 64 * 1024
"""A claim larger than this is corrupt: flashckpt writes about a hundred bytes."""
MAX_CLAIM_TRIES = 64
"""Claims lost to other claimants in a row before giving up (each loss is another run's
claim, made in the same moment: more than a few means something else is wrong)."""


@dataclass(frozen=True)
class Claim:
    """What a run recorded when it claimed its epoch."""

    epoch: int
    seen: int  # the newest step any source showed the run at its start (-1: none)
    node: str = ""
    claimed_at: float = 0.0

    def to_json(self) -> bytes:
        doc = {"epoch": self.epoch, "seen": self.seen, "node": self.node,
               "claimed_at": self.claimed_at}  # fmt: skip
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, raw: bytes, epoch: int, source: str) -> Claim:
        doc = load_json(raw, source, "epoch claim")
        ok = (
            isinstance(doc, dict)
            and doc.keys() == {"epoch", "seen", "node", "claimed_at"}
            and type(doc["epoch"]) is int and doc["epoch"] == epoch
            and type(doc["seen"]) is int and doc["seen"] >= -1
            and isinstance(doc["node"], str)
            and type(doc["claimed_at"]) in (int, float) and math.isfinite(doc["claimed_at"])
        )  # fmt: skip
        if not ok:
            raise ManifestError(
                f'{source}: expected an epoch claim like {{"epoch": {epoch}, "seen": 12, "node": '
                f'"n0", "claimed_at": 1795292828.0}}, found {raw[:120]!r}; the claim is corrupt '
                "and fences nothing (remove it by hand once no run of the job is writing)"
            )
        return cls(doc["epoch"], doc["seen"], doc["node"], float(doc["claimed_at"]))


async def newest_epoch(tier, job: str) -> int:
    """The newest epoch claimed for ``job`` in ``tier`` (0: none)."""
    keys = await tier.list(f"{job}/{layout.FENCE_DIR}/")
    return max(layout.claims(job, keys), default=0)


async def check(tier, job: str, epoch: int, step: int) -> None:
    """Raise StaleWriterError where run ``epoch`` may not write ``step`` into ``tier`` any
    more: a newer run claimed the job there before having seen that step."""
    keys = await tier.list(f"{job}/{layout.FENCE_DIR}/")
    newer = [e for e in layout.claims(job, keys) if e > epoch]
    if newer and Limits(await read_claims(tier, job, newer)).fenced(epoch, step):
        raise stale(tier, job, epoch, max(newer), step)


def stale(tier, job: str, epoch: int, newest: int, step: int) -> StaleWriterError:
    return StaleWriterError(
        f"tier {_name(tier)}: step {step} of run {epoch} of job {job} is not written: run "
        f"{newest} claimed the job since, before that step, so this writer is a stale one (an "
        "agent of an earlier run that was stopped, cut off or left draining after the job "
        "moved); the newer run's steps stay as they are"
    )


async def claim(tiers: list, job: str, at_least: int, seen: int, node: str) -> int:
    """Claim for a new run of ``job`` the lowest epoch >= ``at_least`` above every epoch
    claimed in any of ``tiers``, in each of them; the epoch. Every claim is an exclusive put:
    losing one to another claimant moves on to the next epoch (the tiers that already took
    this one keep it: an unused claim fences older runs all the same)."""
    epoch = at_least
    for _ in range(MAX_CLAIM_TRIES):
        newest = await asyncio.gather(*(newest_epoch(t, job) for t in tiers))
        epoch = max([epoch, *(n + 1 for n in newest)])
        raw = Claim(epoch, seen, node, time.time()).to_json()
        try:
            for tier in tiers:
                await tier.put(layout.claim_key(job, epoch), [memoryview(raw)], len(raw),
                               exclusive=True)  # fmt: skip
        except ObjectExistsError:
            epoch += 1
            continue
        log.info("job %s: run %d claimed (newest step seen at its start: %d) in %s", job,
                 epoch, seen, ", ".join(_name(t) for t in tiers))  # fmt: skip
        return epoch
    raise StaleWriterError(
        f"job {job}: {MAX_CLAIM_TRIES} epochs in a row were claimed by other runs while this "
        "one tried to claim one: more than one launch of the job is starting at once; stop the "
        "others (one job name, one run at a time) and restart"
    )


async def read_claims(tier, job: str, epochs: Iterable[int]) -> dict[int, Claim]:
    """The claims of ``epochs`` in ``tier``; one that is gone or corrupt is left out (it fences
    nothing: a warning says so)."""
    wanted = sorted(set(epochs))
    got = await asyncio.gather(*(_read_claim(tier, job, e) for e in wanted))
    return {c.epoch: c for c in got if c is not None}


async def _read_claim(tier, job: str, epoch: int) -> Claim | None:
    key = layout.claim_key(job, epoch)
    source = f"{_name(tier)}/{key}"
    try:
        raw = await tier.get(key, 0, MAX_CLAIM_BYTES + 1)
        if len(raw) > MAX_CLAIM_BYTES:
            raise ManifestError(f"{source}: the epoch claim is larger than {MAX_CLAIM_BYTES} "
                                "bytes; it is corrupt and fences nothing")  # fmt: skip
        return Claim.from_json(raw, epoch, source)
    except ManifestError as exc:
        log.warning("%s", exc)
    except CheckpointNotFoundError:
        log.info("%s: the epoch claim went away after the listing", source)
    return None


class Limits:
    """The newest step each run's commit markers may name in a tier: a run's marker counts
    only up to the step every newer run had seen when it claimed its epoch."""

    def __init__(self, claims: dict[int, Claim]):
        # (epoch, the least ``seen`` of the claims from this one on), newest first.
        self._floors: list[tuple[int, int]] = []
        least = math.inf
        for epoch in sorted(claims, reverse=True):
            least = min(least, claims[epoch].seen)
            self._floors.append((epoch, int(least)))

    def limit(self, run: int) -> float:
        """The newest step run ``run`` may have committed; inf where no newer run claimed."""
        out = math.inf
        for epoch, least in self._floors:
            if epoch <= run:
                break
            out = least
        return out

    def fenced(self, run: int, step: int) -> bool:
        return step > self.limit(run)


def _name(tier) -> str:
    from ..storage_tiers.registry import redact

    return redact(tier.spec.url)
