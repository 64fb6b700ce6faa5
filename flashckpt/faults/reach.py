"""Whether a node reaches the others on the training network: the evidence that tells a node cut
off that network from a rank that hangs.

When only the training network fails on a host (its NIC, its cable, its switch port), the host's
ranks stall in their collectives, and so does every peer waiting on them. The host's agent and
launcher still answer the controller over the management network. To the watchdogs every rank
looks hung alike, and a culprit picked from them is replaced by a standby on the same cut-off
host, to stall again.

So every launcher (a spare's too) keeps a listening socket on its training address: the address
of ``GLOO_SOCKET_IFNAME`` (else ``NCCL_SOCKET_IFNAME``), else the node's own (``--local-addr``).
It publishes ``host:port`` in the job's recovery store under its node's name. A node with ranks
under suspicion tries a TCP connection to each of the next ``PROBE_FANOUT`` nodes in name order
(``PROBE_S`` each, all at once; the kernel answers a connection however busy the listening
process is). It posts what it reached with its suspects (``culprit``). ``cut_off`` then names
the nodes that no node reached while those nodes reached others, and that reached nobody
themselves. That node leaves the job, and a spare or a restart takes it.

The probe speaks TCP, as gloo and NCCL's socket transport do. A fabric that carries no TCP
(InfiniBand verbs without IPoIB on the socket interface) is probed on the interface named, which
may not be the one that failed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from .store_client import forget, on_new_store

log = logging.getLogger(__name__)

EXIT_CUT_OFF = 78
"""``flashckpt-run``'s exit status when its node left the job, cut off the training network."""
PROBE_S = 1.0
"""How long a probe's connection is given."""
PROBE_FANOUT = 8
"""How many other nodes each node probes: every node is probed by that many (a ring)."""
_SIOCGIFADDR = 0x8915
NAMES = "flashckpt/reach-names"
"""The recovery store's list of the nodes that published an address, one JSON string a line."""


