"""``peer://``: another node's memory, as a tier. A node's replica of its newest snapshots.

Every node's agent holds, in its shared memory, the newest complete step of a few other nodes
(``agent/replicas.py``). Which node holds which is the controller's to answer, in one small
reply (``Holders``): placement is rendezvous hashing with bounded loads over the nodes that
serve replicas, outside the source's failure domain (``FLASHCKPT_FAILURE_DOMAIN``) where
domains are set (``peer_placement``). ``peer://auto`` stores at the node's holder for ``hop``
(1 by default) and reads from whichever node holds its newest replica at that hop (the holder
it stored at before the placement moved, until the new one holds a step as new);
``peer://<node>`` names one.

It is a node-scope tier like a local disk: each node's ranks are stored with their own
holder. What it reads back is untrusted like any tier's: manifests and chunks are checked by
the restore, and the sizes a holder declares are checked against what was asked. Transfers are
plain sockets: a restore reads straight into its buffer, and the holder sends from its memory
with ``sendfile``. Each connection starts with the node channel's handshake (the job's token
proved both ways, never sent; ``flashckpt/node_channel.py``), over TLS where the controller
uses TLS. A node's ranks restoring together list the holder once for the node, not once each:
the first lists, the others read its answer from the run directory.

After the handshake, requests go one at a time, each a frame, and for ``put`` and ``get`` the
raw bytes after it:

- ``put {key, size, incarnation}``: ``ok`` (room reserved, send) or an error; the bytes
  follow; ``ok`` once they are stored whole, under their key, atomically;
- ``get {key, start, end}``: ``ok {size}`` and that many bytes, or an error;
- ``list {prefix}``: ``ok {keys}``; ``delete {prefix, incarnation}``: ``ok``;
- ``leftovers {prefix}``: ``ok {leftovers}`` (what a crashed upload left at the holder);
  ``remove_leftover {key, name}``: ``ok``.

A node reaches only its own replicas: the holder files each request under the node name the
handshake bound.

Writes are fenced where they land. A put or a delete carries the writer's run of the job (its
``incarnation``; none counts as 0): the run of the manifest a rank's data and manifest are put
with (a rank's data is sent together with its manifest, which follows it), of the commit marker
put, and otherwise the newest this writer put. The holder refuses a run older than the newest
it took for the job (``stale``: StaleWriterError here) and a node the controller declared lost
(``lost``). A node's own agent puts nothing while its lease from the controller lapsed
(``may_write``, set by the agent: see ``agent/link.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from flashckpt import config
from flashckpt import node_channel as wire
from flashckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    StaleWriterError,
    TierUnavailableError,
)

from . import peer_listing as shared_listing
from . import threads
from .base import Leftover, Tier, TierSpec, check_key, iter_chunks
from .peer_placement import PeerNode, holder
from .registry import option
from .threads import in_thread

__all__ = ["PeerNode", "PeerTier", "declared_lost", "holder", "peer_timeout", "replicas_of"]

log = logging.getLogger(__name__)

SERVICE = "replicas"
PEER_TIMEOUT_S = 3.0
"""How long a restore waits for a holder (``FLASHCKPT_PEER_TIMEOUT``): the controller's
answer, the connect, each reply, and any pause in the bytes of a transfer. A replica is
optional: a holder slower than this is skipped, and the restore goes on from the tiers."""
IO_TIMEOUT_S = 60.0  # one socket call of a sender's upload; a transfer may take longer in all
SEND_PIECE = 1 << 20  # a put checks between pieces whether its caller was cancelled
PIECE = 8 << 20  # bytes received per socket call
RESOLVE_TTL_S = 5.0  # a holder looked up is used this long before it is looked up again
_RESOLVED: dict[tuple, tuple[float, PeerNode, PeerNode]] = {}  # key -> (when, store, read)
_RANK_DATA = re.compile(r"(.+/rank-[0-9]+)/data")
_RANK_MANIFEST = re.compile(r"(.+/rank-[0-9]+)/manifest\.json")
_COMMIT = re.compile(r".+/commit-[A-Za-z0-9._-]+\.json")


def peer_timeout() -> float:
    """``FLASHCKPT_PEER_TIMEOUT`` seconds, default PEER_TIMEOUT_S (see there)."""
    return config.setting_float("peer_timeout", None, PEER_TIMEOUT_S, lo=0.1, hi=600.0)


class NoHolder(TierUnavailableError):
    """No node can hold this node's replica now. ``reported``: some node still reports
    holding one of this node's replicas (it may be one that cannot be reached)."""

    def __init__(self, message: str, reported: bool):
        super().__init__(message)
        self.reported = reported


