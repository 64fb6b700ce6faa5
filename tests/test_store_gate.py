"""The recovery store's gate: only holders of the job's token reach the store, and only on the
address it was asked to serve; the store itself listens on loopback alone."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from flashckpt import node_channel as wire
from flashckpt.faults.store_gate import SERVICE, LoopbackStore, StoreGate, StoreTunnel

TOKEN = b"the-jobs-token"


def client(port: int, timeout: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))  # fmt: skip


@pytest.fixture
def gate():
    g = StoreGate("127.0.0.1", 0, TOKEN)
    yield g
    g.close()


def test_a_holder_of_the_token_reaches_the_store_through_its_nodes_tunnel(gate):
    tunnel = StoreTunnel("127.0.0.1", gate.port, TOKEN)
    try:
        a, b = client(tunnel.port), client(tunnel.port)
        a.set("flashckpt/ns/round", "3")
        assert b.get("flashckpt/ns/round") == b"3"
        assert b.add("flashckpt/ns/round-3/arrived", 1) == 1
    finally:
        tunnel.close()
    assert gate.refused == 0


def test_a_client_without_the_token_is_refused_and_changes_nothing(gate):
    with pytest.raises(Exception):  # noqa: B017 - what torch raises for a closed peer varies
        client(gate.port, timeout=1).set("flashckpt/ns/round", "99")  # a plain TCPStore client
    wrong = StoreTunnel("127.0.0.1", gate.port, b"a-guess")
    try:
        with pytest.raises(Exception):  # noqa: B017
            client(wrong.port, timeout=1).set("flashckpt/ns/round", "99")
    finally:
        wrong.close()
    # A proof recorded from one exchange, replayed in the next: the gate's nonce differs.
    recorded = wire.ClientHandshake(TOKEN.decode(), SERVICE, "", "node0", "")
    with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as raw:
        raw.sendall(recorded.hello())
        proof = recorded.answer(wire.recv_frame(raw, "gate", wire.HELLO_LIMIT))
        raw.sendall(proof)
        assert wire.recv_frame(raw, "gate")["ok"] is True  # the first one passes
    with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as raw:
        raw.sendall(recorded.hello())
        wire.recv_frame(raw, "gate", wire.HELLO_LIMIT)
        raw.sendall(proof)
        with pytest.raises(wire.WireError, match="wrong job or token"):
            wire.recv_frame(raw, "gate")
        assert raw.recv(1) == b""  # and hung up on
    assert gate.refused >= 3
    right = StoreTunnel("127.0.0.1", gate.port, TOKEN)
    try:
        assert not client(right.port).check(["flashckpt/ns/round"])  # nothing got through
    finally:
        right.close()


def test_the_gate_serves_only_its_address_and_the_store_only_loopback(gate):
    for port in (gate.port, gate.store_port):
        with pytest.raises(ConnectionRefusedError):  # 127.0.0.2 is this host too, not asked for
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    alone = LoopbackStore()
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", alone.port), timeout=5).close()
        assert client(alone.port).add("k", 2) == 2
    finally:
        alone.close()


def test_a_store_client_behind_a_tunnel_whose_gate_is_gone_gives_up_within_its_patience():
    """A ``TCPStore`` client waits, past its own timeout, as long as the tunnel holds its
    connection; a tunnel whose gate refuses lets go within seconds, so a client that may
    wait only briefly (a launcher's last word) is not held for the store's whole window."""
    import time

    from flashckpt.faults.store_client import StoreClient

    gate = StoreGate("127.0.0.1", 0, TOKEN)
    tunnel = StoreTunnel("127.0.0.1", gate.port, TOKEN)
    try:
        store = StoreClient("127.0.0.1", tunnel.port, timeout=60)
        store.set("k", "v")
        gate.close()  # the node serving the store is gone: its port refuses
        began = time.monotonic()
        with pytest.raises(dist.DistNetworkError), store.patience(1.0):
            store.get("k")
        assert time.monotonic() - began < 12, time.monotonic() - began
    finally:
        tunnel.close()
