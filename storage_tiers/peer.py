"""``peer://``: another node's memory, as a tier. A node's replica of its newest snapshots.

Every node's agent holds, in its shared memory, the newest complete step of ``k`` other
nodes (``agent/replicas.py``). From the sending agent and from a restoring rank alike, the
holder is found the same way: the job's controller lists the nodes and the address each
agent serves replicas on, and the holder of node ``N`` at ``hop=h`` is the ``h``-th node
after ``N`` in name order (wrapping around), skipping nodes of ``N``'s failure domain
(``FLASHCKPT_FAILURE_DOMAIN``) where domains are set, and nodes the controller has lost.
``peer://auto`` is that holder; ``peer://<node>`` names one.

It is a node-scope tier like a local disk: each node's ranks are stored with their own
holder. What it reads back is untrusted like any tier's: manifests and chunks are checked by
the restore. Transfers are plain sockets (``peer_wire``): a restore reads straight into its
buffer, and the holder sends from its memory with ``sendfile``; the channel is authenticated
with the job's controller token, over TLS where the controller uses TLS.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from flashckpt import config
from flashckpt.errors import CheckpointNotFoundError, ConfigError, TierUnavailableError

from . import peer_wire as wire
from . import threads
from .base import Leftover, Tier, TierSpec, check_key, iter_chunks
from .registry import option
from .threads import in_thread

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 3.0
"""How long a restore waits for a holder (``FLASHCKPT_PEER_TIMEOUT``): the controller's
answer, the connect, each reply, and any pause in the bytes of a transfer. A replica is
optional: a holder slower than this is skipped, and the restore goes on from the tiers."""
IO_TIMEOUT_S = 60.0  # one socket call of a sender's upload; a transfer may take longer in all
SEND_PIECE = 1 << 20  # a put checks between pieces whether its caller was cancelled
RESOLVE_TTL_S = 5.0  # a holder looked up is used this long before it is looked up again
_RESOLVED: dict[tuple, tuple[float, PeerNode]] = {}  # (job, run dir, node, ...) -> holder


@dataclass(frozen=True)
class PeerNode:
    """A node as the controller lists it: where its agent serves replicas."""

    name: str
    address: str  # "host:port"; "" where it serves none
    domain: str = ""
    lost: bool = False


def holder(nodes: list[PeerNode], me: str, hop: int, my_domain: str = "") -> PeerNode | None:
    """The ``hop``-th node after ``me`` in name order that can hold ``me``'s replica: not
    ``me``, serving replicas, not lost, and of another failure domain where ``me`` has one;
    None if there are fewer such nodes than ``hop``. ``me`` need not be listed (a node
    started again wiped asks before its agent has reported)."""
    fit = sorted(
        (n for n in nodes
         if n.name != me and n.address and not n.lost and not (my_domain and n.domain == my_domain)),
        key=lambda n: n.name,
    )  # fmt: skip
    if hop < 1 or len(fit) < hop:
        return None
    after = [n for n in fit if n.name > me] + [n for n in fit if n.name < me]
    return after[hop - 1]


def peer_timeout() -> float:
    """``FLASHCKPT_PEER_TIMEOUT`` seconds, default PEER_TIMEOUT_S (see there)."""
    return config.setting_float("peer_timeout", None, PEER_TIMEOUT_S, lo=0.1, hi=600.0)


class NoHolder(TierUnavailableError):
    """No node can hold this node's replica now. ``reported``: some node still reports
    holding one of this node's replicas (it may be one that cannot be reached)."""

    def __init__(self, message: str, reported: bool):
        super().__init__(message)
        self.reported = reported


def _nodes(reply: Any) -> list[PeerNode]:
    return [PeerNode(n.node, n.peer_address, n.failure_domain, n.lost) for n in reply.nodes]


async def list_nodes(job: str, run_dir: Any = None) -> list[PeerNode]:
    """The job's nodes as its controller knows them; TierUnavailableError without one."""
    return _nodes(await _job_status(job, run_dir))


