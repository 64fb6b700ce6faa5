"""The recovery store's descriptors: the limit raised at start, a job it cannot take refused."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

from flashckpt.faults.descriptors import LAUNCHER_CLIENTS, store_capacity


def _limit(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_limit():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
    code = ("import resource; from flashckpt.faults.descriptors import raise_soft_limit; "
            "print(raise_soft_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, preexec_fn=_limit(hard // 2, hard))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(hard)] * 3


def test_the_launcher_refuses_a_job_its_recovery_store_cannot_take(shm_dir, tmp_path):
    # Enough descriptors for this node's own workers (the node check passes), not for the
    # store's clients across 40 nodes: only the launcher that serves the store knows that.
    nodes, per_node, limit = 40, 2, 512
    clients = nodes * (per_node + LAUNCHER_CLIENTS)
    assert store_capacity(limit) < clients
    script = tmp_path / "never.py"
    script.write_text("print('worker started')\n")
    launcher = Path(sys.executable).parent / "flashckpt-run"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
           "FLASHCKPT_RESTART_POLICY": "in-process", "FLASHCKPT_CONTROLLER_TOKEN": "a" * 32}  # fmt: skip
    proc = subprocess.run([str(launcher), f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                           "--rdzv-id=wide", str(script)],
                          env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit(limit, limit))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"flashckpt-run: the recovery store needs {clients} clients" in proc.stderr, proc.stderr
    assert f"open-file limit ({limit}, the hard limit) takes {store_capacity(limit)}" in proc.stderr
    assert "ulimit -n" in proc.stderr
    assert "worker started" not in proc.stdout + proc.stderr