def key(node: str) -> str:
    """The recovery store's key of ``node``'s listening address."""
    return f"flashckpt/reach/{node}"


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name``, or None (no such interface, or none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def training_address(fallback: str) -> str:
    """The address this node's collectives use: the first interface of ``GLOO_SOCKET_IFNAME``
    (else ``NCCL_SOCKET_IFNAME``; an exclusion list, ``^...``, names none), else ``fallback``."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        names = os.environ.get(var, "").lstrip("=")
        if not names or names.startswith("^"):
            continue
        address = interface_address(names.split(",")[0].strip())
        if address is not None:
            return address
        log.warning("%s=%s: no IPv4 address on that interface; the training network is probed "
                    "at %s", var, names, fallback)  # fmt: skip
    return fallback


class Reach:
    """This node's listening socket on its training address (see the module doc)."""

    def __init__(self, address: str):
        self.sock = socket.create_server((address, 0), backlog=64)
        self.address = f"{address}:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self.published: str | None = None  # the node's name this address was published as
        threading.Thread(target=self._serve, name="flashckpt-reach", daemon=True).start()
        on_new_store(self._put_back)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def publish(self, store: Any, node: str) -> None:
        """Say in the job's recovery store where ``node`` (this node) listens."""
        store.set(key(node), self.address)
        store.append(NAMES, json.dumps(node) + "\n")
        self.published = node

    def _put_back(self, store: Any) -> None:
        """The recovery store restarted (``store_client``): this node's address again."""
        if self.published is not None:
            self.publish(store, self.published)

    def probe(self, store: Any, node: str) -> dict[str, bool]:
        """Whether this node (``node``) reaches each of the next ``PROBE_FANOUT`` nodes (in
        name order, wrapping) that published an address: {their name: reached}."""
        names = sorted(set(_names(store)) | {node})
        at = names.index(node)
        others = [names[(at + i) % len(names)] for i in range(1, len(names))][:PROBE_FANOUT]
        if not others:
            return {}
        addresses = [store.get(key(n)).decode() for n in others]  # theirs alone, not all
        with ThreadPoolExecutor(len(others), thread_name_prefix="flashckpt-probe") as pool:
            return dict(zip(others, pool.map(_connects, addresses), strict=True))

    def close(self) -> None:
        forget(self._put_back)
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.close()


def listen(node: str, store: Any, fallback: str, halt: threading.Event) -> Reach | None:
    """This node's ``Reach`` on its training address (``training_address(fallback)``),
    published as ``node`` in the job's recovery store from a thread that tries until the store
    answers or ``halt``; None, with a warning, where the address cannot be bound."""
    address = training_address(fallback)
    try:
        reach = Reach(address)
    except OSError as exc:
        log.warning("cannot listen on the training address %s (%s): this node posts no word of "
                    "its training network, and a cut-off node is not told apart", address,
                    exc)  # fmt: skip
        return None

    def publish() -> None:
        while True:
            try:
                reach.publish(store() if callable(store) else store, node)
                return
            except Exception as exc:  # the store not served yet: try again
                log.debug("publishing %s's training address: %s", node, exc)
            if halt.wait(1.0):
                return

    threading.Thread(target=publish, name="flashckpt-reach-publish", daemon=True).start()
    return reach


def listen_for_probes(node: str, store: Any, args: Any, halt: threading.Event) -> Reach | None:
    """``listen`` for a launcher run with torchrun's ``args``: the training address falls back
    to ``--local-addr``, else this host's address on its route to the controller."""
    from .control import controller_address, split_address

    fallback = args.local_addr or route_address(split_address(controller_address(args))[0])
    return listen(node, store, fallback, halt)


def route_address(host: str) -> str:
    """This host's address on its route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _names(store: Any) -> list[str]:
    """The nodes that published their listening address."""
    raw = store.get(NAMES).decode() if store.check([NAMES]) else ""
    return list(dict.fromkeys(json.loads(line) for line in raw.splitlines() if line))


def _connects(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_S).close()
    except OSError:
        return False
    return True


def cut_off(reached: Mapping[str, Mapping[str, bool]]) -> list[str]:
    """The nodes cut off the training network, from what each node posted it reached
    (``reached[a][b]``: whether ``a`` reached ``b``): those that every node which probed them
    failed to reach, while at least one of those reached another node, and that reached none
    of the nodes they probed themselves. Two nodes that lost each other, with no third to
    tell which one is cut off, are neither."""
    probed = {b for got in reached.values() for b in got}
    out = []
    for x in sorted(probed | set(reached)):
        probers = {a: got for a, got in reached.items() if a != x and x in got}
        if not probers or any(got[x] for got in probers.values()):
            continue
        if not any(ok for a, got in probers.items() for b, ok in got.items() if b != x):
            continue  # no prober reached anyone else: it may be the one cut off
        if any(reached.get(x, {}).values()):
            continue
        out.append(x)
    return out


def leave(run_dir: Path, job: str, events: Any, why: str, halt: threading.Event) -> NoReturn:
    """Take this node out of the job, found cut off its training network: its agent first, so
    that the controller's last word of the node has its workers running and it finds the node
    lost (a spare takes it, or the job restarts), then every process this launcher started;
    then exit with ``EXIT_CUT_OFF``. ``halt``: stops the node's agent keeper."""
    from .. import config
    from .agent_client import agent_pid
    from .proc import children

    node = config.node_name()
    log.error("node %s leaves job %s: %s. Check this host's training network (%s); a spare node "
              "takes its ranks, or the job restarts without it", node, job, why,
              os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
              or "the interface its collectives use")  # fmt: skip
    events.record("node_cut_off", node=node, reason=why)
    halt.set()  # no agent started again
    for pid in filter(None, [agent_pid(run_dir, job), *children(os.getpid())]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    events.record("launcher_exited", ok=False, error="cut off the training network")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CUT_OFF)
