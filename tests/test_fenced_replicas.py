"""Peer replicas fenced where they land: a holder refuses the puts and deletes of a writer of an
earlier run of the job, and those of a node the controller declared lost, and says why; the
newer run's replica stays as it was. A real controller and real replica stores over TCP on
loopback (``peer_cluster``), this process acting as the writing node."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time

import pytest
import torch
from conftest import wait_for
from flashckpt.agent import replicas as replicas_module
from flashckpt.proto import controller_pb2 as pb
from flashckpt.storage_tiers import open_tier
from test_replicas_reshard import JOB, STEP, manifest_of

from flashckpt.errors import StaleWriterError, TierUnavailableError
from flashckpt.faults.events import EventLog, read_events
from flashckpt.format import layout, tier_io
from flashckpt.snapshot.flatten import Leaf


def rank0(value: float, run: int):
    """Rank 0's sealed manifest (of run ``run``) and data: one tensor full of ``value``."""
    manifest, data = manifest_of(0, [Leaf("w", "tensor", torch.full((64,), value))], 1)
    return dataclasses.replace(manifest, incarnation=run), memoryview(data)


async def store(tier, value: float, run: int) -> None:
    """Rank 0's step STEP of run ``run``, as a node's agent stores it: data, manifest, marker."""
    await tier_io.write_rank(tier, *rank0(value, run))
    await tier_io.commit_step(tier, JOB, STEP, "node0", [0], 1, incarnation=run)


def test_a_put_and_a_delete_of_an_older_run_are_refused_and_the_newer_replica_stays(
    nodes, tmp_path, caplog
):
    cluster = nodes(["node0", "node1"], job=JOB)
    holder = cluster.stores["node1"]
    holder.events = EventLog(tmp_path / "events.jsonl")
    cluster.as_node("node0")

    async def go():
        # The agent of the earlier run (1), left over, and the newer run's (2): both node0.
        stale, newer = open_tier("peer://node1"), open_tier("peer://node1")
        await store(stale, 1.0, run=1)
        await store(newer, 2.0, run=2)
        with pytest.raises(StaleWriterError, match="of run 1 of job rep, and this holder took "
                                                   "run 2 of the job since"):  # fmt: skip
            await store(stale, 1.0, run=1)
        with pytest.raises(StaleWriterError, match="refuses node node0's delete"):
            await stale.delete(layout.step_prefix(JOB, STEP))
        listing = tier_io.complete(await tier_io.list_steps(newer, JOB))
        manifest, data = await tier_io.read_rank(newer, JOB, STEP, 0, 0, incarnation=2)
        return listing, manifest, data

    listing, manifest, data = asyncio.run(go())
    assert listing[0, STEP].incarnation == 2 and listing[0, STEP].ranks == {0}
    assert manifest.incarnation == 2
    assert bytes(data) == bytes(rank0(2.0, 2)[1])  # the newer run's bytes, whole
    assert holder.fenced == 2 and holder.newest_run == 2
    refused = [e for e in read_events(holder.events.path) if e["kind"] == "replica_refused"]
    assert [(e["source"], e["why"], e["op"], e["run"]) for e in refused] == [
        ("node0", "stale", "put", 1)  # the delete's is said with the next, ten seconds on
    ]
    assert "this holder took run 2" in caplog.text
    # A holder started again on what it holds keeps the fence: its commit markers say run 2.
    again = replicas_module.ReplicaStore(JOB, holder.shm_dir, holder.run_dir, node="node1")
    cluster.call(again.held())
    assert again.newest_run == 2


def test_a_writer_that_names_no_run_counts_as_run_0(nodes):
    cluster = nodes(["node0", "node1"], job=JOB)
    cluster.as_node("node0")
    asyncio.run(store(open_tier("peer://node1"), 2.0, run=2))
    with pytest.raises(StaleWriterError, match="it is of run 0"):  # what an older agent sends
        asyncio.run(open_tier("peer://node1").put(f"{JOB}/other", [memoryview(b"x")], 1))


