"""The job's controller: it hears every node agent, notices failed workers and lost nodes, and
has the agents kill the failed round's workers so that every node restarts together.

One per job, embedded in the ``flashckpt-run`` that can bind the controller's address (the
rendezvous host), or run on its own with ``flashckpt-agent controller``. It holds no state of
its own: everything comes from the agents' reports, so a restarted controller knows the job
again after one heartbeat, and training never waits on it. The recovery store it serves under
in-process recovery comes back empty with it, and the nodes put back what it held
(``flashckpt.faults.store_client``).

Which workers a detection kills: those that started before the failure. The rendezvous starts
a new round only once every old worker is gone, so a worker that started after the failure is
already the restarted job and is left alone; times are converted to the controller's clock
from the ages the agents report, so node clocks never have to agree.

Built for thousands of nodes reporting every second (``benchmarks/scale.py`` measures it): a
report costs the same whatever the number of nodes (global commits are kept by counters, see
``commits.py``), nodes lost together are one detection, and an agent that keeps its report
stream open (``Connect``) gets its kill orders pushed the moment they are decided.

A lost node that a spare took is fenced: its name is the spare's from then on. When its own
agent reports again (it was only stalled, or its keeper restarted it), it is refused: it never
takes the node's entry back, its workers still running are ordered killed, and it is told which
spare holds the node (``ReportReply.taken_by``); a report stream then ends. A lost node that no
spare took comes back as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc

from flashckpt import config
from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.faults import control
from flashckpt.faults.events import EventLog

from . import spares
from .commits import Coverage
from .common_steps import held_steps
from .job_view import JobState, Node, Seen, Taken, short_of_world
from .replica_map import ReplicaMap

log = logging.getLogger(__name__)

REDIAL_S = 5.0
"""After a cut, how late a node's link may dial the controller again: it dials afresh every
few seconds (a wait of 2 s for the stream's headers, then a heartbeat) until it is through."""

DEFAULT_NODE_TIMEOUT = 5.0
DEFAULT_HEARTBEAT = 1.0
_KEPT_DETECTIONS = 100
ACK_EVERY = 10  # a report stream answers at least every this many reports


class Controller:
    """The decisions, apart from gRPC: fed reports and clock ticks, it orders kills."""

    def __init__(self, events: EventLog | None = None, policy: str = "restart",
                 node_timeout: float | None = None, heartbeat: float | None = None):  # fmt: skip
        self.events, self.policy = events, policy
        self.node_timeout = config.setting_float("node_timeout", node_timeout,
                                                 DEFAULT_NODE_TIMEOUT, lo=0.1)  # fmt: skip
        self.heartbeat = config.setting_float("heartbeat_interval", heartbeat, DEFAULT_HEARTBEAT,
                                              lo=0.05)  # fmt: skip
        self.jobs: dict[str, JobState] = {}
        self.replica_maps: dict[str, ReplicaMap] = {}  # job -> where replicas go and are held
        self.watchers: dict[tuple[str, str], Callable[[pb.ReportReply | None], None]] = {}

    def report(self, r: pb.NodeReport, now: float | None = None) -> pb.ReportReply:
        now = time.monotonic() if now is None else now
        job = self.jobs.setdefault(r.job, JobState())
        taken = None if r.spare else job.taken.get(r.node)
        if taken is not None and taken.refuses(r, now):
            return self._refuse(r, taken)
        node = job.nodes.get(r.node)
        if node is None or node.agent_id != r.agent_id:
            if node is not None and node.lost:
                self._record("node_back", job=r.job, node=r.node, agent_id=r.agent_id)
            old = node or Node("", now)
            node = job.nodes[r.node] = Node(r.agent_id, now, kill=old.kill, handled=old.handled,
                                            tiers=old.tiers, taking=old.taking,
                                            joining=old.joining,
                                            lost_silent_s=old.lost_silent_s)  # fmt: skip
        node.last_seen, node.lost = now, False
        node.spare = r.spare
        if r.spare:  # runs nothing: heard only to be handed a lost node, or told it is over
            busy = node.taking or node.joining
            return pb.ReportReply(heartbeat_s=self.heartbeat, seq=r.seq, take_node=node.taking,
                                  lost_silent_s=node.lost_silent_s, join_node=node.joining,
                                  job_over=not busy and spares.job_over(
                                      job, now, self.node_timeout))  # fmt: skip
        node.workers = {w.pid: Seen(w, now - w.age_s) for w in r.workers}
        node.ranks, node.world_size = frozenset(r.ranks), r.world_size
        node.peer_address, node.failure_domain = r.peer_address, r.failure_domain
        node.replicas = list(r.replicas)
        node.ran |= node.running()
        node.kill &= {pid for pid, s in node.workers.items() if s.worker.alive}
        node.handled &= node.workers.keys()  # a page gone is never reported again
        dead = [w for w in r.workers if not w.alive and w.pid not in node.handled]
        for w in sorted(dead, key=lambda w: -w.silent_s):  # the first to go first
            node.handled.add(w.pid)
            if now - w.age_s < job.round_failed_at:
                continue  # it went down with a round that already failed
            self._detect(r.job, job, "worker_failed", [r.node], w.rank, now - w.silent_s,
                         pid=w.pid, step=w.step, phase=w.phase)  # fmt: skip
        self._update_commits(r.job, job, r.node, node, r.tiers)
        job.common.update(r.node, held_steps(r.tiers), node.ranks, node.world_size)
        known, common = job.common.answer()
        replicas = self.replica_map(r.job)
        replicas.update(r.node, node.replicas)
        expired = replicas.expired(job.nodes, r.node, job.commits, now) if node.replicas else []
        return pb.ReportReply(kill_pids=sorted(node.kill), heartbeat_s=self.heartbeat, seq=r.seq,
                              common_known=known, expired_replicas=expired,
                              common=[pb.StepKey(generation=g, step=s) for g, s in common])  # fmt: skip

    def _refuse(self, r: pb.NodeReport, taken: Taken) -> pb.ReportReply:
        """The answer to an agent of a node a spare took: its live workers killed (the lost
        node's, a second claimant of every rank they hold), the spare named."""
        kill = sorted(w.pid for w in r.workers if w.alive and w.phase != "closed")
        if r.agent_id not in taken.refused:
            taken.refused.add(r.agent_id)
            log.error("job %s: the agent %s of node %s reports again, but spare node %s took "
                      "that node while it was lost: refused, and its %d running workers are "
                      "ordered killed", r.job, r.agent_id, r.node, taken.spare, len(kill))  # fmt: skip
            self._record("node_fenced", job=r.job, fenced_node=r.node, agent_id=r.agent_id,
                         spare=taken.spare, ordered=kill)  # fmt: skip
        return pb.ReportReply(kill_pids=kill, heartbeat_s=self.heartbeat, seq=r.seq,
                              taken_by=taken.spare)  # fmt: skip

    def replica_map(self, name: str) -> ReplicaMap:
        if name not in self.replica_maps:
            self.replica_maps[name] = ReplicaMap(self.node_timeout)
        return self.replica_maps[name]

    def holders(self, request: pb.HoldersRequest) -> pb.HoldersReply:
        job = self.jobs.get(request.job)
        if job is None:  # no node of it reported: nothing to place (and nothing kept for it)
            return pb.HoldersReply(assigned=pb.PeerHolder(), read_from=pb.PeerHolder())
        return self.replica_map(request.job).holders(job.nodes, request)

    def watch(
        self, job: str, node: str, deliver: Callable[[pb.ReportReply | None], None]
    ) -> Callable:
        """Have ``deliver`` called with the node's orders whenever a detection adds to them
        (the stream of an agent that keeps one open), and with None when the controller stops.
        Returns the call that stops it."""
        self.watchers[job, node] = deliver

        def stop() -> None:
            if self.watchers.get((job, node)) is deliver:
                del self.watchers[job, node]

        return stop

    def job_over(self, job: str) -> None:
        """Tell the job's spare nodes that the job has ended: they have nothing left to take."""
        state = self.jobs.get(job)
        for (name, node), deliver in list(self.watchers.items()):
            spare = state.nodes.get(node) if state is not None else None
            if name == job and spare is not None and spare.spare:
                deliver(pb.ReportReply(heartbeat_s=self.heartbeat, job_over=True))

    def hang_up(self) -> None:
        """End every node's report stream: the controller stops."""
        for deliver in list(self.watchers.values()):
            deliver(None)

    def tick(self, now: float | None = None) -> None:
        """Flag nodes whose agent went silent while their workers ran; the nodes found in one
        tick (a rack that lost power) are one detection.

        A node also counts as running when it went silent before it ever reported a worker,
        while workers of the job run and some of its ranks were never reported: those ranks
        joined the round (the others could not have started without them) in the second
        before its agent's first report of them. Such a node failed after every running
        worker started, so its detection is dated now and kills the whole round. A spare
        node, in a round none of whose ranks are missing, is never flagged, nor is a node
        whose workers all closed. A spare (``flashckpt-run --spare``) silent that long is
        forgotten: gone, or it has taken a lost node and reports under that node's name."""
        now = time.monotonic() if now is None else now
        for name, job in self.jobs.items():
            if self._deaf(name, job, now):
                continue
            lost, short = [], None
            spares.forget_gone(job, now, self.node_timeout)
            for node_name, node in job.nodes.items():
                if now - node.last_seen > self.node_timeout:
                    job.common.drop(node_name)  # what it holds is not known any more
                if node.lost or now - node.last_seen <= self.node_timeout:
                    continue
                if node.running():
                    lost.append((node.last_seen, node_name))
                elif not node.ran and not node.workers:
                    short = short_of_world(job.nodes) if short is None else short
                    if not short:
                        continue
                    lost.append((now, node_name))
                else:
                    continue
                node.lost = True
            # Nodes silent since before the round failed: their workers were already ordered
            # killed with it; the others are a new failure, dated by the first to go silent.
            fresh = sorted(x for x in lost if x[0] >= job.round_failed_at)
            if not fresh:
                continue
            ranks = sorted({s.worker.rank for _, n in fresh for s in job.nodes[n].workers.values()})
            first = min(job.nodes[n].last_seen for _, n in fresh)
            silent = round(now - first, 3)
            taking = self._spares_for(name, job, [n for _, n in fresh], silent, now)
            self._detect(name, job, "node_lost", [n for _, n in fresh], -1, fresh[0][0],
                         silent_s=silent, ranks=ranks, **taking)  # fmt: skip

    def _deaf(self, name: str, job: JobState, now: float) -> bool:
        """Whether this controller, with a node of ``job`` past the node timeout, has heard
        from no node (spares included) within a heartbeat and a half: every node fell silent
        at once, so its own network is the likely cause (or the whole job is down, and nothing
        is left to kill), and no node is judged lost. Once one is heard again, the others are
        given the node timeout and ``REDIAL_S`` to be heard too. Never for a job of one node:
        it has no witness."""
        nodes = job.nodes.values()
        # Reports come every heartbeat: when one node's timeout runs out, the others were heard
        # within a heartbeat and a half, unless this controller hears nobody.
        recent = min(1.5 * self.heartbeat, self.node_timeout)
        pending = any(now - n.last_seen > self.node_timeout and n.running() and not n.lost
                      for n in nodes)  # fmt: skip
        if pending and len(nodes) > 1 and not any(now - n.last_seen <= recent for n in nodes):
            if job.deaf_since is None:
                log.warning("job %s: no node heard for %.0fs; this controller's own network may "
                            "be cut: no node is judged lost until they are heard again", name,
                            self.node_timeout)  # fmt: skip
                self._record("controller_deaf", job=name, nodes=len(job.nodes))
                job.deaf_since = now
            job.heard_again = None
            return True
        if job.deaf_since is None:
            return False
        if job.heard_again is None:  # when the first was heard again
            job.heard_again = max(n.last_seen for n in job.nodes.values())
            log.info("job %s: nodes heard again after %.1fs", name, now - job.deaf_since)
        if now - job.heard_again <= self.node_timeout + REDIAL_S:
            return True
        job.deaf_since = job.heard_again = None
        return False

    def _spares_for(self, name: str, job: JobState, lost: list[str], silent: float,
                    now: float) -> dict:  # fmt: skip
        """Under in-process recovery, a free spare for each node in ``lost``, each told to take
        its node (``{"spares": {lost: spare}}``); else why not (``{"fallback": why}``), and the
        job restarts whole: then each free spare is told to join the restart as one of the lost
        nodes (``{"joining": {lost: spare}}``), so that it has as many of its nodes as there
        were spares, and the scheduler brings back the others."""
        if self.policy != "in-process":
            return {}
        # Heard within the last heartbeat and a half (a spare reports twice a heartbeat): a spare
        # lost with the nodes it would take must not be handed one.
        fresh = min(self.node_timeout, 1.5 * self.heartbeat)
        free = spares.free(job, now, fresh)
        if len(free) < len(lost):
            joining = dict(zip(lost, free, strict=False))
            for node_name, spare_name in joining.items():
                job.nodes[spare_name].joining = node_name
                if deliver := self.watchers.get((name, spare_name)):
                    deliver(pb.ReportReply(heartbeat_s=self.heartbeat, join_node=node_name))
            return {"fallback": f"{len(lost)} node(s) lost and {len(free)} free spare node(s) "
                                "(flashckpt-run --spare): every worker restarts"
                                + (f", the spare(s) joining as {', '.join(joining)}"
                                   if joining else ""), "joining": joining}  # fmt: skip
        chosen = dict(zip(lost, free, strict=False))
        for node_name, spare_name in chosen.items():
            gone = job.nodes[node_name]
            job.taken[node_name] = Taken(spare_name, gone.agent_id,
                                         {pid: s.started for pid, s in gone.workers.items()})  # fmt: skip
            spare = job.nodes[spare_name]
            spare.taking, spare.lost_silent_s = node_name, silent
            if deliver := self.watchers.get((name, spare_name)):
                deliver(pb.ReportReply(heartbeat_s=self.heartbeat, take_node=node_name,
                                       lost_silent_s=silent))  # fmt: skip
        return {"spares": chosen}

    def _detect(self, name: str, job: JobState, kind: str, nodes: list[str], rank: int,
                failed_at: float, **detail: object) -> None:  # fmt: skip
        # In-process recovery replaces a failed worker where it ran, keeping the others; a lost
        # node (no launcher left to replace its ranks) is taken by spare nodes where there are
        # enough (``_spares_for``), and else restarts everyone.
        kills = self.policy == "restart" or (self.policy == "in-process" and kind == "node_lost"
                                             and "spares" not in detail)  # fmt: skip
        action = ("kill" if kills else "replace" if "spares" in detail
                  else "recover" if self.policy == "in-process" else "notify")  # fmt: skip
        job.round_failed_at = max(job.round_failed_at, failed_at)
        taken = detail.get("spares") or {}
        job.detections.append((time.monotonic(), pb.Detection(
            kind=kind, node=nodes[0], rank=rank, action=action,
            spare=", ".join(taken.values()))))  # fmt: skip
        del job.detections[:-_KEPT_DETECTIONS]
        ordered = {}
        if action == "kill":
            job.taken.clear()  # the job restarts whole: every node joins it under its own name
            for node_name, n in job.nodes.items():
                doomed = {pid for pid, s in n.workers.items()
                          if s.worker.alive and s.worker.phase != "closed" and s.started < failed_at}  # fmt: skip
                if doomed - n.kill:
                    n.kill |= doomed
                    ordered[node_name] = sorted(doomed)
                    if deliver := self.watchers.get((name, node_name)):
                        deliver(
                            pb.ReportReply(kill_pids=sorted(n.kill), heartbeat_s=self.heartbeat)
                        )
        where = nodes[0] if len(nodes) == 1 else f"{nodes[0]} and {len(nodes) - 1} more"
        log.error("job %s: %s on node %s%s; %s", name, kind.replace("_", " "), where,
                  f" (rank {rank})" if rank >= 0 else "",
                  f"killing {sum(map(len, ordered.values()))} workers of the failed round on "
                  f"{len(ordered)} nodes" if ordered
                  else "nothing left to kill" if action == "kill"
                  else f"spare node(s) {', '.join(taken.values())} take it, in-process"
                  if taken else f"policy {self.policy}: no kill")  # fmt: skip
        if "fallback" in detail:
            log.warning("job %s: %s", name, detail["fallback"])
        lost = {"nodes": nodes} if kind == "node_lost" else {}
        self._record(kind, job=name, failed_node=nodes[0], rank=rank, action=action,
                     ordered=ordered, **lost, **detail)  # fmt: skip

    def _update_commits(self, name: str, job: JobState, node_name: str, node: Node,
                        tiers: list[pb.TierCommit]) -> None:  # fmt: skip
        """A tier's step is committed globally once the nodes reporting it cover the world."""
        urls = {t.url for t in tiers}
        for url in [u for u in node.tiers if u not in urls]:  # a tier the node no longer has
            job.coverage[url].drop(node_name)
        node.tiers = sorted(urls)
        for t in tiers:
            cover = job.coverage.setdefault(t.url, Coverage())
            cover.update(node_name, (t.generation, t.step), node.ranks, node.world_size)
            step = cover.committed()
            if step is not None and job.commits.get(t.url, (-1, -1)) < step:
                job.commits[t.url] = step
                self._record("global_commit", job=name, tier=t.url, step=step[1],
                             generation=step[0])  # fmt: skip

    def status(self, name: str, now: float | None = None) -> pb.JobStatusReply:
        now = time.monotonic() if now is None else now
        job = self.jobs.get(name, JobState())
        nodes = [
            pb.NodeStatus(node=k, agent_id=n.agent_id, last_seen_s=now - n.last_seen,
                          lost=n.lost, workers=[s.worker for s in n.workers.values()],
                          peer_address=n.peer_address, failure_domain=n.failure_domain,
                          replicas=n.replicas, spare=n.spare, taking=n.taking)
            for k, n in sorted(job.nodes.items())
        ]  # fmt: skip
        commits = [pb.GlobalCommit(url=u, step=s, generation=g)
                   for u, (g, s) in sorted(job.commits.items())]  # fmt: skip
        detections = []
        for at, d in job.detections:
            shown = pb.Detection()
            shown.CopyFrom(d)
            shown.age_s = now - at
            detections.append(shown)
        return pb.JobStatusReply(policy=self.policy, nodes=nodes, commits=commits,
                                 detections=detections)  # fmt: skip

    def _record(self, kind: str, **fields: object) -> None:
        if self.events is not None:
            self.events.record(kind, **fields)


_HANG_UP = pb.ReportReply()  # the controller stops: a stream's last word (never sent)


class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, controller: Controller):
        self.c = controller

    async def Report(self, request, context):
        await _check(request, context)
        return self.c.report(request)

    async def Connect(self, request_iterator, context):
        """Answer the reports that bring news (new orders, a new heartbeat) and every tenth
        as a sign of life; between them, write the orders a detection pushes. The stream is
        accepted at once (headers sent), so a node knows before its first report whether it is
        heard or refused, and why."""
        await context.send_initial_metadata(())
        outbox: asyncio.Queue[pb.ReportReply | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        watched: dict[tuple[str, str], Callable] = {}
        last: list[tuple | None] = [None]  # the orders and heartbeat last written

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await _check(request, context)
                    reply = self.c.report(request)
                    if reply.taken_by:  # refused: the orders, then the stream ends
                        outbox.put_nowait(reply)
                        return
                    if (request.job, request.node) not in watched:
                        for stop in watched.values():
                            stop()
                        watched.clear()
                        watched[request.job, request.node] = self.c.watch(
                            request.job,
                            request.node,
                            lambda r: loop.call_soon_threadsafe(
                                outbox.put_nowait, _HANG_UP if r is None else r
                            ),
                        )
                    # Answer when there is news (orders, a new heartbeat, new common steps),
                    # and every tenth report as a sign of life: half the messages of
                    # answering them all.
                    said = (tuple(reply.kill_pids), reply.heartbeat_s, reply.common_known,
                            tuple((k.generation, k.step) for k in reply.common),
                            tuple(reply.expired_replicas), reply.take_node,
                            reply.job_over)  # fmt: skip
                    if said != last[0] or request.seq % ACK_EVERY == 0:
                        last[0] = said
                        outbox.put_nowait(reply)
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (reply := await outbox.get()) is not None:
                if reply is _HANG_UP:
                    return  # the controller stops: the stream ends cleanly, the node reconnects
                await context.write(reply)
                if reply.taken_by:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, taken_text(reply))
            await reader  # raises what ended the stream (an abort), if anything
        finally:
            reader.cancel()
            for stop in watched.values():
                stop()

    async def JobStatus(self, request, context):
        return self.c.status(request.job)

    async def Holders(self, request, context):
        if request.hop < 1 and not request.named:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hop must be >= 1")
        return self.c.holders(request)