async def replicas_of(
    job: str, source: str, run_dir: Any = None
) -> list[tuple[str, int, int, list[int]]]:
    """(holder node, generation, step, ranks) of every replica of ``source``'s ranks the
    job's nodes hold, as they last reported to the controller."""
    from flashckpt.proto import controller_pb2 as pb

    reply = await _ask(job, run_dir, "JobStatus", pb.JobStatusRequest(job=job))
    return [(n.node, r.generation, r.step, sorted(r.ranks))
            for n in reply.nodes for r in n.replicas if r.source == source]  # fmt: skip


async def declared_lost(job: str, node: str, run_dir: Any = None, timeout: float = 1.0) -> bool:
    """Whether the job's controller declares ``node`` lost now (its holders take no write
    from it); TierUnavailableError where the controller cannot say within ``timeout``."""
    from flashckpt.proto import controller_pb2 as pb

    request = pb.HoldersRequest(job=job, node=node, hop=1)
    return (await _ask(job, run_dir, "Holders", request, timeout)).lost


async def _ask(job: str, run_dir: Any, method: str, request: Any,
               timeout: float | None = None) -> Any:  # fmt: skip
    """One call to the job's controller; TierUnavailableError without one."""
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
            stub = pb_grpc.ControllerStub(channel)
            return await getattr(stub, method)(request, metadata=endpoint.metadata(),
                                               timeout=timeout or peer_timeout())  # fmt: skip
    except Exception as exc:  # grpc.aio.AioRpcError and transport errors alike
        raise TierUnavailableError(
            f"peer replicas of job {job!r}: the controller at {endpoint.address} cannot list "
            f"the nodes ({exc})"
        ) from None


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
        # Whether this node may store replicas now: the agent sets it to its lease from the
        # job's controller (a node cut off from it may have had its ranks given to a spare).
        self.may_write: Callable[[], bool] = lambda: True
        self._runs: dict[str, int] = {}  # job -> the newest run this writer put
        # A rank's data, held until its manifest is put: both go with the manifest's run.
        self._data: dict[str, tuple[str, list, int]] = {}

    # ---- where ------------------------------------------------------------------------
    def _key(self, job: str) -> tuple:
        domain = str(config.setting("failure_domain", None, "") or "")
        return (job, str(config.run_dir()), config.node_name(), domain, self.named, self.hop)

    async def _holder(self, job: str, reading: bool) -> PeerNode:
        """The node to store at (or with ``reading``, to read from), looked up at most every
        RESOLVE_TTL_S per process (a restore opens the tier for each listing and read: one
        controller call serves them all)."""
        from flashckpt.proto import controller_pb2 as pb

        key, now = self._key(job), time.monotonic()
        held = _RESOLVED.get(key)
        if held is None or now - held[0] >= RESOLVE_TTL_S:
            _, _, me, domain, named, hop = key
            reply = await _ask(job, None, "Holders", pb.HoldersRequest(
                job=job, node=me, hop=hop, failure_domain=domain, named=named))  # fmt: skip
            store, read = (PeerNode(h.node, h.address) for h in (reply.assigned, reply.read_from))
            if not read.address:
                read = store
            if not store.address:
                raise NoHolder(
                    f"peer replicas of job {job!r}: no node can hold node {me}'s replica "
                    f"({self._wanted()}; the controller knows no node serving replicas outside "
                    "its failure domain)",
                    reply.reported,
                )
            held = _RESOLVED[key] = (now, store, read)
        self.peer = held[2] if reading else held[1]
        return self.peer

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
            wire.keep_alive(sock, send_s=wire.BULK_SEND_S)
            contexts = wire.tls_contexts()
            if contexts is not None:
                try:
                    sock = contexts[1].wrap_socket(sock, server_hostname=peer.name)
                except ssl.SSLError as exc:
                    raise TierUnavailableError(
                        f"peer {peer.name} at {peer.address}: TLS failed ({exc}); every node "
                        "needs a certificate the CA in FLASHCKPT_CONTROLLER_TLS_CA signed"
                        + (f", naming the node ({peer.name})" if wire.tls_checks_names() else "")
                    ) from None
            hands = wire.ClientHandshake(token, SERVICE, job, config.node_name(), peer.name)
            wire.shake_hands(sock, hands)
            yield sock
        except TimeoutError:
            raise TierUnavailableError(
                f"peer {peer.name} at {peer.address} stopped answering: nothing came within "
                f"{sock.gettimeout():g} s (FLASHCKPT_PEER_TIMEOUT for restores)"
            ) from None
        finally:
            sock.close()

    async def _call(self, key_or_prefix: str, fn, *args: Any, reading: bool = True,
                    stop: threading.Event | None = None) -> Any:  # fmt: skip
        job = key_or_prefix.split("/", 1)[0]
        config.validate_name("job", job)
        from flashckpt.faults.control import Endpoint

        endpoint = Endpoint.load(config.run_dir(), job)
        token = endpoint.token if endpoint is not None else ""
        peer = await self._holder(job, reading)
        socks: list[socket.socket] = []  # the write's connection, for its watch to shut
        moved: list[str] = []  # why the watch shut it

        def run() -> Any:
            with self._connect(peer, job, token) as sock:
                socks.append(sock)
                if moved:  # found lost while this connected: the watch shut nothing
                    raise TierUnavailableError(moved[0])
                return fn(sock, peer, *args)

        try:
            work = in_thread(run, stop=stop)  # a cancelled caller waits for it
            return await (work if reading else self._watched(work, job, peer, socks, moved))
        except (wire.WireError, OSError, TierUnavailableError) as exc:
            self._forget()  # the holder may have moved: look again next time
            if moved:
                raise TierUnavailableError(
                    f"peer {peer.name} at {peer.address}: {moved[0]}: the write to it was cut "
                    "off, and the next goes to the new holder"
                ) from None
            if isinstance(exc, wire.WireError):
                raise _as_error(exc, peer) from None
            raise

    async def _watched(self, work: Any, job: str, peer: PeerNode, socks: list[socket.socket],
                       moved: list[str]) -> Any:  # fmt: skip
        """Await a write to ``peer``, asking the controller every ``peer_timeout()`` while it
        lasts whether ``peer`` was found lost. Once it was (it lost power, or was cut off),
        the write's connection is shut: it fails now, not after its send deadline
        (``BULK_SEND_S``: 30 s), and this node's next snapshot goes to its new holder instead
        of waiting behind a silent one. The reason is put in ``moved``."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=peer_timeout()))[0]:
                why = await self._lost(job, peer)
                if why:
                    moved.append(why)
                    for sock in socks:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    break
            return await task
        except asyncio.CancelledError:
            task.cancel()
            await threads.settled(task)
            raise

    async def _lost(self, job: str, peer: PeerNode) -> str:
        """Why ``peer`` is to be written to no more ("" while it may be, or while the
        controller cannot say)."""
        try:
            if await declared_lost(job, peer.name, timeout=peer_timeout()):
                return f"the controller declared node {peer.name} lost"
        except TierUnavailableError:
            pass
        return ""

    async def put(self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview],
                  size: int, exclusive: bool = False) -> None:  # fmt: skip
        """``exclusive`` is not kept here: a peer's memory holds one copy a rank, replaced by
        its newer snapshots, and its holder refuses writers of an older run.

        A rank's data (``.../rank-<R>/data``) is sent with the rank's manifest, put next: the
        holder takes both as of the manifest's run, or neither."""
        check_key(key)
        job = key.split("/", 1)[0]
        manifest = _RANK_MANIFEST.fullmatch(key)
        # Taken first: whatever fails from here on, no view of the data outlives this call.
        data = self._data.pop(manifest.group(1), None) if manifest is not None else None
        self._leased(job)
        views = chunks if isinstance(chunks, list) else [c async for c in iter_chunks(chunks)]
        rank = _RANK_DATA.fullmatch(key)
        if rank is not None:
            held = rank.group(1)
            rank_dir = held.rsplit("/", 1)[1]
            # A rank's data of an earlier step whose manifest never came (its round failed) is
            # dropped: no view of a slot is kept past the next round of its rank.
            for other in [k for k in self._data if k != held and k.split("/", 1)[0] == job
                          and k.rsplit("/", 1)[1] == rank_dir]:  # fmt: skip
                del self._data[other]
            self._data[held] = (key, views, size)
            return
        puts = [(key, views, size)] if data is None else [data, (key, views, size)]
        run = self._runs.get(job, 0)
        if manifest is not None or _COMMIT.fullmatch(key):
            run = _run_of(views)
        stop = threading.Event()  # set when the caller is cancelled: the send ends there
        await self._call(key, _put, puts, run, stop, reading=False, stop=stop)
        self._runs[job] = max(run, self._runs.get(job, 0))
        shared_listing.stale(config.run_dir(), key)

    def _leased(self, job: str) -> None:
        if not self.may_write():
            raise TierUnavailableError(
                f"peer replicas of job {job!r}: not stored: this node's lease from the job's "
                "controller lapsed (the controller has not answered it within the lease, and may "
                "be giving its ranks to a spare); they are stored again once it answers"
            )

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
        job = prefix.split("/", 1)[0]
        config.validate_name("job", job)
        path = self._listing_path(job, prefix)
        return await shared_listing.once_per_node(path, lambda: self._list(prefix), peer_timeout())

    async def _list(self, prefix: str) -> list[str]:
        try:
            return await self._call(prefix, _list, prefix)
        except NoHolder as exc:
            if exc.reported:
                raise
            # No node can hold a replica of this node and none reports holding one (a job of
            # one node, or one whose other nodes have not reported yet): there is none.
            return []

    def _listing_path(self, job: str, prefix: str) -> Any:
        tag = hashlib.sha256(repr((self._key(job), prefix)).encode()).hexdigest()[:16]
        return config.run_dir() / f"{job}.peer-listing-{tag}.json"

    async def delete(self, prefix: str) -> None:
        check_key(prefix, prefix=True)
        job = prefix.split("/", 1)[0]
        self._leased(job)
        for held in [k for k in self._data if k.startswith(prefix)]:
            del self._data[held]
        await self._call(prefix, _delete, prefix, self._runs.get(job, 0), reading=False)
        shared_listing.stale(config.run_dir(), prefix)

    async def leftovers(self, prefix: str) -> list[Leftover]:
        """What crashed uploads of this node left at its holder."""
        check_key(prefix, prefix=True)
        try:
            return await self._call(prefix, _leftovers, prefix, reading=False)
        except NoHolder:
            return []

    async def remove_leftover(self, leftover: Leftover) -> None:
        await self._call(leftover.key, _remove_leftover, leftover, reading=False)

    def describe(self) -> str | None:
        peer = self.peer
        return None if peer is None else f"peer {peer.name} ({peer.address}) memory"

    async def close(self) -> None:
        self._data.clear()


