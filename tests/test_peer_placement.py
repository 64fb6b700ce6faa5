"""Where replicas go: rendezvous hashing with bounded loads spreads them evenly across failure
domains whatever the names, and a node joining or leaving moves only a few."""

from __future__ import annotations

import random
from collections import Counter

from flashckpt.storage_tiers.peer_placement import PeerNode, assign, holder


def racks(nodes: int, racks: int) -> list[PeerNode]:
    """Nodes named by rack, as clusters name them: every rack's nodes sort together."""
    return [PeerNode(f"rack{i % racks}-node{i:04d}", f"10.0.0.{i % 250}:7000", f"rack{i % racks}")
            for i in range(nodes)]  # fmt: skip


def test_only_a_node_that_can_hold_is_chosen():
    nodes = [PeerNode("n1", "a:1"), PeerNode("n3", "a:3"), PeerNode("n2", "a:2"),
             PeerNode("n4", ""), PeerNode("n5", "a:5", lost=True)]  # fmt: skip
    for me in ("n1", "n2", "n3"):
        first, second = holder(nodes, me, 1), holder(nodes, me, 2)
        assert {first.name, second.name} == {"n1", "n2", "n3"} - {me}  # n4 serves none, n5 lost
        assert holder(nodes, me, 3) is None  # only two nodes other than me can hold
    assert holder(nodes, "n0", 1).name in {"n1", "n2", "n3"}  # a wiped node asks before it reports
    assert holder(nodes, "n1", 0) is None
    two = [PeerNode("a1", "x:1", "r1"), PeerNode("a2", "x:2", "r1"), PeerNode("b1", "x:3", "r2")]
    assert holder(two, "a1", 1, "r1").name == "b1"  # never in the source's failure domain
    assert holder(two, "a2", 1, "r1").name == "b1"
    assert holder(two, "a1", 2, "r1") is None
    assert holder(two, "b1", 1, "r2").name in {"a1", "a2"}


def test_128_nodes_in_4_racks_hold_at_most_2_replicas_each_at_every_hop():
    nodes = racks(128, 4)
    domain = {n.name: n.domain for n in nodes}
    placed = assign(nodes, hops=2)
    for hop in (0, 1):
        load = Counter(held[hop] for held in placed.values())
        assert max(load.values()) <= 2, load.most_common(3)
        assert len(load) >= 64  # spread over most nodes, not piled on a few
    for source, held in placed.items():
        assert len(set(held)) == 2 and source not in held
        assert all(domain[h] != domain[source] for h in held)


def test_a_node_lost_or_joining_moves_only_a_few_replicas_of_1000():
    nodes = racks(1000, 16)
    before = assign(nodes)
    for i in random.Random(7).sample(range(1000), 10):
        lost = nodes[i].name
        after = assign([PeerNode(n.name, n.address, n.domain, lost=n.name == lost) for n in nodes])
        moved = [s for s in before if s != lost and after[s] != before[s]]
        assert len(moved) <= 5, (lost, moved)
        # The lost node keeps its holder: started again in its place, it reads its replica.
        assert after[lost] == before[lost]
        assert lost not in {h[0] for h in after.values()}  # and holds nothing any more
    joined = assign([*nodes, PeerNode("rack3-node9999", "10.0.1.1:7000", "rack3")])
    assert sum(1 for s in before if joined[s] != before[s]) <= 5


def test_a_wiped_node_that_has_not_reported_finds_the_holder_it_had():
    nodes = racks(40, 4)
    me = nodes[5]
    had = holder(nodes, me.name, 1, me.domain)
    gone = [n for n in nodes if n.name != me.name]  # the controller forgot it, or never knew
    assert holder(gone, me.name, 1, me.domain) == had
    listed_lost = [PeerNode(n.name, n.address, n.domain, n.name == me.name) for n in nodes]
    assert holder(listed_lost, me.name, 1, me.domain) == had
