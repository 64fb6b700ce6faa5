"""The controller's side of node-local retention: the steps every node of a job holds.

A node-local tier (NVMe) holds only its own node's ranks, so a step there restores the job
only if every node holds it. Each agent reports, with every heartbeat, the newest steps its
node-local tiers hold complete (``TierCommit.held``); the controller answers the newest steps
held by every live node that runs ranks of the job (``ReportReply.common``), and the agents'
retention never deletes the newest of them (``flashckpt.format.retention``).

A node counts a step as held when any of its node-local tiers holds it: a restore reads a
rank from whichever of its node's tiers has it. The answer is known only once the nodes
heard from cover every rank of the job: a node not heard from yet, lost, or silent for longer
than the node timeout leaves it unknown, and the agents then keep what they have.

Kept by counters (how many nodes hold each step, claim each rank and each world size), like
``commits.py``: a report costs the same at any number of nodes, and the answer is computed
again only when a node's holdings change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

Key = tuple[int, int]  # (generation, step)

REPORTED = 32
"""How many of its newest steps a node reports per node-local tier (besides the common steps
it last learned and still holds)."""
ANSWERED = 32
"""How many of the newest common steps the controller answers."""


def held_steps(tiers: Iterable) -> set[Key]:
    """The steps a node's report says its node-local tiers hold (``TierCommit.held``)."""
    return {(k.generation, k.step) for t in tiers for k in t.held}


@dataclass(frozen=True)
class Holding:
    keys: frozenset[Key]
    ranks: frozenset[int]
    world: int


@dataclass
class CommonSteps:
    """One job's node-local holdings, node by node, and the steps every node holds."""

    nodes: dict[str, Holding] = field(default_factory=dict)
    keys: Counter = field(default_factory=Counter)  # (generation, step) -> nodes holding it
    ranks: Counter = field(default_factory=Counter)  # rank -> nodes that run it
    worlds: Counter = field(default_factory=Counter)  # world size -> nodes that claim it
    _answer: tuple[bool, list[Key]] | None = None

    def update(self, node: str, keys: Iterable[Key], ranks: frozenset[int], world: int) -> None:
        """What ``node`` holds now; a node that runs no rank takes no part."""
        if not ranks:
            self.drop(node)
            return
        new = Holding(frozenset(keys), ranks, world)
        if self.nodes.get(node) == new:
            return
        self.drop(node)
        self.nodes[node] = new
        self.keys.update(new.keys)
        self.ranks.update(ranks)
        self.worlds[world] += 1
        self._answer = None

    def drop(self, node: str) -> None:
        """``node`` takes no part any more (lost, silent, or it runs no rank)."""
        old = self.nodes.pop(node, None)
        if old is None:
            return
        self.keys.subtract(old.keys)
        self.ranks.subtract(old.ranks)
        self.worlds.subtract([old.world])
        for counter in (self.keys, self.ranks, self.worlds):
            for k in [k for k, n in counter.items() if n <= 0]:
                del counter[k]
        self._answer = None

    def answer(self) -> tuple[bool, list[Key]]:
        """(known, the newest ``ANSWERED`` steps every node holds, oldest first); known only
        while the nodes taking part cover every rank of the job."""
        if self._answer is None:
            world = max(self.worlds, default=0)
            known = world > 0 and sum(1 for r in self.ranks if r < world) >= world
            everyone = len(self.nodes)
            common = sorted(k for k, n in self.keys.items() if n == everyone) if known else []
            self._answer = (known, common[-ANSWERED:])
        return self._answer
