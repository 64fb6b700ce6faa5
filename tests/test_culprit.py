"""The culprits of a hang for the whole job (``faults.culprit``): nodes post suspects to the
recovery store and all act on the set recorded once, chosen from evidence (a stopped process,
the collectives each rank issued, its step, its last progress), never by when a node looked."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from flashckpt.faults.collectives import causes, likeliest
from flashckpt.faults.culprit import JobCulprit, Suspect
from flashckpt.faults.events import EventLog
from flashckpt.faults.hang import Hang, HangPolicy
from flashckpt.faults.node_watch import NodeWatch
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


def watches(tmp_path, made: list[JobCulprit]) -> list[NodeWatch]:
    """A node's watch (hang floor 3 s) over each of ``made``, asked directly what to kill."""
    return [NodeWatch(tmp_path, "j", EventLog(tmp_path / f"events-{c.node}.jsonl"),
                      HangPolicy(floor=3.0), one_at_a_time=True, culprits=c)
            for c in made]  # fmt: skip


def hang(rank: int, silent: float, stopped: bool = False, **issued: int) -> Hang:
    """Rank ``rank`` as its node's watchdog reads it (timeout 3 s; the pid ``suspect`` gives)."""
    return Hang(rank, 100 + rank, "train", 12, silent, 3.0, time.time() - silent, dict(issued),
                stopped)  # fmt: skip


def ranks(suspects) -> list[tuple[str, int]]:
    return sorted((s.node, s.rank) for s in suspects)


def test_every_node_acts_on_one_culprit_a_stopped_rank_first():
    served, (n0, n1), _ = nodes()
    try:
        blocked = suspect("node1", 3, world=41)  # waits in a collective on the stopped one
        hung = suspect("node0", 1, stopped=True, world=40)
        assert n1.decide([blocked], judged=True) == []  # the others may be about to post
        assert n0.decide([hung], judged=True) == [hung]  # the cause: recorded at once
        assert n1.decide([blocked], judged=True) == [hung]  # node 1 acts on it, before its settle
        assert n0.decide([], judged=False) == [hung]  # recorded: the same
        late = JobCulprit(n0._store, "node2", lambda: PREFIX, 0.0)
        assert late.decide([suspect("node2", 5, stopped=True)], judged=True) == [hung]
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
        assert n1.decide([sleeper], judged=False) == []  # silent past half its timeout
        assert n0.decide(behind, judged=True) == []  # within the settle
        time.sleep(0.25)
        assert n0.decide(behind, judged=True) == [sleeper]
        assert n1.decide([sleeper], judged=True) == [sleeper]
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
        assert n1.decide([saving], judged=False) == []  # posted, not judged on its node
        assert n0.decide(blocked, judged=True) == [saving]
        assert n1.decide([saving], judged=False) == [saving]  # every node acts on the same one
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
        assert n0.decide([first], judged=False) == [] and n0.decide([first], True) == [first]
        where["prefix"] = "flashckpt/ns/round-1"  # the replacement moved the job on
        second = suspect("node1", 2)
        assert n1.decide([second], judged=True) == [second]
        where["prefix"] = None
        alone = suspect("node1", 3, stopped=True)
        assert n1.decide([alone], judged=True) == [alone] and n1.decide([], judged=False) == []
    finally:
        served.close()


def test_two_ranks_stopped_on_two_nodes_are_both_replaced_in_one_recovery(tmp_path):
    """Rank 1 (node 0) and rank 3 (node 1) stop together; ranks 0 and 2 wait in a collective
    on them. The first node to judge records both at once, and each node kills its own: no
    stopped rank is left to keep the next round from forming."""
    served, made, _ = nodes()
    try:
        w0, w1 = watches(tmp_path, made)
        on0 = [hang(0, 1.7, world=41), hang(1, 1.6, stopped=True, world=40)]
        on1 = [hang(2, 3.1, world=41), hang(3, 3.2, stopped=True, world=40)]
        assert w0._jobs_culprit(on0, []) == []  # posted, none past its timeout here
        assert w1._jobs_culprit(on1, on1) == [on1[1]]  # a stopped one: decided at once
        assert w0._jobs_culprit(on0, []) == [on0[1]]  # the same decision: its own
        assert ranks(made[0].decide([], judged=False)) == [("node0", 1), ("node1", 3)]
        assert w0._quiet_until == w1._quiet_until == 0.0  # both act: neither only waits
    finally:
        served.close()


def test_a_node_whose_workers_all_stopped_has_them_all_replaced_at_once(tmp_path):
    """Both ranks of node 0 stop; node 1's ranks wait in a collective on them (past their
    timeout, within the settle). Node 0 records both, at once, and kills both; node 1 waits."""
    served, made, _ = nodes(settle=30.0)
    try:
        w0, w1 = watches(tmp_path, made)
        on0 = [hang(r, 3.05, stopped=True, world=40) for r in (0, 1)]
        on1 = [hang(r, 3.1, world=41) for r in (2, 3)]
        assert w1._jobs_culprit(on1, on1) == []  # within the settle: the others may post
        assert w0._jobs_culprit(on0, on0) == on0  # both, in one decision
        before = time.monotonic()
        assert w1._jobs_culprit(on1, on1) == []  # none of them here: wait for them
        assert w1._quiet_until >= before + 3.0
        assert ranks(made[1].decide([], judged=False)) == [("node0", 0), ("node0", 1)]
    finally:
        served.close()


