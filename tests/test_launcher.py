"""``flashckpt-run`` across two simulated nodes on this machine: a killed rank and a hung rank
are brought back, every rank at the same step, and the job ends bit-identical to an
undisturbed run.

Each node is its own launcher process with its own shared-memory and run directories, joined
by a real c10d rendezvous on 127.0.0.1; the workers are real gloo DDP processes that call a
plain ``init_process_group()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

from flashckpt.events import events_path, read_events

TRAINER = ROOT / "tests" / "ft_trainer.py"
LAUNCHER = Path(sys.executable).parent / "flashckpt-run"
NODES, PER_NODE = 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    codes: list[int]
    logs: list[str]
    events: list[list[dict]]
    digest: str | None

    def restored(self) -> list[tuple[int, str]]:
        """(rank, step) of every ``restored`` line, in order, over both nodes."""
        out = []
        for text in self.logs:
            for line in text.splitlines():
                parts = line.split()
                if len(parts) >= 3 and parts[-3].endswith("restored"):
                    out.append((int(parts[-2]), parts[-1]))
        return out


def run_job(tmp: Path, name: str, timeout: float = 240, node_env: tuple[dict, ...] = ({}, {}),
            **env: str) -> Run:  # fmt: skip
    """Two flashckpt-run "nodes" of two workers each (``node_env``: each node's own
    variables); waits for both to exit."""
    port, rdzv = free_port(), f"{name}-{uuid.uuid4().hex[:8]}"
    marks = tmp / f"{name}-marks"
    marks.mkdir()
    procs, dirs = [], []
    for node in range(NODES):
        shm = Path("/dev/shm") / f"flashckpt-test-{rdzv}-n{node}"
        run_dir = tmp / f"{name}-run{node}"
        dirs.append((shm, run_dir))
        full = {**os.environ, "FLASHCKPT_SHM_DIR": str(shm), "FLASHCKPT_RUN_DIR": str(run_dir),
                "FT_MARKS": str(marks), "FT_DIGEST": str(tmp / f"{name}.digest"),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env, **node_env[node]}  # fmt: skip
        full.pop("FLASHCKPT_JOB", None)
        cmd = [str(LAUNCHER), f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv}",
               "--max-restarts=3", "--monitor-interval=0.1", str(TRAINER)]  # fmt: skip
        log = open(tmp / f"{name}-node{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=ROOT), log))  # fmt: skip
    codes = []
    try:
        for proc, _ in procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                codes.append(-999)
    finally:
        for proc, log in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
        for shm, _ in dirs:
            shutil.rmtree(shm, ignore_errors=True)
    logs = [(tmp / f"{name}-node{n}.log").read_text() for n in range(NODES)]
    events = []
    for _, run_dir in dirs:
        path = events_path(run_dir, rdzv)
        events.append(read_events(path) if path.exists() else [])
    digest_file = tmp / f"{name}.digest"
    return Run(codes, logs, events, digest_file.read_text() if digest_file.exists() else None)


def explain(run: Run) -> str:
    return "\n".join(f"--- node {n} (exit {c}) ---\n{text[-4000:]}"
                     for n, (c, text) in enumerate(zip(run.codes, run.logs, strict=True)))  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    run = run_job(tmp_path_factory.mktemp("ref"), "ref")
    assert run.codes == [0, 0] and run.digest, explain(run)
    return run.digest


@pytest.mark.slow
def test_a_killed_rank_restarts_every_node_at_the_step_after_the_last_saved(tmp_path, reference):
    run = run_job(tmp_path, "kill", FT_FAULT="kill", FT_RANK="1", FT_STEP="12")
    assert run.codes == [0, 0], explain(run)
    resumed = [(r, s) for r, s in run.restored() if s != "None"]
    assert sorted(r for r, _ in resumed) == list(range(NODES * PER_NODE)), explain(run)
    assert {s for _, s in resumed} == {"12"}, explain(run)
    assert run.digest == reference
    exited = [e for e in run.events[0] if e["kind"] == "worker_exited" and e["rank"] == 1]
    assert exited, run.events[0]


@pytest.mark.slow
def test_a_hung_rank_is_detected_within_its_floor_and_the_job_resumes(tmp_path, reference):
    # Node 0's ranks wait in the collective for rank 3 and go silent with it; a higher floor
    # there lets node 1 act first, so the stopped rank's stacks are taken before the restart
    # it causes reaches node 0 (the other order: README, hang detection).
    run = run_job(tmp_path, "hang", FT_FAULT="stop", FT_RANK="3", FT_STEP="10",
                  node_env=({"FLASHCKPT_HANG_FLOOR": "8"}, {"FLASHCKPT_HANG_FLOOR": "3"}))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    hangs = [e for e in run.events[1] if e["kind"] == "hang_detected" and e["rank"] == 3]
    assert hangs, run.events[1]
    assert 3 <= hangs[0]["silent_s"] <= 3 + 2 and hangs[0]["timeout_s"] == 3
    assert hangs[0]["process_state"] == "T"  # the stopped one is told apart in the log
    stacks = [e for e in run.events[1] if e["kind"] == "stacks" and e["rank"] == 3]
    assert stacks and "ft_trainer.py" in stacks[0]["stacks"], stacks
    resumed = {s for _, s in run.restored() if s != "None"}
    assert len(resumed) == 1 and int(next(iter(resumed))) >= 10, explain(run)
    assert run.digest == reference