def taken_text(reply: pb.ReportReply) -> str:
    """Why an agent is refused: its node is a spare's now (see the module doc)."""
    return (f"spare node {reply.taken_by} took this node while it was lost and runs its ranks "
            "under its name: this agent is refused and its workers here are killed; stop it "
            "(this host can serve the job again as a spare: flashckpt-run --spare)")  # fmt: skip


async def _check(request: pb.NodeReport, context) -> None:
    try:
        config.validate_name("job", request.job)
    except Exception as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the job's token."""

    def __init__(self, token: str):
        self._want = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing controller token: give every node the same "
                "FLASHCKPT_CONTROLLER_TOKEN (or _TOKEN_FILE)",
            )

        # One refusal per kind of call, so a stream is refused as a stream.
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    async def intercept_service(self, continuation, details):
        for key, value in details.invocation_metadata or ():
            got = value.encode() if isinstance(value, str) else value
            if key == "authorization" and hmac.compare_digest(got, self._want):
                return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # not a method of ours: UNIMPLEMENTED, token or not
        kind = (handler.request_streaming, handler.response_streaming)
        return self._deny.get(kind, self._deny[False, False])


async def start(
    controller: Controller, bind: str, token: str, tls=None
) -> tuple[grpc.aio.Server, int]:
    """Serve ``controller`` on ``bind`` (``host:port``; port 0: any). Returns the server and
    its port; raises RuntimeError if the address cannot be bound (in use, or not this host's)."""
    # No SO_REUSEPORT: a second controller on the same address must fail to bind, not share it.
    server = grpc.aio.server(interceptors=[TokenAuth(token)],
                             options=[("grpc.so_reuseport", 0), *control.SERVER_OPTIONS])  # fmt: skip
    pb_grpc.add_ControllerServicer_to_server(ControllerService(controller), server)
    if tls is not None:
        port = server.add_secure_port(bind, tls.server_credentials())
    else:
        port = server.add_insecure_port(bind)
    if not port:
        raise RuntimeError(f"cannot bind {bind}")
    await server.start()
    return server, port


