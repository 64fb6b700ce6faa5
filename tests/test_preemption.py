"""Preemption with a deadline under ``flashckpt-run``: the scheduler's notice (SIGTERM at the
launchers, or a file a hook writes) sends the newest step every rank holds to a tier that
persists only every 1,000 steps, the launchers exit 143 saying what was made durable, and the
job requeued on fresh hosts resumes from that step, bit-identical to a run never stopped."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import wait_for
from test_launcher import Cluster, explain

from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier


def saved(marks: Path, ranks: range, step: int) -> bool:
    return all((marks / f"saved-{r}-{step}").exists() for r in ranks)


def last_saved(marks: Path, rank: int) -> int:
    return max(int(p.name.rsplit("-", 1)[1]) for p in marks.glob(f"saved-{rank}-*"))


def committed(url: str, job: str) -> set[int]:
    async def steps(tier) -> set[int]:
        listing = await tier_io.list_steps(tier, job)
        return set(tier_io.in_lineage(listing, tier_io.head(listing)))

    return run_with_tier(url, steps)


def preempted(events: list[dict]) -> dict:
    said = [e for e in events if e["kind"] == "preempted"]
    assert len(said) == 1, events[-10:]
    return said[0]


@pytest.mark.slow
def test_a_preempted_job_stores_its_newest_step_and_the_requeued_job_resumes_from_it(
    tmp_path, reference
):
    pfs = f"pfs://{tmp_path / 'pfs'}?every_steps=1000"
    cluster = Cluster(tmp_path, "pre", FT_TIERS=pfs, FT_PREEMPT="ask", FT_STEP_S="0.2")
    try:
        for node in range(2):
            cluster.start(node)
        wait_for(lambda: saved(cluster.marks, range(4), 12), timeout=120, what="step 12")
        for proc in cluster.procs:  # the scheduler's notice, at each node's entry point
            os.kill(proc.pid, signal.SIGTERM)
    finally:
        run = cluster.finish(timeout=60)
    assert run.codes == [143, 143], explain(run)
    stops = re.findall(r"stopped (\d+) (\d+)", "".join(run.logs))
    assert sorted(int(r) for r, _ in stops) == [0, 1, 2, 3], explain(run)
    (step,) = {int(s) for _, s in stops}  # every rank stopped after the same step
    assert step >= 12
    for node in range(2):
        said = preempted(run.events[node])
        assert said["why"] == "SIGTERM" and said["step"] == step, said
        assert said["tiers"] and "pfs://" in said["tiers"][0] and not said["missing"], said
    assert step in committed(pfs, cluster.job)  # past every_steps=1000

    # Requeued on fresh hosts: their memory, run directories and node tiers are new.
    again = Cluster(tmp_path, "requeued", job=cluster.job, FT_TIERS=pfs)
    try:
        for node in range(2):
            again.start(node)
    finally:
        resumed = again.finish(timeout=180)
    assert resumed.codes == [0, 0], explain(resumed)
    assert sorted(resumed.restored()) == [(r, str(step)) for r in range(4)], explain(resumed)
    assert resumed.digest == reference


@pytest.mark.slow
def test_workers_that_never_ask_are_stopped_at_half_the_budget_and_a_whole_step_stored(tmp_path):
    """Two nodes of one rank each, whose loop never asks: each node's newest step goes out,
    with the one before it, so the newest step both ranks hold is whole in the tier."""
    pfs = f"pfs://{tmp_path / 'pfs'}?every_steps=1000"
    notice = tmp_path / "notice"
    cluster = Cluster(tmp_path, "deaf", per_node=1, FT_TIERS=pfs, FT_PREEMPT="ignore",
                      FT_STEP_S="0.2", FLASHCKPT_PREEMPT_FILE=str(notice),
                      FLASHCKPT_PREEMPT_BUDGET="8")  # fmt: skip
    try:
        for node in range(2):
            cluster.start(node)
        wait_for(lambda: saved(cluster.marks, range(2), 5), timeout=120, what="step 5")
        notice.touch()  # a preStop hook's word, seen by both nodes
        began = time.monotonic()
        run = cluster.finish(timeout=60)
    finally:
        cluster.close()
    took = time.monotonic() - began
    assert run.codes == [143, 143], explain(run)
    assert took < 8 + 3, f"the launchers took {took:.1f}s of an 8s budget"
    assert "stopped" not in "".join(run.logs)
    steps = []
    stopping = [[e for e in run.events[n] if e["kind"] == "preempt_stopping_workers"]
                for n in range(2)]  # fmt: skip
    stops = [[e["time"] for e in es] for es in stopping]
    stopped = {pid for es in stopping for e in es for pid in e["pids"]}
    assert any(stops), stops  # they never stop by themselves
    first_stop = min(t for ts in stops for t in ts)
    for node in range(2):
        if not stops[node]:  # the other node's notice came first: its stop ended this worker
            asked = [e["time"] for e in run.events[node] if e["kind"] == "preempt_asked"]
            assert first_stop < asked[0] + 8 / 2, (stops, asked)
        failed = [e for e in run.events[node] if e["kind"] == "worker_failed"]
        assert not [e for e in failed if e["pid"] in stopped], failed  # stopped, not failed
        said = preempted(run.events[node])
        assert said["why"] == f"file {notice}" and not said["missing"], said
        # Its rank saved at least to its last mark (stopped between a save and its mark, one
        # more).
        last = last_saved(cluster.marks, node)
        assert last <= said["step"] <= last + 1, (said, last)
        steps.append(said["step"])
    assert min(steps) in committed(pfs, cluster.job), (steps, committed(pfs, cluster.job))


@pytest.mark.slow
def test_a_launcher_still_in_its_rendezvous_leaves_by_the_deadline(tmp_path):
    """Notice while TorchElastic waits for a node that never comes: nothing to store, and the
    launcher is gone by the deadline all the same."""
    cluster = Cluster(tmp_path, "alone", FT_TIERS=f"pfs://{tmp_path / 'pfs'}",
                      FLASHCKPT_PREEMPT_BUDGET="3")  # fmt: skip
    try:
        cluster.start(0)  # node 1 never starts: the rendezvous waits for it
        wait_for(lambda: any(e["kind"] == "launcher_started" for e in cluster.events(0)),
                 timeout=60, what="the launcher's start")  # fmt: skip
        time.sleep(1.0)  # into the rendezvous
        began = time.monotonic()
        os.kill(cluster.procs[0].pid, signal.SIGTERM)
        code = cluster.procs[0].wait(30)
        took = time.monotonic() - began
    finally:
        cluster.close()
    assert code == 143 and took < 3 + 4, (code, took)
    said = preempted(cluster.events(0))
    assert said["step"] is None and said["said"] == "no step saved here: nothing to persist", said
