"""What the cases of the snapshot benchmark share: timing, the model, the bytes of a state,
the memcpy baseline, and for the two-rank cases their launch, interleaved rounds and report.

``python benchmarks/snapshot.py --case fsdp2|deepspeed`` comes here to re-launch itself on
two gloo ranks under ``torch.distributed.run``, with private FLASHCKPT_SHM_DIR,
FLASHCKPT_RUN_DIR and FLASHCKPT_JOB; when the ranks finish, the job's agent is stopped and
those directories and the files the ranks wrote are removed. Every rank times every method
once a round, the ranks starting each call together, with the background work a method
leaves (checksums, the agent persisting, DCP's writer thread, dirty pages) finished
untimed before the next call. Rank 0 prints each rank's medians and the median over rounds
of the slowest rank, which is what a job waits for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch before 2.4
    DTensor = None  # type: ignore[assignment,misc]

RANKS = 2


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def linear_stack(params_m: int, width: int) -> torch.nn.Sequential:
    """A model of square Linear layers with about ``params_m`` million parameters."""
    layers = max(1, round(params_m * 1e6 / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def local_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors ``value`` holds as this rank stores them (a DTensor's local shard), walking
    containers and anything with ``state_dict()``/``load_state_dict()`` through its state."""
    out, stack = [], [value]
    while stack:
        x = stack.pop()
        if DTensor is not None and isinstance(x, DTensor):
            out.append(x.to_local())
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif callable(getattr(x, "state_dict", None)) and hasattr(x, "load_state_dict"):
            stack.append(x.state_dict())
    return out


def size_of(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


class Memcpy:
    """The baseline: the same tensors copied one after another into memory allocated and
    faulted in beforehand, as a snapshot's slots are."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = [t.detach() for t in tensors]
        self.nbytes = size_of(self.tensors)
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8).fill_(0)

    def __call__(self, _round: int = 0) -> None:
        at = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.buf[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
            at += n


# ---- two ranks --------------------------------------------------------------------------
def launch(script: str, argv: list[str], parent: str | None, env: dict[str, str]) -> int:
    """Run ``script argv --work-dir W`` on RANKS local gloo ranks with private flashckpt
    settings; stop the job's agent and remove everything the run made. The exit status."""
    tag = uuid.uuid4().hex[:8]
    shm = Path("/dev/shm") / f"flashckpt-bench-{tag}"
    run = Path(tempfile.mkdtemp(prefix="fc-run-", dir="/tmp"))  # short: a unix socket's path
    work = Path(tempfile.mkdtemp(prefix="flashckpt-bench-", dir=parent))
    env = {
        **os.environ,
        **env,
        "FLASHCKPT_SHM_DIR": str(shm),
        "FLASHCKPT_RUN_DIR": str(run),
        "FLASHCKPT_JOB": f"bench-{tag}",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={RANKS}", script, *argv, "--work-dir", str(work)]  # fmt: skip
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        stop_agents(run)
        for path in (shm, run, work):
            shutil.rmtree(path, ignore_errors=True)


def stop_agents(run_dir: Path, grace: float = 10.0) -> None:
    """Stop the agents this run's ranks spawned (their pids are in the private run dir)."""
    for pidfile in run_dir.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                os.kill(pid, 0)  # ProcessLookupError once it is gone
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)


@dataclass
class Method:
    """One way of saving a rank's state. ``run(round)`` is timed; ``after(round)`` is not:
    it waits for what the call left running and removes what it wrote. ``nbytes``: what
    this rank's call saves (``after`` may set it once the files are written). A method
    without ``run`` is a part of another, timed by the case itself."""

    key: str
    label: str
    run: Callable[[int], object] | None
    after: Callable[[int], object] | None = None
    nbytes: int = 0


def rounds(methods: list[Method], n: int) -> dict[str, list[float]]:
    """Time every method once a round for a warm-up round (not counted) and ``n`` more,
    the first method moving on by one each round; every rank starts each call together."""
    import torch.distributed as dist

    timed_here = [m for m in methods if m.run is not None]
    times: dict[str, list[float]] = {m.key: [] for m in timed_here}
    for i in range(n + 1):
        k = i % len(timed_here)
        for m in timed_here[k:] + timed_here[:k]:
            dist.barrier()
            t = timed(lambda m=m, i=i: m.run(i))  # type: ignore[misc]
            if m.after is not None:
                m.after(i)
            os.sync()  # this call's dirty pages are written back before the next call
            if i:
                times[m.key].append(t)
    return times


def remove_together(path: str | Path) -> None:
    """Remove ``path`` (on rank 0) once every rank is done with it."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def report(case: str, note: str, methods: list[Method], times: dict[str, list[float]],
           ratios: list[tuple[str, str, str]]) -> None:  # fmt: skip
    """On rank 0, print each rank's medians, the slowest rank's, and the RESULT line:
    ``ratios`` are (name, numerator key, denominator key) of the slowest rank's medians."""
    import torch.distributed as dist

    mine = {"times": times, "bytes": {m.key: m.nbytes for m in methods}}
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return
    n = len(times[methods[0].key])
    slowest = {
        m.key: [max(r["times"][m.key][i] for r in gathered) for i in range(n)] for m in methods
    }
    job = {k: statistics.median(v) for k, v in slowest.items()}
    base = job[methods[0].key]
    print(f"case {case}: {len(gathered)} ranks, gloo on CPU, {torch.get_num_threads()} threads a "
          f"rank, torch {torch.__version__}; {note}")  # fmt: skip
    cols = "".join(f"{f'rank {r} ms':>11} {'GB/s':>6}" for r in range(len(gathered)))
    print(f"{f'blocking part, median of {n}':<46}{cols} {'slowest ms':>11} {'vs memcpy':>9}")
    for m in methods:
        cells = ""
        for r in gathered:
            t = statistics.median(r["times"][m.key])
            cells += f"{t * 1e3:11.1f} {r['bytes'][m.key] / t / 1e9:6.2f}"
        print(f"{m.label:<46}{cells} {job[m.key] * 1e3:11.1f} {base / job[m.key]:9.2f}")
    for m in methods:
        print(f"  {m.key} rounds, slowest rank, ms: "
              + " ".join(f"{t * 1e3:.0f}" for t in slowest[m.key]))  # fmt: skip
    for name, a, b in ratios:
        each = [
            statistics.median(r["times"][a]) / statistics.median(r["times"][b]) for r in gathered
        ]
        print(f"  {name}, each rank's medians: " + " ".join(f"{x:.2f}" for x in each))
    print("  MB saved a rank: " + ", ".join(
        f"{m.key} " + "/".join(f"{r['bytes'][m.key] / 1e6:.0f}" for r in gathered) for m in methods
    ))  # fmt: skip
    mb = "/".join(f"{r['bytes'][methods[0].key] / 1e6:.0f}" for r in gathered)
    print(f"RESULT case={case} MB_per_rank={mb} "
          + " ".join(f"{name}={job[a] / job[b]:.2f}" for name, a, b in ratios))  # fmt: skip
