"""The in-process recovery store under a simulated job of thousands of ranks, on this machine.

The store of in-process recovery is one ``TCPStore`` behind its gate (``faults.store_gate``),
reached from every node through that node's tunnel. What it must bear:

- while the job trains: the watch that tells each rank its round is over. Before, every rank
  polled the round key every 50 ms; now each node's launcher relays the round
  (``inprocess_agent.RoundRelay``: a few checks a second per node) and the ranks read a
  file. Measured: store requests a second, both ways, side by side;
- when a round forms: every rank arrives (one ``add``) and waits for the last (one blocking
  ``wait``). Measured: from the moment all ranks start arriving to the moment the last one
  is through.

Requests are counted where the store receives them (a counting relay in front of it).

    python benchmarks/recovery_store.py --ranks 2000 --per-node 8 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from flashckpt.faults.inprocess_agent import RoundRelay
from flashckpt.faults.store_gate import LoopbackStore, StoreGate, StoreTunnel

TOKEN = b"benchmark-token"


class Counter:
    """A relay in front of the store that counts what clients send it (one read of a client's
    bytes is one request: a polling client sends one small request at a time)."""

    def __init__(self, port: int):
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        started = asyncio.run_coroutine_threadsafe(self._start(port), self.loop).result(30)
        self.port = started.sockets[0].getsockname()[1]

    async def _start(self, port: int):
        self.target = port
        return await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=4096)

    async def _serve(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src, dst, count: bool):
            try:
                while data := await src.read(1 << 16):
                    if count:
                        self.requests += 1
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    def take(self) -> int:
        n, self.requests = self.requests, 0
        return n


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=120))  # fmt: skip


def relays(nodes: int, counter: Counter, seconds: float, work: Path) -> float:
    """Requests a second while training, this design: one relay per node."""
    running = [RoundRelay(("127.0.0.1", counter.port), "bench", work / f"node{n}.round")
               for n in range(nodes)]  # fmt: skip
    for r in running:
        r.start()
    time.sleep(2.0)  # connected and settled
    counter.take()
    time.sleep(seconds)
    rate = counter.take() / seconds
    for r in running:
        r.halt.set()
    for r in running:
        r.join(15)
    return rate


def pollers(ranks: int, counter: Counter, seconds: float) -> float:
    """Requests a second while training, the design before: every rank reads the round key
    every 50 ms (a store client of its own)."""
    clients = [client(counter.port) for _ in range(ranks)]
    halt = threading.Event()

    def poll(c: dist.TCPStore) -> None:
        while not halt.wait(0.05):
            c.get("flashckpt/bench/round")

    threads = [threading.Thread(target=poll, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    time.sleep(1.0)
    counter.take()
    time.sleep(seconds)
    rate = counter.take() / seconds
    halt.set()
    for t in threads:
        t.join(5)
    return rate


def formation(ranks: int, per_node: int, gate: StoreGate, round_: int) -> dict:
    """One round formed by ``ranks`` ranks, each through its node's tunnel: the time from
    all of them starting to arrive to the last one through, and each rank's wait."""
    tunnels = [StoreTunnel("127.0.0.1", gate.port, TOKEN) for _ in range(-(-ranks // per_node))]
    clients = [client(tunnels[r // per_node].port) for r in range(ranks)]
    arrived, formed = f"b/round-{round_}/arrived", f"b/round-{round_}/formed"
    start = threading.Barrier(ranks + 1)
    through = [0.0] * ranks

    def rank(r: int) -> None:
        c = clients[r]
        start.wait()
        if c.add(arrived, 1) == ranks:
            c.set(formed, "1")
        c.wait([formed])
        through[r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    start.wait()
    began = time.monotonic()
    for t in threads:
        t.join(120)
    for t in tunnels:
        t.close()
    return {"formed_s": max(through) - began,
            "median_rank_through_s": statistics.median(x - began for x in through)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2000)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    nodes = -(-args.ranks // args.per_node)
    store = LoopbackStore()
    seed = client(store.port)
    seed.set("flashckpt/bench/round", "0")
    counter = Counter(store.port)
    with tempfile.TemporaryDirectory() as work:
        relay_rate = relays(nodes, counter, args.seconds, Path(work))
    poll_rate = pollers(args.ranks, counter, args.seconds)
    gate = StoreGate("127.0.0.1", 0, TOKEN)
    rounds = [formation(args.ranks, args.per_node, gate, r) for r in range(args.rounds)]
    gate.close()
    out = {
        "ranks": args.ranks, "nodes": nodes,
        "training_requests_per_s": {"node relay (now)": round(relay_rate, 1),
                                    "per-rank poll every 50 ms (before)": round(poll_rate, 1)},
        "round_formed_s": [round(r["formed_s"], 3) for r in rounds],
        "round_formed_median_s": round(statistics.median(r["formed_s"] for r in rounds), 3),
    }  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.ranks} ranks on {nodes} simulated nodes ({args.per_node} a node), one machine")
    print("store requests a second while the job trains:")
    for k, v in out["training_requests_per_s"].items():
        print(f"  {k:<38} {v:>10.1f}")
    print(f"a round formed through the gate and a tunnel per node: {out['round_formed_s']} s "
          f"(median {out['round_formed_median_s']} s)")  # fmt: skip


if __name__ == "__main__":
    main()
