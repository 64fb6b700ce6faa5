"""Peer replicas under ``flashckpt-run`` with real processes, each simulated node with its own
shared memory, run directory and agent: a lost node under in-process recovery comes back from
a peer's memory too, and when the peer holding a node's replica is lost with it, its ranks
(and so the job) go back to the newest step they can still read, from storage. The two-node
case under the restart policy is ``test_launcher``'s."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT
from faults import poll
from flashckpt.agent.replicas import store_root
from test_launcher import (
    PEER,
    PER_NODE,
    Cluster,
    back_from_a_peer,
    explain,
    held_steps,
    lose_a_node,
    restores,
)

INPROCESS = ROOT / "tests" / "inprocess_trainer.py"


def committed_by(root: Path, job: str, nodes: int) -> list[int]:
    """The steps of ``job`` a directory tier holds every node's commit marker of."""
    return [int(d.name.split("-")[1].split(".")[0]) for d in (root / job).glob("step-*")
            if len(list(d.glob("commit-*.json"))) == nodes]  # fmt: skip


@pytest.mark.slow
def test_under_in_process_recovery_a_lost_node_comes_back_from_a_peer(tmp_path, reference):
    pfs = f"pfs://{tmp_path / 'ip-pfs'}?every_steps=1000"
    cluster = Cluster(tmp_path, "ip-lost", trainer=INPROCESS, FT_TIERS=pfs, FT_WAIT_TIERS=PEER,
                      FT_FAULTS="pause:2:12", FLASHCKPT_RESTART_POLICY="in-process",
                      FLASHCKPT_RECOVERY_DEADLINE="15", FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip
    try:
        lose_a_node(cluster, 1)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0], explain(run)
    back_from_a_peer(run, reference)
    # No spare node: the job restarts whole, and says why.
    lost = next(e for e in run.events[0] if e["kind"] == "node_lost")
    assert lost["action"] == "kill" and "0 free spare node(s)" in lost["fallback"], lost


@pytest.mark.slow
def test_two_nodes_lost_with_one_replica_go_back_to_the_newest_step_all_can_read(
    tmp_path, reference3
):
    """Three nodes, one replica each (placed by the controller: node 0's and node 1's on node 2,
    node 2's on node 0), the shared tier at most every 5 steps. Nodes 1 and 2 are lost together after step 12:
    node 2's ranks could read step 12 from node 0's memory, but node 1's replica was on node
    2, so its ranks can read only what storage committed for every rank (a slow tier skips
    ahead, and node 0's agent may still complete a step after the others are stopped, so
    which step that is depends on timing: at least the newest complete when they stopped);
    every rank resumes after the same step, node 1's ranks from storage."""
    pfs = tmp_path / "two-pfs"
    cluster = Cluster(tmp_path, "two", ({}, {}, {}), nodes=3, FT_TIERS=f"pfs://{pfs}?every_steps=5",
                      FT_FAULT="pause", FT_RANK="2", FT_STEP="12", FT_WAIT_TIERS=PEER,
                      FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip
    try:
        cluster.start(0)
        assert poll(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
        for n in (1, 2):
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "paused").exists(), 180), cluster.finish(1)
        # Node 2's step 12 is in node 0's memory (node 1's, waited for by the paused rank, is
        # in node 2's).
        holder = store_root(Path(cluster.shm[0]), cluster.job) / "node2"
        assert poll(lambda: any(holder.rglob("commit-node2.json")), 60)
        for n in (1, 2):
            cluster.signal_node(n, signal.SIGSTOP)
        stored = committed_by(pfs, cluster.job, 3)
        assert stored, held_steps(pfs, cluster.job)
        floor = max(stored)  # complete steps only grow: the restore takes this one or newer
        assert poll(lambda: any(e["kind"] == "node_lost" for e in cluster.events(0)), 30)
        for n in (1, 2):
            cluster.lose(n)
        time.sleep(0.5)
        for n in (1, 2):
            cluster.start(n)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0, 0], explain(run)
    resumed = {}
    for events in run.events:
        resumed.update(restores(events))
    assert sorted(resumed) == list(range(3 * PER_NODE)), explain(run)
    (step,) = {e["step"] for e in resumed.values()}  # one step for every rank
    assert floor <= step <= 12, (floor, resumed)
    assert all(resumed[r]["source"].startswith("pfs") for r in (2, 3)), resumed
    assert run.digest == reference3
