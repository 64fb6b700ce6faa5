"""One culprit per hang for the whole job (``faults.culprit``): nodes post suspects to the
recovery store and all act on the one recorded, chosen from evidence (a stopped process, the
collectives each rank issued, its step, its last progress), never by when a node looked."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from flashckpt.faults.collectives import likeliest
from flashckpt.faults.culprit import JobCulprit, Suspect
from flashckpt.faults.store_gate import LoopbackStore

PREFIX = "flashckpt/ns/round-0"


def nodes(settle: float = 0.2):
    served = LoopbackStore()

    def client():
        return dist.TCPStore("127.0.0.1", served.port, is_master=False,
                             timeout=datetime.timedelta(seconds=10))  # fmt: skip

    where = {"prefix": PREFIX}
    made = [JobCulprit(client, f"node{n}", lambda: where["prefix"], settle) for n in (0, 1)]
    return served, made, where


def suspect(
    node: str, rank: int, stopped: bool = False, step: int = 12, ago: float = 3.0, **issued: int
) -> Suspect:
    """Rank ``rank`` of ``node``, its last progress ``ago`` seconds back, with the collectives
    it issued per group (``issued``: group name -> count)."""
    return Suspect(node, rank, 100 + rank, stopped, step, time.time() - ago, dict(issued))


def test_every_node_acts_on_one_culprit_a_stopped_rank_first():
    served, (n0, n1), _ = nodes()
    try:
        blocked = suspect("node1", 3, world=41)  # waits in a collective on the stopped one
        hung = suspect("node0", 1, stopped=True, world=40)
        assert n1.decide([blocked], judged=True) is None  # the others may be about to post
        assert n0.decide([hung], judged=True) == hung  # the cause: recorded at once
        assert n1.decide([blocked], judged=True) == hung  # node 1 acts on it, before its settle
        assert n0.decide([], judged=False) == hung  # recorded: the same
        late = JobCulprit(n0._store, "node2", lambda: PREFIX, 0.0)
        assert late.decide([suspect("node2", 5, stopped=True)], judged=True) == hung
    finally:
        served.close()


def test_the_rank_the_others_wait_for_is_chosen_whatever_the_clocks_say():
    """A rank that sleeps or spins after its step: the ranks behind it have issued the next
    step's collective, it has not. Their last progress came first (they finished the step a
    moment before it did), and their node is the one that judges: it is still not them."""
    served, (n0, n1), _ = nodes()
    try:
        sleeper = suspect("node1", 3, ago=2.9, world=40)
        behind = [suspect("node0", 0, ago=3.2, world=41), suspect("node0", 1, ago=3.1, world=41)]
        assert n1.decide([sleeper], judged=False) is None  # silent past half its timeout
        assert n0.decide(behind, judged=True) is None  # within the settle
        time.sleep(0.25)
        assert n0.decide(behind, judged=True) == sleeper
        assert n1.decide([sleeper], judged=True) == sleeper
    finally:
        served.close()


def test_peers_blocked_on_a_rank_in_a_long_save_are_not_killed_for_it():
    """Rank 3 hangs in ``save()`` (its own timeout five minutes), ranks 0 and 1 wait in the
    next step's all-reduce, judged at the 30 s floor. Rank 3 is posted as soon as they are
    (silent past half the floor, whatever its phase), so the evidence names it: it is the one
    replaced at the floor, not a healthy peer."""
    served, (n0, n1), _ = nodes(settle=0.0)
    try:
        saving = suspect("node1", 3, ago=31.0, world=40)
        blocked = [suspect("node0", r, ago=31.0, world=41) for r in (0, 1)]
        assert n1.decide([saving], judged=False) is None  # posted, not judged on its node
        assert n0.decide(blocked, judged=True) == saving
        assert n1.decide([saving], judged=False) == saving  # every node acts on the same one
    finally:
        served.close()


def test_likeliest_follows_who_waits_for_whom_across_subgroups():
    """Tensor-parallel group ``tp`` {0, 1}, data-parallel ``dp`` {1, 2}: rank 0 hangs, rank 1
    waits for it in ``tp`` (so it never issues its ``dp`` collective), rank 2 waits for rank 1
    in ``dp``. Rank 1 is behind in ``dp``, but it waits on someone: rank 0 it is."""
    hung = suspect("a", 0, tp=7)
    tp_blocked = suspect("a", 1, ago=3.5, tp=8, dp=3)
    dp_blocked = suspect("b", 2, ago=3.6, dp=4)
    assert likeliest([dp_blocked, tp_blocked, hung]) == hung
    # Without counts (a backend that keeps none), the step, then the earliest last progress.
    assert likeliest([suspect("a", 0, step=12, ago=1.0), suspect("b", 1, step=11)]).rank == 1
    assert likeliest([suspect("a", 0, ago=1.0), suspect("b", 1, ago=2.0)]).rank == 1


def test_a_new_round_is_a_new_choice_and_without_a_worker_group_a_node_judges_alone():
    served, (n0, n1), where = nodes(settle=0.0)
    try:
        first = suspect("node0", 1)
        assert n0.decide([first], judged=False) is None and n0.decide([first], True) == first
        where["prefix"] = "flashckpt/ns/round-1"  # the replacement moved the job on
        second = suspect("node1", 2)
        assert n1.decide([second], judged=True) == second
        where["prefix"] = None
        alone = suspect("node1", 3, stopped=True)
        assert n1.decide([alone], judged=True) == alone and n1.decide([], judged=False) is None
    finally:
        served.close()
