"""Node-local retention agrees across nodes: a node's NVMe never deletes the newest step every
node of the job holds, so a job with only node-local tiers always finds a step to restore.

The decision alone (``retention.kept``), the controller's common steps, and real agents of two
simulated nodes (each with its own shared memory, run directory and NVMe directory) reporting
to a real controller."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, wait_for
from flashckpt.agent.common_steps import ANSWERED
from flashckpt.agent.controller import Controller, InThread
from flashckpt.agent.node_retention import LearnedCommon
from flashckpt.proto import controller_pb2 as pb
from ports import free_port

from flashckpt.faults.agent_client import socket_path
from flashckpt.faults.control import Endpoint
from flashckpt.format.lineage import Lineage
from flashckpt.format.retention import Common, Held, kept

TOKEN = "r" * 32

# ---- the decision ---------------------------------------------------------------------------

HALF = Held(ranks=1, world_size=2)  # a node-local marker of a two-node job


def steps(*numbers: int, gen: int = 0, held: Held = HALF) -> dict[tuple[int, int], Held]:
    return {(gen, s): held for s in numbers}


def test_diverged_nodes_keep_the_newest_step_both_hold_and_everything_newer():
    node0, node1 = steps(0, 1, 2, 3, 4, 6, 8), steps(0, 1, 2, 3, 5, 7)
    common = Common(frozenset(node0) & frozenset(node1))
    assert kept(node0, Lineage(), 2, None, common=common) == set(steps(2, 3, 4, 6, 8))
    assert kept(node1, Lineage(), 2, None, common=common) == set(steps(2, 3, 5, 7))
    # keep_every keeps its steps on top, common or not.
    assert kept(node0, Lineage(), 1, 4, common=common) == set(steps(0, 3, 4, 6, 8))


def test_a_node_that_learned_no_common_step_deletes_no_committed_step():
    node0 = steps(0, 1, 2, 3, 4, 6, 8)
    assert kept(node0, Lineage(), 2, None, common=Common()) == set(node0)
    # Common steps of which this node holds none prove nothing either.
    assert kept(node0, Lineage(), 2, None, common=Common(frozenset(steps(5, 7)))) == set(node0)


def test_a_node_that_runs_the_whole_job_keeps_the_tier_s_policy_alone():
    whole = steps(0, 1, 2, 3, 4, held=Held(ranks=2, world_size=2))
    assert kept(whole, Lineage(), 2, None, common=Common()) == set(steps(3, 4))
    # A shared tier's committed steps are job-wide: as before.
    assert kept(steps(0, 1, 2, 3), Lineage(), 2, None) == set(steps(2, 3))


def test_common_steps_of_an_abandoned_branch_do_not_count():
    """Generation 1 went back to step 3. The other node holds no step of generation 1 yet;
    the abandoned branch's steps 5 and 6 are on both nodes but are never restored again."""
    branch = Lineage(((1, 3),))
    node = {**steps(0, 1, 2, 3, 4, 5, 6), **steps(4, 5, gen=1)}
    common = Common(frozenset(steps(2, 3, 5, 6)))
    assert kept(node, branch, 1, None, common=common) == {
        (0, 3), (1, 4), (1, 5), (0, 4), (0, 5), (0, 6),
    }  # fmt: skip
    retired = kept(node, branch, 1, None, retire_abandoned=True, common=common)
    assert retired == {(0, 3), (1, 4), (1, 5)}
    # Step 4 of generation 0 and step 4 of generation 1 are different steps.
    assert kept(node, branch, 1, None, common=Common(frozenset({(0, 4)}))) == set(node)


def test_a_cut_list_of_common_steps_keeps_older_steps_in_their_stead():
    node = steps(*range(10))
    listed = Common(frozenset(steps(7, 8)), partial=True)
    assert kept(node, Lineage(), 4, None, common=listed) == set(steps(5, 6, 7, 8, 9))


def test_a_step_once_answered_common_is_not_forgotten_when_an_answer_leaves_it_out():
    """An answer built from reports of different ages can miss a step every node holds: the
    node keeps it as common, so it never ends with fewer than ``keep_last`` common steps."""
    learned = LearnedCommon()
    assert learned.learn(True, [(0, 17), (0, 21)])
    assert learned.learn(True, [(0, 29)])  # 21 left out, though both nodes hold it
    node = steps(17, 20, 21, 22, 28, 29)
    assert kept(node, Lineage(), 2, None, common=learned.common()) == set(steps(21, 29))
    assert not learned.learn(True, [(0, 21), (0, 29)])  # nothing new
    assert not learned.learn(False, [])  # a reply that cannot tell changes nothing
    assert learned.keys == ((0, 17), (0, 21), (0, 29))
    for s in range(100, 100 + ANSWERED):  # only the newest ANSWERED are kept
        learned.learn(True, [(0, s)])
    assert len(learned.keys) == ANSWERED and learned.common().partial


