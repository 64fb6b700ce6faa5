"""The agent's side of node-local retention: what this node learned of the steps every node of
its job holds, and what it reports for the controller to work them out.

A node-local tier (``file://`` NVMe; not ``peer://``, whose replicas in memory keep only the
newest step) of a multi-node job never deletes the newest step every node holds
(``flashckpt.format.retention``). The node learns those steps from the controller's replies
(``common_steps.py`` is the controller's side) and keeps the last ones it learned while the
controller is down or cannot tell (a node not heard from yet): a step stays proven common
until a newer one is. A node that never learned any deletes no committed step, except one
whose commit marker names every rank of the job: the job runs on this node alone, and a
single-node job (no controller, as the agent a trainer starts by itself) keeps the tier's
policy as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flashckpt.format.retention import Common

from .common_steps import ANSWERED, REPORTED

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (generation, step)


class LearnedCommon:
    """The steps every node of the job holds, as the controller last answered (shared by a
    job's tiers on this node), and why nothing newer is known, for the log."""

    def __init__(self) -> None:
        self.keys: tuple[Key, ...] = ()  # oldest first
        self.version = 0  # bumped whenever ``keys`` change
        self.why = "the job's controller has not answered yet"

    def learn(self, known: bool, keys: Iterable[Key]) -> bool:
        """Take a reply; True if the common steps changed. A reply that cannot tell (a node
        not heard from) or names none (a node that holds nothing yet) keeps what was learned:
        the steps stay on the nodes that held them.

        A step once answered stays learned (the newest ``ANSWERED`` are kept) even when a later
        answer leaves it out. An answer is made of reports of different ages, so it can miss a
        step that every node still holds; a node that forgot such a step would keep fewer
        than ``keep_last`` common steps, and none older than the newest. Every node holds a
        step it learned until it learns ``keep_last`` newer ones, so remembering it costs no
        more than ``keep_last`` allows."""
        if not known:
            self.why = "the controller has not heard from every node of the job yet"
            return False
        new = set(keys)
        if not new:
            self.why = "the controller finds no step that every node holds"
            return False
        self.why = ""
        merged = tuple(sorted(new | set(self.keys))[-ANSWERED:])
        if merged == self.keys:
            return False
        self.keys, self.version = merged, self.version + 1
        return True

    def common(self) -> Common:
        return Common(frozenset(self.keys), partial=len(self.keys) >= ANSWERED)

    def to_report(self, held: Iterable[Key]) -> list[Key]:
        """The steps of a tier to report: its newest ``REPORTED``, and the common steps last
        learned that it still holds (so that a node running far ahead of another does not
        make them look held by fewer nodes)."""
        held = sorted(held)
        return sorted(set(held[-REPORTED:]) | (set(self.keys) & set(held)))

    def explain(self, url: str, job: str, here: int, world: int, said: str) -> str:
        """Say once per reason that a node-local tier of a multi-node job (this node runs
        ``here`` of its ``world`` ranks) keeps every committed step, so that a disk filling
        past ``keep_last`` is explained; the reason now (``said``: the one said last)."""
        why = "" if self.keys else self.why
        if why and why != said and world > here:
            log.warning(
                "tier %s: keeping every committed step of job %s: this node runs %d of its %d "
                "ranks, and no step is known to be held by every node (%s). keep_last applies "
                "once the job's controller says which steps every node holds; check that "
                "every node's agent reports to it", url, job, here, world, why,
            )  # fmt: skip
        return why
