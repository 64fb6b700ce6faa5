"""Which node serves the job's controller and recovery store (``faults.addresses``): a port
that a passing connection holds is waited for, not taken for another node's server."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from ports import free_port

from flashckpt.errors import FlashCkptError
from flashckpt.faults.addresses import serve_here, where


def hold(port: int) -> socket.socket:
    """Bind ``port`` without listening, as an outgoing connection's local port is."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    return sock


def listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def test_where_tells_a_server_a_held_port_a_free_one_and_another_hosts_address():
    port = free_port()
    assert where("127.0.0.1", port) == "free"
    with hold(port):
        assert where("127.0.0.1", port) == "held"
    with listen(port):
        assert where("127.0.0.1", port) == "served"
    assert where("192.0.2.1", port) == "elsewhere"  # TEST-NET-1: no host of ours has it


def test_a_port_held_for_a_moment_is_served_once_it_is_free():
    port = free_port()
    held = hold(port)
    threading.Timer(0.5, held.close).start()
    began = time.monotonic()
    served = serve_here("127.0.0.1", port, lambda: listen(port), "the store", retry_s=10)
    try:
        assert served is not None and served.getsockname()[1] == port
        assert 0.4 < time.monotonic() - began < 5
    finally:
        served.close()


def test_a_port_another_process_serves_or_another_hosts_address_is_reached_not_served():
    port = free_port()
    with listen(port):
        assert serve_here("127.0.0.1", port, lambda: listen(port), "the store") is None
    tries = []

    def fail():
        tries.append(1)
        raise OSError(99, "Cannot assign requested address")

    assert serve_here("192.0.2.1", port, fail, "the controller") is None and len(tries) == 1


def test_a_port_held_for_good_is_a_clear_error():
    port = free_port()
    with hold(port), pytest.raises(FlashCkptError, match="held on this host.*another port"):
        serve_here("127.0.0.1", port, lambda: listen(port), "the store", retry_s=0.3)
