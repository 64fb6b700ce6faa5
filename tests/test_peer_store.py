"""``peer://`` against a real replica store and a real controller, in one process: the holder
is found through the controller, objects go and come back whole, a listing and a delete are
one source node's, a wrong token is refused, a replica that would crowd out the trainers'
memory is refused, and a restore reads a corrupt replica chunk as corrupt."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from flashckpt.agent import replicas as replicas_module
from flashckpt.proto import controller_pb2 as pb
from flashckpt.storage_tiers import open_tier
from flashckpt.storage_tiers.peer import PeerNode
from flashckpt.storage_tiers.peer_placement import assign
from peer_cluster import TOKEN

from flashckpt import Checkpointer
from flashckpt.errors import CheckpointNotFoundError, PartlyRestoredError, TierUnavailableError
from flashckpt.faults import control
from flashckpt.format import layout


def run(coro):
    return asyncio.run(coro)


def test_objects_go_to_the_next_node_and_come_back_whole(nodes):
    cluster = nodes(["node0", "node1", "node2"])
    cluster.as_node("node1")
    placed = assign([PeerNode(n, "a:1") for n in ("node0", "node1", "node2")], hops=2)
    data = bytes(range(256)) * 40_000  # about 10 MiB: several pieces on the wire

    async def go():
        tier = open_tier("peer://auto")
        await tier.put("pj/a/b", [memoryview(data[:5]), memoryview(data[5:])], len(data))
        assert tier.peer.name == placed["node1"][0]
        assert await tier.get("pj/a/b") == data
        assert await tier.get("pj/a/b", 10, 20) == data[10:20]
        out = bytearray(100)
        await tier.get_into("pj/a/b", memoryview(out), 1000)
        assert bytes(out) == data[1000:1100]
        assert await tier.list("pj/") == ["pj/a/b"]
        with pytest.raises(CheckpointNotFoundError):
            await tier.get("pj/nothing")
        await tier.delete("pj/a")
        assert await tier.list("pj/") == []

    run(go())
    target = placed["node1"][0]
    assert not any(cluster.stores[target].root.rglob("b"))  # deleted from the holder's memory
    cluster.as_node("node0")  # another source node sees its own objects only
    run(open_tier(f"peer://{target}").put("pj/x", [memoryview(b"x")], 1))
    cluster.as_node("node1")
    assert run(open_tier(f"peer://{target}").list("pj/")) == []


def test_a_wrong_token_is_refused(nodes):
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    # The holder's node was given another token than this one: it cannot prove the job's.
    control.Endpoint(cluster.address, "y" * 40).save(cluster.run_dir("node1"), "pj")
    with pytest.raises(TierUnavailableError, match="did not prove that it holds the job's token"):
        run(open_tier("peer://auto").list("pj/"))
    control.Endpoint(cluster.address, TOKEN).save(cluster.run_dir("node1"), "pj")
    assert run(open_tier("peer://auto").list("pj/")) == []


def test_a_replica_that_would_crowd_out_the_trainers_is_refused(nodes, monkeypatch, caplog):
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    monkeypatch.setattr(replicas_module, "RESERVE", 1.0)  # every byte is the trainers'
    with pytest.raises(OSError, match="no room for"):
        run(open_tier("peer://auto").put("pj/big", [memoryview(b"y" * 1000)], 1000))
    assert cluster.stores["node1"].refused == 1
    assert "refused" in caplog.text


def test_no_holder_and_no_controller_say_what_to_do(nodes, tmp_path, monkeypatch):
    cluster = nodes(["node0"])
    cluster.as_node("node0")
    with pytest.raises(TierUnavailableError, match="no node can hold node node0's replica"):
        run(open_tier("peer://auto").get("pj/x"))
    # No node can hold one and none reports holding one: there is no replica to list.
    assert run(open_tier("peer://auto").list("pj/")) == []
    # A node that reports holding one, but cannot hold it now (lost, or serving nowhere):
    # the replica exists and cannot be had.
    cluster.controller.controller.report(pb.NodeReport(
        job="pj", node="node1", agent_id="node1-a",
        replicas=[pb.Replica(source="node0", generation=0, step=3, ranks=[0])]))  # fmt: skip
    with pytest.raises(TierUnavailableError, match="no node can hold node node0's replica"):
        run(open_tier("peer://auto").list("pj/"))
    empty = tmp_path / "no-controller"
    empty.mkdir(mode=0o700)
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", str(empty))
    with pytest.raises(TierUnavailableError, match="FLASHCKPT_PEER_REPLICAS=0"):
        run(open_tier("peer://auto").list("pj/"))


def test_a_restore_from_a_peer_checks_every_chunk(nodes, monkeypatch, shm_dir):
    cluster = nodes(["node0", "node1"], job="pr")
    cluster.as_node("node0")
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    with Checkpointer("peer://auto?keep_last=1", job="pr") as ck:
        ck.save(3, state)
        assert ck.wait(3, tier="peer://auto?keep_last=1", timeout=60) == 3
    # The node is wiped: only the peer holds step 3.
    import shutil

    shutil.rmtree(shm_dir, ignore_errors=True)
    fresh = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    with Checkpointer("peer://auto?keep_last=1", job="pr") as ck:
        assert ck.restore(fresh) == 3
        assert ck._restored_from.startswith("peer node1")
    assert torch.equal(fresh["w"], state["w"]) and torch.equal(fresh["b"], state["b"])
    # Both sides of it are listed: from node1's replica store (what it holds for node0) and
    # from node0 (which peer holds its ranks, as reported to the controller).
    cluster.controller.controller.report(pb.NodeReport(
        job="pr", node="node1", agent_id="node1-a", peer_address=cluster.stores["node1"].address,
        replicas=[pb.Replica(source=n, generation=g, step=s, ranks=r)
                  for n, g, s, r in run(cluster.stores["node1"].held())]))  # fmt: skip
    shown = subprocess.run([sys.executable, "-m", "flashckpt.cli", "ls", "shm", "--job", "pr",
                            "--json"], capture_output=True, text=True, env=os.environ)  # fmt: skip
    doc = json.loads(shown.stdout).get("peer_replicas", shown.stdout + shown.stderr)
    assert isinstance(doc, dict), doc
    assert doc["elsewhere"] == [{"holder": "node1", "generation": 0, "step": 3, "ranks": [0]}]
    here = subprocess.run([sys.executable, "-m", "flashckpt.cli", "ls", "shm", "--job", "pr",
                           "--shm-dir", str(cluster.stores["node1"].shm_dir)],
                          capture_output=True, text=True, env=os.environ)  # fmt: skip
    assert "step 3 of node node0's ranks 0 held here" in here.stdout, here.stdout + here.stderr
    # A flipped byte in the holder's copy: the restore refuses it, and nothing else holds it;
    # the state it was received into holds part of it, which the restore says.
    data = next(cluster.stores["node1"].root.rglob(layout.data_key("pr", 3, 0).split("/")[-1]))
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0xFF
    data.write_bytes(bytes(raw))
    shutil.rmtree(shm_dir, ignore_errors=True)
    with (
        Checkpointer("peer://auto?keep_last=1", job="pr") as ck,
        pytest.raises(PartlyRestoredError, match="chunk|holds part of a copy"),
    ):
        ck.restore({"w": torch.zeros(1000), "b": torch.zeros(10)})


def test_an_agent_whose_replica_store_cannot_be_served_still_persists(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {
        **os.environ,
        "FLASHCKPT_PEER_REPLICAS": "1",
        "FLASHCKPT_PEER_HOST": "203.0.113.1",
        "FLASHCKPT_NODE": "node0",
    }  # fmt: skip  (an address of no interface here)
    proc = subprocess.run(
        [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", "pj", "--shm-dir",
         str(tmp_path / "shm"), "--run-dir", str(run_dir), "--exit-when-idle", "0.5"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "holds no other node's replica" in log and "FLASHCKPT_PEER_HOST" in log, log


def test_a_connection_that_never_says_hello_is_closed(nodes, monkeypatch):
    import socket

    monkeypatch.setattr(replicas_module, "HELLO_TIMEOUT_S", 0.3)
    cluster = nodes(["node0"])
    host, port = cluster.stores["node0"].address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        assert silent.recv(1) == b""  # hung up on, without a word