# ---- one request each, on a connected socket (run in a thread) -----------------------------
def _send(sock: socket.socket, header: dict) -> None:
    sock.sendall(wire.encode(header))


def _reply(sock: socket.socket, peer: PeerNode) -> dict:
    return wire.recv_frame(sock, f"peer {peer.name}")


def _run_of(views: list) -> int:
    """The run of the job (``incarnation``) a manifest or a commit marker names; 0 where it
    names none (written before runs were kept) or cannot be read (the holder stores it as it
    is: a restore checks what it reads)."""
    try:
        doc = json.loads(b"".join(bytes(v) for v in views))
    except ValueError:
        return 0
    run = doc.get("incarnation", 0) if isinstance(doc, dict) else 0
    return run if type(run) is int and run >= 0 else 0


def _put(sock: socket.socket, peer: PeerNode, puts: list[tuple[str, list, int]], run: int,
         stop: threading.Event) -> None:  # fmt: skip
    # The holder makes room first (allocating a large replica takes a while), and a large
    # upload's sendall is one socket call: an upload is no restore's wait.
    sock.settimeout(IO_TIMEOUT_S)
    for key, views, size in puts:
        _send(sock, {"op": "put", "key": key, "size": size, "incarnation": run})
        _reply(sock, peer)  # room made: send
        sent = 0
        for view in views:
            flat = memoryview(view).cast("B")
            for at in range(0, len(flat), SEND_PIECE):  # a cancelled put reads no further
                threads.check(stop)
                sock.sendall(flat[at : at + SEND_PIECE])
            sent += len(flat)
        if sent != size:
            raise wire.WireError("bad", f"{key}: {sent} bytes given for a size of {size}")
        _reply(sock, peer)