def test_a_node_the_controller_declared_lost_is_refused_until_it_reports_again(nodes, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_NODE_TIMEOUT", "0.5")  # the controller's
    monkeypatch.setattr(replicas_module, "LOST_TTL_S", 0.0)  # the holder asks every time
    cluster = nodes(["node0", "node1"])
    controller = cluster.controller.controller
    cluster.as_node("node0")
    tier = open_tier("peer://node1")
    asyncio.run(tier.put("pj/before", [memoryview(b"b")], 1))
    worker = pb.Worker(rank=0, pid=os.getpid(), phase="train", step=1, age_s=1.0, alive=True)
    controller.report(pb.NodeReport(job="pj", node="node0", agent_id="node0-a", workers=[worker],
                                    ranks=[0], world_size=1))  # fmt: skip

    def lost() -> bool:  # node1 reports on (the controller hears), node0 falls silent
        cluster.report_address("node1", cluster.stores["node1"].address)
        return controller.jobs["pj"].nodes["node0"].lost

    wait_for(lost, 10, what="node0 lost")
    with pytest.raises(TierUnavailableError, match="controller declared node node0 lost"):
        asyncio.run(tier.put("pj/after", [memoryview(b"a")], 1))
    with pytest.raises(TierUnavailableError, match="declared node node0 lost"):
        asyncio.run(tier.delete("pj/before"))
    assert cluster.stores["node1"].fenced == 2
    # It reports again (its workers closed): its writes are taken again.
    closed = pb.Worker(rank=0, pid=os.getpid(), phase="closed", step=1, age_s=2.0, alive=True)
    controller.report(pb.NodeReport(job="pj", node="node0", agent_id="node0-a", workers=[closed],
                                    ranks=[0], world_size=1))  # fmt: skip
    asyncio.run(tier.put("pj/after", [memoryview(b"a")], 1))
    assert asyncio.run(tier.list("pj/")) == ["pj/after", "pj/before"]


def test_a_write_to_a_holder_that_falls_silent_ends_once_the_controller_declares_it_lost(
    nodes, monkeypatch
):
    """Node 0's replica holder takes a put's request and then says nothing more (its host lost
    power mid-transfer). The put fails as soon as the controller declares the holder lost,
    saying so, not after the transfer's send deadline (30 s, 60 s for a reply), and node 0's
    next put goes to the node that holds its replica now."""
    monkeypatch.setenv("FLASHCKPT_NODE_TIMEOUT", "0.5")  # the controller's
    monkeypatch.setenv("FLASHCKPT_PEER_TIMEOUT", "0.3")  # how often a long write looks
    cluster = nodes(["node0", "node1", "node2"])
    controller = cluster.controller.controller
    cluster.as_node("node0")
    tier = open_tier("peer://auto")
    asyncio.run(tier.put("pj/before", [memoryview(b"b")], 1))
    holder = tier.peer.name
    (other,) = {"node1", "node2"} - {holder}

    async def silent(*args, **kwargs):
        await asyncio.sleep(3600)

    monkeypatch.setattr(cluster.stores[holder], "_put", silent)

    def report(node: str) -> None:
        worker = pb.Worker(rank=int(node[-1]), pid=os.getpid(), phase="train", step=1,
                           age_s=1.0, alive=True)  # fmt: skip
        controller.report(pb.NodeReport(job="pj", node=node, agent_id=f"{node}-a",
                                        workers=[worker], ranks=[int(node[-1])], world_size=3,
                                        peer_address=cluster.stores[node].address))  # fmt: skip

    report(holder)  # a node with workers, then silent
    done = threading.Event()

    def others() -> None:
        while not done.wait(0.1):
            for node in ("node0", other):
                report(node)

    reporter = threading.Thread(target=others, daemon=True)
    reporter.start()
    try:
        began = time.monotonic()
        with pytest.raises(TierUnavailableError, match=f"declared node {holder} lost: the write"):
            asyncio.run(tier.put("pj/during", [memoryview(b"d" * 1000)], 1000))
        took = time.monotonic() - began
        assert controller.jobs["pj"].nodes[holder].lost
        assert took < 10, took
        asyncio.run(tier.put("pj/after", [memoryview(b"a")], 1))
        assert tier.peer.name == other
    finally:
        done.set()
        reporter.join(5)
    assert asyncio.run(tier.list("pj/")) == ["pj/after"]
