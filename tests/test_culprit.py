"""One culprit per hang for the whole job (``faults.culprit``): nodes post suspects to the
recovery store and all act on the one recorded, a stopped process before a blocked one."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

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


def test_every_node_acts_on_one_culprit_a_stopped_rank_first():
    served, (n0, n1), _ = nodes()
    try:
        blocked = Suspect("node1", 3, 300, stopped=False, silent_s=3.3)  # waits on the hung one
        hung = Suspect("node0", 1, 100, stopped=True, silent_s=3.1)
        assert n1.decide(blocked) is None  # posted; the others may be about to post
        assert n0.decide(hung) == hung  # a stopped process is the cause: recorded at once
        assert n1.decide(blocked) == hung  # node 1 acts on it, before its own settle
        assert n0.decide(None) == hung  # recorded: the same
        late = JobCulprit(n0._store, "node2", lambda: PREFIX, 0.0)
        assert late.decide(Suspect("node2", 5, 500, stopped=True, silent_s=9.0)) == hung
    finally:
        served.close()


def test_running_suspects_settle_then_the_one_silent_longest_is_chosen():
    served, (n0, n1), _ = nodes()
    try:
        waiting = Suspect("node0", 1, 100, stopped=False, silent_s=3.1)
        longest = Suspect("node1", 3, 300, stopped=False, silent_s=3.4)
        assert n0.decide(waiting) is None and n1.decide(longest) is None
        assert n0.decide(waiting) is None  # within the settle: the others may still post
        time.sleep(0.25)
        assert n0.decide(waiting) == longest and n1.decide(None) == longest
    finally:
        served.close()


def test_a_new_round_is_a_new_choice_and_without_a_worker_group_a_node_judges_alone():
    served, (n0, n1), where = nodes(settle=0.0)
    try:
        first = Suspect("node0", 1, 100, stopped=False, silent_s=4.0)
        assert n0.decide(first) is None and n0.decide(first) == first
        where["prefix"] = "flashckpt/ns/round-1"  # the replacement moved the job on
        second = Suspect("node1", 2, 200, stopped=False, silent_s=5.0)
        assert n1.decide(second) is None and n1.decide(second) == second
        where["prefix"] = None
        alone = Suspect("node1", 3, 300, stopped=True, silent_s=1.0)
        assert n1.decide(alone) == alone and n1.decide(None) is None
    finally:
        served.close()
