"""Simulated node agents for ``benchmarks/scale.py``: many nodes in one process, each with its
own gRPC connection to the controller, reporting what a node agent reports every heartbeat.

    python benchmarks/scale_sim.py PLAN.json FIRST COUNT OUT.json

Each node runs ``--workers`` ranks that train (their step advances), commits a step of one
shared tier on the plan's schedule (each node at its own moment of the commit window), and
acts on the controller's kill orders as an agent would: the workers it names die, and the
node starts the next round's workers after the plan's restart delay. The plan's faults are
played on the nodes they name: ``silent`` (the agent stops reporting: a node or rack lost),
``dead`` (a worker exits), ``hang`` (a worker stops beating; the node's own hang watchdog
kills it after ``floor`` seconds). Everything observed goes to OUT.json when the run ends:
report round trips, how late each report left against its schedule (the simulator's own
lag), kill orders received, the last report of each silenced node and each node's commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import resource
import sys
import time
from dataclasses import dataclass, field

import grpc
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc

TIER = "s3://scale-bench/ckpt"


@dataclass
class Worker:
    rank: int
    pid: int
    started: float
    beat: float
    alive: bool = True
    hung_until: float = 0.0  # the node's watchdog kills it then (0: not hung)


@dataclass
class Node:
    index: int
    plan: dict
    out: dict
    round: int = 0
    workers: list[Worker] = field(default_factory=list)
    commit: int = -1
    seq: int = 0
    killed: set[int] = field(default_factory=set)
    restart_at: float = 0.0
    silent_from: float = float("inf")
    silent_to: float = float("inf")
    sent: dict[int, float] = field(default_factory=dict)  # seq -> when it left

    @property
    def name(self) -> str:
        return f"node{self.index:05d}"

    def start_round(self, now: float) -> None:
        w = self.plan["workers"]
        self.round += 1
        self.workers = [
            Worker(self.index * w + j, 1 + self.index * 100_000 + self.round * w + j, now, now)
            for j in range(w)
        ]  # fmt: skip

    def agent_id(self) -> str:
        back = time.time() >= self.silent_to  # a lost node comes back as a new agent
        return f"{self.name}-{'b' if back else 'a'}"

    def report(self, now: float) -> pb.NodeReport:
        plan = self.plan
        for w in self.workers:
            if w.alive and not w.hung_until:
                w.beat = now - random.uniform(0, 0.05)
            if w.hung_until and w.alive and now >= w.hung_until:
                w.alive = False  # the node's hang watchdog killed it
        while self.pending and self.pending[0][1] <= now:  # a step this node committed
            self.commit, at = self.pending.pop(0)
            self.out["commits"].append([self.name, self.commit, at])
        self.seq += 1
        w = plan["workers"]
        return pb.NodeReport(
            job=plan["job"], node=self.name, agent_id=self.agent_id(), seq=self.seq,
            world_size=plan["nodes"] * w, ranks=range(self.index * w, (self.index + 1) * w),
            tiers=[pb.TierCommit(url=TIER, shared=True, step=self.commit, generation=0)],
            workers=[
                pb.Worker(rank=x.rank, pid=x.pid, phase="train", alive=x.alive,
                          step=int((now - x.started) / plan["step_s"]),
                          silent_s=max(0.0, now - x.beat), age_s=now - x.started)
                for x in self.workers
            ],
        )  # fmt: skip

    def __post_init__(self) -> None:
        # When, within each commit window, this node's persistence finishes the step.
        rng = random.Random(self.index)
        self.pending = [(c["step"], c["at"] + rng.uniform(0, c["spread"]))
                        for c in self.plan["commits"]]  # fmt: skip

    def act(self, reply: pb.ReportReply, now: float) -> None:
        if reply.seq and (sent := self.sent.pop(reply.seq, None)) is not None:
            self.out["rtt"].append(now - sent)
        fresh = [p for p in reply.kill_pids if p not in self.killed]
        if not fresh:
            return
        self.killed.update(fresh)
        self.out["kills"].append([self.name, fresh, now, bool(reply.seq == 0)])
        for w in self.workers:
            if w.pid in fresh:
                w.alive = False
        if not any(w.alive for w in self.workers):
            self.restart_at = now + self.plan["restart_s"]

    def fault(self, f: dict, now: float) -> None:
        if f["kind"] == "silent":
            self.silent_from, self.silent_to = now, now + f["for_s"]
            self.out["silenced"].append([self.name, self.out["last_report"]])
        elif f["kind"] == "dead":
            self.workers[f["local"]].alive = False
            self.workers[f["local"]].beat = now
        elif f["kind"] == "hang":
            self.workers[f["local"]].hung_until = now + f["floor"]


async def run_node(node: Node, channel: grpc.aio.Channel, metadata, stop: float) -> None:
    plan = node.plan
    interval = plan["interval"]
    faults = sorted((f for f in plan["faults"] if node.index in f["nodes"]), key=lambda f: f["at"])
    stub = pb_grpc.ControllerStub(channel)
    stream = plan["transport"] == "stream"
    call, reader = None, None

    async def read(call) -> None:
        async for reply in call:
            node.act(reply, time.time())

    async def close() -> None:
        if call is not None:
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reader

    due = plan["start"] + random.uniform(0, interval)  # agents start at random moments
    node.start_round(plan["start"])
    try:
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.time()))
            now = time.time()
            if due > plan["start"] + 2 * interval:  # past the simulator's own start-up
                node.out["late"].append(now - due)
            while faults and faults[0]["at"] <= now:
                node.fault(faults.pop(0), now)
            if node.restart_at and now >= node.restart_at:
                node.restart_at = 0.0
                node.start_round(now)
            if node.silent_from <= now < node.silent_to:
                due += interval
                continue
            if now >= node.silent_to and node.silent_from < float("inf"):
                node.silent_from = node.silent_to = float("inf")
                node.start_round(now)  # a replaced node starts fresh workers
                await close()  # and its new agent opens a new stream
                call = None
            if stream and (call is None or reader.done()):  # (re)connect, as the agent does
                if call is not None:
                    why = reader.exception() if not reader.cancelled() else None
                    node.out["errors"].append(f"stream ended: {why!r}")
                    await close()
                call = stub.Connect(metadata=metadata)
                reader = asyncio.create_task(read(call))
            report = node.report(now)
            node.sent[report.seq] = now
            try:
                if stream:
                    await call.write(report)
                else:
                    reply = await stub.Report(report, metadata=metadata, timeout=10)
                    node.sent.pop(report.seq, None)
                    node.out["rtt"].append(time.time() - now)  # a controller may not echo seq
                    node.act(reply, time.time())
                node.out["last_report"] = now
            except grpc.aio.AioRpcError as exc:
                node.out["errors"].append(f"{exc.code().name}: {exc.details()}")
            except asyncio.InvalidStateError:  # the stream ended: reconnect next time
                node.out["errors"].append("write on an ended stream")
            due += interval
    finally:
        await close()


async def main(plan: dict, first: int, count: int, out_path: str) -> None:
    metadata = (("authorization", f"Bearer {plan['token']}"),)
    per = max(1, plan["nodes_per_channel"])
    channels = [
        grpc.aio.insecure_channel(plan["target"], options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range((count + per - 1) // per)
    ]  # fmt: skip
    outs = []
    tasks = []
    for i in range(count):
        out = {"rtt": [], "late": [], "kills": [], "silenced": [], "commits": [], "errors": [],
               "last_report": 0.0}  # fmt: skip
        outs.append(out)
        node = Node(first + i, plan, out)
        tasks.append(
            asyncio.create_task(run_node(node, channels[i // per], metadata, plan["stop"]))
        )
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    merged = {
        "rtt": [x for o in outs for x in o["rtt"]],
        "late": [x for o in outs for x in o["late"]],
        "kills": [x for o in outs for x in o["kills"]],
        "silenced": [x for o in outs for x in o["silenced"]],
        "commits": [x for o in outs for x in o["commits"]],
        "errors": [x for o in outs for x in o["errors"]][:20],
        "cpu_s": ru.ru_utime + ru.ru_stime,
    }
    with open(out_path, "w") as f:
        json.dump(merged, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    asyncio.run(main(plan, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
