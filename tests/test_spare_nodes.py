"""Spare nodes (``flashckpt-run --spare``) with real processes: a node lost whole is taken by a
spare in-process, its ranks restored from a peer's memory, while the healthy ranks keep their
processes; and what happens when that cannot be. Each simulated node has its own shared memory,
run directory, agent and tiers; the job runs under the README's multi-node settings and
``FLASHCKPT_RESTART_POLICY=in-process``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from faults import poll
from flashckpt.agent.replicas import store_root
from test_launcher import PEER, Cluster, explain, restores

from flashckpt.errors import ConfigError
from flashckpt.faults.report import render, summarize
from flashckpt.faults.spare import split_flag
from flashckpt.faults.standby import script_imports

INPROCESS = ROOT / "tests" / "inprocess_trainer.py"
# The recovery deadline is the default (30 s): a spare's standbys that are still importing
# torch when it takes a node, on a busy 2-core machine, need more than 15 s to arrive.
SETTINGS = {"FLASHCKPT_RESTART_POLICY": "in-process", "FLASHCKPT_NODE_TIMEOUT": "3"}


def spare_cluster(tmp_path, name: str, nodes: int = 3, spares: int = 1, **env: str) -> Cluster:
    pfs = f"pfs://{tmp_path / f'{name}-pfs'}?every_steps=1000"
    settings = {"FT_TIERS": pfs, "FT_WAIT_TIERS": PEER, "FT_FAULTS": "pause:2:12", **SETTINGS,
                **env}  # fmt: skip
    return Cluster(tmp_path, name, tuple({} for _ in range(nodes)), trainer=INPROCESS,
                   nodes=nodes, spares=spares, **settings)  # fmt: skip


def start(cluster: Cluster) -> None:
    """Every node, node 0 first (it hosts the rendezvous, the controller and the store); then
    wait until the pausing rank saved step 12 and its peer holds it, and the spares are warm."""
    cluster.start(0)
    assert poll(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
    for n in range(1, cluster.n):
        cluster.start(n)
    assert poll(lambda: (cluster.marks / "paused").exists(), 180), cluster.finish(1)
    for n in range(cluster.n - cluster.spares, cluster.n):
        assert poll(lambda n=n: any(e["kind"] == "spare_ready" for e in cluster.events(n)), 60)
    time.sleep(1.0)  # the spares' first reports reach the controller


def pids_of(log: str, rank: int) -> set[str]:
    return set(re.findall(rf"restored {rank} \S+ pid=(\d+)", log))


def first_step_after(events: list[dict], since: float) -> float | None:
    stepped = [e["time"] for e in events if e["kind"] == "stepped" and e["time"] > since]
    return min(stepped) if stepped else None


@pytest.mark.slow
def test_a_node_lost_whole_is_taken_by_a_spare_in_process_from_a_peers_memory(tmp_path,
                                                                              reference):  # fmt: skip
    """2 nodes x 2 ranks and a spare node, a shared tier persisting every 1,000 steps: node 1
    is lost whole after step 12 (every process SIGKILLed, its memory wiped). The spare takes its
    ranks under its name, restores them from node 0's memory, node 0's ranks keep their
    processes and restore from their own; every rank trains step 13 again and the job ends
    bit-identical to an undisturbed run."""
    cluster = spare_cluster(tmp_path, "spare")
    try:
        start(cluster)
        killed = time.time()
        cluster.lose(1)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, -9, 0], explain(run)  # node 1's launcher: the SIGKILL
    lost = next(e for e in run.events[0] if e["kind"] == "node_lost")
    assert (lost["action"], lost["spares"]) == ("replace", {"node1": "node2"}), lost
    assert lost["ordered"] == {}, lost
    (replaced,) = [e for e in run.events[2] if e["kind"] == "node_replaced_in_process"]
    assert (replaced["spare"], replaced["lost_node"], replaced["node"]) == (
        "node2", "node1", "node1"), replaced  # fmt: skip
    assert replaced["step"] == 12 and replaced["ranks"] == [2, 3], replaced
    for phase in ("detect_s", "round_s", "restore_s"):
        assert replaced[phase] > 0, replaced
    kept, taken = restores(run.events[0]), restores(run.events[2])
    assert sorted(taken) == [2, 3] and {e["step"] for e in taken.values()} == {12}, taken
    assert all(e["source"].startswith("peer node0 ") for e in taken.values()), taken
    assert {kept[r]["step"] for r in (0, 1)} == {12}, kept
    assert {kept[r]["source"] for r in (0, 1)} == {"shared memory"}, kept
    for rank in (0, 1):  # node 0's ranks kept their processes through it
        assert len(pids_of(run.logs[0], rank)) == 1, run.logs[0][-3000:]
    assert not any(e["kind"] == "inprocess_fallback" for ev in run.events for e in ev), explain(run)
    assert run.digest == reference
    back = first_step_after(run.events[2], killed)
    assert back is not None, explain(run)
    print(f"SIGKILL -> the spare's first step trained: {back - killed:.2f}s; {replaced}")
    # flashckpt report, on the logs of the nodes that remain: one lost node, taken by a spare.
    report = summarize([e for n in (0, 2) for e in run.events[n]])
    assert report.recoveries() == {"in_process": 0, "spare_node": 1, "restart": 0}, report
    (failure,) = report.failures
    assert (failure.kind, failure.spare, failure.restored_step) == ("node", "node2", 12), failure
    assert "1 by a spare node taking a lost node" in render(report)


@pytest.mark.slow
def test_a_spare_with_nothing_to_take_exits_with_the_job(tmp_path, reference):
    """No fault: the job ends on its nodes, and the spare (told by the controller) with it."""
    cluster = spare_cluster(tmp_path, "idle", FT_FAULTS="")
    try:
        for n in range(cluster.n):
            cluster.start(n)
            if n == 0:
                assert poll(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(),
                            60)  # fmt: skip
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0, 0], explain(run)
    assert run.digest == reference
    (started,) = [e for e in run.events[2] if e["kind"] == "launcher_started"]
    assert started["spare"] is True, started
    assert "job " in run.logs[2] and " is over" in run.logs[2], run.logs[2][-2000:]
    assert not any(e["kind"] == "worker_started" for e in run.events[2]), explain(run)


@pytest.mark.slow
def test_a_spare_node_needs_in_process_recovery(tmp_path):
    cluster = Cluster(tmp_path, "policy", ({}, {}, {}), nodes=3, spares=1,
                      FLASHCKPT_RESTART_POLICY="restart")  # fmt: skip
    cluster.start(2)
    code = cluster.procs[2].wait(60)
    cluster.close()
    text = (tmp_path / "policy-node2-1.log").read_text()
    assert code == 1 and "FLASHCKPT_RESTART_POLICY=in-process" in text, text


@pytest.mark.slow
def test_two_nodes_lost_with_one_replica_are_both_taken_by_spares_from_the_newest_stored_step(
    tmp_path, reference3
):
    """3 nodes x 2 ranks and two spares, the shared tier at most every 5 steps: nodes 1 and 2
    are lost together after step 12, and node 2 held node 1's replica. Each spare takes one
    node in-process; node 1's ranks can read only what storage holds for every rank, so every
    rank (node 0's keep their processes) goes back to the newest stored step, and the job
    ends bit-identical."""
    pfs = tmp_path / "two-pfs"
    cluster = spare_cluster(tmp_path, "two", nodes=5, spares=2,
                            FT_TIERS=f"pfs://{pfs}?every_steps=5")  # fmt: skip
    try:
        start(cluster)
        holder = store_root(cluster.shm[0], cluster.job) / "node2"  # node 2's step 12 there
        assert poll(lambda: any(holder.rglob("commit-node2.json")), 60)
        for n in (1, 2):
            cluster.signal_node(n, signal.SIGKILL)
        for n in (1, 2):
            cluster.lose(n)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, -9, -9, 0, 0], explain(run)
    # One detection, or two where their agents' last reports fell in different ticks.
    lost = [e for e in run.events[0] if e["kind"] == "node_lost"]
    assert {e["action"] for e in lost} == {"replace"}, lost
    taken = {k: v for e in lost for k, v in e["spares"].items()}
    assert sorted(taken) == ["node1", "node2"], lost
    assert sorted(taken.values()) == ["node3", "node4"], lost
    replaced = [e for n in (3, 4) for e in run.events[n] if e["kind"] == "node_replaced_in_process"]
    assert sorted(e["lost_node"] for e in replaced) == ["node1", "node2"], explain(run)
    resumed = {}
    for n in (0, 3, 4):
        resumed.update(restores(run.events[n]))
    assert sorted(resumed) == list(range(6)), explain(run)
    (step,) = {e["step"] for e in resumed.values()}  # one step for every rank
    assert step < 12 and step % 5 == 0, resumed
    assert all(resumed[r]["source"].startswith("pfs") for r in (2, 3)), resumed
    for rank in (0, 1):
        assert len(pids_of(run.logs[0], rank)) == 1, run.logs[0][-3000:]
    assert not any(e["kind"] == "inprocess_fallback" for ev in run.events for e in ev), explain(run)
    assert run.digest == reference3


@pytest.mark.slow
def test_a_second_node_lost_while_the_first_is_taken_ends_in_one_restart(tmp_path, reference3):
    """3 nodes and one spare: node 1 is lost whole and handed to the spare; node 2 is lost
    while that happens, with no spare left. The job restarts once (the spare joins it as
    node 1, node 2 comes back wiped) and ends bit-identical, never hung."""
    cluster = spare_cluster(tmp_path, "second", nodes=4, spares=1)
    try:
        start(cluster)
        cluster.lose(1)
        assert poll(lambda: any(e["kind"] == "node_lost" for e in cluster.events(0)), 30)
        cluster.lose(2)
        time.sleep(0.5)
        cluster.start(2)  # a fresh machine in its place
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(300)
    assert run.codes == [0, -9, 0, 0], explain(run)
    lost = [e for e in run.events[0] if e["kind"] == "node_lost"]
    assert lost[0]["action"] == "replace", lost
    # Node 2 is found lost (no spare left: the job restarts whole, and says why), unless it
    # is back before its node timeout: then the round's deadline ends the recovery instead.
    assert all(e["action"] == "kill" and "0 free spare" in e["fallback"] for e in lost[1:]), lost
    fallbacks = [e for e in run.events[0] if e["kind"] == "inprocess_fallback"]
    assert len(fallbacks) <= 1, fallbacks
    assert run.digest == reference3


def test_spare_is_the_launchers_flag_only_before_the_training_script(monkeypatch):
    monkeypatch.delenv("FLASHCKPT_SPARE", raising=False)
    assert split_flag(["--spare", "--nnodes=2", "t.py", "--spare"]) == (
        ["--nnodes=2", "t.py", "--spare"], True)  # fmt: skip
    assert split_flag(["--nnodes=2", "t.py", "--spare"]) == (
        ["--nnodes=2", "t.py", "--spare"],
        False,
    )
    monkeypatch.setenv("FLASHCKPT_SPARE", "1")
    assert split_flag(["--nnodes=2", "t.py"]) == (["--nnodes=2", "t.py"], True)
    monkeypatch.setenv("FLASHCKPT_SPARE", "maybe")
    with pytest.raises(ConfigError, match="FLASHCKPT_SPARE"):
        split_flag(["--nnodes=2", "t.py"])


def test_a_standby_warms_the_training_scripts_own_imports(tmp_path):
    """What the script imports at its top level is imported ahead, from where the script runs
    (its sibling modules too); a module that fails to import is left to the script."""
    (tmp_path / "helper_mod_for_standby.py").write_text("VALUE = 7\n")
    script = tmp_path / "train_me.py"
    script.write_text("from __future__ import annotations\nimport json, helper_mod_for_standby\n"
                      "from email import message\nfrom . import nothing\nimport missing_mod_x\n"
                      "if __name__ == '__main__':\n    import csv\n")  # fmt: skip
    where, names = script_imports(["-u", str(script), "--lr", "1"])
    assert where == str(tmp_path)
    assert names == ["json", "helper_mod_for_standby", "email", "missing_mod_x"]
    probe = ("import json, sys; from flashckpt.faults.standby import warm_script; "
             f"warm_script(['-u', {str(script)!r}]); "
             "print(json.dumps(['helper_mod_for_standby' in sys.modules, "
             "'email' in sys.modules, 'csv' in sys.modules]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [True, True, False], out.stderr
    assert "missing_mod_x (imported by the script) not warmed" in out.stderr
    assert "argparse" in script_imports(["-m", "json.tool"])[1]  # python -m module: its file