async def run(controller: Controller, server: grpc.aio.Server, stop: asyncio.Event) -> None:
    """Tick the lost-node detector until ``stop``; then stop serving."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=min(0.25, controller.node_timeout / 4))
        controller.tick()
    controller.hang_up()
    await asyncio.sleep(0.05)  # the streams end on their own, not cancelled by the stop
    await server.stop(grace=1)


class InThread(threading.Thread):
    """A controller served from its own event loop on a thread of the caller (the launcher)."""

    def __init__(self, controller: Controller, bind: str, token: str, tls=None):
        super().__init__(name="flashckpt-controller", daemon=True)
        self.controller, self.bind, self.token, self.tls = controller, bind, token, tls
        self.port = 0
        self.error: Exception | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._halt: asyncio.Event | None = None

    def start_serving(self, timeout: float = 10) -> int:
        """Start; the bound port. RuntimeError if the address cannot be bound here."""
        self.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the controller did not start on {self.bind} in {timeout}s")
        if self.error is not None:
            raise RuntimeError(str(self.error))
        return self.port

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._halt = asyncio.get_running_loop(), asyncio.Event()
        try:
            server, self.port = await start(self.controller, self.bind, self.token, self.tls)
        except Exception as exc:
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        await run(self.controller, server, self._halt)

    def end_job(self, job: str) -> None:
        """The job is over (its launcher exits): its spare nodes are told, before the stop."""
        if self._loop is not None and self.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.controller.job_over, job)

    def stop(self) -> None:
        if self._loop is not None and self._halt is not None and self.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop already ended
                self._loop.call_soon_threadsafe(self._halt.set)
        self.join(5)


async def serve_standalone(bind: str | None, events: str | None, run_dir: str | None,
                           policy: str | None, node_timeout: float | None) -> None:  # fmt: skip
    """``flashckpt-agent controller``: serve until SIGTERM or SIGINT."""
    bind = (
        bind
        or os.environ.get("FLASHCKPT_CONTROLLER_BIND")
        or os.environ.get("FLASHCKPT_CONTROLLER")
    )
    if not bind:
        raise ConfigError(
            "give the controller an address: --bind HOST:PORT (or FLASHCKPT_CONTROLLER)"
        )
    control.split_address(bind, "--bind")
    token = control.token_from_env()
    if token is None:
        raise ConfigError(
            "the controller needs a token that every node's agent presents: set "
            "FLASHCKPT_CONTROLLER_TOKEN_FILE (a file only you can read) or FLASHCKPT_CONTROLLER_TOKEN"
        )
    if policy is not None:
        os.environ["FLASHCKPT_RESTART_POLICY"] = policy
    path = Path(events) if events else config.run_dir(run_dir) / "controller.events.jsonl"
    controller = Controller(EventLog(path), control.policy(), node_timeout)
    tls = control.Tls.from_env(server=True)
    try:
        server, port = await start(controller, bind, token, tls)
    except RuntimeError as exc:
        raise ConfigError(f"the controller cannot serve on {bind}: {exc}") from None
    host = control.split_address(bind, "--bind")[0]
    log.info("controller serving on %s:%d (%s, policy %s, node timeout %.1fs); events in %s",
             host, port, "TLS" if tls else "no TLS", controller.policy, controller.node_timeout,
             path)  # fmt: skip
    gate = (
        _recovery_gate(controller, host, port, token) if controller.policy == "in-process" else None
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await run(controller, server, stop)
    finally:
        if gate is not None:
            gate.close()


def _recovery_gate(controller: Controller, host: str, port: int, token: str):
    """Under in-process recovery, the job's recovery store, next to the controller (no node
    serves it then): at FLASHCKPT_RECOVERY_STORE, else the controller's port + 1, where every
    node's launcher looks for it."""
    from flashckpt.faults.addresses import serve_here
    from flashckpt.faults.descriptors import prepare_store
    from flashckpt.faults.inprocess import STORE_ENV
    from flashckpt.faults.store_gate import StoreGate

    address = os.environ.get(STORE_ENV) or (
        f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"
    )
    gate_host, gate_port = control.split_address(address, STORE_ENV)
    prepare_store()  # the job's size is not known here: the limit raised and logged
    try:
        gate = serve_here(gate_host, gate_port, lambda: StoreGate(gate_host, gate_port,
                          token.encode()), "the job's recovery store")  # fmt: skip
    except FlashCkptError as exc:
        raise ConfigError(str(exc)) from None
    if gate is None:
        raise ConfigError(f"the recovery store cannot serve on {address}: another process (or "
                          "host) serves that address; set FLASHCKPT_RECOVERY_STORE to a free "
                          "port of this host")  # fmt: skip
    log.info("recovery store serving on %s", gate.address)
    if controller.events is not None:
        controller.events.record("recovery_store_started", address=gate.address)
    return gate
