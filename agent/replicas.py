"""This node's memory for other nodes' snapshots: the holder's side of ``peer://``.

When a job runs on several nodes (``FLASHCKPT_PEER_REPLICAS`` >= 1, which ``flashckpt-run``
sets for a multi-node job), every agent serves a replica store on TCP and reports its address
to the controller. The other nodes' agents store their newest complete step in it, as into
any node-local tier (``storage_tiers/peer.py``; their tier workers keep one step and retire
the one before once a newer is committed), and a node that was lost and started again wiped
reads its ranks back from it.

Each source node has a directory of its own under ``<shm_dir>/<job>.replicas/``: a
directory tier in shared memory, so a replica costs its size in memory once per holder and
survives this agent being restarted. Before a replica is taken, the store checks that
shared memory keeps ``RESERVE`` of its size free after it; if not, it refuses (the sender
logs it; a log line and a metric here) rather than starve the trainers' own slots. Every
request must come with the job's token (the controller's); what arrives is written under the
key checks of any directory tier and handed to restores as untrusted input, like any tier.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from flashckpt.storage_tiers import peer_wire as wire
from flashckpt.storage_tiers.base import check_key
from flashckpt.storage_tiers.local import LocalTier
from flashckpt.storage_tiers.registry import parse_spec

from flashckpt import config
from flashckpt.errors import CheckpointNotFoundError, ConfigError
from flashckpt.faults.control import Endpoint, split_address
from flashckpt.format import tier_io
from flashckpt.safe_paths import private_dir

log = logging.getLogger(__name__)

RESERVE = 0.10  # of shared memory's size, kept free after any replica is taken
HELLO_TIMEOUT_S = 10.0  # a connection must name its job and token within this
_COMMIT_NAME = re.compile(r"commit-[A-Za-z0-9._-]+\.json")


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

    def __init__(self, job: str, shm_dir: Path, run_dir: Path, metrics: Any = None):
        self.job, self.shm_dir, self.run_dir, self.metrics = job, shm_dir, run_dir, metrics
        self.root = store_root(shm_dir, job)
        self.refused = 0  # replicas refused for want of memory
        self.address = ""
        self.held_now: list[tuple[str, int, int, list[int]]] = []  # ``held()``, as last seen
        self._server: asyncio.base_events.Server | None = None
        self._tiers: dict[str, LocalTier] = {}

    def tier(self, node: str) -> LocalTier:
        """The directory tier holding ``node``'s replicas."""
        if node not in self._tiers:
            private_dir(self.root, "replica store")
            self._tiers[node] = LocalTier(parse_spec(f"file://{self.root / node}"))
        return self._tiers[node]

    async def start(self, host: str | None = None, port: int = 0) -> str:
        host = host or advertised_host(self.run_dir, self.job)
        contexts = wire.tls_contexts()
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=contexts[0] if contexts else None, limit=wire.PIECE
        )
        bound = self._server.sockets[0].getsockname()
        self.address = f"[{host}]:{bound[1]}" if ":" in host else f"{host}:{bound[1]}"
        self.held_now = await self.held()  # a restarted agent reports what it still holds
        log.info("job %s: holding other nodes' replicas in %s, served on %s%s", self.job,
                 self.root, self.address, " (TLS)" if contexts else "")  # fmt: skip
        return self.address

    async def held(self) -> list[tuple[str, int, int, list[int]]]:
        """(source node, generation, step, ranks) of every complete replica held."""
        return await held_replicas(self.root, self.job)

    async def close(self, remove: bool = True) -> None:
        """Stop serving; with ``remove``, give the memory back (the job is over here)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- one connection ----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            node = await self._hello(reader, writer)
            if node is None:
                return
            while True:
                try:
                    head = await reader.readexactly(4)
                except asyncio.IncompleteReadError:
                    return  # the peer is done
                header = wire.decode(await reader.readexactly(wire.decode_length(head)))
                if not await self._one(node, header, reader, writer):
                    return
        except (wire.WireError, asyncio.IncompleteReadError, ConnectionError) as exc:
            log.debug("replica connection ended: %s", exc)
        except Exception:  # a bug here must not take the agent down
            log.exception("replica connection failed")
        finally:
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> str | None:  # fmt: skip
        try:  # a connection that says nothing is not kept open
            head = await asyncio.wait_for(reader.readexactly(4), HELLO_TIMEOUT_S)
            hello = wire.decode(await asyncio.wait_for(
                reader.readexactly(wire.decode_length(head)), HELLO_TIMEOUT_S))  # fmt: skip
        except asyncio.TimeoutError:
            return None
        endpoint = Endpoint.load(self.run_dir, self.job)
        token, node = hello.get("token"), hello.get("node")
        ok = (
            hello.get("op") == "hello" and hello.get("job") == self.job
            and endpoint is not None and isinstance(token, str)
            and hmac.compare_digest(token.encode(), endpoint.token.encode())
        )  # fmt: skip
        if not ok:
            peer = writer.get_extra_info("peername")
            log.warning("job %s: a replica connection from %s was refused: wrong job or token",
                        self.job, peer)  # fmt: skip
            await _answer(writer, {"ok": False, "code": "auth", "error": "wrong job or token"})
            return None
        try:
            config.validate_name("node", node)
        except ConfigError as exc:
            await _answer(writer, {"ok": False, "code": "bad", "error": str(exc)})
            return None
        await _answer(writer, {"ok": True})
        return node

    async def _one(self, node: str, header: dict, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> bool:  # fmt: skip
        """Answer one request; False when the connection must end (after a refused put)."""
        op, tier = header.get("op"), self.tier(node)
        try:
            if op == "put":
                return await self._put(tier, node, header, reader, writer)
            if op == "get":
                await self._get(tier, header, writer)
            elif op == "list":
                prefix = _text(header, "prefix")
                self._in_job(prefix)
                keys = await tier.list(prefix) if (self.root / node).is_dir() else []
                await _answer(writer, {"ok": True, "keys": keys})
            elif op == "delete":
                prefix = _text(header, "prefix")
                self._in_job(prefix)
                await tier.delete(check_key(prefix, prefix=True))
                await _answer(writer, {"ok": True})
                self.held_now = await self.held()
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

    def _in_job(self, key: str) -> None:
        if key.split("/", 1)[0] != self.job:
            raise ConfigError(f"{key!r} is not of job {self.job!r}")

    async def _put(self, tier: LocalTier, node: str, header: dict,
                   reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:  # fmt: skip
        key, size = check_key(_text(header, "key")), header.get("size")
        self._in_job(key)
        if type(size) is not int or size < 0:
            raise ValueError(f"a put of size {size!r}")
        short = self._short_of(size)
        if short:
            self.refused += 1
            if self.metrics is not None:
                self.metrics.replica_refused()
            log.warning("job %s: node %s's replica %s (%.1f MiB) refused: %s", self.job, node,
                        key, size / 2**20, short)  # fmt: skip
            await _answer(writer, {"ok": False, "code": "full",
                                   "error": f"node {config.node_name()} {short}"})  # fmt: skip
            return False
        await _answer(writer, {"ok": True})

        async def body():
            left = size
            while left:
                piece = await reader.readexactly(min(left, wire.PIECE))
                left -= len(piece)
                yield memoryview(piece)

        await tier.put(key, body(), size)
        await _answer(writer, {"ok": True})
        if _COMMIT_NAME.fullmatch(key.rsplit("/", 1)[-1]):  # a step complete: report it
            self.held_now = await self.held()
        return True

    def _short_of(self, size: int) -> str:
        """Why ``size`` more bytes would leave shared memory too full ("" if they fit)."""
        st = os.statvfs(self.shm_dir)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        keep = int(total * RESERVE)
        if size + keep <= free:
            return ""
        return (f"has {free / 2**20:.0f} MiB free in {self.shm_dir} and keeps {keep / 2**20:.0f} "
                f"MiB of it for its own trainers: no room for {size / 2**20:.1f} MiB more")  # fmt: skip

    async def _get(self, tier: LocalTier, header: dict, writer: asyncio.StreamWriter) -> None:
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
            if count:
                await asyncio.get_running_loop().sendfile(writer.transport, f, start, count)


def store_root(shm_dir: Path, job: str) -> Path:
    """Where a node holds ``job``'s replicas of other nodes."""
    return shm_dir / f"{job}.replicas"


async def held_replicas(root: Path, job: str) -> list[tuple[str, int, int, list[int]]]:
    """(source node, generation, step, ranks) of every complete replica under ``root``."""
    out = []
    for node in sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            tier = LocalTier(parse_spec(f"file://{root / node}"))
            listing = await tier_io.list_steps(tier, job)
        except (OSError, ConfigError):
            continue
        for (gen, step), c in sorted(tier_io.complete(listing).items()):
            out.append((node, gen, step, sorted(c.ranks)))
    return out


def _text(header: dict, name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, found {value!r}")
    return value


async def _answer(writer: asyncio.StreamWriter, reply: dict) -> None:
    writer.write(wire.encode(reply))
    await writer.drain()
