"""The replica store against hostile and broken clients: a connection flood, a client that
trickles its hello, an oversized or malformed hello, a flood of bad tokens in the log, a put
that stalls, puts racing for the reserve, a holder that declares more bytes than asked, a
proof replayed or reflected, a fixed port; and its memory coming back (copies that moved,
crashed uploads, a dead agent's folder)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for
from flashckpt.agent import replicas as replicas_module
from flashckpt.storage_tiers import open_tier
from flashckpt.storage_tiers import peer as peer_module
from flashckpt.storage_tiers.peer import SERVICE
from peer_cluster import TOKEN

from flashckpt import node_channel as wire
from flashckpt.errors import TierUnavailableError


def run(coro):
    return asyncio.run(coro)


def address_of(cluster, name: str) -> tuple[str, int]:
    host, port = cluster.stores[name].address.rsplit(":", 1)
    return host, int(port)


def handshake(sock: socket.socket, node: str = "node0", holder: str = "node1",
              token: str = TOKEN) -> None:  # fmt: skip
    wire.shake_hands(sock, wire.ClientHandshake(token, SERVICE, "pj", node, holder))


def closed_within(sock: socket.socket, seconds: float) -> float:
    """How long until ``sock`` is hung up on (what comes before is read past)."""
    began = time.monotonic()
    sock.settimeout(seconds)
    while sock.recv(4096):
        pass
    return time.monotonic() - began


def test_a_connection_flood_is_capped_and_the_service_stays_up(nodes, monkeypatch):
    monkeypatch.setattr(replicas_module, "MAX_PER_ADDRESS", 8)
    cluster = nodes(["node0", "node1"])
    target = address_of(cluster, "node1")
    flood = [socket.create_connection(target, timeout=10) for _ in range(8)]
    try:
        time.sleep(0.3)  # the eight are accepted and wait for their hello
        extra = [socket.create_connection(target, timeout=10) for _ in range(20)]
        for sock in extra:  # closed unread, at once
            assert closed_within(sock, 5) < 5
            sock.close()
        assert sum(cluster.stores["node1"]._open.values()) == 8
    finally:
        for sock in flood:
            sock.close()
    time.sleep(0.3)
    cluster.as_node("node0")
    assert run(open_tier("peer://node1").list("pj/")) == []  # served again once they went
    assert cluster.stores["node1"].refusals.count >= 20


def test_the_hello_has_one_deadline_however_slowly_it_trickles(nodes, monkeypatch):
    monkeypatch.setattr(replicas_module, "HELLO_TIMEOUT_S", 1.0)
    cluster = nodes(["node0", "node1"])
    hello = wire.ClientHandshake(TOKEN, SERVICE, "pj", "node0", "node1").hello()
    with socket.create_connection(address_of(cluster, "node1"), timeout=10) as slow:
        began = time.monotonic()
        try:
            for byte in hello:  # one byte every 0.2 s: each read is quick, the whole is not
                slow.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass  # hung up on
        took = closed_within(slow, 10) + (time.monotonic() - began)
    # One deadline: a deadline per read would let the whole hello trickle in (20 s and more).
    assert 1.0 <= time.monotonic() - began < 8, took


def test_an_oversized_or_malformed_hello_is_refused_before_it_is_read(nodes, caplog):
    cluster = nodes(["node0", "node1"])
    target = address_of(cluster, "node1")
    with socket.create_connection(target, timeout=5) as big:
        big.sendall((1 << 20).to_bytes(4, "big"))  # a header of 1 MiB announced, none sent
        with pytest.raises(wire.WireError, match="at most 4096"):
            wire.recv_frame(big, "holder")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for node in ("\ud800", "../x", 7):  # a lone surrogate, a path, not a string
            body = json.dumps({"op": "hello", "v": 1, "service": SERVICE, "job": "pj",
                               "node": node, "holder": "", "nonce": "00" * 32}).encode()  # fmt: skip
            with socket.create_connection(target, timeout=5) as bad:
                bad.sendall(len(body).to_bytes(4, "big") + body)
                with pytest.raises(wire.WireError, match="node name"):
                    wire.recv_frame(bad, "holder")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_flood_of_wrong_tokens_logs_a_line_not_a_flood(nodes, caplog):
    cluster = nodes(["node0", "node1"])
    target = address_of(cluster, "node1")
    with caplog.at_level(logging.WARNING, logger="flashckpt.agent.replicas"):
        for _ in range(30):
            with socket.create_connection(target, timeout=5) as sock, pytest.raises(wire.WireError):
                handshake(sock, token="w" * 40)
    wait_for(lambda: cluster.stores["node1"].refusals.count == 30, what="30 refusals")
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


def test_a_proof_replayed_or_reflected_is_refused():
    server = wire.ServerHandshake(TOKEN, SERVICE, "pj", "node1")
    client = wire.ClientHandshake(TOKEN, SERVICE, "pj", "node0", "node1")
    challenge = wire.decode(server.challenge(wire.decode(client.hello()[4:]))[4:])
    # The server's own proof sent back as the client's: the labels differ.
    with pytest.raises(wire.WireError, match="wrong job or token"):
        server.check({"proof": challenge["proof"]})
    proof = wire.decode(client.answer(challenge)[4:])
    assert server.check(proof) == "node0"
    again = wire.ServerHandshake(TOKEN, SERVICE, "pj", "node1")
    again.challenge(wire.decode(client.hello()[4:]))  # the same hello, a fresh nonce
    with pytest.raises(wire.WireError, match="wrong job or token"):
        again.check(proof)
    # A server that does not hold the token cannot pass itself off as node1.
    impostor = wire.ServerHandshake("i" * 40, SERVICE, "pj", "node1")
    fresh = wire.ClientHandshake(TOKEN, SERVICE, "pj", "node0", "node1")
    with pytest.raises(wire.WireError, match="did not prove"):
        fresh.answer(wire.decode(impostor.challenge(wire.decode(fresh.hello()[4:]))[4:]))
    # The name bound in the proofs is the one checked: a hello for another holder is refused.
    with pytest.raises(wire.WireError, match="not 'node2'"):
        server.challenge(wire.decode(wire.ClientHandshake(TOKEN, SERVICE, "pj", "node0",
                                                          "node2").hello()[4:]))  # fmt: skip


def test_a_put_that_stalls_is_cut_off_and_its_memory_freed(nodes, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_PEER_STALL_TIMEOUT", "0.5")
    cluster = nodes(["node0", "node1"])
    store = cluster.stores["node1"]
    with socket.create_connection(address_of(cluster, "node1"), timeout=10) as sock:
        handshake(sock)
        sock.sendall(wire.encode({"op": "put", "key": "pj/s/big", "size": 40 << 20}))
        assert wire.recv_frame(sock, "holder")["ok"]
        sock.sendall(b"x")  # one byte of 40 MiB, then nothing: a sender that lost power
        time.sleep(0.2)
        assert store.reserved == 40 << 20 and any(store.root.rglob(".tmp-*"))
        assert closed_within(sock, 5) < 5  # cut off after the stall timeout
    time.sleep(0.2)
    assert store.reserved == 0
    assert not [p for p in store.root.rglob("*") if p.is_file()]  # the temporary is gone


def test_concurrent_puts_cannot_break_the_reserve(nodes, monkeypatch):
    cluster = nodes(["node0", "node1"])
    # Shared memory of 64 MiB with 64 MiB free: two 30 MiB puts at once fit one at a time.
    monkeypatch.setattr(replicas_module, "shm_space", lambda path: (64 << 20, 64 << 20))
    cluster.as_node("node0")
    started, results = threading.Barrier(2), []
    data = memoryview(bytes(30 << 20))

    def put(key: str) -> None:
        started.wait()
        try:
            run(open_tier("peer://node1").put(key, [data], len(data)))
            results.append("stored")
        except OSError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=put, args=(f"pj/r/{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results)[1] == "stored", results  # one stored, the other refused:
    assert "promised to puts in flight" in sorted(results)[0], results
    assert cluster.stores["node1"].reserved == 0


def test_a_holder_that_declares_more_than_was_asked_is_not_believed(nodes, monkeypatch):
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    run(open_tier("peer://node1").put("pj/k", [memoryview(b"0123456789")], 10))

    async def lying_get(self, tier, header, writer, stall):  # the holder says 1 TiB follow
        await replicas_module._answer(writer, {"ok": True, "size": 1 << 40})

    monkeypatch.setattr(replicas_module.ReplicaStore, "_get", lying_get)
    tier = open_tier("peer://node1")
    with pytest.raises(TierUnavailableError, match="to a request for 4 bytes"):
        run(tier.get("pj/k", 2, 6))
    with pytest.raises(TierUnavailableError, match="to a request for 10 bytes"):
        run(tier.get_into("pj/k", memoryview(bytearray(10))))


def test_the_port_can_be_fixed(nodes, monkeypatch):
    cluster = nodes(["node0"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FLASHCKPT_PEER_PORT", str(port))
    store = replicas_module.ReplicaStore("pj", cluster.tmp / "shm-node0", cluster.run_dir("node0"),
                                         node="node0")  # fmt: skip
    address = cluster.call(store.start("127.0.0.1"))
    try:
        assert address == f"127.0.0.1:{port}"
    finally:
        cluster.call(store.close())


def test_a_crashed_upload_is_listed_and_removed_through_the_tier(nodes):
    cluster = nodes(["node0", "node1"])
    with socket.create_connection(address_of(cluster, "node1"), timeout=10) as sock:
        handshake(sock)
        sock.sendall(wire.encode({"op": "put", "key": "pj/5/rank-0.data", "size": 1 << 20}))
        wire.recv_frame(sock, "holder")
        sock.sendall(b"y" * 1000)
        time.sleep(0.2)
        cluster.as_node("node0")
        tier = open_tier("peer://node1")
        [left] = run(tier.leftovers("pj/"))
        assert left.key == "pj/5/rank-0.data"
        cluster.as_node("node2")  # another node cannot see it, nor remove it
        assert run(peer_module.PeerTier(tier.spec).leftovers("pj/")) == []
        cluster.as_node("node0")
        run(tier.remove_leftover(left))
    assert not [p for p in cluster.stores["node1"].root.rglob("*") if p.is_file()]


def test_a_restarted_holder_removes_what_crashed_uploads_left(nodes):
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    run(open_tier("peer://node1").put("pj/1/rank-0.data", [memoryview(b"kept")], 4))
    folder = cluster.stores["node1"].root / "node0" / "pj" / "1"
    (folder / ".tmp-rank-0.data-0123456789ab").write_bytes(b"half")  # an agent died mid-upload
    cluster.stop_store("node1")
    cluster.restart_store("node1")
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0.data"]


def certificate(folder, names: str) -> tuple[str, str]:
    folder.mkdir()
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=localhost", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    return str(cert), str(key)


def use_tls(monkeypatch, cert_key: tuple[str, str]) -> None:
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TLS_CERT", cert_key[0])
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TLS_KEY", cert_key[1])


def test_under_tls_the_holders_name_is_checked_where_asked(nodes, tmp_path, monkeypatch):
    monkeypatch.setattr(replicas_module, "HELLO_TIMEOUT_S", 1.0)
    named = certificate(tmp_path / "named", "IP:127.0.0.1,DNS:node0,DNS:node1")
    use_tls(monkeypatch, named)
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    tier = open_tier("peer://node1")
    run(tier.put("pj/t", [memoryview(b"secret")], 6))
    monkeypatch.setenv("FLASHCKPT_PEER_TLS_NAMES", "1")
    assert run(tier.get("pj/t")) == b"secret"  # the certificate names node1
    # Plain text to the TLS port, or nothing at all: hung up on within the one deadline.
    for say in (wire.ClientHandshake(TOKEN, SERVICE, "pj", "node0", "node1").hello(), b""):
        with socket.create_connection(address_of(cluster, "node1"), timeout=10) as plain:
            plain.sendall(say)
            assert closed_within(plain, 5) < 3
    # A holder whose certificate does not name it: refused where names are checked.
    unnamed = certificate(tmp_path / "unnamed", "IP:127.0.0.1")
    use_tls(monkeypatch, unnamed)
    trusted = tmp_path / "ca.pem"  # both issuers trusted: only the name can fail
    trusted.write_text(Path(named[0]).read_text() + Path(unnamed[0]).read_text())
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TLS_CA", str(trusted))
    cluster.stop_store("node1")
    cluster.restart_store("node1")
    with pytest.raises(TierUnavailableError, match="TLS failed.*naming the node"):
        run(open_tier("peer://node1").get("pj/t"))
    monkeypatch.delenv("FLASHCKPT_PEER_TLS_NAMES")
    assert run(open_tier("peer://node1").get("pj/t")) == b"secret"  # the chain alone is checked


LISTER = """
import asyncio, sys, time
from pathlib import Path
from flashckpt.storage_tiers import open_tier
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
began = time.monotonic()
try:
    print(len(asyncio.run(open_tier("peer://node1").list("pj/"))), flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
print(f"{time.monotonic() - began:.2f}", flush=True)
"""


def list_together(cluster, tmp_path, ranks: int = 4) -> list[list[str]]:
    """``ranks`` processes of node0 list node1's replicas at once; what each printed."""
    cluster.as_node("node0")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", LISTER, str(go)], stdout=subprocess.PIPE,
                              text=True) for _ in range(ranks)]  # fmt: skip
    time.sleep(3)  # all of them started and waiting
    go.touch()
    return [p.communicate(timeout=60)[0].split() for p in procs]


