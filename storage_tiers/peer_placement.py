"""Which node holds which node's replica: rendezvous hashing with bounded loads.

Every node ranks the nodes that can hold its replica (serving replicas, not lost, not itself,
outside its failure domain where domains are set) by a hash of the pair, the same ranking on
every machine. Nodes pick in a fixed order, itself a hash of their names, and each takes the
best-ranked node that holds fewer than its share (``ceil(1.25 * sources / holders)``) at that
hop;
a node with no such choice left takes its best-ranked one. So:

- replicas spread evenly whatever the names: 128 nodes in 4 racks named by rack hold at most 2
  each, where "the next node by name outside my rack" piled 32 onto each of 4 nodes;
- a node that joins or leaves moves only the replicas that chose it and the few that the freed
  or taken places shift (about one at a thousand nodes, a handful at most);
- a lost node stays a source: its replica keeps its holder, so the node started again in its
  place reads it back, while the replicas the lost node held move to other nodes.

``hop`` h is a node's h-th holder; its holders at lower hops are never chosen again.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

SLACK = 1.25  # a holder takes at most this much over an even share, rounded up
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


@dataclass(frozen=True)
class PeerNode:
    """A node as the controller lists it: where its agent serves replicas."""

    name: str
    address: str  # "host:port"; "" where it serves none
    domain: str = ""
    lost: bool = False


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _mixed(keys: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (splitmix64's), so that each pair's score is as good as random."""
    z = keys.copy()
    z ^= z >> np.uint64(30)
    z *= _MIX[0]
    z ^= z >> np.uint64(27)
    z *= _MIX[1]
    z ^= z >> np.uint64(31)
    return z


def assign(nodes: list[PeerNode], hops: int = 1) -> dict[str, list[str]]:
    """Every listed node's holders, hop 1 first (fewer where fewer nodes can hold)."""
    sources = sorted(nodes, key=lambda n: (_hash("order\0" + n.name), n.name))
    fit = [n for n in nodes if n.address and not n.lost]
    out: dict[str, list[str]] = {n.name: [] for n in sources}
    if not fit:
        return out
    with np.errstate(over="ignore"):
        keys = np.array([_hash(n.name) for n in fit], dtype=np.uint64)
        domains = np.array([n.domain for n in fit], dtype=object)
        names = [n.name for n in fit]
        index = {name: i for i, name in enumerate(names)}
        share = max(1, math.ceil(SLACK * len(sources) / len(fit)))
        ranked = {}  # source -> the nodes that can hold it, best first
        for s in sources:
            order = np.argsort(_mixed(keys ^ np.uint64(_hash(s.name))), kind="stable")[::-1]
            ok = np.ones(len(fit), dtype=bool) if not s.domain else domains != s.domain
            if s.name in index:
                ok[index[s.name]] = False
            ranked[s.name] = order[ok[order]]
        for _ in range(hops):
            load = np.zeros(len(fit), dtype=np.int64)
            for s in sources:
                taken = {index[h] for h in out[s.name]}
                first = None
                for i in ranked[s.name]:
                    if i in taken:
                        continue
                    first = i if first is None else first
                    if load[i] < share:
                        first = i
                        break
                if first is None:
                    continue  # no node left that can hold it at this hop
                load[first] += 1
                out[s.name].append(names[first])
    return out


def holder(nodes: list[PeerNode], me: str, hop: int, my_domain: str = "") -> PeerNode | None:
    """``me``'s holder at ``hop`` (see the module doc); None if fewer nodes than ``hop`` can
    hold. ``me`` need not be listed (a node started again wiped asks before its agent has
    reported): it is placed as a source of ``my_domain``."""
    if hop < 1:
        return None
    if not any(n.name == me for n in nodes):
        nodes = [*nodes, PeerNode(me, "", my_domain, lost=True)]
    chosen = assign(nodes, hop)[me]
    if len(chosen) < hop:
        return None
    return next(n for n in nodes if n.name == chosen[hop - 1])