def _get(sock: socket.socket, peer: PeerNode, key: str, start: int, end: int | None) -> bytes:
    _send(sock, {"op": "get", "key": key, "start": start, "end": end})
    size = _size(_reply(sock, peer), peer, None if end is None else max(0, end - start))
    if end is not None:
        return wire.recv_exact(sock, size)
    # The whole object, its size the holder's word alone: memory grows with what arrives,
    # never with what is declared.
    out = bytearray()
    while len(out) < size:
        piece = sock.recv(min(size - len(out), PIECE))
        if not piece:
            raise wire.WireError("failed", "the peer hung up mid-transfer")
        out += piece
    return bytes(out)


def _get_into(sock: socket.socket, peer: PeerNode, key: str, out: memoryview, start: int) -> None:
    view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    _send(sock, {"op": "get", "key": key, "start": start, "end": start + len(view)})
    size = _size(_reply(sock, peer), peer, len(view))
    if size != len(view):
        raise ValueError(
            f"peer {peer.name}: object {key!r} holds {size} bytes from byte {start}, expected "
            f"{len(view)}; it is truncated or the caller's size is wrong"
        )
    wire.recv_into(sock, view, PIECE)


def _get_scatter(sock: socket.socket, peer: PeerNode, key: str,
                 pieces: list[tuple[int, int, int]], size: int) -> None:  # fmt: skip
    _send(sock, {"op": "get", "key": key, "start": 0, "end": size})
    got = _size(_reply(sock, peer), peer, size)
    if got != size:
        raise wire.WireError("bad", f"object {key!r} holds {got} bytes, the manifest says {size}")
    scratch = memoryview(bytearray(min(size, PIECE) or 1))
    at = 0
    for offset, address, n in pieces:
        if offset < at or offset + n > size:
            raise wire.WireError("bad", f"{key}: a piece at {offset} of {n} bytes in {size}, "
                                        f"after {at}")  # fmt: skip
        _skip(sock, scratch, offset - at)
        if n:
            target = memoryview((ctypes.c_char * n).from_address(address)).cast("B")
            wire.recv_into(sock, target, PIECE)
        at = offset + n
    _skip(sock, scratch, size - at)


