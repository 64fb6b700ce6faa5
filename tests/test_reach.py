"""The training network's evidence (``faults.reach``): which nodes each node reaches, and the
node found cut off from it."""

from __future__ import annotations

import socket
import threading

import pytest
from ports import free_port

from flashckpt.faults import reach
from flashckpt.faults.reach import Reach, cut_off


@pytest.mark.parametrize(
    ("reached", "expected"),
    [
        # node1 cut off: the others reach each other (node2 a spare, a witness), node1 none
        ({"node0": {"node1": False, "node2": True}, "node1": {"node0": False, "node2": False}},
         ["node1"]),
        # node1 posted nothing (it lost power): the others' word is enough
        ({"node0": {"node1": False, "node2": True}, "node2": {"node0": True, "node1": False}},
         ["node1"]),
        # two nodes that lost each other and no third: neither is named
        ({"node0": {"node1": False}, "node1": {"node0": False}}, []),
        # every node reaches every other: none
        ({"a": {"b": True, "c": True}, "b": {"a": True, "c": True}}, []),
        # one link down (a and b), both reach c: neither is cut off
        ({"a": {"b": False, "c": True}, "b": {"a": False, "c": True}}, []),
        # c reached by one prober and not by another: not cut off
        ({"a": {"b": True, "c": False}, "b": {"a": True, "c": True}}, []),
        # c unreachable from every prober, but it reached someone itself: not cut off
        ({"a": {"b": True, "c": False}, "b": {"a": True, "c": False}, "c": {"a": True}}, []),
        # nobody posted anything
        ({}, []),
    ],
)  # fmt: skip
def test_a_node_is_cut_off_only_when_the_others_reach_each_other_and_not_it(reached, expected):
    assert cut_off(reached) == expected


@pytest.fixture
def store():
    """A real TCPStore, as the job's recovery store."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))  # fmt: skip


def test_a_node_probes_the_next_nodes_in_name_order_and_a_closed_port_is_not_reached(
    monkeypatch, store
):
    """Three listeners published in the store, one more name whose port listens no more: each
    node probes the next ones after its own name (wrapping), and finds which answer."""
    assert made_none(store)
    made = {n: Reach("127.0.0.1") for n in ("n0", "n1", "n2")}
    try:
        for name, r in made.items():
            r.publish(store, name)
        gone = socket.create_server(("127.0.0.1", 0))
        store.set(reach.key("n3"), f"127.0.0.1:{gone.getsockname()[1]}")
        store.append(reach.NAMES, '"n3"\n')
        gone.close()
        assert made["n1"].probe(store, "n1") == {"n2": True, "n3": False, "n0": True}
        monkeypatch.setattr(reach, "PROBE_FANOUT", 2)
        assert made["n2"].probe(store, "n2") == {"n3": False, "n0": True}
    finally:
        for r in made.values():
            r.close()


def test_the_training_address_is_the_named_interfaces_else_the_fallback(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert reach.training_address("10.9.9.9") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    assert reach.training_address("10.9.9.9") == "10.9.9.9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker,lo")  # an exclusion list names none
    assert reach.training_address("10.9.9.9") == "10.9.9.9"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=lo")
    assert reach.training_address("10.9.9.9") == "127.0.0.1"


def made_none(store) -> bool:
    """Nobody published yet: a probe has nobody to try."""
    alone = Reach("127.0.0.1")
    try:
        return alone.probe(store, "n0") == {}
    finally:
        alone.close()


def test_a_listener_publishes_once_the_store_answers_and_stops_trying_when_halted(store):
    calls, halt = [], threading.Event()

    def late():
        calls.append(1)
        if len(calls) < 2:
            raise ConnectionError("not served yet")
        return store

    r = reach.listen("n0", late, "127.0.0.1", halt)
    try:
        assert r is not None
        for _ in range(50):
            if store.check([reach.key("n0")]):
                break
            halt.wait(0.1)
        assert store.get(reach.key("n0")).decode() == r.address
        assert store.get(reach.NAMES) == b'"n0"\n'
    finally:
        halt.set()
        r.close()
    assert reach.listen("n1", store, "192.0.2.1", halt) is None  # an address not of this host