def test_a_nodes_ranks_restoring_together_list_the_holder_once(nodes, tmp_path):
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    run(open_tier("peer://node1").put("pj/1/a", [memoryview(b"a")], 1))
    listed = list_together(cluster, tmp_path)
    assert [out[0] for out in listed] == ["1"] * 4, listed
    assert cluster.stores["node1"].served["list"] == 1


def test_ranks_wait_for_a_holder_that_does_not_answer_once_not_each(nodes, tmp_path):
    cluster = nodes(["node0", "node1"])
    with socket.create_server(("127.0.0.1", 0)) as mute:
        cluster.report_address("node1", f"127.0.0.1:{mute.getsockname()[1]}")
        listed = list_together(cluster, tmp_path)
    assert [out[0] for out in listed] == ["TierUnavailableError"] * 4, listed
    took = sorted(float(out[1]) for out in listed)
    # One waits out the peer timeout; the others, queued behind it, take its answer.
    assert took[-1] < 2 * peer_module.PEER_TIMEOUT_S, took


def test_a_holder_gives_back_the_replicas_the_controller_says_expired(nodes):
    cluster = nodes(["node0", "node1", "node2"])
    for source in ("node0", "node2"):
        cluster.as_node(source)
        run(open_tier("peer://node1").put("pj/1/a", [memoryview(b"a")], 1))
    store = cluster.stores["node1"]
    cluster.call(store.expire(["node0", "..", "node9"]))  # a bad name and an absent one pass
    assert sorted(p.name for p in store.root.iterdir()) == ["node2"]


