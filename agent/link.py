"""The node agent's side of the controller: report this node every heartbeat, carry out kills.

The agent keeps one report stream open to the controller (``Connect``). Each round reads the
job's heartbeat pages in shared memory (which workers run here, at which step and phase, and
which died without closing) and the tiers' last commits and writes them to the stream; the
replies name the workers to terminate, and the controller also pushes such orders the moment
it decides them. A worker ordered killed gets SIGTERM, then SIGKILL after a grace period; a
stopped process gets SIGKILL at once (SIGTERM would wait for it to continue).
The controller is found through ``<run_dir>/<job>.controller`` each round, so an agent that
outlived one launch follows the next. A controller that is down or refuses the token costs
training nothing: it never waits on it.

The node's writes where other nodes read (shared tiers, replicas in peers' memory) are held
under a lease from the controller (``Lease``): each report the controller answers renews it,
and it lapses after half the node timeout without one, so a node cut off from the controller
stops those writes before the controller could declare it lost and hand its ranks to a spare.
Node-local tiers go on. A node with no controller (no controller file) is not leased; a node
the controller says a spare took (``taken_by``) never writes there again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc
from flashckpt.storage_tiers.registry import redact

from flashckpt import config
from flashckpt.faults import control
from flashckpt.faults.control import Endpoint
from flashckpt.faults.events import EventLog
from flashckpt.faults.heartbeat import Phase, pages
from flashckpt.faults.proc import parent_and_state

from .controller import ACK_EVERY, DEFAULT_NODE_TIMEOUT, taken_text
from .jobs import Job
from .replicas import ReplicaStore

log = logging.getLogger(__name__)

DEFAULT_KILL_GRACE = 5.0
LEASE_SHARE = 0.5
"""The lease lasts this share of the node timeout (FLASHCKPT_NODE_TIMEOUT) past the report the
controller last answered: a node that cannot renew it stops writing where other nodes read
half a node timeout before the controller could declare it lost."""


def workers(shm_dir: Path, job: str) -> list[pb.Worker]:
    """The job's workers on this node, from their heartbeat pages."""
    now = time.monotonic()
    return [
        pb.Worker(
            rank=rank, pid=b.pid, phase=b.phase.name.lower(),
            step=-1 if b.step is None else b.step, silent_s=max(0.0, now - b.updated_at),
            age_s=max(0.0, now - b.started_at),
            alive=b.phase == Phase.CLOSED or parent_and_state(b.pid)[1] != "",
        )
        for rank, b in pages(shm_dir, job)
    ]  # fmt: skip


class Lease:
    """This node's right to write where other nodes read (shared tiers, peers' memory), held
    from the job's controller while one is known (its controller file names one).

    Each report the controller answers renews it until ``seconds`` (LEASE_SHARE of the node
    timeout) after the report was sent. The controller declares a node lost once it has heard
    nothing from it for the node timeout, counted from when it last heard it, which is no
    earlier than that send: the lease of a node that cannot renew it runs out half a node
    timeout before. Until the controller's first answer the lease does not hold; once the
    controller told the node to stop (``revoke``: a spare took its name) it never holds again.
    A lapse and its end are logged and recorded (``lease_lapsed``, ``lease_regained``)."""

    def __init__(self, job: str, events: EventLog | None = None,
                 node_timeout: float | None = None,
                 regained: Callable[[], None] = lambda: None):  # fmt: skip
        """``regained`` is called when writes may go again after a lapse."""
        timeout = config.setting_float("node_timeout", node_timeout, DEFAULT_NODE_TIMEOUT, lo=0.1)
        self.job, self.events, self.regained = job, events, regained
        self.node_timeout, self.seconds = timeout, LEASE_SHARE * timeout
        self.leased = False  # a controller is known: writing takes its word
        self.until = -math.inf  # monotonic time the lease holds until
        self.revoked = ""  # why the controller told this node to stop for good
        self._lapsed_at: float | None = None  # when it lapsed, while it is lapsed
        self._timer: asyncio.TimerHandle | None = None

    def valid(self) -> bool:
        """Whether this node may write where other nodes read, now."""
        if self.revoked:
            return False
        return not self.leased or time.monotonic() < self.until

    def follow(self, known: bool, where: Path) -> None:
        """A controller is known now (``where``, its file, names one), or not any more."""
        if known == self.leased:
            return
        self.leased = known
        if known:
            log.info("job %s: writes to shared tiers and peers' memory wait for the controller's "
                     "answer (they are leased from it)", self.job)  # fmt: skip
        else:
            log.info("job %s: no controller is known any more (%s is gone: its launcher ended "
                     "the job here): writes are not leased", self.job, where)  # fmt: skip
            self._regained("the controller file is gone")

    def renew(self, sent_at: float) -> None:
        """The controller answered the report sent at ``sent_at`` (monotonic)."""
        until = sent_at + self.seconds
        if self.revoked or until <= self.until:
            return
        if self.until == -math.inf:
            log.info("job %s: the controller answered: this node's lease holds (%.1fs a report "
                     "answered)", self.job, self.seconds)  # fmt: skip
        self.until = until
        if self.valid():
            self._regained("the controller answers again")
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(
                until - time.monotonic(), self.check
            )

    def check(self) -> None:
        """Log and record the lapse, once, where the lease ran out."""
        self._timer = None
        if not self.leased or self.revoked or self._lapsed_at is not None:
            return
        now = time.monotonic()
        if now < self.until:  # woken early
            self._timer = asyncio.get_running_loop().call_later(self.until - now, self.check)
            return
        self._lapsed_at = now
        silent = now - (self.until - self.seconds)
        log.warning("job %s: this node's lease from the controller lapsed: no report answered "
                    "for %.1fs (lease %.1fs, node timeout %.1fs); it writes no shared tier and no "
                    "peer replica until the controller answers again", self.job, silent,
                    self.seconds, self.node_timeout)  # fmt: skip
        if self.events is not None:
            self.events.record("lease_lapsed", silent_s=round(silent, 3), lease_s=self.seconds,
                               node_timeout_s=self.node_timeout)  # fmt: skip

    def revoke(self, why: str) -> None:
        """The controller told this node to stop (a spare took its name): the lease never
        holds again."""
        if self.revoked:
            return
        self.revoked = why
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        log.error("job %s: the controller told this node to stop (%s): it writes no shared tier "
                  "and no peer replica any more", self.job, why)  # fmt: skip
        if self.events is not None:
            self.events.record("lease_revoked", why=why)

    def _regained(self, why: str) -> None:
        if self._lapsed_at is None:
            return
        lapsed = time.monotonic() - self._lapsed_at
        self._lapsed_at = None
        log.warning("job %s: writes to shared tiers and peers' memory resume after %.1fs: %s",
                    self.job, lapsed, why)  # fmt: skip
        if self.events is not None:
            self.events.record("lease_regained", lapsed_s=round(lapsed, 3), why=why)
        self.regained()


