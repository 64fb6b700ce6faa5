"""The node agent's side of the controller: report this node every heartbeat, carry out kills.

The agent keeps one report stream open to the controller (``Connect``). Each round reads the
job's heartbeat pages in shared memory (which workers run here, at which step and phase, and
which died without closing) and the tiers' last commits and writes them to the stream; the
replies name the workers to terminate, and the controller also pushes such orders the moment
it decides them. A worker ordered killed gets SIGTERM, then SIGKILL after a grace period; a
stopped process gets SIGKILL at once (SIGTERM would wait for it to continue).
The controller is found through ``<run_dir>/<job>.controller`` each round, so an agent that
outlived one launch follows the next. A controller that is down or refuses the token costs
nothing but a warning: training never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import grpc
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc
from flashckpt.storage_tiers.registry import redact

from flashckpt import config
from flashckpt.faults import control
from flashckpt.faults.control import Endpoint
from flashckpt.faults.heartbeat import Phase, pages
from flashckpt.faults.proc import parent_and_state

from .jobs import Job
from .replicas import ReplicaStore

log = logging.getLogger(__name__)

DEFAULT_KILL_GRACE = 5.0


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


class Link:
    def __init__(self, job: Job, run_dir: Path, agent_id: str, kill_grace: float | None = None,
                 replicas: ReplicaStore | None = None):  # fmt: skip
        self.job, self.run_dir, self.agent_id = job, run_dir, agent_id
        self.replicas = replicas  # what this node holds for others, reported with it
        self.kill_grace = config.setting_float("kill_grace", kill_grace, DEFAULT_KILL_GRACE)
        self.interval = 1.0
        self._endpoint: Endpoint | None = None
        self._channel: grpc.aio.Channel | None = None
        self._killing: dict[int, asyncio.Task] = {}
        self._warned = ""
        self._seq = 0

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
        if endpoint != self._endpoint:
            await self._close()
            self._endpoint = endpoint
            if endpoint is not None:
                self._channel = endpoint.channel()
                log.info("job %s: reporting to the controller at %s", self.job.name,
                         endpoint.address)  # fmt: skip
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
                self._seq += 1
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
        self._warn(endpoint, orders)

    async def _orders(self, call) -> None:
        """Act on every reply of ``call``: answers to reports and orders pushed unasked."""
        async for reply in call:
            self._warned = ""
            common = [(k.generation, k.step) for k in reply.common]
            if reply.seq and self.job.common.learn(reply.common_known, common):
                self.job.wake()  # node-local tiers may retire what every node now holds
            if reply.heartbeat_s > 0:
                self.interval = min(reply.heartbeat_s, 30.0)
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
