"""A second fault at restore: a source that can only add a newer copy (a peer's memory) is
optional, and a restore goes on without it when it does not answer; a required tier that fails
for a moment is tried again. Real controller, real replica stores, real agents and tiers; the
node being restored is lost whole first (its agent killed, its shared memory wiped)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import threading
import time

import pytest
import torch
from conftest import wait_for
from flashckpt.storage_tiers import peer as peer_module
from flashckpt.storage_tiers.peer import IO_TIMEOUT_S, PEER_TIMEOUT_S

from flashckpt import Checkpointer
from flashckpt.errors import TierUnavailableError
from flashckpt.faults.agent_client import agent_pid
from flashckpt.faults.events import read_events
from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier

PEER = "peer://auto?keep_last=1"


@pytest.fixture(autouse=True)
def fresh_lookups(monkeypatch):
    """Every open of the peer tier asks the controller who holds the replica (the test moves
    holders faster than the cache's few seconds)."""
    monkeypatch.setattr(peer_module, "RESOLVE_TTL_S", 0.0)


@pytest.fixture
def events(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("FLASHCKPT_EVENTS", str(path))
    return lambda kind: [e for e in read_events(path) if e["kind"] == kind] if path.exists() else []


def lose_node(run_dir, shm_dir, job: str) -> None:
    """The node is lost whole: its agent is killed and its shared memory is gone."""
    pid = agent_pid(run_dir, job)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: agent_pid(run_dir, job) is None, 30, what="the agent's claim to go")
    shutil.rmtree(shm_dir, ignore_errors=True)


def saved(ck: Checkpointer, step: int, state: dict, *tiers: str) -> None:
    ck.save(step, state)
    for tier in tiers:
        assert ck.wait(step, tier=tier, timeout=60) == step


def lost_after_saving(cluster, shm_dir, tmp_path, step: int) -> tuple[str, dict]:
    """node0 of ``cluster`` saves ``step`` to its peer and to its disk, then is lost whole;
    the disk tier's URL and the state saved."""
    job = cluster.job
    cluster.as_node("node0")
    disk = f"file://{tmp_path / 'nvme'}"
    state = {"w": torch.randn(1000)}
    with Checkpointer(PEER, disk, job=job) as ck:
        saved(ck, step, state, PEER, disk)
    lose_node(cluster.run_dir("node0"), shm_dir, job)
    return disk, state


def test_a_holder_whose_store_is_gone_is_skipped_and_the_tier_restores(
    nodes, shm_dir, tmp_path, events
):
    cluster = nodes(["node0", "node1"], job="gone")
    disk, state = lost_after_saving(cluster, shm_dir, tmp_path, 3)
    cluster.stop_store("node1")  # the holder's agent died too; the controller still lists it
    fresh = {"w": torch.zeros(1000)}
    with Checkpointer(PEER, disk, job="gone") as ck:
        assert ck.restore(fresh) == 3
        assert ck._restored_from == disk
        assert ck.generation == 1  # what it saves next is a branch of its own (see below)
    assert torch.equal(fresh["w"], state["w"])
    [skip] = events("restore_source_skipped")
    assert skip["source"].startswith("peer://auto") and skip["at"] == "listing"
    assert "cannot be reached" in skip["why"] and "Connection refused" in skip["why"], skip


def test_a_holder_that_takes_the_connection_and_never_answers_costs_a_few_seconds(
    nodes, shm_dir, tmp_path, events
):
    cluster = nodes(["node0", "node1"], job="mute")
    disk, state = lost_after_saving(cluster, shm_dir, tmp_path, 4)
    # node1 now answers on an address whose connections are taken (the kernel's backlog)
    # and never read: a holder that hangs.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        cluster.report_address("node1", f"127.0.0.1:{mute.getsockname()[1]}")
        fresh = {"w": torch.zeros(1000)}
        with Checkpointer(PEER, disk, job="mute") as ck:
            began = time.monotonic()
            assert ck.restore(fresh) == 4
            took = time.monotonic() - began
    assert torch.equal(fresh["w"], state["w"])
    # One listing, waited on for the peer timeout, not the minute a transfer may take (the
    # bound leaves room for a loaded machine: it fails only if a socket call's timeout ran).
    assert took < IO_TIMEOUT_S / 2, took
    [skip] = events("restore_source_skipped")
    assert f"nothing came within {PEER_TIMEOUT_S:g} s" in skip["why"], skip


def test_a_node_whose_controller_knows_no_other_node_restores_without_a_replica(
    nodes, shm_dir, tmp_path, events
):
    # The nodes of one job were given different controllers: each knows only its own node,
    # so no node holds a replica. That is no fault: the restore finds nothing, and training
    # starts at step 0 in the job's first branch.
    cluster = nodes(["node0"], job="alone")
    cluster.as_node("node0")
    disk = f"file://{tmp_path / 'nvme'}"
    with Checkpointer(PEER, disk, job="alone") as ck:
        assert ck.restore({"w": torch.zeros(10)}) is None
        assert ck.generation == 0
        saved(ck, 0, {"w": torch.ones(10)}, disk)
    assert events("restore_source_skipped") == []


def test_a_skipped_holder_that_comes_back_never_sends_a_restore_back_to_its_branch(
    nodes, shm_dir, tmp_path, events
):
    """The decision this tests: a restore that skipped a source starts a new branch (a new
    generation, after the step it restored). The skipped source may hold a newer step of
    the old branch; when it answers again, that step is of an abandoned branch and is never
    a candidate, so the work trained since the restore is never dropped for it."""
    cluster = nodes(["node0", "node1"], job="branch")
    cluster.as_node("node0")
    nvme = tmp_path / "nvme"
    disk = f"file://{nvme}"
    states = {s: {"w": torch.full((100,), float(s))} for s in (1, 2, 3, 5)}
    with Checkpointer(PEER, disk, job="branch") as ck:
        saved(ck, 1, states[1], PEER, disk)
        saved(ck, 5, states[5], PEER, disk)
    # The disk lost step 5 (it lags, or its write was lost with the node): only node1's
    # memory holds it.
    run_with_tier(disk, lambda t: t.delete("branch/step-000000000005"))
    lose_node(cluster.run_dir("node0"), shm_dir, "branch")
    cluster.stop_store("node1")
    into = {"w": torch.zeros(100)}
    with Checkpointer(PEER, disk, job="branch", close_timeout=3) as ck:
        assert ck.restore(into) == 1 and ck.generation == 1
        saved(ck, 2, states[2], disk)
        saved(ck, 3, states[3], disk)
    assert len(events("restore_source_skipped")) == 1
    # node1 comes back holding step 5 of the branch the restore left.
    cluster.restart_store("node1")
    held = run_with_tier(PEER, lambda t: tier_io.list_steps(t, "branch"))
    assert (0, 5) in tier_io.complete(held), held
    lose_node(cluster.run_dir("node0"), shm_dir, "branch")
    with Checkpointer(PEER, disk, job="branch") as ck:
        assert ck.restore(into) == 3
    assert torch.equal(into["w"], states[3]["w"])


@pytest.mark.usefixtures("shm_dir", "run_dir")
def test_a_required_tier_that_fails_for_a_moment_is_tried_again(
    s3_server, s3_bucket, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="flashckpt.restore")
    tier = f"s3://{s3_bucket}/run?retry_attempts=1"
    state = {"t": torch.full((1024,), 7.0)}
    with Checkpointer(tier, job="blip") as ck:
        saved(ck, 7, state, tier)
    shutil.rmtree(os.environ["FLASHCKPT_SHM_DIR"], ignore_errors=True)
    monkeypatch.setenv("FLASHCKPT_LIST_RETRY_S", "20")
    s3_server.stop()
    back = threading.Timer(1.5, s3_server.start)  # the store restarts while the restore waits
    back.start()
    try:
        into = {"t": torch.zeros(1024)}
        with Checkpointer(tier, job="blip") as ck:
            assert ck.restore(into) == 7
        assert torch.equal(into["t"], state["t"])
        assert "cannot be listed" in caplog.text and "trying again" in caplog.text
    finally:
        back.join()


@pytest.mark.usefixtures("shm_dir", "run_dir")
def test_a_required_tier_that_stays_down_fails_the_restore_once_the_budget_is_spent(
    s3_server, s3_bucket, monkeypatch
):
    tier = f"s3://{s3_bucket}/run?retry_attempts=1"
    with Checkpointer(tier, job="down") as ck:
        saved(ck, 2, {"t": torch.ones(8)}, tier)
    shutil.rmtree(os.environ["FLASHCKPT_SHM_DIR"], ignore_errors=True)
    monkeypatch.setenv("FLASHCKPT_LIST_RETRY_S", "2")
    s3_server.stop()
    try:
        began = time.monotonic()
        refused = pytest.raises(TierUnavailableError, match=r"could not be listed .* for 2 s")
        with Checkpointer(tier, job="down") as ck, refused:
            ck.restore({"t": torch.zeros(8)})
        assert time.monotonic() - began < 30
    finally:
        s3_server.start()


def test_a_controller_that_is_down_while_a_node_restores_costs_the_replica_only(
    nodes, shm_dir, tmp_path, events
):
    # The controller restarts while the lost node's ranks restore: who holds the replica
    # cannot be asked, so the peer tier is skipped and the tiers serve the restore.
    cluster = nodes(["node0", "node1"], job="ctl")
    disk, state = lost_after_saving(cluster, shm_dir, tmp_path, 6)
    cluster.controller.stop()
    fresh = {"w": torch.zeros(1000)}
    with Checkpointer(PEER, disk, job="ctl") as ck:
        began = time.monotonic()
        assert ck.restore(fresh) == 6 and ck.generation == 1
        took = time.monotonic() - began
    assert torch.equal(fresh["w"], state["w"])
    assert took < IO_TIMEOUT_S / 2, took
    [skip] = events("restore_source_skipped")
    assert "cannot list the nodes" in skip["why"], skip


def test_an_agent_takes_a_trainer_while_a_tier_it_lists_at_start_hangs(nodes, shm_dir):
    # A restore registers its rank with the node's agent first: a tier the agent lists at
    # start (here a holder that hangs) must not hold that up, nor so the restore.
    from flashckpt.agent.jobs import Job

    cluster = nodes(["node0", "node1"], job="slow")
    cluster.as_node("node0")
    with socket.create_server(("127.0.0.1", 0)) as mute:
        cluster.report_address("node1", f"127.0.0.1:{mute.getsockname()[1]}")
        job = Job("slow", shm_dir, "node0")

        async def go():
            began = time.monotonic()
            worker = await job.add_tier(PEER)
            took = time.monotonic() - began
            await asyncio.sleep(PEER_TIMEOUT_S + 1)  # its listing gives up in its own task
            state = (worker.state.healthy, worker.state.last_error)
            await job.drain(10)
            return took, state

        took, (healthy, error) = asyncio.run(go())
    assert took < PEER_TIMEOUT_S / 2, took  # it did not wait for the listing
    assert not healthy and "stopped answering" in error, error
