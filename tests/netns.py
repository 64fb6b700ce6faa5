"""Simulated hosts for the multi-node tests: each a Linux network namespace with its own stack
(loopback, port space, routes) and its own address on one switch, so that a fault can cut a
host off the network while its processes run on, as on real machines.

``Hosts(n)`` makes a switch (a bridge in a namespace of its own: the test machine's own network
is never touched, nothing is routed off it) and ``n`` hosts, host ``i`` a namespace with
interface ``eth0`` at ``address(i)`` in a /24 of 10.213.0.0/16, cabled to the switch by a veth
pair. ``popen(i, argv, ...)`` runs a process in host ``i`` (through ``nsenter``: only the
network namespace changes; files, shared memory, pids and the environment are the machine's).

``Hosts(n, networks=2)`` gives every host a second network, as real clusters have a
management network and a training fabric: interface ``eth1`` at ``address(i, TRAINING)`` on a
second switch. ``training_iface`` names the interface the collectives use (``GLOO_SOCKET_IFNAME``
on every host); the rendezvous, the controller and the recovery store use ``address(i)``.

Faults, each silent to the other hosts (no FIN, no RST, no ICMP: frames are dropped), on every
network of host ``i``, or on one (``net``: ``MANAGEMENT`` or ``TRAINING``):

- ``unplug(i, net=None)``: the switch's port of host ``i`` goes down: the cable pulled (the host
  sees its carrier gone);
- ``partition(i, net=None)``: the switch disables that port and drops its frames both ways while
  both links stay up: the host sees nothing wrong and its TCP retransmits until ``heal``;
- ``heal(i)``: every port of the host forwards again; TCP data queued meanwhile arrives then.

Everything is named ``fcnt-<pid>-<tag>-...`` (``<pid>``: the test process); ``close()`` kills
the processes left in its namespaces and removes them, and a new ``Hosts`` first removes what
a killed test process left. ``unavailable()`` says why namespaces cannot be made here (not
root, no ``ip``), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "fcnt"
IFACE = "eth0"
"""Every host's interface to the (first) switch."""
MANAGEMENT, TRAINING = 0, 1
"""The networks of ``Hosts(n, networks=2)``: ``IFACE`` on the first, ``eth1`` on the second."""
_NAME = re.compile(rf"{PREFIX}-(\d+)-[0-9a-f]+-(?:sw|h\d+)")
_CMD_S = 10.0  # an ``ip`` call that takes longer than this is stuck


def unavailable() -> str | None:
    """Why no namespace can be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "bridge", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"network namespaces need {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-h0"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=_CMD_S)  # fmt: skip
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_CMD_S)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(ns: str) -> None:
    """Kill what runs in ``ns`` (started there by these tests) and remove it."""
    for _ in range(20):  # bounded: processes forking while they are killed
        pids = [int(p) for p in _ip("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("ip", "netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of test processes that are gone (killed before their cleanup)."""
    names = [line.split()[0] for line in _ip("ip", "netns", "list", check=False).stdout.splitlines()
             if line.strip()]  # fmt: skip
    left = [n for n in names if (m := _NAME.fullmatch(n)) and not _alive(int(m.group(1)))]
    for ns in left:
        _remove(ns)
    return left


