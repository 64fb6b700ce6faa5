"""Which committed steps a tier's retention keeps: the decision alone, apart from any I/O.

A shared tier's committed steps are job-wide (its commit markers cover the world), so it keeps
the newest ``keep_last`` of them. A node-local tier of a multi-node job holds only its node's
ranks: a step it holds restores the job only if every other node holds it too. Such a tier
keeps ``keep_last`` of the steps common to every node of the job (``Common``, learned from the
job's controller) and everything newer than the newest of them, and deletes no committed step
at all while it knows of none: a node that cannot prove a step is covered elsewhere keeps it.

A node-local step whose commit marker names every rank of the job's world is job-wide by
itself: the job ran on this node alone (a single-node job needs no controller for this).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..storage_tiers.base import Scope, TierSpec
from .lineage import Lineage

Key = tuple[int, int]
"""A stored step's (generation, step)."""


def takes_part(spec: TierSpec) -> bool:
    """Whether a tier keeps steps by what every node holds: a node-local storage tier (not
    ``peer://``, whose replicas in memory keep only the newest step)."""
    return spec.scope is Scope.NODE and spec.scheme != "peer"


@dataclass(frozen=True)
class Common:
    """The steps complete on every node of the job, as this node last learned them (empty:
    none learned yet). ``partial``: the list was cut to its newest entries, so older steps
    not listed may be common too."""

    keys: frozenset[Key] = frozenset()
    partial: bool = False


@dataclass(frozen=True)
class Held:
    """What retention needs of one committed step: the ranks its commit markers name and the
    job's world size then."""

    ranks: int
    world_size: int

    @property
    def whole_job(self) -> bool:
        return self.world_size > 0 and self.ranks >= self.world_size


def kept(
    done: Mapping[Key, Held], lineage: Lineage, keep_last: int | None, keep_every: int | None,
    retire_abandoned: bool = False, common: Common | None = None,
) -> set[Key]:  # fmt: skip
    """The committed steps of ``done`` to keep. ``lineage``: the current branch; its steps
    beyond the policy go, and those of abandoned branches too with ``retire_abandoned``.
    ``common`` None: ``done`` is job-wide (a shared tier). Otherwise (a node-local tier)
    the job-wide steps are those of ``common`` and those whose marker covers the world; with
    none of them in the current branch nothing committed goes."""
    ours = sorted((k for k in done if lineage.holds(*k)), key=lambda k: k[1], reverse=True)
    agreed = [k for k in ours if common is None or k in common.keys or done[k].whole_job]
    if not agreed:
        return set(done)
    newest = agreed[0][1]
    keep = set(agreed[:keep_last] if keep_last else agreed)
    keep |= {k for k in ours if k[1] > newest}  # not yet on every node: a restore needs them
    short = (keep_last or 0) - len(agreed)
    if common is not None and common.partial and short > 0:
        # Older common steps went unlisted: keep the newest older ones in their stead.
        keep |= set([k for k in ours if k[1] < agreed[-1][1]][:short])
    if keep_every:
        keep |= {k for k in ours if k[1] % keep_every == 0}
    if not retire_abandoned:
        keep |= set(done) - set(ours)
    return keep
