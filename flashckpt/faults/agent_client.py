"""The trainer's side of the node agent: find or spawn it, register, notify (never block)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from .. import config
from ..errors import ConfigError, TierUnavailableError
from ..pidfile import holder
from ..safe_paths import open_file, private_dir
from .proc import parent_and_state

log = logging.getLogger(__name__)

REVIVE_AFTER_S = 10.0
"""How long a trainer's notices find no agent before the trainer starts one itself."""
SOCKET_PATH_MAX = 107  # bytes: a unix socket address holds 108, the last one a NUL


def socket_path(run_dir: Path, job: str) -> Path:
    """``<run_dir>/<job>.sock``; past the unix limit, a short name with a hash of the job.
    ConfigError if even that does not fit (the run dir's own path is too long)."""
    path = run_dir / f"{job}.sock"
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        return path
    short = run_dir / f"{job[:16]}-{hashlib.sha256(job.encode()).hexdigest()[:16]}.sock"
    path = min(path, short, key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        return path
    raise ConfigError(
        f"the agent's socket {path} is {len(os.fsencode(path))} bytes long, but a unix socket "
        f"path holds at most {SOCKET_PATH_MAX}; set FLASHCKPT_RUN_DIR (or run_dir) to a "
        f"directory whose path is at most {SOCKET_PATH_MAX - len(path.name) - 1} bytes long"
    )


def agent_pid_path(run_dir: Path, job: str) -> Path:
    """The job's agent claim on this node: a pid file its agent holds locked."""
    return run_dir / f"{job}.pid"


def agent_pid(run_dir: Path, job: str) -> int | None:
    """The pid of the process holding the claim of the job's agent on this node, if any."""
    return holder(agent_pid_path(run_dir, job))


class AgentClient:
    def __init__(self, job: str, run_dir: Path):
        from ..proto import agent_pb2 as pb
        from ..proto import agent_pb2_grpc as pb_grpc

        self.pb = pb
        self.job, self.run_dir = job, run_dir
        self.socket = socket_path(run_dir, job)
        self.channel = grpc.insecure_channel(f"unix:{self.socket}")
        self.stub = pb_grpc.AgentStub(self.channel)
        self._inflight: list[grpc.Future] = []  # notices not yet answered
        self._registration: Any = None  # the last RegisterTrainerRequest sent
        self._shm_dir: Path | None = None  # set by connect(): where a new agent reads slots
        self._revived_at = -math.inf
        self._gone_since: float | None = None  # since when notices find no agent
        # Plain notices are sent from this thread: starting a grpc call costs milliseconds,
        # which save() must not wait for.
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-notify")

    def listening(self) -> bool:
        """True if the socket exists; ConfigError if it is not a socket of this user (the
        trainer would hand its tier URLs, credentials included, to whoever listens)."""
        try:
            st = os.lstat(self.socket)
        except FileNotFoundError:
            return False
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(
                f"{self.socket} is not the socket of an agent of this user (mode "
                f"{stat.filemode(st.st_mode)}, uid {st.st_uid}); remove it and check who can "
                f"write {self.run_dir}"
            )
        return True

    def answers(self, timeout: float) -> bool:
        """Whether the agent answers a request within ``timeout`` seconds: its event loop
        runs, not merely its socket (a stopped agent's socket still takes connections)."""
        try:
            self.tier_status(timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        return True

    @staticmethod
    def log_path(job: str, run_dir: Path) -> Path:
        return run_dir / f"{job}.log"

    @classmethod
    def connect(
        cls,
        job: str,
        run_dir: Path,
        shm_dir: Path,
        spawn: bool = True,
        timeout: float = 60,
        extra: tuple[str, ...] = (),
    ) -> AgentClient:
        """The job's agent on this node; spawned detached (with ``extra`` arguments) if none
        answers and ``spawn``, waited for up to ``timeout`` (a starting Python on a node whose
        cores are all busy, a first import of torch from a cold disk, can take half a minute)."""
        private_dir(run_dir, "run_dir")
        client = cls(job, run_dir)
        client._shm_dir = shm_dir
        if client.listening() and client.answers(0.5):
            return client
        if not spawn:
            raise TierUnavailableError(
                f"no flashckpt agent answers on {client.socket}; start one with 'flashckpt-agent serve --job {job}'"
            )
        deadline = time.monotonic() + timeout
        spawned: subprocess.Popen | None = None
        spawned_at, spawns = -math.inf, 0
        while time.monotonic() < deadline:
            # One that holds the claim (starting, busy, or stopped) is waited for, not doubled;
            # one that died (its socket may stay) is replaced.
            pid = agent_pid(run_dir, job)
            exited = None if spawned is None else spawned.poll()
            if pid is None and exited is not None:
                if exited >= 0 or spawns >= 3:  # it refused to start: no point in another
                    client.close()
                    raise TierUnavailableError(client._exited(exited))
                spawned_at = -math.inf  # killed by a signal as it started: start another now
            if pid is None and time.monotonic() - spawned_at > 10:
                spawned = client._spawn(shm_dir, extra)
                spawned_at, spawns = time.monotonic(), spawns + 1
            if client.listening() and client.answers(0.5):
                if spawns:
                    log.info("started the flashckpt agent for job %s (log: %s)", job,
                             run_dir / f"{job}.log")  # fmt: skip
                return client
            time.sleep(0.1)
        client.close()
        raise TierUnavailableError(client._not_answering(timeout))

    def _spawn(self, shm_dir: Path, extra: tuple[str, ...]) -> subprocess.Popen:
        """Start the job's agent detached (with ``extra`` arguments), logging to its log."""
        job, run_dir = self.job, self.run_dir
        logfile = open_file(self.log_path(job, run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        cmd = [sys.executable, *agent_args(job, run_dir, shm_dir, extra)]
        try:
            # Its own session: the agent outlives this trainer, and torchrun's kill of the workers.
            return subprocess.Popen(
                cmd,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=logfile,
                close_fds=True,
            )
        finally:
            os.close(logfile)

    def _exited(self, code: int) -> str:
        """Why a spawned agent exited at start: the last line of its log."""
        log_path = self.run_dir / f"{self.job}.log"
        try:
            with open(log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else "(its log is empty)"
        return (f"the flashckpt agent for job {self.job} exited at start (exit code {code}): "
                f"{last}; see {log_path}")  # fmt: skip

    def _revive(self) -> None:
        """Start a new agent when the job's agent has been gone (it died; nothing holds its
        claim) for REVIVE_AFTER_S, which leaves a supervisor (the launcher, systemd) the first
        move; at most one start per REVIVE_AFTER_S. The new agent learns this rank from the
        next notice, and its tiers from the registration that notice asks for."""
        now = time.monotonic()
        if agent_pid(self.run_dir, self.job) is not None:  # a new one is starting
            self._gone_since = None
            return
        if self._gone_since is None:
            self._gone_since = now
        waited = now - max(self._gone_since, self._revived_at)
        if self._shm_dir is None or waited < REVIVE_AFTER_S:
            return
        self._revived_at = now
        log.warning("the node agent of job %s has been gone for %.0fs: starting a new one "
                    "(log: %s)", self.job, now - self._gone_since,
                    self.run_dir / f"{self.job}.log")  # fmt: skip
        self._spawn(self._shm_dir, ())

    def _not_answering(self, timeout: float) -> str:
        """Why no agent answered within ``timeout`` seconds, and what to do."""
        job, log_path = self.job, self.run_dir / f"{self.job}.log"
        pid = agent_pid(self.run_dir, job)
        if pid is None:
            return (
                f"the flashckpt agent for job {job} did not start within {timeout}s; see {log_path}"
            )
        state = parent_and_state(pid)[1]
        how = "it is stopped: continue it with 'kill -CONT {0}', or" if state == "T" else "or"
        return (
            f"the flashckpt agent for job {job} (pid {pid}, state {state or 'gone'}) holds this "
            f"node's claim but has not answered on {self.socket} for {timeout}s; "
            f"{how.format(pid)} kill it ('kill -9 {pid}') and a new one starts; see {log_path}"
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
        self._registration = req  # sent again to an agent that replaced this one
        try:
            return list(self.stub.RegisterTrainer(req, timeout=30).tiers)
        except grpc.RpcError as exc:
            raise TierUnavailableError(
                f"the flashckpt agent refused rank {rank}: {exc.details()}"
            ) from exc

    def notify(
        self, rank: int, step: int, final: bool = False, world_size: int = 0,
        local_world_size: int = 0, generation: int = 0,
    ) -> bool:  # fmt: skip
        """Tell the agent a snapshot is READY.

        A plain notice is fire and forget (the agent also polls), but its call is kept
        referenced until it completes: grpc cancels a call whose future is collected. A
        ``final`` notice (a closing trainer's last step, which must pass any throttle) waits
        for the answer; returns whether the agent has it. Agent death stops persistence,
        never training: errors are dropped.
        """
        req = self.pb.SnapshotReadyRequest(
            job=self.job, rank=rank, step=step, final=final, pid=os.getpid(),
            world_size=world_size, local_world_size=local_world_size, generation=generation,
        )  # fmt: skip
        if final:
            try:
                self._answered(self.stub.SnapshotReady(req, timeout=30))
                return True
            except grpc.RpcError as exc:
                log.warning("the agent did not take the final step %d: %s", step, exc.details())
                return False
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the agent polls anyway
            self._sender.submit(self._send, req)
        return True

    def _send(self, req: Any) -> None:
        self._inflight = [f for f in self._inflight if not f.done()]
        with contextlib.suppress(Exception):
            call = self.stub.SnapshotReady.future(req, timeout=5)
            call.add_done_callback(self._on_answer)
            self._inflight.append(call)

    def _on_answer(self, call: grpc.Future) -> None:
        """A notice's answer: register again if asked; start a new agent if none listens."""
        try:
            reply = call.result()
        except grpc.RpcError as exc:  # not answered: the next notice asks again
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    self._sender.submit(self._revive)
            return
        except Exception:
            return
        self._gone_since = None
        with contextlib.suppress(RuntimeError):
            self._sender.submit(self._answered, reply)

    def _answered(self, reply: Any) -> None:
        """Register again with an agent that asks: one started after this trainer registered
        (a replaced agent) knows the rank from its notices, but not the tiers it wants."""
        if not reply.register_again or self._registration is None:
            return
        try:
            self.stub.RegisterTrainer(self._registration, timeout=30)
            log.info("rank %d registered again with the job's new agent", self._registration.rank)
        except grpc.RpcError as exc:
            log.warning("the job's new agent refused rank %d: %s (its snapshots stay in shared "
                        "memory)", self._registration.rank, exc.details())  # fmt: skip

    def tier_status(self, timeout: float = 5) -> list:
        return list(
            self.stub.GetTierStatus(
                self.pb.GetTierStatusRequest(job=self.job), timeout=timeout
            ).tiers
        )

    def wait_persisted(
        self, rank: int, step: int, generation: int, timeout: float, **shape: int
    ) -> bool:
        """Tell the agent ``step`` is the rank's last (it goes out through any throttle), then
        wait up to ``timeout`` seconds until every tier committed it or is failing. True if
        every tier has it."""
        if not self.notify(rank, step, True, generation=generation, **shape):
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = self.tier_status()
            except Exception as exc:
                log.warning(
                    "the agent does not answer (%s); step %d stays in shared memory", exc, step
                )
                return False
            behind = [t for t in status
                      if (t.last_committed_generation, t.last_committed_step) < (generation, step)]  # fmt: skip
            if all(t.last_error for t in behind):  # every tier has it, or is failing
                for t in behind:
                    log.error("step %d is not persisted in %s: %s", step, t.url, t.last_error)
                return not behind
            time.sleep(0.05)
        log.warning("tiers still persisting step %d after %.0fs; the agent finishes and frees "
                    "the slots", step, timeout)  # fmt: skip
        return False

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self.channel.close()


def agent_args(job: str, run_dir: Path, shm_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The interpreter's arguments that run the job's agent on this node."""
    return ["-m", "flashckpt.agent.cli", "serve", "--job", job, "--shm-dir", str(shm_dir),
            "--run-dir", str(run_dir), "--exit-when-idle",
            str(config.setting_float("exit_when_idle", None, 30.0)), *extra]  # fmt: skip
