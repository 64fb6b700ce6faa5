"""Releasing a gloo collective blocked on a silent peer (``faults.release``): real gloo
processes, the peer stopped (SIGSTOP: its connections stay open and say nothing, as a host
that lost power or was cut off the network)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ports import free_port

from flashckpt.faults.release import Connections, sockets, tcp_table

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

RANK = r"""
import datetime, json, os, signal, sys, threading, time
import torch, torch.distributed as dist
from flashckpt.faults.release import Connections

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
conns = Connections({port})
conns.begin()
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
pair = dist.new_group([0, 1])
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t, group=pair)
store.set(f"ready-{rank}", "1")
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # silent from here on
    time.sleep(600)
store.wait(["ready-1"])
time.sleep(0.5)  # rank 1 is stopped now
opened = len(conns.opened())
cut = {}
def release():
    time.sleep(1.0)
    cut["at"] = time.monotonic()
    cut["count"] = conns.cut()
threading.Thread(target=release, daemon=True).start()
began = time.monotonic()
try:
    dist.all_reduce(t, group=pair)
    error = None
except Exception as exc:
    error = str(exc)
released_s = time.monotonic() - cut.get("at", began)
dist.destroy_process_group()
store.set("after", "still here")  # the store's connection was not cut
print(json.dumps({"opened": opened, "cut": cut.get("count"), "error": error,
                  "released_s": released_s, "store": store.get("after").decode()}))
"""


def test_a_collective_blocked_on_a_stopped_peer_is_released_by_cutting_the_rounds_connections(
    tmp_path,
):
    """Rank 0 blocks in a subgroup all-reduce on rank 1, which is stopped: shutting down the
    connections opened since ``begin()`` (the default group's and the subgroup's) makes it fail
    within a second, with gloo's "connection closed"; the listener is kept (gloo aborts the
    process on a shut one), so is the store's connection, and the groups still destroy."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]  # fmt: skip
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["opened"] >= 2 and result["cut"] == result["opened"], result
    assert result["error"] and "closed" in result["error"].lower(), result
    assert result["released_s"] < 5.0, result
    assert result["store"] == "still here"


def test_only_connections_opened_since_begin_and_not_to_kept_ports_are_found():
    """A connection made before ``begin()``, a listener, and one to a kept port are never
    named; one opened after is, and ``cut()`` shuts it (its peer reads end of file)."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    kept_server = socket.create_server(("127.0.0.1", 0))
    port, kept_port = server.getsockname()[1], kept_server.getsockname()[1]
    before = socket.create_connection(("127.0.0.1", port))
    accepted = [server.accept()[0]]
    conns = Connections({kept_port})
    conns.begin()
    listener = socket.create_server(("127.0.0.1", 0))
    to_kept = socket.create_connection(("127.0.0.1", kept_port))
    after = socket.create_connection(("127.0.0.1", port))
    accepted.append(server.accept()[0])
    try:
        assert {i for i, fd in sockets().items() if fd == after.fileno()} <= set(tcp_table())
        found = set(conns.opened().values())
        # ``after`` and its accepted end (made after begin(), its remote port ``after``'s
        # own): never ``before`` or its accepted end, the listener or the kept connection.
        assert found == {after.fileno(), accepted[1].fileno()}
        assert not found & {before.fileno(), accepted[0].fileno(), listener.fileno(),
                            to_kept.fileno(), server.fileno(), kept_server.fileno()}  # fmt: skip
        assert conns.cut() == 2
        assert after.recv(1) == b""  # shut down here: reads end
        before.sendall(b"x")  # untouched
        assert accepted[0].recv(1) == b"x"
    finally:
        for s in (server, kept_server, before, listener, to_kept, after, *accepted):
            s.close()