# ---- the controller's answer ---------------------------------------------------------------


def report(node: str, ranks: list[int], held: list[int], agent: str = "", gen: int = 0,
           world: int = 4) -> pb.NodeReport:  # fmt: skip
    keys = [pb.StepKey(generation=gen, step=s) for s in held]
    tier = pb.TierCommit(url="file:///nvme", step=max(held, default=-1), generation=gen,
                         held=keys)  # fmt: skip
    return pb.NodeReport(job="rj", node=node, agent_id=agent or f"{node}-a", world_size=world,
                         tiers=[tier], ranks=ranks)  # fmt: skip


def answered(reply: pb.ReportReply) -> tuple[bool, list[int]]:
    return reply.common_known, [k.step for k in reply.common]


def test_the_controller_answers_the_steps_every_node_holds_once_every_rank_is_heard():
    c = Controller(None, node_timeout=3, heartbeat=1)
    reply = c.report(report("a", [0, 1], [0, 1, 2, 3, 4, 6, 8]), now=1)
    assert answered(reply) == (False, [])  # ranks 2 and 3 were never heard of
    reply = c.report(report("b", [2, 3], [0, 1, 2, 3, 5, 7]), now=1)
    assert answered(reply) == (True, [0, 1, 2, 3])
    # b's agent restarts and reports what its tier holds now.
    reply = c.report(report("b", [2, 3], [2, 3, 5, 7, 8], agent="b-2"), now=2)
    assert answered(reply) == (True, [2, 3, 8])
    # b goes silent: what it holds is not known any more.
    c.report(report("a", [0, 1], [2, 3, 4, 6, 8]), now=4.5)
    c.tick(now=5.5)
    assert answered(c.report(report("a", [0, 1], [2, 3, 4, 6, 8]), now=5.5)) == (False, [])
    # A node that runs no rank (a spare) takes no part.
    c.report(report("b", [2, 3], [3, 8], agent="b-3"), now=6)
    assert answered(c.report(report("spare", [], []), now=6)) == (True, [3, 8])


def test_common_steps_are_compared_with_their_generation():
    c = Controller(None)
    c.report(report("a", [0, 1], [4, 5], gen=1), now=1)
    reply = c.report(report("b", [2, 3], [4, 5], gen=0), now=1)
    assert answered(reply) == (True, [])


# ---- real agents, a real controller --------------------------------------------------------

SAVER = """
import os, sys, torch
from flashckpt import Checkpointer
url, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
rank = int(os.environ["RANK"])
with Checkpointer(url) as ck:
    for step in steps:
        ck.save(step, {"w": torch.full((64,), float(100 * rank + step)), "step": step})
        ck.wait(step, tier=url, timeout=60)
"""

