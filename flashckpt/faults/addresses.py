"""Which node serves an address of the job (the controller's, the recovery store's).

Every node is given the same address, and the node whose host it names serves it. A bind that
fails says little by itself: the address may be another host's (the node only reports to it),
another launcher on this host may serve it already (several nodes on one host), or a passing
connection of this host may hold the port for a moment (an outgoing connection's local port
is any free one, a port the job was given included). Taking the last for the second once left
a job with no recovery store at all: every node looked for it elsewhere. ``serve_here`` tells
the three apart and tries again while only a passing connection holds the port.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import FlashCkptError

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_S = 10.0
"""How long a port held by no server is tried again before the launcher gives up."""


def where(host: str, port: int) -> str:
    """Where ``host:port`` is served, as seen from this host: ``elsewhere`` (another host's
    address), ``served`` (a process here listens on it), ``held`` (bound here by a socket that
    does not listen), or ``free``."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return "elsewhere"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
            return "free"
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return "elsewhere"
    try:
        with socket.create_connection(addr[:2], timeout=1.0):
            return "served"
    except OSError:
        return "held"


def serve_here(host: str, port: int, serve: Callable[[], T], what: str,
               retry_s: float = RETRY_S) -> T | None:  # fmt: skip
    """``serve()``'s result when this node serves ``host:port``; None when another host or
    another process here serves it (this node reaches it there). ``serve`` raises (an OSError,
    a RuntimeError) when it cannot bind; while no server holds the port, it is tried again for
    ``retry_s``, then a FlashCkptError says what to do."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return serve()
        except (OSError, RuntimeError) as exc:
            found = where(host, port)
            if found in ("elsewhere", "served"):
                log.info("%s at %s:%d is served %s (%s)", what, host, port,
                         "by another host" if found == "elsewhere" else "by another process "
                         "of this host", exc)  # fmt: skip
                return None
            if time.monotonic() > deadline:
                raise FlashCkptError(
                    f"cannot serve {what} on {host}:{port}: {exc}; the port is held on this "
                    f"host by a socket that serves nothing (for {retry_s:.0f}s): give the job "
                    "another port, the same on every node"
                ) from None
            time.sleep(0.1)
