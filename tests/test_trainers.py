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
            assert t.stale({0, 1, 2, 3}, lambda r: False) == {0, 1}
        finally:
            other.kill()