RESTORER = """
import os, sys, torch, torch.distributed as dist
from flashckpt import Checkpointer
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"w": torch.zeros(64), "step": None}
# Closed, as a trainer ends: a rank that vanished unclosed would be a failure the controller
# answers by killing the round's other workers.
with Checkpointer(sys.argv[1]) as ck:
    step = ck.restore(state)
    print("restored", step, state["step"], float(state["w"][0]) - 100 * rank, flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


class Node:
    """One simulated node: its own shared memory, run directory, NVMe directory and agent."""

    def __init__(self, root: Path, job: str, index: int, world: int, keep_last: int = 2):
        self.index, self.job = index, job
        self.shm = Path("/dev/shm") / f"flashckpt-test-{uuid.uuid4().hex[:10]}"
        self.run_dir = Path(tempfile.mkdtemp(prefix="fc-run-", dir="/tmp"))
        self.nvme = root / f"nvme{index}"
        self.log = root / f"agent{index}.log"
        self.url = f"file://{self.nvme}?keep_last={keep_last}"
        path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "FLASHCKPT_SHM_DIR": str(self.shm),
                    "FLASHCKPT_RUN_DIR": str(self.run_dir), "FLASHCKPT_NODE": f"node{index}",
                    "FLASHCKPT_JOB": job, "RANK": str(index), "LOCAL_RANK": "0",
                    "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
        self.agent: subprocess.Popen | None = None

    def report_to(self, port: int) -> None:
        Endpoint(f"127.0.0.1:{port}", TOKEN).save(self.run_dir, self.job)

    def start_agent(self) -> None:
        with open(self.log, "a") as log:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", self.job,
                 "--tier", self.url], env=self.env, cwd=ROOT / "tests", stderr=log,
            )  # fmt: skip
        # Serving before a trainer starts, which would otherwise start an agent of its own.
        wait_for(lambda: socket_path(self.run_dir, self.job).exists(), what="the agent's socket")

    def save(self, steps: list[int]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", SAVER, self.url, ",".join(map(str, steps))], env=self.env,
            cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def step_dirs(self) -> list[int]:
        return sorted(int(d.name.split("-")[1].split(".")[0])
                      for d in (self.nvme / self.job).glob("step-*"))  # fmt: skip

    def stop_agent(self) -> str:
        """Stop the agent; what its agents logged so far."""
        if self.agent is not None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
            self.agent = None
        return self.log.read_text() if self.log.exists() else ""

    def close(self) -> None:
        self.stop_agent()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def nodes(tmp_path):
    made: list[Node] = []

    def make(job: str, count: int = 2, world: int = 2) -> list[Node]:
        made.extend(Node(tmp_path, job, i, world) for i in range(count))
        return made[-count:]

    yield make
    for node in made:
        node.close()


@pytest.fixture
def controller():
    c = InThread(Controller(None, node_timeout=5, heartbeat=0.2), "127.0.0.1:0", TOKEN)
    c.start_serving()
    yield c
    c.stop()


def finished(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{out}\n{err[-3000:]}"


def restore_together(nodes: list[Node]) -> list[list[str]]:
    """Every node's rank restores through one gloo process group; each one's printed words."""
    port = free_port()
    procs = []
    for n in nodes:
        env = {**n.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", RESTORER, n.url], env=env,
                                      cwd=ROOT / "tests", text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(next(ln.split() for ln in stdout.splitlines() if ln.startswith("restored")))
    return out


def test_diverged_nodes_keep_the_newest_step_both_hold_and_restore_it(nodes, controller):
    """Node 0 commits steps 0-4, 6 and 8 to its NVMe, node 1 steps 0-3, 5 and 7, each with
    keep_last=2. Each keeping its own newest two ([6, 8] and [5, 7]) would leave no step on
    both; both keep step 3, the newest they share, with the one before it and everything
    newer, and the job restores step 3."""
    pair = nodes("diverged")
    for n in pair:
        n.report_to(controller.port)
        n.start_agent()
    savers = [pair[0].save([0, 1, 2, 3, 4, 6, 8]), pair[1].save([0, 1, 2, 3, 5, 7])]
    for s in savers:
        finished(s)
    want = {0: [2, 3, 4, 6, 8], 1: [2, 3, 5, 7]}
    with contextlib.suppress(AssertionError):
        wait_for(lambda: all(n.step_dirs() == want[n.index] for n in pair), timeout=30,
                 what="retention to settle")  # fmt: skip
    assert {n.index: n.step_dirs() for n in pair} == want
    rows = restore_together(pair)
    assert [r[1:] for r in rows] == [["3", "3", "3.0"], ["3", "3", "3.0"]], rows


def test_with_the_controller_unreachable_no_committed_step_is_deleted(nodes, controller):
    """Node 0 of a two-node job, with keep_last=2: first with no controller known (it cannot
    tell which steps node 1 holds), then with a controller that does not answer; nothing
    committed goes. Once the job's controller answers, the steps every node holds are known
    and retention resumes; when it stops answering, the node keeps every step from the newest
    common one it learned."""
    node0, node1 = nodes("unreached")
    node0.start_agent()
    finished(node0.save([0, 1, 2]))
    assert node0.step_dirs() == [0, 1, 2]
    node0.stop_agent()
    node0.report_to(free_port())  # nothing listens there
    node0.start_agent()
    finished(node0.save([3, 4, 5]))
    assert node0.step_dirs() == [0, 1, 2, 3, 4, 5]
    err = node0.stop_agent()
    assert "keeping every committed step of job unreached" in err, err[-3000:]
    # The controller comes: node 1 joins with steps 0-4 of its own.
    for n in (node0, node1):
        n.report_to(controller.port)
        n.start_agent()
    finished(node1.save([0, 1, 2, 3, 4]))
    finished(node0.save([6]))
    wait_for(lambda: node0.step_dirs() == [3, 4, 5, 6], timeout=30,
             what=f"node 0 to keep steps 3-6, not {node0.step_dirs()}")  # fmt: skip
    # The controller goes: node 0 keeps what it cannot prove is on node 1.
    controller.stop()
    finished(node0.save([7, 8, 9]))
    assert node0.step_dirs() == [3, 4, 5, 6, 7, 8, 9]
