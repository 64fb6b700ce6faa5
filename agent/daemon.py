"""``flashckpt-agent serve``: the agent process, its socket, its lock, its shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid
from pathlib import Path

import grpc
from flashckpt.proto import agent_pb2_grpc as pb_grpc

from flashckpt import config, preempt_mark
from flashckpt.errors import ConfigError
from flashckpt.faults.agent_client import agent_pid_path, socket_path
from flashckpt.faults.events import EventLog
from flashckpt.pidfile import PidFileBusy, lock_pidfile, pid_alive
from flashckpt.safe_paths import private_dir

from .jobs import Job
from .link import Link
from .metrics import Metrics
from .replicas import ReplicaStore
from .service import AgentService

log = logging.getLogger(__name__)

DEFAULT_NICE = 10
"""How much lower than the trainers' the agent's CPU priority is (FLASHCKPT_AGENT_NICE)."""

DEFAULT_GIVE_UP_AFTER = 3600.0
"""Seconds an idle agent keeps retrying a tier that is behind before it exits anyway. Once the
launcher that started it is gone and its lease from the controller has lapsed, the tiers
written under the lease (shared ones, peers' memory) are not waited for at all: nothing more
can be written there (see ``link.Lease``); node-local tiers are still drained."""


def claim(run_dir: Path, job: str) -> int:
    """Lock ``<run_dir>/<job>.pid``: one agent per job per node."""
    private_dir(run_dir, "run_dir")
    try:
        return lock_pidfile(agent_pid_path(run_dir, job))
    except PidFileBusy as busy:
        raise SystemExit(
            f"an agent for job {job!r} already runs on this node ({busy.holder()}); stop it "
            "first or use it"
        ) from None


async def serve(
    job: str, tiers: list[str], shm_dir: Path, run_dir: Path, metrics_port: int | None = None,
    exit_when_idle: float | None = None, drain_timeout: float = 60.0, metrics_addr: str = "127.0.0.1",
    give_up_after: float = DEFAULT_GIVE_UP_AFTER, while_pid: int | None = None,
) -> None:  # fmt: skip
    """Serve ``job`` until SIGTERM; with ``exit_when_idle``, also exit once no trainer is alive
    (nor ``while_pid``, the launcher that started it) and every tier holds the newest snapshot
    (a failing tier is retried, with backoff, for ``give_up_after`` seconds first; a tier
    written under the lease not at all once the launcher is gone and the lease lapsed).
    Reports the node to the job's controller when a launcher named one (see ``link``)."""
    config.validate_name("job", job)
    nice = config.setting_int("agent_nice", None, DEFAULT_NICE, lo=0, hi=19)
    if nice:  # the trainers first: persistence and replicas take the cycles they leave
        os.nice(nice)
    sock = socket_path(run_dir, job)  # a path past the unix limit fails before the lock
    lock_fd = claim(run_dir, job)
    sock.unlink(missing_ok=True)
    metrics = Metrics(metrics_port, metrics_addr) if metrics_port is not None else None
    node = config.node_name()
    service = AgentService(f"{node}-{uuid.uuid4().hex[:8]}", shm_dir, node, metrics, tiers, run_dir)
    service.jobs[job] = j = Job(job, shm_dir, node, metrics, EventLog.of_launched(run_dir, job))
    for url in tiers:
        await j.add_tier(url)
    server = grpc.aio.server()
    pb_grpc.add_AgentServicer_to_server(service, server)
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    os.chmod(sock, 0o600)
    ours = os.stat(sock).st_ino  # at exit, removed only if still this agent's
    log.info("agent %s serving job %s on %s (shm %s, metrics %s)", service.agent_id, job, sock, shm_dir,
             metrics.port if metrics else "off")  # fmt: skip

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    replicas = None
    if config.peer_replicas() > 0:  # a multi-node job: hold other nodes' newest steps
        replicas = ReplicaStore(job, shm_dir, run_dir, metrics, node, j.events)
        try:
            await replicas.start()
        except (OSError, ConfigError) as exc:  # persistence goes on; peers find no store here
            log.error("job %s: this node holds no other node's replica: its replica store "
                      "cannot be served (%s); check FLASHCKPT_PEER_HOST", job, exc)  # fmt: skip
            replicas = None
    unlinked = asyncio.Event()  # set once persistence drained: the lease holds until then
    link = asyncio.create_task(
        Link(j, run_dir, service.agent_id, replicas=replicas).run(unlinked),
        name="controller link",
    )
    idle_since = None
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        for jb in service.jobs.values():
            jb.reclaim()
            if preempt_mark.read(run_dir, jb.name) is not None:
                jb.preempt("its launcher was asked to stop")
        if exit_when_idle is not None:
            launcher = bool(while_pid) and pid_alive(while_pid)
            orphan = bool(while_pid) and not launcher  # the launcher that started it is gone
            quiet = not launcher and all(
                not jb.trainers.alive()
                and jb.idle(give_up_after, cut_off=orphan and not jb.may_write())
                for jb in service.jobs.values()
            )
            idle_since = (idle_since or loop.time()) if quiet else None
            # Once the launcher that started it is gone, its workers are too: no grace.
            grace = 0.0 if orphan else exit_when_idle
            if idle_since is not None and loop.time() - idle_since >= grace:
                for jb in service.jobs.values():
                    cut_off = jb.cut_off() if orphan else []
                    for w in jb.workers.values():
                        if w.state.lag_steps and w in cut_off:
                            log.error(
                                "giving up on tier %s: step %d of job %s stays in shared memory "
                                "only: its launcher is gone and its lease from the controller "
                                "lapsed (nothing renews it: this node may have been replaced)",
                                w.state.url, w.state.newest_in_memory[1], jb.name,
                            )  # fmt: skip
                        elif w.state.lag_steps:
                            log.error(
                                "giving up on tier %s after %.0fs: step %d of job %s stays in "
                                "shared memory only (%s)", w.state.url, give_up_after,
                                w.state.newest_in_memory[1], jb.name, w.state.last_error or "behind",
                            )  # fmt: skip
                log.info(
                    "no trainer left and nothing to persist for %.0fs: exiting", exit_when_idle
                )
                break
    stop.set()
    log.info("shutting down: draining persistence (up to %.0fs)", drain_timeout)
    await server.stop(grace=2)
    for jb in service.jobs.values():
        jb.preempt("the agent was asked to stop")  # the newest step out first, past throttles
        await jb.drain(drain_timeout)
    unlinked.set()  # the controller heard this node while it drained: its lease held
    await link
    if replicas is not None:  # the job is over on this node: its memory goes back
        await replicas.close()
    log.info("drained; exiting")
    if metrics:
        metrics.close()
    with contextlib.suppress(OSError):  # a newer agent's socket at the path is left alone
        if os.stat(sock).st_ino == ours:
            sock.unlink()
    os.close(lock_fd)
