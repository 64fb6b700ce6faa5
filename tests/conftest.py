from __future__ import annotations

import contextlib
import importlib.util
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


def requires(module: str, install: str) -> pytest.MarkDecorator:
    """Skip where ``module`` is not installed (a GPU image, say), saying what to install.
    CI installs every extra: there nothing skips."""
    try:
        missing = importlib.util.find_spec(module) is None
    except ImportError:  # a parent package is missing
        missing = True
    return pytest.mark.skipif(missing, reason=f"needs {module}: pip install {install}")


METRICS = requires("prometheus_client", "'flashckpt[metrics]'")
S3 = requires("s3fs", "'flashckpt[s3]'")
SAFETENSORS = requires("safetensors", "'flashckpt[export]'")


def run_python(
    code: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a new trainer process); fail loudly on error. It
    runs in the tests folder: from the repository root, the in-tree ``flashckpt/`` would
    shadow an installed (not editable) package."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
        timeout=timeout, cwd=ROOT / "tests",
    )  # fmt: skip
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
    from flashckpt.faults.proc import parent_and_state

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


# Real S3 for the tests: moto's server (tests/s3fixture.py). Where moto or s3fs is not
# installed (a GPU image, say), the tests that need it skip, saying what to install.
try:
    import s3fs  # noqa: F401
    from s3fixture import s3_bucket, s3_server  # noqa: F401
except ImportError as _missing:
    _S3_MISSING = (
        f"needs a real S3 endpoint ({_missing.name} is not installed): pip install "
        "'moto[server]' s3fs, or pip install -e '.[dev]'"
    )

    @pytest.fixture(scope="session")
    def s3_server():
        pytest.skip(_S3_MISSING)

    @pytest.fixture
    def s3_bucket():
        pytest.skip(_S3_MISSING)


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Makes in-process clusters for peer-replica tests: ``nodes(["node0", "node1"], job=)``
    (a real controller and a replica store per node; see ``peer_cluster.Nodes``)."""
    from peer_cluster import Nodes

    made = []

    def make(names: list[str], job: str = "pj") -> Nodes:
        n = Nodes(tmp_path, monkeypatch, job, names)
        n.serve()
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> str:
    """The weights' digest of the two-node launcher job run undisturbed (once per test run:
    every module of multi-node runs compares with it)."""
    from test_launcher import explain, run_job

    def make() -> str:
        run = run_job(tmp_path_factory.mktemp("ref"), "ref")
        assert run.codes == [0, 0] and run.digest, explain(run)
        return run.digest

    return once_per_run("ref", make)


@pytest.fixture(scope="session")
def reference3(tmp_path_factory) -> str:
    """The same for three nodes."""
    from test_launcher import explain, run_job

    def make() -> str:
        run = run_job(tmp_path_factory.mktemp("ref3"), "ref3", nodes=3, node_env=({}, {}, {}))
        assert run.codes == [0, 0, 0] and run.digest, explain(run)
        return run.digest

    return once_per_run("ref3", make)


def once_per_run(name: str, make) -> str:
    """``make()``'s text, made once for every test process of this code (the test workers
    of one phase and the processes of the next share it): kept in ``.pytest_cache`` under a
    key of the trainers' and the harness's source and torch's version, one maker at a time."""
    import fcntl
    import hashlib

    sources = ("ft_trainer.py", "inprocess_trainer.py", "test_launcher.py", "conftest.py")
    key = hashlib.sha256(torch.__version__.encode())
    for source in sources:
        key.update((ROOT / "tests" / source).read_bytes())
    where = ROOT / ".pytest_cache" / "flashckpt-references"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}-{key.hexdigest()[:16]}"
    with open(where / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and (text := path.read_text()):
            return text
        text = make()
        path.write_text(text)
        return text


def in_forked_child(fn, timeout: float = 60) -> bool:
    """Whether ``fn()`` returned true in a forked child of this process, which must finish
    within ``timeout`` seconds (killed, and an AssertionError, where it hangs). The child
    leaves with ``os._exit``: no torch op belongs in ``fn`` (libgomp's hang in a child whose
    parent's OpenMP team has run)."""
    import select

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = 0
        try:
            ok = int(bool(fn()))
        finally:
            os.write(write, bytes([ok]))
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        assert ready, "the forked child hung"
        return os.read(read, 1) == b"\x01"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