async def replicas_of(
    job: str, source: str, run_dir: Any = None
) -> list[tuple[str, int, int, list[int]]]:
    """(holder node, generation, step, ranks) of every replica of ``source``'s ranks the
    job's nodes hold, as they last reported to the controller."""
    reply = await _job_status(job, run_dir)
    return [(n.node, r.generation, r.step, sorted(r.ranks))
            for n in reply.nodes for r in n.replicas if r.source == source]  # fmt: skip


async def _job_status(job: str, run_dir: Any) -> Any:
    from flashckpt.proto import controller_pb2 as pb
    from flashckpt.proto import controller_pb2_grpc as pb_grpc

    from flashckpt.faults.control import Endpoint

    endpoint = Endpoint.load(config.run_dir(run_dir, create=False), job)
    if endpoint is None:
        raise TierUnavailableError(
            f"peer replicas of job {job!r}: no controller is known on this node (no "
            f"{job}.controller in the run directory), so no peer can be found; run the job "
            "under flashckpt-run, or set FLASHCKPT_PEER_REPLICAS=0"
        )
    try:
        async with endpoint.channel() as channel:
            reply = await pb_grpc.ControllerStub(channel).JobStatus(
                pb.JobStatusRequest(job=job), metadata=endpoint.metadata(), timeout=peer_timeout()
            )
    except Exception as exc:  # grpc.aio.AioRpcError and transport errors alike
        raise TierUnavailableError(
            f"peer replicas of job {job!r}: the controller at {endpoint.address} cannot list "
            f"the nodes ({exc})"
        ) from None
    return reply