def test_a_reader_that_stops_reading_is_cut_off(nodes, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_PEER_STALL_TIMEOUT", "0.5")
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    data = memoryview(bytes(48 << 20))  # more than the socket buffers hold
    run(open_tier("peer://node1").put("pj/1/big", [data], len(data)))
    store = cluster.stores["node1"]
    with socket.create_connection(address_of(cluster, "node1"), timeout=10) as sock:
        handshake(sock)
        sock.sendall(wire.encode({"op": "get", "key": "pj/1/big", "start": 0, "end": len(data)}))
        assert wire.recv_frame(sock, "holder")["size"] == len(data)
        wait_for(lambda: not store._open, timeout=10, what="the stalled get to be cut off")


def test_a_rank_stopped_while_it_lists_holds_the_others_up_only_for_a_while(nodes, monkeypatch):
    import fcntl
    import os

    monkeypatch.setenv("FLASHCKPT_PEER_TIMEOUT", "0.5")
    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    tier = open_tier("peer://node1")
    run(tier.put("pj/1/a", [memoryview(b"a")], 1))
    lock = f"{tier._listing_path('pj', 'pj/')}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # another rank holds it, and is stopped
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        began = time.monotonic()
        assert run(tier.list("pj/")) == ["pj/1/a"]
        assert 1.0 <= time.monotonic() - began < 10  # twice the peer timeout, then on its own
    finally:
        os.close(fd)
