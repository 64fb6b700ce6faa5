"""Releasing a rank's gloo collectives from a peer that went silent.

A gloo collective waits on its peers' TCP connections. A peer that dies with its host still
up has its connections closed by the kernel and the wait fails at once; a peer whose host
lost power, or was cut off the network, sends nothing, neither data nor FIN nor RST, and the
wait lasts the group's whole timeout (30 minutes). Gloo's ``abort()`` closes nothing.

``Connections`` notes which of this process's sockets exist when a round of in-process
recovery begins to form; when the round is over, ``cut()`` shuts down every TCP connection
opened since (the round's process groups', subgroups' included), which is what the kernel
does for a peer that died on a live host: each collective blocked on one fails with
"connection closed", the rank leaves the round, and destroying the groups finishes the job.
Kept: listening sockets (gloo's listener aborts the process on a shut one), the connections
to the recovery store, and every socket that existed before the round. A connection that the
training function itself opened during the round is cut too: the round is over, and the
training function runs again from the top in the next.

Linux only (``/proc``): elsewhere nothing is found, and nothing cut.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
_PROC_FD = "/proc/self/fd"


def sockets() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    try:
        fds = os.listdir(_PROC_FD)
    except OSError:
        return {}
    found = ((_inode(int(fd)), int(fd)) for fd in fds)
    return {inode: fd for inode, fd in found if inode is not None}


def tcp_table() -> dict[int, tuple[str, int]]:
    """Every TCP socket of this network namespace: inode -> (state, remote port)."""
    table: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            with contextlib.suppress(ValueError):
                remote_port = int(fields[2].rpartition(":")[2], 16)
                table[int(fields[9])] = (fields[3], remote_port)
    return table


class Connections:
    """The TCP connections a round opens (see the module doc). ``keep_ports``: remote ports
    never cut (the recovery store's)."""

    def __init__(self, keep_ports: set[int] | frozenset[int] = frozenset()):
        self.keep_ports = frozenset(keep_ports)
        self.before: set[int] = set()

    def begin(self) -> None:
        """The round begins to form: what exists now is never cut."""
        self.before = set(sockets())

    def opened(self) -> dict[int, int]:
        """inode -> fd of the established TCP connections opened since ``begin``."""
        table = tcp_table()
        out = {}
        for inode, fd in sockets().items():
            if inode in self.before or inode not in table:
                continue
            state, remote_port = table[inode]
            if state != _LISTEN and remote_port not in self.keep_ports:
                out[inode] = fd
        return out

    def cut(self) -> int:
        """Shut down, both ways, every connection the round opened; how many. The descriptors
        stay open (their owners close them): a blocked read returns, a write fails."""
        count = 0
        for inode, fd in self.opened().items():
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # closed, or reused by a non-socket meanwhile
                continue
            try:
                if _inode(fd) == inode:  # still the socket found above
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            except OSError as exc:  # not connected any more
                log.debug("shutdown of fd %d: %s", fd, exc)
            finally:
                sock.detach()
        return count


def _inode(fd: int) -> int | None:
    """The inode of the socket ``fd`` is; None if it is none (or closed meanwhile)."""
    try:
        target = os.readlink(f"{_PROC_FD}/{fd}")
    except OSError:
        return None
    return int(target[8:-1]) if target.startswith("socket:[") and target.endswith("]") else None
