"""The control plane restarted while a job trains (issue 53): the controller, which serves the
recovery store, is killed with -9 and started again, first on its own host, then on another
that takes its address over (its first host lost whole). Each time it learns the job back from
the nodes' reports, the nodes put back what the store held (``store_client``), and the next
fault, a rank killed, is recovered in-process as before: no worker but the killed one is
restarted, and the job ends bit-identical. Then etcd, the rendezvous, is killed and started
again from its data 6 s later: the launchers wait for it (``rdzv_away``) and the job trains on.

The hosts are ``netns.Hosts``: two training nodes, etcd's rendezvous on a host of its own, and
the controller on a fourth, then a fifth."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from faults import poll
from test_launcher import TOKEN, Cluster, explain
from test_partition import hosts  # noqa: F401  (the fixture)
from test_spare_nodes import INPROCESS, pids_of


def current_pid(cluster: Cluster, node: int, rank: int) -> int:
    """The pid of the process that runs ``rank`` now: the last to report its restore."""
    text = (cluster.tmp / f"{cluster.name}-node{node}-{cluster.starts[node]}.log").read_text()
    return int(re.findall(rf"restored {rank} \S+ pid=(\d+)", text)[-1])


def node_logs(cluster: Cluster) -> list[str]:
    return [(cluster.tmp / f"{cluster.name}-node{n}-{cluster.starts[n]}.log").read_text()
            for n in range(cluster.n)]  # fmt: skip


def recovered_after(cluster: Cluster, node: int, since: float) -> dict | None:
    found = [e for e in cluster.events(node) if e["kind"] == "inprocess_recovered"
             and e["time"] > since]  # fmt: skip
    return found[0] if found else None


def restart_then_kill(control, cluster: Cluster, rank: int, host: int | None):
    """Restart the controller (on ``host``), wait until it has learned the job back, kill
    ``rank``: where, how long the learning and the in-process recovery took."""
    control.restart_controller(host)
    back = time.time()
    # It learns the job back: a step committed by every rank, from their reports.
    assert poll(lambda: any(e["kind"] == "global_commit" and e["time"] > back
                            for e in control.events()), 30), (
        (control.tmp / "controller.log").read_text()[-3000:])  # fmt: skip
    learned = time.time() - back
    node = rank // 2
    killed = time.time()
    os.kill(current_pid(cluster, node, rank), signal.SIGKILL)
    assert poll(lambda: recovered_after(cluster, node, killed) is not None, 60), (
        explain(cluster.finish(1)))  # fmt: skip
    rec = recovered_after(cluster, node, killed)
    return "same host" if host is None else "another host", learned, rec["replacement_s"]


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_a_controller_killed_and_started_again_learns_the_job_back(hosts, tmp_path,  # noqa: F811
                                                                   reference):  # fmt: skip
    import control_plane

    if why := control_plane.unavailable():
        pytest.skip(why)
    h = hosts(5)
    control = control_plane.ControlPlane(tmp_path / "control", TOKEN, hosts=h, host=3,
                                         etcd_host=2)  # fmt: skip
    cluster = Cluster(tmp_path, "ctlrestart", ({}, {}), trainer=INPROCESS, hosts=h,
                      control=control, FT_FAULTS="mark:0:3", FT_STEP_S="0.8",
                      FLASHCKPT_RESTART_POLICY="in-process", FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip
    took: list[tuple[str, float, float]] = []
    try:
        for n in (0, 1):
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "mark-0-3").exists(), 180), explain(cluster.finish(1))
        for rank, host in ((1, None), (2, 4)):
            took.append(restart_then_kill(control, cluster, rank, host))
        # etcd, the rendezvous, killed and back from its data 6 s later: the launchers wait
        # for it (``rdzv_away``) and the job trains on.
        control.restart_etcd(6.0)
        assert poll(lambda: all("the rendezvous answers again" in log for log in node_logs(
            cluster)), 60), explain(cluster.finish(1))  # fmt: skip
        run = cluster.finish(240)
    finally:
        cluster.close()
        control.close()
    assert run.codes == [0, 0], explain(run)
    fallbacks = [e for events in run.events for e in events if e["kind"] == "inprocess_fallback"]
    assert not fallbacks, fallbacks
    for rank in range(4):  # the killed ranks replaced once, every other worker kept
        assert len(pids_of(run.logs[rank // 2], rank)) == (2 if rank in (1, 2) else 1), (
            explain(run))  # fmt: skip
    assert run.digest == reference
    for where, learned, replaced in took:
        print(f"controller restarted on {where}: the job learned back in {learned:.2f}s, a rank "
              f"killed then recovered in-process in {replaced:.2f}s")  # fmt: skip