class Link:
    def __init__(self, job: Job, run_dir: Path, agent_id: str, kill_grace: float | None = None,
                 replicas: ReplicaStore | None = None):  # fmt: skip
        self.job, self.run_dir, self.agent_id = job, run_dir, agent_id
        self.replicas = replicas  # what this node holds for others, reported with it
        self.kill_grace = config.setting_float("kill_grace", kill_grace, DEFAULT_KILL_GRACE)
        # Regained: every tier's worker goes at once (a peer's, refused meanwhile, may be
        # waiting out its backoff).
        self.lease = Lease(job.name, job.events, regained=job.wake)
        job.may_write = self.lease.valid
        # Reports go at least three times a lease: one lost answer never lapses it.
        self.interval = min(1.0, self.lease.seconds / 3)
        self._endpoint: Endpoint | None = None
        self._channel: grpc.aio.Channel | None = None
        self._killing: dict[int, asyncio.Task] = {}
        self._warned = ""
        self._seq = 0
        self._sent: dict[int, float] = {}  # seq -> when the report was sent (monotonic)
        self._broken = False  # the last stream broke: the next one dials afresh

    def report(self, seq: int = 0) -> pb.NodeReport:
        j = self.job
        tiers = [
            pb.TierCommit(url=redact(w.state.url), shared=w.state.scope == "shared",
                          step=w.state.last_committed[1], generation=w.state.last_committed[0],
                          held=[] if w.learned is None else [
                              pb.StepKey(generation=g, step=s)
                              for g, s in j.common.to_report(w.state.held)])
            for w in j.workers.values()
        ]  # fmt: skip
        held = self.replicas
        return pb.NodeReport(
            job=j.name, node=j.node, agent_id=self.agent_id, world_size=j.trainers.world_size,
            workers=workers(j.shm_dir, j.name), tiers=tiers, ranks=sorted(j.trainers.pids),
            seq=seq, peer_address=held.address if held else "",
            failure_domain=str(config.setting("failure_domain", None, "") or ""),
            replicas=[pb.Replica(source=n, generation=g, step=s, ranks=r)
                      for n, g, s, r in (held.held_now if held else [])],
        )  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.connected(stop)
            except Exception:  # the link must never take the agent down
                log.exception("controller report failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)
        await self._close()

    async def connected(self, stop: asyncio.Event) -> None:
        """One report stream to the job's current controller: a report every heartbeat, kill
        orders carried out as they arrive. Returns when the stream breaks, the controller file
        names another controller, or ``stop``."""
        endpoint = Endpoint.load(self.run_dir, self.job.name)
        self.lease.follow(endpoint is not None, control.file_path(self.run_dir, self.job.name))
        # A stream that broke is followed by a fresh connection: a controller back on its
        # address (restarted) is reached at once, not after the channel's reconnect backoff,
        # which would keep this node's lease lapsed meanwhile.
        if endpoint != self._endpoint or self._broken:
            await self._close()
            if endpoint is not None:
                self._channel = endpoint.channel()
                if endpoint != self._endpoint:
                    log.info("job %s: reporting to the controller at %s", self.job.name,
                             endpoint.address)  # fmt: skip
            self._endpoint, self._broken = endpoint, False
        if self._channel is None or endpoint is None:
            self.job.common.why = (
                f"no controller is known on this node: {control.file_path(self.run_dir, self.job.name)} "
                "is missing (flashckpt-run writes it)"
            )
            return
        call = pb_grpc.ControllerStub(self._channel).Connect(metadata=endpoint.metadata())
        orders = asyncio.create_task(self._orders(call))
        stopping = asyncio.create_task(stop.wait())
        try:
            # Accepted or refused before the first report: a report written to a stream the
            # controller has just refused fails with a client-side error that hides its reason.
            await asyncio.wait_for(call.initial_metadata(), max(2.0, self.interval))
            while not orders.done() and not stopping.done() and not call.done():
                if Endpoint.load(self.run_dir, self.job.name) != endpoint:
                    return  # the next call follows the new controller
                # Numbered for the controller's sign of life (it answers every ACK_EVERY-th):
                # every report is answered, and each answer renews the lease.
                self._seq += ACK_EVERY
                self._sent[self._seq] = time.monotonic()
                while len(self._sent) > 64:  # never answered: a stream that broke
                    del self._sent[min(self._sent)]
                await asyncio.wait_for(call.write(self.report(self._seq)), max(2.0, self.interval))
                await asyncio.wait({orders, stopping}, timeout=self.interval,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            pass  # the stream broke: why is the orders task's to say
        finally:
            call.cancel()
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await orders  # what ended it, if anything, is for _warn to say
            self._broken = (
                not stop.is_set() and Endpoint.load(self.run_dir, self.job.name) == endpoint
            )
        self._warn(endpoint, orders)

    async def _orders(self, call) -> None:
        """Act on every reply of ``call``: answers to reports and orders pushed unasked."""
        async for reply in call:
            self._warned = ""
            if reply.taken_by:  # a spare took this node while it was lost: its writes are over
                self.lease.revoke(taken_text(reply))
            if reply.seq in self._sent:
                self.lease.renew(self._sent[reply.seq])
                for seq in [s for s in self._sent if s <= reply.seq]:
                    del self._sent[seq]
            common = [(k.generation, k.step) for k in reply.common]
            if reply.seq and self.job.common.learn(reply.common_known, common):
                self.job.wake()  # node-local tiers may retire what every node now holds
            if reply.heartbeat_s > 0:
                self.interval = min(reply.heartbeat_s, 30.0, self.lease.seconds / 3)
            if reply.expired_replicas and self.replicas is not None:
                await self.replicas.expire(list(reply.expired_replicas))
            for pid in reply.kill_pids:
                if pid not in self._killing or self._killing[pid].done():
                    self._killing[pid] = asyncio.create_task(self.terminate(pid))

    def _warn(self, endpoint: Endpoint, orders: asyncio.Task) -> None:
        exc = None if orders.cancelled() else orders.exception()
        if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() == grpc.StatusCode.CANCELLED:
            if exc is not None:
                log.warning("the controller link failed: %r", exc)
            return
        why = f"{exc.code().name}: {exc.details()}"
        self.job.common.why = f"the controller at {endpoint.address} does not answer ({why})"
        if why != self._warned:  # once per new reason, not every heartbeat
            log.warning("the controller at %s does not take reports (%s)", endpoint.address, why)
            self._warned = why

    async def terminate(self, pid: int) -> None:
        """SIGTERM ``pid`` if it is one of the job's workers here, SIGKILL after the grace
        period (at once if it is stopped)."""
        if pid not in {w.pid for w in workers(self.job.shm_dir, self.job.name) if w.alive}:
            return  # gone already, or not a worker of this job: never signal anything else
        stopped = parent_and_state(pid)[1] == "T"
        log.warning("job %s: the controller ordered worker %d killed (%s)", self.job.name, pid,
                    "stopped: SIGKILL" if stopped else "SIGTERM")  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if stopped else signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        while parent_and_state(pid)[1] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if parent_and_state(pid)[1]:
            log.warning("job %s: worker %d outlived SIGTERM by %.1fs: SIGKILL", self.job.name,
                        pid, self.kill_grace)  # fmt: skip
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
