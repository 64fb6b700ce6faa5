"""This node's memory for other nodes' snapshots: the holder's side of ``peer://``.

When a job runs on several nodes (``FLASHCKPT_PEER_REPLICAS`` >= 1, which ``flashckpt-run``
sets for a multi-node job), every agent serves a replica store on TCP (on
``FLASHCKPT_PEER_PORT``, any free port by default) and reports its address to the controller.
The other nodes' agents store their newest complete step in it, as into any node-local tier
(``storage_tiers/peer.py``; their tier workers keep one step and retire the one before once a
newer is committed), and a node that was lost and started again wiped reads its ranks back
from it.

Each source node has a directory of its own under ``<shm_dir>/_replicas/<job>/`` (no job name
starts with ``_``): a directory tier in shared memory, so a replica costs its size in memory
once per holder and survives this agent being restarted. What a crashed agent's uploads left
is removed when the next one starts; ``flashckpt gc shm`` removes the folder of a job whose
processes are all gone. Copies the controller says are no longer needed (their source stores
at another holder that holds a step as new, or left the job) are deleted when it says so.

The service is built to face the network:

- at most ``MAX_CONNECTIONS`` connections, ``MAX_PER_ADDRESS`` from one address; more are
  closed unread;
- the TLS handshake and the node channel's handshake (the job's token proved both ways, the
  node name bound) share one deadline, ``HELLO_TIMEOUT_S``, and frames before it are at most
  a few KiB;
- after it, TCP keepalive, and every read and write of a request waits at most
  ``FLASHCKPT_PEER_STALL_TIMEOUT`` (30 s) for progress: a sender that stalls or loses power
  mid-put is cut off, its temporary removed and its reservation freed;
- refused clients are logged at most once per 10 s, with a count.

Writes are fenced where they land. Each put and delete carries the writer's run of the job
(its ``incarnation``; none counts as 0). The store keeps the newest run it took a put of for
the job (and, after a restart, the newest its held commit markers name): a put or a delete of
an older run is refused (``stale``), so a writer whose run is over (an agent left over from an
earlier run, cut off while the job moved on) never replaces a newer run's replica. A put or a
delete from a node the job's controller declares lost is refused too (``lost``), until the node
reports again; the controller is asked at most every ``LOST_TTL_S`` per node. Each refusal is
answered with its reason, logged and recorded in the job's event log (``replica_refused``), at
most once per ``SAY_EVERY_S`` per node and reason.

Space is reserved before a put is accepted: under the event loop's single thread, the check
and the reservation are one step, so concurrent puts cannot break ``RESERVE`` (10 % of shared
memory, kept free for the trainers' own slots). A put in flight counts at its full size until
it ends, even once allocated, so the reserve errs toward refusing. The peak to plan for: while
a source replaces its step, the holder holds the old step and the new one, twice the source's
share of its ranks' snapshots, until the new step is committed and the old one retired.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import shutil
import socket
import ssl
import time
from pathlib import Path
from typing import Any

from flashckpt.storage_tiers.base import check_key
from flashckpt.storage_tiers.local import LocalTier
from flashckpt.storage_tiers.peer import SERVICE, declared_lost
from flashckpt.storage_tiers.registry import parse_spec

from flashckpt import config
from flashckpt import node_channel as wire
from flashckpt.errors import CheckpointNotFoundError, ConfigError, TierUnavailableError
from flashckpt.faults.control import Endpoint, split_address
from flashckpt.faults.events import EventLog
from flashckpt.format import tier_io
from flashckpt.safe_paths import private_dir
from flashckpt.snapshot import host_memory

log = logging.getLogger(__name__)

RESERVE = 0.10  # of shared memory's size, kept free after any replica is taken
HELLO_TIMEOUT_S = 10.0  # TLS and the node channel's handshake, together
STALL_TIMEOUT_S = 30.0  # FLASHCKPT_PEER_STALL_TIMEOUT: the longest wait for a request's bytes
MAX_CONNECTIONS = 256
MAX_PER_ADDRESS = 32
REQUEST_LIMIT = 64 << 10  # a request's header after the handshake (keys are short)
PIECE = 8 << 20  # bytes of a put read per deadline
SEND_PIECE = 64 << 20  # bytes of a get sent per deadline (each sendfile call stalls the pipe)
LOST_TTL_S = 1.0  # the controller's word on whether a writing node is lost is kept this long
SAY_EVERY_S = 10.0  # a node refused again for the same reason is logged at most this often
_COMMIT_NAME = re.compile(r"commit-[A-Za-z0-9._-]+\.json")


def stall_timeout() -> float:
    return config.setting_float("peer_stall_timeout", None, STALL_TIMEOUT_S, lo=0.1, hi=3600.0)


def advertised_host(run_dir: Path, job: str) -> str:
    """The address peers reach this node on: ``FLASHCKPT_PEER_HOST``, else the one this node
    reaches the job's controller from (the interface the job's traffic uses), else the
    loopback address (one machine)."""
    host = config.setting("peer_host", None, "")
    if host:
        return str(host)
    endpoint = Endpoint.load(run_dir, job)
    address = endpoint.address if endpoint else os.environ.get("FLASHCKPT_CONTROLLER", "")
    if address:
        try:
            target, _ = split_address(address)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # no packet is sent: only a route is chosen
                return probe.getsockname()[0]
        except (OSError, ConfigError, ValueError):
            pass
    return "127.0.0.1"


class ReplicaStore:
    """Serves one job's replica store on TCP (see the module doc)."""

    def __init__(self, job: str, shm_dir: Path, run_dir: Path, metrics: Any = None,
                 node: str | None = None, events: EventLog | None = None):  # fmt: skip
        self.job, self.shm_dir, self.run_dir, self.metrics = job, shm_dir, run_dir, metrics
        self.node = node or config.node_name()  # this holder's own name
        self.events = events  # the job's event log on this node: refused writers
        self.newest_run = 0  # the newest run of the job a put was taken from (the fence)
        self.fenced = 0  # puts and deletes refused: an older run, or a lost node
        self._lost: dict[str, tuple[float, bool]] = {}  # node -> (when asked, lost)
        self._said: dict[tuple[str, str], tuple[float, int]] = {}  # (node, why) -> (when, unsaid)
        self.root = store_root(shm_dir, job)
        self.refused = 0  # replicas refused for want of memory
        self.served: collections.Counter[str] = collections.Counter()  # requests by op
        self.reserved = 0  # bytes of puts accepted and not yet ended
        self.address = ""
        self.held_now: list[tuple[str, int, int, list[int]]] = []  # ``held()``, as last seen
        self.refusals = wire.Refusals(log, f"job {job}: replica store")
        self._server: asyncio.base_events.Server | None = None
        self._tiers: dict[str, LocalTier] = {}
        self._open: dict[str, int] = {}  # connections by source address
        self._tls: ssl.SSLContext | None = None
        self._serving: set[asyncio.Task] = set()

    def tier(self, node: str) -> LocalTier:
        """The directory tier holding ``node``'s replicas."""
        if node not in self._tiers:
            private_dir(self.root.parent, "replica store")
            private_dir(self.root, "replica store")
            self._tiers[node] = LocalTier(parse_spec(f"file://{self.root / node}"))
        return self._tiers[node]

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        host = host or advertised_host(self.run_dir, self.job)
        port = config.setting_int("peer_port", port, 0, lo=0, hi=65535)
        contexts = wire.tls_contexts()
        self._tls = contexts[0] if contexts else None
        await self._remove_leftovers()
        self._server = await asyncio.start_server(self._serve, host, port, limit=PIECE,
                                                  backlog=MAX_CONNECTIONS)  # fmt: skip
        bound = self._server.sockets[0].getsockname()
        self.address = f"[{host}]:{bound[1]}" if ":" in host else f"{host}:{bound[1]}"
        self.held_now = await self.held()  # a restarted agent reports what it still holds
        log.info("job %s: holding other nodes' replicas in %s, served on %s%s", self.job,
                 self.root, self.address, " (TLS)" if contexts else "")  # fmt: skip
        return self.address

    async def _remove_leftovers(self) -> None:
        """What uploads into a store of this job left when its agent died: no upload is in
        flight before this store serves."""
        for node in _sources(self.root):
            tier = self.tier(node)
            for leftover in await tier.leftovers(""):
                await tier.remove_leftover(leftover)
                log.info("job %s: removed what a crashed upload of node %s's %s left", self.job,
                         node, leftover.key)  # fmt: skip

    async def held(self) -> list[tuple[str, int, int, list[int]]]:
        """(source node, generation, step, ranks) of every complete replica held; the newest
        run their commit markers name raises the fence (a restarted store keeps it)."""
        listed = await _listed(self.root, self.job)
        self.newest_run = max([self.newest_run, *(run for *_, run in listed)])
        return [held[:4] for held in listed]

    async def close(self, remove: bool = True) -> None:
        """Stop serving and end every connection; with ``remove``, give the memory back (the
        job is over here)."""
        if self._server is not None:
            self._server.close()
            for task in list(self._serving):
                task.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)
            await self._server.wait_closed()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    async def expire(self, sources: list[str]) -> None:
        """Delete the replicas of ``sources`` (the controller says no restore needs them)."""
        for source in sources:
            try:
                config.validate_name("node", source)
            except ConfigError:
                continue
            folder = self.root / source
            if folder.is_dir():
                self._tiers.pop(source, None)
                await asyncio.to_thread(shutil.rmtree, folder, True)
                log.info("job %s: gave back node %s's replica: it is held as new elsewhere, or "
                         "no restore reads it any more", self.job, source)  # fmt: skip
        self.held_now = await self.held()

    # ---- one connection ----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if (
            sum(self._open.values()) >= MAX_CONNECTIONS
            or self._open.get(host, 0) >= MAX_PER_ADDRESS
        ):
            self.refusals.refused(peer, f"too many connections (at most {MAX_CONNECTIONS}, "
                                        f"{MAX_PER_ADDRESS} from one address)")  # fmt: skip
            writer.transport.abort()
            return
        self._open[host] = self._open.get(host, 0) + 1
        task = asyncio.current_task()
        self._serving.add(task)
        try:
            node = await self._admit(reader, writer, peer)
            if node is not None:
                wire.keep_alive(writer.get_extra_info("socket"), send_s=wire.BULK_SEND_S)
                await self._requests(node, reader, writer)
        except (wire.WireError, asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            log.debug("replica connection ended: %s", exc)
        except asyncio.CancelledError:
            pass  # the store closes
        except Exception:  # a bug here must not take the agent down
            log.exception("replica connection failed")
        finally:
            self._serving.discard(task)
            self._open[host] -= 1
            if not self._open[host]:
                del self._open[host]
            writer.transport.abort()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     peer: object) -> str | None:  # fmt: skip
        """The client's node name once TLS (where configured) and the handshake pass, all
        within HELLO_TIMEOUT_S; None (the client told why, where it can be) if not."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                if self._tls is not None:
                    await writer.start_tls(self._tls)
                endpoint = Endpoint.load(self.run_dir, self.job)
                if endpoint is None:
                    raise wire.WireError("failed", "this node knows no controller of the job")
                hands = wire.ServerHandshake(endpoint.token, SERVICE, self.job, self.node)
                writer.write(hands.challenge(await wire.read_frame(reader, wire.HELLO_LIMIT)))
                await writer.drain()
                node = hands.check(await wire.read_frame(reader, wire.HELLO_LIMIT))
                await _answer(writer, {"ok": True})
                return node
        except TimeoutError:
            self.refusals.refused(peer, f"no handshake within {HELLO_TIMEOUT_S:g} s")
        except wire.WireError as exc:
            self.refusals.refused(peer, str(exc))
            with contextlib.suppress(Exception):
                writer.write(wire.refusal(exc.code, str(exc)))
                await asyncio.wait_for(writer.drain(), 1.0)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError) as exc:
            self.refusals.refused(peer, f"the connection broke in the handshake ({exc!r})")
        return None

    async def _requests(self, node: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:  # fmt: skip
        """Answer ``node``'s requests until it hangs up, stalls or sends a bad one."""
        stall = stall_timeout()
        while True:
            try:
                head = await asyncio.wait_for(reader.readexactly(4), stall)
            except (asyncio.IncompleteReadError, TimeoutError):
                return  # the peer is done, or idle
            n = wire.decode_length(head, REQUEST_LIMIT)
            header = wire.decode(await asyncio.wait_for(reader.readexactly(n), stall))
            if not await self._one(node, header, reader, writer, stall):
                return

    async def _one(self, node: str, header: dict, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, stall: float) -> bool:  # fmt: skip
        """Answer one request; False when the connection must end (after a refused put)."""
        op, tier = header.get("op"), self.tier(node)
        self.served[str(op)] += 1
        try:
            if op in ("put", "delete"):
                run = header.get("incarnation", 0)
                if type(run) is not int or run < 0:
                    raise ValueError(f"incarnation must be a whole number >= 0, found {run!r}")
                refused = await self._fence(node, op, header, run)
                if refused is not None:
                    await _answer(writer, refused)
                    return op != "put"  # a put's bytes would follow: the connection ends
            if op == "put":
                return await self._put(tier, node, header, reader, writer, stall)
            if op == "get":
                await self._get(tier, header, writer, stall)
                return True
            prefix = check_key(_text(header, "prefix" if op != "remove_leftover" else "key"),
                               prefix=True)  # fmt: skip
            self._in_job(prefix)
            if op == "list":
                keys = await tier.list(prefix) if (self.root / node).is_dir() else []
                await _answer(writer, {"ok": True, "keys": keys})
            elif op == "delete":
                await tier.delete(prefix)
                await _answer(writer, {"ok": True})
                self.held_now = await self.held()
            elif op == "leftovers":
                found = await tier.leftovers(prefix) if (self.root / node).is_dir() else []
                await _answer(writer, {"ok": True, "leftovers": [
                    {"key": t.key, "name": t.name, "size": t.size, "modified": t.modified}
                    for t in found]})  # fmt: skip
            elif op == "remove_leftover":
                await self._remove_leftover(tier, prefix, _text(header, "name"))
                await _answer(writer, {"ok": True})
            else:
                await _answer(writer, {"ok": False, "code": "bad", "error": f"no op {op!r}"})
                return False
        except CheckpointNotFoundError as exc:
            await _answer(writer, {"ok": False, "code": "missing", "error": str(exc)})
        except (ConfigError, ValueError) as exc:
            await _answer(writer, {"ok": False, "code": "bad", "error": str(exc)})
            return False
        except OSError as exc:
            await _answer(writer, {"ok": False, "code": "failed", "error": str(exc)})
            return False
        return True

    @staticmethod
    async def _remove_leftover(tier: LocalTier, key: str, name: str) -> None:
        """Remove the leftover ``name`` of ``key``, if it is one: found again here, never taken
        on the client's word (a path it names could be anything)."""
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        for leftover in await tier.leftovers(parent):
            if leftover.key == key and leftover.name == name:
                await tier.remove_leftover(leftover)

    async def _fence(self, node: str, op: str, header: dict, run: int) -> dict | None:
        """The refusal to answer ``node``'s ``op`` of run ``run`` with; None if it may write."""
        what = header.get("key", header.get("prefix"))
        if run < self.newest_run:
            why = "stale"
            error = (f"node {self.node} refuses node {node}'s {op} of {what!r}: it is of run {run} "
                     f"of job {self.job}, and this holder took run {self.newest_run} of the job "
                     "since; a writer of a run that is over (an agent left over from an earlier "
                     "run, or cut off while the job moved on) never replaces a newer run's "
                     "replica")  # fmt: skip
        elif await self._declared_lost(node):
            why = "lost"
            error = (f"node {self.node} refuses node {node}'s {op} of {what!r}: the job's "
                     f"controller declared node {node} lost (it may be replaced); its replicas "
                     "are taken again once it reports to the controller")  # fmt: skip
        else:
            return None
        self.fenced += 1
        self._say(node, why, error, op=op, key=str(what), run=run, newest_run=self.newest_run)
        return {"ok": False, "code": why, "error": error}

    async def _declared_lost(self, node: str) -> bool:
        """Whether the job's controller declares ``node`` lost, as it last said (asked at most
        every LOST_TTL_S; where it cannot be asked, its last answer stands, else not lost)."""
        now = time.monotonic()
        known = self._lost.get(node)
        if known is not None and now - known[0] < LOST_TTL_S:
            return known[1]
        try:
            lost = await declared_lost(self.job, node, self.run_dir)
        except TierUnavailableError as exc:
            log.debug("job %s: cannot ask whether node %s is lost: %s", self.job, node, exc)
            lost = known[1] if known is not None else False
        self._lost[node] = (time.monotonic(), lost)
        return lost

    def _say(self, node: str, why: str, error: str, **fields: Any) -> None:
        """Log and record a refusal, at most once per SAY_EVERY_S per node and reason."""
        now = time.monotonic()
        said, unsaid = self._said.get((node, why), (-SAY_EVERY_S, 0))
        if now - said < SAY_EVERY_S:
            self._said[node, why] = (said, unsaid + 1)
            return
        self._said[node, why] = (now, 0)
        more = f" ({unsaid} more since it was last said)" if unsaid else ""
        log.warning("job %s: %s%s", self.job, error, more)
        if self.events is not None:
            self.events.record("replica_refused", source=node, why=why, refused_since=unsaid,
                               **fields)  # fmt: skip

    def _in_job(self, key: str) -> None:
        if key.split("/", 1)[0] != self.job:
            raise ConfigError(f"{key!r} is not of job {self.job!r}")

    async def _put(self, tier: LocalTier, node: str, header: dict, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, stall: float) -> bool:  # fmt: skip
        """Take one put (fenced already: ``_fence``)."""
        key, size = check_key(_text(header, "key")), header.get("size")
        self._in_job(key)
        if type(size) is not int or size < 0:
            raise ValueError(f"a put of size {size!r}")
        short = self._short_of(size)  # checked and reserved with no wait between
        if short:
            self.refused += 1
            if self.metrics is not None:
                self.metrics.replica_refused()
            log.warning("job %s: node %s's replica %s (%.1f MiB) refused: %s", self.job, node,
                        key, size / 2**20, short)  # fmt: skip
            await _answer(writer, {"ok": False, "code": "full",
                                   "error": f"node {self.node} {short}"})  # fmt: skip
            return False
        self.reserved += size
        # Taken: a writer of an older run is refused from now on, even while this put lasts.
        self.newest_run = max(self.newest_run, header.get("incarnation", 0))
        try:
            await _answer(writer, {"ok": True})

            async def body():
                left = size
                while left:  # a sender that stalls is cut off: the put fails, its temp goes
                    piece = await asyncio.wait_for(reader.readexactly(min(left, PIECE)),
                                                   stall)  # fmt: skip
                    left -= len(piece)
                    yield memoryview(piece)

            await tier.put(key, body(), size)
        finally:
            self.reserved -= size
        await _answer(writer, {"ok": True})
        if _COMMIT_NAME.fullmatch(key.rsplit("/", 1)[-1]):  # a step complete: report it
            self.held_now = await self.held()
        return True

    def _short_of(self, size: int) -> str:
        """Why ``size`` more bytes would leave shared memory too full ("" if they fit), the
        puts in flight counted at their full size."""
        capped = host_memory.fits(self.shm_dir, size + self.reserved)
        if capped:
            return capped
        free, total = shm_space(self.shm_dir)
        keep = int(total * RESERVE)
        if size + self.reserved + keep <= free:
            return ""
        flight = (
            f", {self.reserved / 2**20:.0f} MiB of it promised to puts in flight"
            if self.reserved
            else ""
        )
        return (f"has {free / 2**20:.0f} MiB free in {self.shm_dir}{flight}, and keeps "
                f"{keep / 2**20:.0f} MiB for its own trainers: no room for {size / 2**20:.1f} "
                "MiB more")  # fmt: skip

    async def _get(self, tier: LocalTier, header: dict, writer: asyncio.StreamWriter,
                   stall: float) -> None:  # fmt: skip
        key = check_key(_text(header, "key"))
        self._in_job(key)
        start, end = header.get("start", 0), header.get("end")
        if type(start) is not int or start < 0 or not (end is None or type(end) is int):
            raise ValueError(f"a get of bytes {start!r}-{end!r}")
        fd = await asyncio.to_thread(tier.read_fd, key)
        with os.fdopen(fd, "rb", buffering=0) as f:
            length = os.fstat(fd).st_size
            stop = length if end is None else min(end, length)
            count = max(0, stop - start)
            await _answer(writer, {"ok": True, "size": count})
            loop = asyncio.get_running_loop()
            for at in range(start, start + count, SEND_PIECE):  # a reader that stalls is cut off
                n = min(SEND_PIECE, start + count - at)
                await asyncio.wait_for(loop.sendfile(writer.transport, f, at, n), stall)


def shm_space(path: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _sources(root: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    return []


def store_root(shm_dir: Path, job: str) -> Path:
    """Where a node holds ``job``'s replicas of other nodes."""
    return config.replicas_dir(shm_dir, job)


async def held_replicas(root: Path, job: str) -> list[tuple[str, int, int, list[int]]]:
    """(source node, generation, step, ranks) of every complete replica under ``root``."""
    return [held[:4] for held in await _listed(root, job)]


async def _listed(root: Path, job: str) -> list[tuple[str, int, int, list[int], int]]:
    """(source node, generation, step, ranks, run) of every complete replica under ``root``."""
    out = []
    for node in _sources(root):
        try:
            tier = LocalTier(parse_spec(f"file://{root / node}"))
            listing = await tier_io.list_steps(tier, job)
        except (OSError, ConfigError):
            continue
        for (gen, step), c in sorted(tier_io.complete(listing).items()):
            out.append((node, gen, step, sorted(c.ranks), c.incarnation))
    return out


def _text(header: dict, name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, found {value!r}")
    return value


async def _answer(writer: asyncio.StreamWriter, reply: dict) -> None:
    writer.write(wire.encode(reply))
    await asyncio.wait_for(writer.drain(), stall_timeout())
