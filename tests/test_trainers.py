"""Which ranks the node agent waits for before it stores a step, across restarts."""

from __future__ import annotations

import os
import subprocess
import sys

from flashckpt.agent.trainers import Trainers


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_rank_still_counts_until_a_new_incarnation_registers():
    t = Trainers()
    t.register(0, os.getpid(), 4, 2)
    t.register(1, gone_pid(), 4, 2)  # SIGKILLed right after its last save
    assert t.required({0, 1}, lambda r: False) == {0, 1}  # its last step goes out with rank 0's


def test_ranks_that_moved_to_another_node_are_not_waited_for():
    t = Trainers()
    t.register(0, gone_pid(), 4, 2)
    t.register(1, gone_pid(), 4, 2)
    # After the restart the rendezvous gave this node ranks 2 and 3; 0 and 1 run elsewhere.
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            t.register(2, os.getpid(), 4, 2)
            assert sorted(t.pids) == [2]
            assert t.required({0, 1, 2}, lambda r: False) is None  # rank 3 still registering
            t.register(3, other.pid, 4, 2)
            assert t.required({0, 1, 2, 3}, lambda r: False) == {2, 3}
            # Their peers restore from ranks 0 and 1's slots here until 2 and 3 train again.
            t.told(2)
            assert t.stale({0, 1, 2, 3}, lambda r: False) == set()
            t.told(3)
            assert t.stale({0, 1, 2, 3}, lambda r: False) == {0, 1}
        finally:
            other.kill()


def test_the_old_ranks_slots_are_kept_until_every_rank_here_has_restored_and_saved():
    """A job restarted at fewer ranks reshards from the old ranks' snapshots in this node's
    memory: none is stale before every rank the live job runs here has told a snapshot."""
    t = Trainers()
    t.register(0, gone_pid(), 2, 2)
    t.register(1, gone_pid(), 2, 2)
    t.told(0)
    t.told(1)
    t.register(0, os.getpid(), 1, 1)  # restarted alone: its restore reads rank 1's slots
    assert t.stale({0, 1}, lambda r: False) == set()
    t.told(0)
    assert t.stale({0, 1}, lambda r: False) == {1}
    assert t.stale({0, 1}, lambda r: r == 1) == set()  # a live process holds it
    t.register(0, gone_pid(), 1, 1)  # the rank restarted again: restoring once more
    assert t.stale({0, 1}, lambda r: False) == set()
    t.told(5)  # a notice from a rank that never registered counts for nothing
    assert 5 not in t.saved
