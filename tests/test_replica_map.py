"""The controller's view of replicas: a compact answer to "who holds node N's replica", reads
that follow the newest copy while the placement moves, and holders told to give back the copies
no restore needs (moved elsewhere, or of a node that left), never the newest one."""

from __future__ import annotations

from flashckpt.agent.controller import Controller
from flashckpt.proto import controller_pb2 as pb

PEER = "peer://auto?keep_last=1"


def report(c: Controller, node: str, replicas=(), tiers=(PEER,), now: float = 0.0,
           workers=()) -> pb.ReportReply:  # fmt: skip
    return c.report(pb.NodeReport(
        job="j", node=node, agent_id=f"{node}-a", peer_address=f"{node}:1", workers=workers,
        tiers=[pb.TierCommit(url=u) for u in tiers],
        replicas=[pb.Replica(source=s, generation=0, step=step, ranks=[0]) for s, step in replicas],
    ), now=now)  # fmt: skip


def ask(c: Controller, node: str, hop: int = 1) -> tuple[str, str]:
    reply = c.holders(pb.HoldersRequest(job="j", node=node, hop=hop))
    return reply.assigned.node, reply.read_from.node


def test_a_copy_is_given_back_only_once_its_new_holder_holds_a_step_as_new():
    c = Controller(node_timeout=5)
    names = [f"n{i}" for i in range(6)]
    for n in names:
        report(c, n)
    home, _ = ask(c, "n0")
    old = next(n for n in names if n not in ("n0", home))
    # n0's replica sits at a node it no longer stores at (the placement moved since).
    assert not report(c, old, [("n0", 12)]).expired_replicas
    assert ask(c, "n0") == (home, old)  # reads go where the newest copy is
    report(c, home, [("n0", 11)])  # the new holder is behind: the old copy stays
    assert not report(c, old, [("n0", 12)]).expired_replicas
    assert ask(c, "n0") == (home, old)
    report(c, home, [("n0", 12)])
    c.jobs["j"].nodes[home].lost = True  # the new holder is lost before the old copy goes
    assert not report(c, old, [("n0", 12)]).expired_replicas
    report(c, home, [("n0", 12)])  # back (a report clears lost)
    assert list(report(c, old, [("n0", 12)]).expired_replicas) == ["n0"]
    assert ask(c, "n0") == (home, home)
    assert not report(c, home, [("n0", 12)]).expired_replicas  # the holder keeps its own


def test_a_second_hop_keeps_its_copy():
    c = Controller(node_timeout=5)
    names = [f"n{i}" for i in range(6)]
    for n in names:
        report(c, n, tiers=(PEER, "peer://auto?hop=2&keep_last=1"))
    first, _ = ask(c, "n0", 1)
    second, _ = ask(c, "n0", 2)
    assert first != second
    report(c, first, [("n0", 7)])
    assert not report(c, second, [("n0", 7)]).expired_replicas


def test_a_lost_nodes_replica_stays_until_the_job_commits_a_newer_step():
    c = Controller(node_timeout=5)
    training = [pb.Worker(rank=0, pid=10, phase="train", step=12, alive=True)]
    for n in ("a", "b", "c"):
        report(c, n, now=0, workers=training)
    home, _ = ask(c, "a")
    report(c, home, [("a", 12)], now=1)
    other = next(n for n in ("b", "c") if n != home)
    report(c, other, now=1)
    report(c, home, [("a", 12)], now=9.5)  # the others report on: a falls silent, lost
    report(c, other, now=9.5)
    c.tick(now=10)
    assert c.jobs["j"].nodes["a"].lost
    assert not report(c, home, [("a", 12)], now=10).expired_replicas  # its restore needs it
    c.jobs["j"].commits["pfs:///ckpt"] = (0, 12)
    assert not report(c, home, [("a", 12)], now=10).expired_replicas  # as new: kept
    c.jobs["j"].commits["pfs:///ckpt"] = (0, 20)  # the job went on without it
    assert list(report(c, home, [("a", 12)], now=10).expired_replicas) == ["a"]


def test_the_holder_query_is_small_at_a_thousand_nodes():
    c = Controller(node_timeout=5)
    for i in range(1000):
        report(c, f"node{i:04d}", [(f"node{(i + 1) % 1000:04d}", 3)])
    status = c.status("j").ByteSize()
    reply = c.holders(pb.HoldersRequest(job="j", node="node0007", hop=1))
    assert reply.assigned.address and reply.read_from.address
    assert reply.ByteSize() < 100 and status > 1000 * reply.ByteSize()
    wiped = c.holders(pb.HoldersRequest(job="j", node="node9999", hop=1))  # not listed yet
    assert wiped.assigned.node and not wiped.reported
    unknown = c.holders(pb.HoldersRequest(job="other", node="node0007", hop=1))
    assert not unknown.assigned.address and "other" not in c.replica_maps  # nothing kept for it