def test_two_sleepers_the_others_wait_for_are_both_causes():
    """Ranks 1 (node 0) and 3 (node 1) sleep after their step; ranks 0 and 2 issued the next
    step's collective, which neither sleeper reached: both are waited for and wait for none."""
    on0 = [suspect("node0", 0, ago=3.2, world=41), suspect("node0", 1, ago=2.9, world=40)]
    on1 = [suspect("node1", 2, ago=3.1, world=41), suspect("node1", 3, ago=2.8, world=40)]
    assert ranks(causes(on0 + on1)) == [("node0", 1), ("node1", 3)]
    served, (n0, n1), _ = nodes(settle=0.0)
    try:
        assert n1.decide(on1, judged=False) == []
        assert ranks(n0.decide(on0, judged=True)) == [("node0", 1), ("node1", 3)]
        assert ranks(n1.decide(on1, judged=False)) == [("node0", 1), ("node1", 3)]
    finally:
        served.close()


def test_without_evidence_of_who_waits_for_whom_only_one_cause_is_named():
    """No counts (a backend that keeps none), equal counts, or ranks each waiting on another:
    the evidence cannot tell two causes from one and a rank blocked on it, so only the
    likeliest is named (the others recover once it is replaced, or are judged again)."""
    two = [suspect("a", 0, ago=3.0), suspect("b", 1, ago=3.5)]
    assert causes(two) == [likeliest(two)] == [two[1]]
    even = [suspect("a", 0, ago=3.0, world=40), suspect("b", 1, ago=3.5, world=40)]
    assert causes(even) == [even[1]]
    cycle = [suspect("a", 0, tp=8, dp=3), suspect("b", 1, ago=3.5, tp=7, dp=4)]
    assert causes(cycle) == [likeliest(cycle)]
    assert causes([]) == []
    served, (n0, n1), _ = nodes(settle=0.0)
    try:
        assert n1.decide([two[1]], judged=False) == []
        assert n0.decide([two[0]], judged=True) == [two[1]]
    finally:
        served.close()


def test_a_node_cut_off_the_training_network_is_the_culprit_whole_and_leaves(tmp_path):
    """Every rank stalls when node 1's training network fails. Node 0 probes the training
    network (``reach``): it reaches node 2 (a spare's listener) and not node 1; node 1 posted
    that it reached nobody. The job's culprit is node 1, whole: its watch calls ``leave``
    and kills no rank, and node 0's kills nothing."""
    import json
    import socket

    from flashckpt.faults import reach

    served, (n0, n1), _ = nodes(settle=0.0)
    spare, gone = reach.Reach("127.0.0.1"), socket.create_server(("127.0.0.1", 0))
    n0.reach = reach.Reach("127.0.0.1")
    try:
        store = n0.store
        n0.reach.publish(store, "node0")
        spare.publish(store, "node2")
        store.set(reach.key("node1"), f"127.0.0.1:{gone.getsockname()[1]}")  # answers no more
        store.append(reach.NAMES, '"node1"\n')
        gone.close()
        store.set(f"{PREFIX}/reach/node1", json.dumps({"node0": False, "node2": False}))
        left: list[str] = []
        w0, w1 = watches(tmp_path, [n0, n1])
        w1.leave = left.append
        assert w1._jobs_culprit([hang(2, 1.6), hang(3, 1.6)], []) == []  # posted, not judged
        assert w0._jobs_culprit([hang(0, 3.5), hang(1, 3.5)], [hang(0, 3.5)]) == []
        decided = n1.decide([], judged=False)
        assert ranks(decided) == [("node1", 2), ("node1", 3)] and all(d.cut_off for d in decided)
        assert json.loads(store.get(f"{PREFIX}/reach/node0")) == {"node1": False, "node2": True}
        assert w1._jobs_culprit([hang(2, 4.0)], [hang(2, 4.0)]) == [] and len(left) == 1
        assert "training network" in left[0]
    finally:
        for r in (spare, n0.reach):
            r.close()
        served.close()


def test_a_judge_that_reached_nobody_waits_for_the_word_of_those_it_could_not_reach():
    """Node 1 is cut off and judges first: it reached none of the nodes it probed, and they
    have not posted yet. It names nobody for up to ``REACH_WAIT_S`` (it may be the one cut
    off), and then, still without their word, judges the ranks as before."""
    import json

    from flashckpt.faults import culprit, reach

    served, (n0, n1), _ = nodes(settle=0.0)
    n1.reach = reach.Reach("127.0.0.1")
    try:
        store = n1.store
        n1.reach.publish(store, "node1")
        store.set(reach.key("node0"), "127.0.0.1:1")  # nothing listens on port 1
        store.append(reach.NAMES, '"node0"\n')
        mine = [suspect("node1", 2, ago=3.5)]
        assert n1.decide(mine, judged=True) == []
        assert json.loads(store.get(f"{PREFIX}/reach/node1")) == {"node0": False}
        n1._posted[PREFIX] = (time.monotonic() - culprit.REACH_WAIT_S, n1._posted[PREFIX][1])
        assert ranks(n1.decide(mine, judged=True)) == [("node1", 2)]  # two nodes: no verdict
    finally:
        n1.reach.close()
        served.close()
