from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shm_dir(monkeypatch) -> Path:
    """A private shared-memory directory for this test, removed afterwards."""
    path = Path("/dev/shm") / f"flashckpt-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(path))
    monkeypatch.delenv("FLASHCKPT_JOB", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_python(
    code: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a new trainer process); fail loudly on error."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun(
    ranks: int, script, *args, env: dict, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``script`` under ``torch.distributed.run --standalone`` with ``ranks`` local ranks (gloo
    workers in new processes); fail with the end of its output unless it succeeds."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", str(script), *map(str, args)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture
def run_dir(monkeypatch, tmp_path) -> Path:
    """A private agent run directory; agents left running by the test are stopped after it."""
    path = Path(
        tempfile.mkdtemp(prefix="fc-run-", dir="/tmp")
    )  # short: unix socket paths are limited
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", str(path))
    yield path
    for pidfile in path.rglob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren...), from /proc."""
    from flashckpt.proc import parent_and_state

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(parent_and_state(int(entry))[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            out.append(kid)
            todo.append(kid)
    return out


def wait_for(predicate, timeout: float = 60, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


from s3fixture import s3_bucket, s3_server  # noqa: E402,F401  (real moto S3 server fixtures)
