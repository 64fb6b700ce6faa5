"""The trainer's side of the node agent: find or spawn it, register, notify (never block)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from .errors import TierUnavailableError

log = logging.getLogger(__name__)


def socket_path(run_dir: Path, job: str) -> Path:
    return run_dir / f"{job}.sock"


class AgentClient:
    def __init__(self, job: str, run_dir: Path):
        from .proto import agent_pb2 as pb
        from .proto import agent_pb2_grpc as pb_grpc

        self.pb = pb
        self.job, self.run_dir = job, run_dir
        self.socket = socket_path(run_dir, job)
        self.channel = grpc.insecure_channel(f"unix:{self.socket}")
        self.stub = pb_grpc.AgentStub(self.channel)
        self._inflight: list[grpc.Future] = []  # notices not yet answered

    def ready(self, timeout: float) -> bool:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    @classmethod
    def connect(
        cls, job: str, run_dir: Path, shm_dir: Path, spawn: bool = True, timeout: float = 30
    ) -> AgentClient:
        """The job's agent on this node; spawned detached if none answers and ``spawn``."""
        client = cls(job, run_dir)
        if client.socket.exists() and client.ready(0.5):
            return client
        if not spawn:
            raise TierUnavailableError(
                f"no flashckpt agent answers on {client.socket}; start one with 'flashckpt-agent serve --job {job}'"
            )
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        logfile = open(run_dir / f"{job}.log", "ab")  # noqa: SIM115  (handed to the child)
        cmd = [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", job, "--shm-dir", str(shm_dir),
               "--run-dir", str(run_dir), "--exit-when-idle", "30"]  # fmt: skip
        # Its own session: the agent outlives this trainer, and torchrun's kill of the workers.
        subprocess.Popen(
            cmd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=logfile,
            close_fds=True,
        )
        logfile.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.socket.exists() and client.ready(0.5):
                log.info(
                    "started the flashckpt agent for job %s (log: %s)", job, run_dir / f"{job}.log"
                )
                return client
            time.sleep(0.1)
        raise TierUnavailableError(
            f"the flashckpt agent for job {job} did not start within {timeout}s; see {run_dir / f'{job}.log'}"
        )

    def register(
        self, rank: int, world_size: int, tiers: list[str], shm_dir: Path, local_world_size: int = 0
    ) -> list[str]:
        req = self.pb.RegisterTrainerRequest(
            job=self.job,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            pid=os.getpid(),
            tiers=tiers,
            shm_dir=str(shm_dir),
        )
        try:
            return list(self.stub.RegisterTrainer(req, timeout=30).tiers)
        except grpc.RpcError as exc:
            raise TierUnavailableError(
                f"the flashckpt agent refused rank {rank}: {exc.details()}"
            ) from exc

    def notify(self, rank: int, step: int, final: bool = False) -> bool:
        """Tell the agent a snapshot is READY.

        A plain notice is fire and forget (the agent also polls), but its call is kept
        referenced until it completes: grpc cancels a call whose future is collected. A
        ``final`` notice (a closing trainer's last step, which must pass any throttle) waits
        for the answer; returns whether the agent has it. Agent death stops persistence,
        never training: errors are dropped.
        """
        req = self.pb.SnapshotReadyRequest(job=self.job, rank=rank, step=step, final=final)
        if final:
            try:
                self.stub.SnapshotReady(req, timeout=30)
                return True
            except grpc.RpcError as exc:
                log.warning("the agent did not take the final step %d: %s", step, exc.details())
                return False
        self._inflight = [f for f in self._inflight if not f.done()]
        with contextlib.suppress(Exception):
            self._inflight.append(self.stub.SnapshotReady.future(req, timeout=5))
        return True

    def tier_status(self, timeout: float = 5) -> list:
        return list(
            self.stub.GetTierStatus(
                self.pb.GetTierStatusRequest(job=self.job), timeout=timeout
            ).tiers
        )

    def close(self) -> None:
        self.channel.close()
