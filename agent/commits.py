"""Global commits: the newest step of a tier that every rank of the job has committed.

A node reports, for each tier, the newest step committed for its ranks. A step is committed
globally once the nodes reporting the tier cover every rank of the job and none of them is
behind it. The controller hears every node every heartbeat, so this is kept up to date
report by report in constant time (counters of the ranks covered, of the steps held and of
the world sizes claimed) instead of rescanning every node on every report: at thousands of
nodes a rescan per report is quadratic per heartbeat.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

Key = tuple[int, int]  # (generation, step); step -1: nothing committed yet


@dataclass
class Held:
    key: Key
    ranks: frozenset[int]
    world: int


@dataclass
class Coverage:
    """One tier's commits, node by node."""

    nodes: dict[str, Held] = field(default_factory=dict)
    ranks: Counter = field(default_factory=Counter)  # rank -> nodes that claim it
    keys: Counter = field(default_factory=Counter)  # (generation, step) -> nodes at it
    worlds: Counter = field(default_factory=Counter)  # world size -> nodes that claim it

    def update(self, node: str, key: Key, ranks: frozenset[int], world: int) -> None:
        old = self.nodes.get(node)
        if old is not None and old.key == key and old.world == world and old.ranks == ranks:
            return
        self.drop(node)
        self.nodes[node] = Held(key, ranks, world)
        self.ranks.update(ranks)
        self.keys[key] += 1
        self.worlds[world] += 1

    def drop(self, node: str) -> None:
        old = self.nodes.pop(node, None)
        if old is None:
            return
        self.ranks.subtract(old.ranks)
        for r in old.ranks:
            if self.ranks[r] <= 0:
                del self.ranks[r]
        for counter, k in ((self.keys, old.key), (self.worlds, old.world)):
            counter[k] -= 1
            if counter[k] <= 0:
                del counter[k]

    def committed(self) -> Key | None:
        """The step every rank holds, or None while a rank is missing or has none."""
        world = max(self.worlds, default=0)
        if world <= 0 or len(self.ranks) < world or any(s < 0 for _, s in self.keys):
            return None
        return min(self.keys)
