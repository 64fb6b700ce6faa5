"""The launcher's watch over this node's agent: started if there is none, replaced if it died
or stopped answering.

An agent answers when a request reaches its event loop, not merely when its socket exists: a
killed agent leaves its socket behind, and a stopped or wedged one still holds the job's claim
(``<run_dir>/<job>.pid``), so no new agent could start in its place. One that holds the claim
without answering is given a while (it may be starting, or busy), then killed with SIGKILL and
replaced. Killing an agent loses nothing: snapshots stay in shared memory, a tier commits a step
only whole, and the next agent persists what is not committed yet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

from .agent_client import AgentClient, agent_pid
from .proc import parent_and_state

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
ANSWER_WITHIN_S = 2.0


class AgentKeeper:
    """Keeps the job's agent on this node up; ``check()`` is one look, ``run()`` looks every
    CHECK_EVERY_S seconds. An agent that holds the claim without answering is replaced once it
    has been stopped (SIGSTOP) for ``stopped_s`` or silent for ``silent_s`` seconds."""

    def __init__(self, job: str, run_dir: Path, shm_dir: Path, stopped_s: float = 2.0,
                 silent_s: float = 20.0):  # fmt: skip
        self.job, self.run_dir, self.shm_dir = job, run_dir, shm_dir
        self.stopped_s, self.silent_s = stopped_s, silent_s
        self._silent_since: float | None = None

    def check(self) -> str:
        """One look: "ok" (it answers), "waiting" (it holds the claim but has not answered
        for long), "started" (there was none) or "replaced" (it was killed for a new one)."""
        client = AgentClient(self.job, self.run_dir)
        try:
            if client.listening() and client.answers(ANSWER_WITHIN_S):
                self._silent_since = None
                return "ok"
        finally:
            client.close()
        pid = agent_pid(self.run_dir, self.job)
        done = "started"
        if pid is not None:
            now = time.monotonic()
            self._silent_since = self._silent_since or now
            state = parent_and_state(pid)[1]
            silent = now - self._silent_since
            if silent < (self.stopped_s if state == "T" else self.silent_s):
                return "waiting"
            log.warning(
                "the node agent of job %s (pid %d, %s) has not answered for %.0fs: killing it; "
                "a new one persists what is not committed yet", self.job, pid,
                "stopped" if state == "T" else f"state {state or 'gone'}", silent,
            )  # fmt: skip
            self._kill(pid)
            done = "replaced"
        self._silent_since = None
        AgentClient.connect(self.job, self.run_dir, self.shm_dir,
                            extra=("--while-pid", str(os.getpid()))).close()  # fmt: skip
        return done

    def run(self, halt: threading.Event) -> None:
        """Look until ``halt``; failures are warned and looked at again (training does not
        need the agent, only persistence does)."""
        while not halt.is_set():
            try:
                self.check()
            except Exception as exc:
                log.warning("the node agent of job %s cannot be started: %s", self.job, exc)
            halt.wait(CHECK_EVERY_S)

    def _kill(self, pid: int, wait_s: float = 5.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while agent_pid(self.run_dir, self.job) == pid and time.monotonic() < deadline:
            time.sleep(0.05)
