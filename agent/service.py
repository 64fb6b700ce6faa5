"""The gRPC servicer: thin translation between proto messages and ``Job`` objects."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from flashckpt.proto import agent_pb2 as pb
from flashckpt.proto import agent_pb2_grpc as pb_grpc
from flashckpt.storage_tiers.registry import redact

from flashckpt import config
from flashckpt.errors import ConfigError
from flashckpt.faults.events import EventLog
from flashckpt.format import tier_io

from .jobs import Job
from .persist import SlotReader

log = logging.getLogger(__name__)

_SCOPE = {"node": pb.TIER_SCOPE_NODE, "shared": pb.TIER_SCOPE_SHARED}


class AgentService(pb_grpc.AgentServicer):
    def __init__(
        self, agent_id: str, shm_dir: Path, node: str, metrics=None,
        tiers: list[str] | None = None, run_dir: Path | None = None,
    ):  # fmt: skip
        """``run_dir``: where jobs launched by ``flashckpt-run`` keep their event logs."""
        self.agent_id, self.shm_dir, self.node, self.metrics = agent_id, shm_dir, node, metrics
        self.run_dir = run_dir
        self.default_tiers = list(tiers or [])
        self.jobs: dict[str, Job] = {}
        # Trainers known only from a notice, not registered with this agent: (job, rank, pid).
        self._unregistered: set[tuple[str, int, int]] = set()

    async def job(self, name: str, context) -> Job:
        try:
            config.validate_name("job", name)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if name not in self.jobs:
            events = EventLog.of_launched(self.run_dir, name) if self.run_dir else None
            self.jobs[name] = job = Job(name, self.shm_dir, self.node, self.metrics, events)
            for url in self.default_tiers:
                await job.add_tier(url)
        return self.jobs[name]

    async def RegisterTrainer(self, request, context):
        if request.rank < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"rank must be >= 0, got {request.rank}"
            )
        if request.shm_dir and Path(request.shm_dir) != self.shm_dir:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this agent reads slots under {self.shm_dir}, the trainer writes them under {request.shm_dir}; "
                "give both the same FLASHCKPT_SHM_DIR",
            )
        job = await self.job(request.job, context)
        for url in request.tiers:
            try:
                await job.add_tier(url)
            except (ConfigError, OSError, ImportError) as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"tier {redact(url)!r}: {exc}"
                )
        job.trainers.register(
            request.rank, request.pid, request.world_size, request.local_world_size
        )
        self._unregistered.discard((job.name, request.rank, request.pid))
        log.info("job %s: rank %d registered (pid %d)", job.name, request.rank, request.pid)
        return pb.RegisterTrainerResponse(agent_id=self.agent_id, tiers=list(job.workers))

    async def SnapshotReady(self, request, context):
        job = await self.job(request.job, context)
        if request.pid and job.trainers.pids.get(request.rank) != request.pid:
            # This agent started after the trainer registered (it was restarted): learn the
            # live job from the notice, so its ranks, not leftover slots, decide what is stored.
            job.trainers.register(
                request.rank, request.pid, request.world_size, request.local_world_size
            )
            self._unregistered.add((job.name, request.rank, request.pid))
            log.info("job %s: rank %d known from its notice (pid %d); asked to register again "
                     "for its tiers", job.name, request.rank, request.pid)  # fmt: skip
        job.trainers.told(request.rank)
        if request.final:
            job.trainers.close(request.rank, (request.generation, request.step))
        job.wake()
        again = (job.name, request.rank, request.pid) in self._unregistered
        return pb.SnapshotReadyResponse(register_again=again)

    async def GetTierStatus(self, request, context):
        job = await self.job(request.job, context)
        out = []
        for w in job.workers.values():
            s = w.state
            out.append(
                pb.TierStatus(
                    url=s.url,
                    scope=_SCOPE[s.scope],
                    health=pb.TIER_HEALTH_OK if s.healthy else pb.TIER_HEALTH_FAILING,
                    last_committed_step=s.last_committed[1],
                    last_committed_generation=s.last_committed[0],
                    lag_steps=s.lag_steps,
                    lag_seconds=s.lag_seconds,
                    bytes_persisted=s.bytes_persisted,
                    snapshots_persisted=s.snapshots_persisted,
                    last_error=s.last_error,
                    last_persist_seconds=s.last_persist_seconds,
                    last_persist_bytes=s.last_persist_bytes,
                )  # fmt: skip
            )
        return pb.GetTierStatusResponse(tiers=out)

    async def ListSnapshots(self, request, context):
        job = await self.job(request.job, context)
        # Its own mappings: a persistence loop's reader may be mid-upload from one it holds.
        reader = SlotReader(self.shm_dir, job.name)
        memory = []
        try:
            for rank, steps in sorted(reader.held().items()):
                for (gen, step), slot in sorted(steps.items()):
                    h = slot.header()
                    memory.append(
                        pb.MemorySnapshot(rank=rank, step=step, sealed=h.sealed, generation=gen)
                    )
        finally:
            reader.close()
        tiers = []
        for url, w in job.workers.items():
            try:
                listing = await tier_io.list_steps(w.tier, job.name)
            except Exception as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"tier {redact(url)}: {exc}")
            lineage = tier_io.head(listing)
            steps = sorted(tier_io.in_lineage(listing, lineage))
            tiers.append(
                pb.TierSteps(url=url, committed_steps=steps, generation=lineage.generation)
            )
        return pb.ListSnapshotsResponse(memory=memory, tiers=tiers)

    async def FetchRestore(self, request, context):
        listing = await self.ListSnapshots(pb.ListSnapshotsRequest(job=request.job), context)
        want = request.step if request.HasField("step") else None
        sources = []
        own = [m for m in listing.memory if m.rank == request.rank]
        gen = max((m.generation for m in own), default=0)  # the newest branch in memory
        mem = sorted((m.step for m in own if m.generation == gen), reverse=True)
        sources += [pb.RestoreSource(url="memory", step=s) for s in mem if want in (None, s)]
        for t in listing.tiers:  # tiers are kept fastest first, as registered
            sources += [
                pb.RestoreSource(url=t.url, step=s)
                for s in sorted(t.committed_steps, reverse=True)
                if want in (None, s)
            ]
        return pb.FetchRestoreResponse(sources=sources)