def _skip(sock: socket.socket, scratch: memoryview, n: int) -> None:
    while n > 0:
        step = min(n, len(scratch))
        wire.recv_into(sock, scratch[:step])
        n -= step


def _size(reply: dict, peer: PeerNode, asked: int | None) -> int:
    """The size the holder declares, checked: a whole number, no more than was asked."""
    size = reply.get("size")
    if type(size) is not int or size < 0 or (asked is not None and size > asked):
        raise wire.WireError("bad", f"peer {peer.name} answered a size of {size!r}"
                                    + (f" to a request for {asked} bytes" if asked is not None else ""))  # fmt: skip
    return size


def _list(sock: socket.socket, peer: PeerNode, prefix: str) -> list[str]:
    _send(sock, {"op": "list", "prefix": prefix})
    keys = _reply(sock, peer).get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise wire.WireError("bad", f"peer {peer.name} answered a listing that is not keys")
    return sorted(keys)


def _delete(sock: socket.socket, peer: PeerNode, prefix: str, run: int) -> None:
    _send(sock, {"op": "delete", "prefix": prefix, "incarnation": run})
    _reply(sock, peer)


def _leftovers(sock: socket.socket, peer: PeerNode, prefix: str) -> list[Leftover]:
    _send(sock, {"op": "leftovers", "prefix": prefix})
    found = _reply(sock, peer).get("leftovers")
    try:
        out = [Leftover(check_key(d["key"]), str(d["name"]),
                        None if d["size"] is None else int(d["size"]), float(d["modified"]))
               for d in found]  # fmt: skip
    except (TypeError, KeyError, ValueError, ConfigError):
        raise wire.WireError("bad", f"peer {peer.name} answered leftovers that are not") from None
    return out


def _remove_leftover(sock: socket.socket, peer: PeerNode, leftover: Leftover) -> None:
    _send(sock, {"op": "remove_leftover", "key": leftover.key, "name": leftover.name})
    _reply(sock, peer)


def _as_error(exc: wire.WireError, peer: PeerNode) -> Exception:
    if exc.code == "missing":
        return CheckpointNotFoundError(str(exc))
    if exc.code == "full":
        import errno

        return OSError(errno.ENOSPC, str(exc))
    if exc.code == "stale":  # a newer run of the job writes there: this writer's run is over
        return StaleWriterError(f"{exc} (peer {peer.name} at {peer.address})")
    return TierUnavailableError(f"{exc} (peer {peer.name} at {peer.address})")
