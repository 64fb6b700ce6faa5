"""A failed round hands no slot back while any upload still reads it.

The uploads of a round read the trainers' slots straight from memory, in worker threads for
fsspec and peer tiers. When one upload fails, the round cancels the others and the slot
locks are released once it returns; a thread still reading then would send a trainer's next
snapshot as part of this one. Here a slow fsspec filesystem (a real memory filesystem that
writes piece by piece), a peer holder behind a slow link (a real replica store) and a
failing tier share one round; once the round's error surfaces, the "slot" is overwritten
as a trainer would overwrite it, and no byte written after that may reach either store.
"""

from __future__ import annotations

import asyncio
import mmap
import socket
import threading
import time
from pathlib import Path

import fsspec
import pytest
from flashckpt.agent.persist import _all_or_none
from flashckpt.proto import controller_pb2 as pb
from flashckpt.storage_tiers import open_tier
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from flashckpt.errors import TierUnavailableError

SIZE = 24 << 20
CHUNK = 8 << 20  # as the agent cuts a rank's data
PIECE = 256 << 10
OVERWRITTEN = b"\xff" * 4096  # what the trainer writes next; no header holds such a run


class SlowFile(MemoryFile):
    """A memory file that takes each write in pieces, a pause before each (a slow store)."""

    received: list[bytes] = []
    last_read = 0.0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), PIECE):
            time.sleep(0.02)
            piece = bytes(view[at : at + PIECE])  # read from the caller's memory now
            SlowFile.last_read = time.monotonic()
            SlowFile.received.append(piece)
            super().write(piece)
        return len(view)


class SlowMemoryFileSystem(MemoryFileSystem):
    protocol = "slowmem"

    def _open(self, path: str, mode: str = "rb", **kwargs: object) -> MemoryFile:
        opened = super()._open(path, mode, **kwargs)
        if "w" in mode or "x" in mode:
            opened.__class__ = SlowFile
        return opened


class SlowLink:
    """A TCP relay to ``target`` that reads its client slowly (a congested link) and keeps
    every byte the client sent."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.received = bytearray()
        self.relays: list[threading.Thread] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            relay = threading.Thread(target=self._relay, args=(client,), daemon=True)
            self.relays.append(relay)
            relay.start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        with client, upstream:
            while data := _recv(client, 64 << 10):
                self.received += data
                upstream.sendall(data)
                time.sleep(0.01)
            upstream.shutdown(socket.SHUT_RDWR)  # the store sees the end (a close alone does
            client.shutdown(socket.SHUT_RDWR)  # not wake the other direction's recv)

    def close(self) -> None:
        """Stop accepting, and let what the client sent drain to the store."""
        self.server.close()
        for relay in self.relays:
            relay.join(timeout=30)


def _recv(sock: socket.socket, n: int) -> bytes:
    try:
        return sock.recv(n)
    except OSError:
        return b""


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    while data := _recv(src, 1 << 16):
        try:
            dst.sendall(data)
        except OSError:
            return


@pytest.fixture
def slow_fsspec() -> str:
    fsspec.register_implementation("slowmem", SlowMemoryFileSystem, clobber=True)
    SlowFile.received, SlowFile.last_read = [], 0.0
    return "fsspec+slowmem://ckpt?global_store=false"


def test_a_failed_round_returns_only_after_every_upload_stopped_reading(
    nodes,
    slow_fsspec: str,
    tmp_path: Path,
):
    cluster = nodes(["node0", "node1"])
    link = SlowLink(cluster.stores["node1"].address)
    cluster.controller.controller.report(pb.NodeReport(
        job="pj", node="node1", agent_id="node1-a", peer_address=link.address))  # fmt: skip
    cluster.as_node("node0")
    slot = mmap.mmap(-1, SIZE)  # a trainer's slot, as the agent maps it
    memory = memoryview(slot)
    chunks = [memory[at : at + CHUNK] for at in range(0, SIZE, CHUNK)]
    failing = open_tier(f"file://{tmp_path / 'unmounted'}?create=0")

    async def fail_soon() -> None:
        await asyncio.sleep(0.5)  # both uploads are well under way
        await failing.put("pj/x/data", [memoryview(b"x")], 1)

    async def to_peer(peer_tier) -> None:
        # A peer holder takes a rank's data with its manifest: both go when the manifest does.
        await peer_tier.put("pj/step-000000000001/rank-0/data", chunks, SIZE)
        raw = b'{"incarnation": 0}'
        await peer_tier.put("pj/step-000000000001/rank-0/manifest.json", [memoryview(raw)],
                            len(raw))  # fmt: skip

    async def round_() -> float:
        fs_tier, peer_tier = open_tier(slow_fsspec), open_tier("peer://node1")
        with pytest.raises(TierUnavailableError, match="there is no directory"):
            await _all_or_none([
                fs_tier.put("pj/step-000000000001/rank-0/data", chunks, SIZE),
                to_peer(peer_tier),
                fail_soon(),
            ])  # fmt: skip
        return time.monotonic()

    started = time.monotonic()
    try:
        surfaced = asyncio.run(round_())
        memory[:] = b"\xff" * SIZE  # the lock is free: the trainer saves its next step
        time.sleep(1.5)  # anything still reading would now send the new bytes on
    finally:
        link.close()
    assert surfaced - started < 5  # stopped early, not at the end of either transfer
    assert SlowFile.received and SlowFile.last_read <= surfaced
    assert not any(OVERWRITTEN in piece for piece in SlowFile.received)
    sent = bytes(link.received)
    assert len(sent) > 1 << 20 and OVERWRITTEN not in sent  # it had sent; none after
    assert len(sent) < SIZE  # the peer upload stopped, it did not run to its end
