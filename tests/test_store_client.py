"""A recovery-store client across the store's restart (``store_client``), and the round kept
across it (``inprocess.restore_round``, ``move_round``, ``last_round``): a real ``TCPStore``
server in a process of its own, killed with -9 and started again on the same port."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from ports import free_port

from flashckpt.faults import store_client
from flashckpt.faults.inprocess import last_round, move_round, restore_round
from flashckpt.faults.store_client import StoreClient

SERVER = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("up", flush=True)
time.sleep(3600)
"""


class Server:
    def __init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(self.port)],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout.readline().strip() == "up"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.kill()


@pytest.fixture
def put_back():
    """What this process puts back into a new store: records each store it is given."""
    given: list = []

    def action(store) -> None:
        given.append(store)
        store.set("put-back", "yes")

    store_client.on_new_store(action)
    yield given
    store_client.forget(action)


def test_a_client_connects_again_to_a_restarted_store_and_puts_back_once(server, put_back):
    a = StoreClient("127.0.0.1", server.port, timeout=10)
    b = StoreClient("127.0.0.1", server.port, timeout=10)
    a.set("k", "1")
    assert b.get("k") == b"1" and not put_back  # the same store: nothing to put back
    server.kill()
    server.start()
    assert not a.check(["k"])  # a new, empty store: the call made again on it
    assert a.get("put-back") == b"yes" and len(put_back) == 1 and a.reconnects == 1
    assert not b.check(["k"]) and len(put_back) == 1  # once for the process, not per client


def test_a_client_gives_up_when_the_store_stays_away(server):
    a = StoreClient("127.0.0.1", server.port, timeout=1)
    server.kill()
    with pytest.raises(dist.DistNetworkError):
        a.get("k")


def test_within_patience_a_call_waits_that_long_for_a_lost_store_not_the_window(server):
    a = StoreClient("127.0.0.1", server.port, timeout=60)
    server.kill()
    began = time.monotonic()
    with pytest.raises(dist.DistNetworkError), a.patience(1.0):
        a.get("k")
    assert time.monotonic() - began < 10  # the window is 60 s
    server.start()
    assert not a.check(["k"])  # out of it, the client connects again as before


def test_the_round_survives_the_stores_restart(server):
    c = StoreClient("127.0.0.1", server.port, timeout=10)
    assert move_round(c, "ns", 0, 5) == 1 and move_round(c, "ns", 1, 6) == 2
    c.set("flashckpt/ns/rank-3/round", "2")
    server.kill()
    server.start()
    # The nodes put back the newest round any of them knows, whichever comes first, and the
    # round each of their ranks is in: a rank's replacement then joins the round after it,
    # where the survivors go.
    assert restore_round(c, "ns", 1, {0: 1}) == 1
    assert restore_round(c, "ns", 2, {2: 2, 3: 2}) == 2 and restore_round(c, "ns", 1, {}) == 2
    assert last_round(c, "ns", 3) == 2 and last_round(c, "ns", 0) == 1
    assert move_round(c, "ns", last_round(c, "ns", 3), 7) == 3
    assert restore_round(c, "ns", 2, {3: 1}) == 3  # late: nothing it knows is newer
    assert last_round(c, "ns", 3) == 2


def test_a_node_that_knows_a_newer_round_of_a_rank_wins_over_one_that_came_first(server):
    """One launcher's relay lags (it still says round 0) and puts back first; the rank's own
    claim, put back after it, is newer: the rank's record ends at the newer round, so its
    replacement joins the round after the one it was really in."""
    c = StoreClient("127.0.0.1", server.port, timeout=10)
    assert restore_round(c, "ns", 0, {2: 0, 3: 0}) == 0
    assert restore_round(c, "ns", 1, {2: 1}) == 1
    assert last_round(c, "ns", 2) == 1 and last_round(c, "ns", 3) == 0
    assert move_round(c, "ns", last_round(c, "ns", 2), None) == 2


def test_a_round_moved_on_a_restarted_store_before_any_node_put_it_back(server):
    c = StoreClient("127.0.0.1", server.port, timeout=10)
    move_round(c, "ns", 0, None)
    server.kill()
    server.start()
    assert move_round(c, "ns", 1, None) == 2  # not round 1 again: the mover knew it left 1
    assert c.get("flashckpt/ns/round") == b"2"


def test_a_launcher_puts_back_the_round_its_ranks_claimed_when_its_relay_lags(server, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    """The relay last saw round 0, but the node's ranks claimed round 1 since (their events in
    the node's log): the launcher puts back round 1 for the job and for each rank, so the
    replacement of a rank killed next joins round 2, not the round the others are in."""
    import json
    from types import SimpleNamespace

    from flashckpt.faults.inprocess_agent import Member, Supervisor

    monkeypatch.setenv("FLASHCKPT_NODE", "node1")
    log = tmp_path / "job.events.jsonl"
    claims = [{"kind": "rank_claimed", "time": 1.0, "pid": 101, "rank": 2, "round": 0},
              {"kind": "rank_claimed", "time": 2.0, "pid": 101, "rank": 2, "round": 1},
              {"kind": "rank_claimed", "time": 2.0, "pid": 102, "rank": 3, "round": 1},
              {"kind": "rank_claimed", "time": 3.0, "pid": 999, "rank": 2, "round": 7}]  # fmt: skip
    log.write_text("".join(json.dumps(c) + "\n" for c in claims))  # pid 999: not a holder now
    env = {"FLASHCKPT_RECOVERY_NAMESPACE": "ns"}
    node = SimpleNamespace(members={0: Member(2, 101, env), 1: Member(3, 102, env)},
                           relay=SimpleNamespace(round=0), recovery=None, holder="node1",
                           job="job", ns="ns", _published=None, events=SimpleNamespace(path=log))  # fmt: skip
    node._claimed = lambda: Supervisor._claimed(node)
    assert node._claimed() == {2: 1, 3: 1}
    c = StoreClient("127.0.0.1", server.port, timeout=10)
    Supervisor._put_back(node, c)
    assert c.get("flashckpt/ns/round") == b"1" and last_round(c, "ns", 2) == 1
    assert move_round(c, "ns", last_round(c, "ns", 2), None) == 2