class PeerTier(Tier):
    """The memory of the node that holds this node's replica (see the module doc)."""

    optional = True  # it only adds a newer copy of this node's steps: a restore goes on without

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.hop = option(spec, "hop", 1, int, "a whole number >= 1")
        if self.hop < 1:
            raise ConfigError(f"tier {spec.url}: hop must be >= 1, got {self.hop}")
        self.named = "" if spec.location in ("", "auto") else spec.location
        self.peer: PeerNode | None = None  # the holder last used (for messages and events)

    # ---- where ------------------------------------------------------------------------
    def _key(self, job: str) -> tuple:
        domain = str(config.setting("failure_domain", None, "") or "")
        return (job, str(config.run_dir()), config.node_name(), domain, self.named, self.hop)

    async def _holder(self, job: str) -> PeerNode:
        """The holder, looked up at most every RESOLVE_TTL_S per process (a restore opens
        the tier for each listing and read: one controller call serves them all)."""
        key, now = self._key(job), time.monotonic()
        held = _RESOLVED.get(key)
        if held is not None and now - held[0] < RESOLVE_TTL_S:
            self.peer = held[1]
            return held[1]
        reply = await _job_status(job, None)
        nodes = _nodes(reply)
        _, _, me, domain, _, _ = key
        if self.named:
            found = next((n for n in nodes if n.name == self.named and n.address), None)
        else:
            found = holder(nodes, me, self.hop, domain)
        if found is None:
            reported = any(r.source == me for n in reply.nodes for r in n.replicas)
            raise NoHolder(
                f"peer replicas of job {job!r}: no node can hold node {me}'s replica "
                f"({self._wanted()}; the controller lists {sorted(n.name for n in nodes)})",
                reported,
            )
        _RESOLVED[key] = (now, found)
        self.peer = found
        return found

    def _wanted(self) -> str:
        return f"node {self.named}" if self.named else f"hop {self.hop}"

    def _forget(self) -> None:
        _RESOLVED.clear()

    # ---- the exchange ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self, peer: PeerNode, job: str, token: str) -> Iterator[socket.socket]:
        from flashckpt.faults.control import split_address

        wait = peer_timeout()  # the connect, the TLS handshake, the hello and every reply
        try:
            host, port = split_address(peer.address, f"peer {peer.name}'s address")
            sock = socket.create_connection((host, port), timeout=wait)
        except (OSError, ConfigError) as exc:
            raise TierUnavailableError(
                f"peer {peer.name} at {peer.address} cannot be reached: {exc}"
            ) from None
        try:
            sock.settimeout(wait)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            contexts = wire.tls_contexts()
            if contexts is not None:
                sock = contexts[1].wrap_socket(sock)
            _send(sock, {"op": "hello", "job": job, "token": token, "node": config.node_name()})
            _reply(sock, f"peer {peer.name}")
            yield sock
        except TimeoutError:
            raise TierUnavailableError(
                f"peer {peer.name} at {peer.address} stopped answering: nothing came within "
                f"{sock.gettimeout():g} s (FLASHCKPT_PEER_TIMEOUT for restores)"
            ) from None
        finally:
            sock.close()

    async def _call(self, key_or_prefix: str, fn, *args: Any,
                    stop: threading.Event | None = None) -> Any:  # fmt: skip
        job = key_or_prefix.split("/", 1)[0]
        config.validate_name("job", job)
        from flashckpt.faults.control import Endpoint

        endpoint = Endpoint.load(config.run_dir(), job)
        token = endpoint.token if endpoint is not None else ""
        peer = await self._holder(job)

        def run() -> Any:
            with self._connect(peer, job, token) as sock:
                return fn(sock, peer, *args)

        try:
            return await in_thread(run, stop=stop)  # a cancelled caller waits for it
        except wire.WireError as exc:
            self._forget()
            raise _as_error(exc, peer) from None
        except (OSError, TierUnavailableError):
            self._forget()  # the holder may have moved: look again next time
            raise

    async def put(self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview],
                  size: int) -> None:  # fmt: skip
        check_key(key)
        views = chunks if isinstance(chunks, list) else [c async for c in iter_chunks(chunks)]
        stop = threading.Event()  # set when the caller is cancelled: the send ends there
        await self._call(key, _put, key, views, size, stop, stop=stop)

    async def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        check_key(key)
        return await self._call(key, _get, key, start, end)

    async def get_into(self, key: str, out: memoryview, start: int = 0) -> None:
        check_key(key)
        await self._call(key, _get_into, key, out, start)

    async def get_scatter(self, key: str, pieces: list[tuple[int, int, int]], size: int) -> None:
        """Receive ``key``'s ``size`` bytes in one pass, each (offset, address, bytes) of
        ``pieces`` (in offset order, not overlapping, within ``size``) written straight to its
        address and the rest read past: a restore's targets filled with no buffer between."""
        check_key(key)
        await self._call(key, _get_scatter, key, pieces, size)

    async def list(self, prefix: str) -> list[str]:
        check_key(prefix, prefix=True)
        if not prefix:
            raise ConfigError(f"tier {self.spec.url} lists one job's keys: give 'job/'")
        try:
            return await self._call(prefix, _list, prefix)
        except NoHolder as exc:
            if exc.reported:
                raise
            # No node can hold a replica of this node and none reports holding one (a job of
            # one node, or one whose other nodes have not reported yet): there is none.
            return []

    async def delete(self, prefix: str) -> None:
        check_key(prefix, prefix=True)
        await self._call(prefix, _delete, prefix)

    async def leftovers(self, prefix: str) -> list[Leftover]:
        return []  # the holder discards a broken upload at once: nothing is left over

    async def remove_leftover(self, leftover: Leftover) -> None:
        return None

    def describe(self) -> str | None:
        peer = self.peer
        return None if peer is None else f"peer {peer.name} ({peer.address}) memory"

    async def close(self) -> None:
        return None


# ---- one request each, on a connected socket (run in a thread) -----------------------------
def _send(sock: socket.socket, header: dict) -> None:
    sock.sendall(wire.encode(header))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got : got + wire.PIECE])
        if not n:
            raise wire.WireError("failed", "the peer hung up mid-transfer")
        got += n


def _reply(sock: socket.socket, where: str) -> dict:
    n = wire.decode_length(_recv_exact(sock, 4))
    return wire.checked(wire.decode(_recv_exact(sock, n)), where)


