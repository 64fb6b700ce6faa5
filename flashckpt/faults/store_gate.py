"""The job's recovery store behind a gate that only the job's own processes pass.

In-process recovery keeps its rounds in a ``TCPStore``: which round the job is in, who has
arrived, the round's process-group bootstrap (gloo addresses, NCCL unique ids). A plain
``TCPStore`` server listens on every interface and asks nobody who they are; anyone who
reaches it could move the round (a job-wide rollback) or rewrite a round's bootstrap keys. So
the store is never reachable directly:

- the node that serves it binds the store itself to loopback (``master_listen_fd``) and puts a
  ``StoreGate`` on the address the job asked for, on that address alone;
- every node's launcher runs a ``StoreTunnel``: its workers and standbys talk to a loopback
  port, and the tunnel carries each connection to the gate;
- a connection passes the gate only through the node channel's handshake
  (``flashckpt/node_channel.py``, shared with the replica store): each side proves with an
  HMAC that it holds the job's token (``FLASHCKPT_CONTROLLER_TOKEN``, the controller's), so the
  token never crosses the network and a tunnel never talks to a gate that cannot prove it
  either. What passes is then relayed byte for byte. The handshake has one deadline, its
  frames are a few KiB at most, and refused clients are logged at most once per 10 s.

A process on a node can reach that node's tunnel, as it can the node's shared memory and
agent: the node is the unit of trust, the network is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from flashckpt import config
from flashckpt import node_channel as wire

log = logging.getLogger(__name__)

SERVICE = "recovery-store"
HANDSHAKE_TIMEOUT = 5.0
# How long a refused gate is tried again before the client's connection is closed. Short: a
# ``TCPStore`` client waits, past its own timeout, for as long as the tunnel holds it, and the
# store's clients (``store_client``) wait for a store that is away themselves, each as long
# as it may.
CONNECT_RETRY_S = 2.0
PIPE_BYTES = 1 << 16


def _loopback_listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(PIPE_BYTES):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _relay(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:  # fmt: skip
    """Copy both ways until either side closes."""
    for sock in (a[1], b[1]):
        raw = sock.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))


class _Loop(threading.Thread):
    """An asyncio loop of its own, in a daemon thread: the gate and the tunnel serve while the
    launcher's main thread runs TorchElastic."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.loop = asyncio.new_event_loop()

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, make: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def close_server(self, server: asyncio.base_events.Server) -> None:
        """Close ``server`` on this loop (a Server is not to be touched from other threads)."""

        async def shut() -> None:
            server.close()

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.call(shut, timeout=5)

    def stop(self) -> None:
        """End every relay and stop the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.call(cancel_all, timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.join(5)


class LoopbackStore:
    """A ``TCPStore`` server listening on loopback only (not on every interface, as one made
    with a host name does): the socket is made here and handed to it."""

    def __init__(self, timeout: float = 30.0):
        import torch.distributed as dist

        listener = _loopback_listener()
        self.port = listener.getsockname()[1]
        # The store takes the descriptor over and closes it when it goes: it gets a copy of
        # its own, never one this process closes too (a second close would hit whatever file
        # reused the number meanwhile).
        fd = os.dup(listener.fileno())
        listener.close()
        self.store: Any = dist.TCPStore("127.0.0.1", self.port, is_master=True,
                                        wait_for_workers=False, master_listen_fd=fd,
                                        timeout=datetime.timedelta(seconds=timeout))  # fmt: skip

    def close(self) -> None:
        self.store = None  # the server stops with its last reference


class StoreGate:
    """Serve the job's recovery store: a ``TCPStore`` on loopback, and the gate to it on
    ``host:port`` (port 0: any free one) for the holders of ``token``."""

    def __init__(self, host: str, port: int, token: bytes, store_timeout: float = 30.0):
        """OSError if ``host:port`` cannot be bound here (another node's address, or taken)."""
        self.token, self.host, self.refused = token, host, 0
        self._refusals = wire.Refusals(log, "recovery store")
        self._thread = _Loop("flashckpt-store-gate")
        self._thread.start()
        try:
            self._server = self._thread.call(
                lambda: asyncio.start_server(self._serve, host, port, reuse_address=True)
            )
        except BaseException:
            self._thread.stop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        self._store = LoopbackStore(store_timeout)
        self.store_port = self._store.port

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # closing: the relay just ends
            await self._admit(reader, writer)

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        wire.keep_alive(writer.get_extra_info("socket"))  # a node that lost power lets go
        hands = wire.ServerHandshake(self.token.decode(), SERVICE, None, "")
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                writer.write(hands.challenge(await wire.read_frame(reader, wire.HELLO_LIMIT)))
                await writer.drain()
                node = hands.check(await wire.read_frame(reader, wire.HELLO_LIMIT))
                writer.write(wire.encode({"ok": True}))
                await writer.drain()
        except (TimeoutError, wire.WireError, asyncio.IncompleteReadError, ConnectionError,
                OSError) as exc:  # fmt: skip
            self.refused += 1
            self._refusals.refused(peer, f"it did not prove the job's token ({exc or 'no answer'})")
            if isinstance(exc, wire.WireError):
                with contextlib.suppress(Exception):
                    writer.write(wire.refusal(exc.code, str(exc)))
            writer.close()
            return
        try:
            store = await asyncio.open_connection("127.0.0.1", self.store_port)
        except OSError as exc:
            log.warning("recovery store: %s", exc)
            writer.close()
            return
        log.debug("recovery store: node %s connected from %s", node, peer)
        await _relay((reader, writer), store)

    def close(self) -> None:
        self._thread.close_server(self._server)
        self._thread.stop()
        self._store.close()


class StoreTunnel:
    """This node's way to the recovery store: a loopback port whose connections are carried
    to the gate at ``address``, each after proving ``token``."""

    def __init__(self, host: str, port: int, token: bytes):
        self.remote, self.token = (host, port), token
        self._thread = _Loop("flashckpt-store-tunnel")
        self._thread.start()
        self._server = self._thread.call(lambda: asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # closing: the relay just ends
            await self._carry(reader, writer)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the gate. Refused ones are tried again for ``CONNECT_RETRY_S``
        (the node that serves the store may be starting); the clients try for longer."""
        deadline = asyncio.get_running_loop().time() + CONNECT_RETRY_S
        pause = 0.05
        while True:
            try:
                return await asyncio.wait_for(asyncio.open_connection(*self.remote),
                                              HANDSHAKE_TIMEOUT)  # fmt: skip
            except ConnectionRefusedError:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hands = wire.ClientHandshake(self.token.decode(), SERVICE, "", config.node_name(), "")
        try:
            gate = await self._connect()
            wire.keep_alive(gate[1].get_extra_info("socket"))  # a silent gate fails, not hangs
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                gate[1].write(hands.hello())
                await gate[1].drain()
                gate[1].write(hands.answer(await wire.read_frame(gate[0], wire.HELLO_LIMIT)))
                await gate[1].drain()
                hands.done(await wire.read_frame(gate[0], wire.HELLO_LIMIT))
        except (TimeoutError, wire.WireError, asyncio.IncompleteReadError, ConnectionError,
                OSError) as exc:  # fmt: skip
            log.warning("recovery store at %s:%d cannot be reached: %s", *self.remote,
                        exc or "no answer")  # fmt: skip
            writer.close()
            return
        await _relay((reader, writer), gate)

    def close(self) -> None:
        self._thread.close_server(self._server)
        self._thread.stop()