class Hosts:
    """``count`` simulated hosts on one switch (see the module doc)."""

    def __init__(self, count: int, networks: int = 1):
        sweep()
        assert networks in (1, 2), networks
        self.networks = networks
        tag = secrets.token_hex(3)
        self.base = f"{PREFIX}-{os.getpid()}-{tag}"
        self.subnet = 1 + int(tag, 16) % 254  # 10.213.<subnet>.0/24: any is isolated here
        self.switch = f"{self.base}-sw"
        self.names = [f"{self.base}-h{i}" for i in range(count)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ("ip", "-n", self.switch)
        for net in range(self.networks):
            _ip(*sw, "link", "add", f"sw{net}", "type", "bridge")  # STP off: ports forward at once
            _ip(*sw, "link", "set", f"sw{net}", "up")
        for i, ns in enumerate(self.names):
            _ip("ip", "netns", "add", ns)
            self._made.append(ns)
            for net in range(self.networks):
                iface = f"eth{net}"
                _ip("ip", "link", "add", self.port(i, net), "netns", self.switch, "type", "veth",
                    "peer", "name", iface, "netns", ns)  # fmt: skip
                _ip(*sw, "link", "set", self.port(i, net), "master", f"sw{net}", "up")
                _ip("ip", "-n", ns, "addr", "add", f"{self.address(i, net)}/24", "dev", iface)
                _ip("ip", "-n", ns, "link", "set", iface, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")

    def __len__(self) -> int:
        return len(self.names)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def address(self, i: int, net: int = MANAGEMENT) -> str:
        """Host ``i``'s address on network ``net``: .11 up, so that every host's sorts as its
        number does (torch's rendezvous orders nodes by address)."""
        return f"10.{213 + net}.{self.subnet}.{11 + i}"

    @property
    def training_iface(self) -> str:
        """The interface the hosts' collectives use: the training network's, where there is one."""
        return f"eth{self.networks - 1}"

    @staticmethod
    def port(i: int, net: int = MANAGEMENT) -> str:
        """The switch's port of host ``i`` on network ``net`` (an interface of the switch's
        namespace)."""
        return f"{'pd'[net]}{i}"

    def _ports(self, i: int, net: int | None) -> list[str]:
        return [self.port(i, n) for n in range(self.networks) if net is None or n == net]

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run in host ``i``: nsenter execs it, so its pid is the process's own."""
        return ["nsenter", f"--net=/run/netns/{self.names[i]}", "--", *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` in host ``i`` (``env`` and the rest as given)."""
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def run(self, i: int, argv: Sequence[str], timeout: float = 30,
            **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
        return subprocess.run(self.command(i, argv), timeout=timeout, **kwargs)

    def pids(self, i: int) -> list[int]:
        """The processes running in host ``i``."""
        out = _ip("ip", "netns", "pids", self.names[i], check=False).stdout
        return [int(p) for p in out.split()]

    def unplug(self, i: int, net: int | None = None) -> None:
        for port in self._ports(i, net):
            _ip("ip", "-n", self.switch, "link", "set", port, "down")

    def partition(self, i: int, net: int | None = None) -> None:
        for port in self._ports(i, net):
            _ip("bridge", "-n", self.switch, "link", "set", "dev", port, "state", "0")

    def heal(self, i: int) -> None:
        """Undo ``unplug`` and ``partition``: every port of the host up and forwarding."""
        for port in self._ports(i, None):
            _ip("ip", "-n", self.switch, "link", "set", port, "up")
            # A port just set up forwards only once its carrier is seen (the kernel's link
            # watch, up to a second later); until then the bridge refuses a state ("Network
            # is down"), and once it comes the port forwards by itself.
            deadline = time.monotonic() + _CMD_S
            argv = ("bridge", "-n", self.switch, "link", "set", "dev", port, "state", "3")
            while (done := _ip(*argv, check=False)).returncode != 0:
                if "Network is down" not in done.stderr or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}"
                    )
                time.sleep(0.05)

    def move_address(self, address: str, to: int, net: int = MANAGEMENT) -> None:
        """Host ``to`` takes ``address`` over (another host's, lost), and the others send to
        it at once: their neighbour entry for the address is dropped, as a floating address's
        gratuitous ARP replaces it."""
        _ip("ip", "-n", self.names[to], "addr", "add", f"{address}/24", "dev", f"eth{net}")
        for i, ns in enumerate(self.names):
            if i != to:
                _ip("ip", "-n", ns, "neigh", "flush", "to", address, check=False)

    def close(self) -> None:
        """Kill every process left in the hosts and remove them and the switch."""
        for ns in reversed(self._made):
            _remove(ns)
        self._made.clear()