def _put(sock: socket.socket, peer: PeerNode, key: str, views: list, size: int,
         stop: threading.Event) -> None:  # fmt: skip
    # The holder makes room first (allocating a large replica takes a while), and a large
    # upload's sendall is one socket call: an upload is no restore's wait.
    sock.settimeout(IO_TIMEOUT_S)
    _send(sock, {"op": "put", "key": key, "size": size})
    _reply(sock, f"peer {peer.name}")  # room made: send
    sent = 0
    for view in views:
        flat = memoryview(view).cast("B")
        for at in range(0, len(flat), SEND_PIECE):  # a cancelled put reads no further
            threads.check(stop)
            sock.sendall(flat[at : at + SEND_PIECE])
        sent += len(flat)
    if sent != size:
        raise wire.WireError("bad", f"{key}: {sent} bytes given for a size of {size}")
    _reply(sock, f"peer {peer.name}")


def _get(sock: socket.socket, peer: PeerNode, key: str, start: int, end: int | None) -> bytes:
    _send(sock, {"op": "get", "key": key, "start": start, "end": end})
    size = _size(_reply(sock, f"peer {peer.name}"), peer)
    return _recv_exact(sock, size)


def _get_into(sock: socket.socket, peer: PeerNode, key: str, out: memoryview, start: int) -> None:
    view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    _send(sock, {"op": "get", "key": key, "start": start, "end": start + len(view)})
    size = _size(_reply(sock, f"peer {peer.name}"), peer)
    if size != len(view):
        raise ValueError(
            f"peer {peer.name}: object {key!r} holds {size} bytes from byte {start}, expected "
            f"{len(view)}; it is truncated or the caller's size is wrong"
        )
    _recv_into(sock, view)


def _get_scatter(sock: socket.socket, peer: PeerNode, key: str,
                 pieces: list[tuple[int, int, int]], size: int) -> None:  # fmt: skip
    _send(sock, {"op": "get", "key": key, "start": 0, "end": size})
    got = _size(_reply(sock, f"peer {peer.name}"), peer)
    if got != size:
        raise wire.WireError("bad", f"object {key!r} holds {got} bytes, the manifest says {size}")
    scratch = memoryview(bytearray(min(size, wire.PIECE) or 1))
    at = 0
    for offset, address, n in pieces:
        if offset < at or offset + n > size:
            raise wire.WireError("bad", f"{key}: a piece at {offset} of {n} bytes in {size}, "
                                        f"after {at}")  # fmt: skip
        _skip(sock, scratch, offset - at)
        if n:
            _recv_into(sock, memoryview((ctypes.c_char * n).from_address(address)).cast("B"))
        at = offset + n
    _skip(sock, scratch, size - at)


def _skip(sock: socket.socket, scratch: memoryview, n: int) -> None:
    while n > 0:
        step = min(n, len(scratch))
        _recv_into(sock, scratch[:step])
        n -= step


def _size(reply: dict, peer: PeerNode) -> int:
    size = reply.get("size")
    if type(size) is not int or size < 0:
        raise wire.WireError("bad", f"peer {peer.name} answered a size of {size!r}")
    return size


def _list(sock: socket.socket, peer: PeerNode, prefix: str) -> list[str]:
    _send(sock, {"op": "list", "prefix": prefix})
    keys = _reply(sock, f"peer {peer.name}").get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise wire.WireError("bad", f"peer {peer.name} answered a listing that is not keys")
    return sorted(keys)


def _delete(sock: socket.socket, peer: PeerNode, prefix: str) -> None:
    _send(sock, {"op": "delete", "prefix": prefix})
    _reply(sock, f"peer {peer.name}")


def _as_error(exc: wire.WireError, peer: PeerNode) -> Exception:
    if exc.code == "missing":
        return CheckpointNotFoundError(str(exc))
    if exc.code == "full":
        import errno

        return OSError(errno.ENOSPC, str(exc))
    return TierUnavailableError(f"{exc} (peer {peer.name} at {peer.address})")
