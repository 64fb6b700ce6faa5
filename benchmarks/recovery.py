"""Recovery time: from a fault to training resumed, on two simulated nodes of this machine.

    python benchmarks/recovery.py [--rounds 3] [--hang-floor 3] [--baseline-timeout 60]

Each node is one ``flashckpt-run`` (two gloo ranks of ``examples/train.py``, its own shared
memory and run directory) joined by a c10d rendezvous on 127.0.0.1, as two hosts would be.
Cases, each run ``--rounds`` times:

- kill: rank 1 SIGKILLs itself after step 20;
- hang: rank 3 SIGSTOPs itself after step 20 (``FLASHCKPT_HANG_FLOOR`` = ``--hang-floor``);

and, in the same run, the baseline: the kill case under plain ``torchrun`` with the same
arguments, given ``--baseline-timeout`` seconds to finish.

The split comes from the launchers' event logs (``flashckpt report``): detect, from the
failed rank's last heartbeat to its detection; restart, from there to the restore starting;
restore, the slowest rank's; steps lost, recomputed after the restore. Medians are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(
    launcher: str, tmp: Path, timeout: float, **env: str
) -> tuple[list[int], float, list[Path]]:
    """Run the job on two simulated nodes; (exit codes, seconds, the nodes' event logs)."""
    port, job = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
    procs, runs, shms = [], [], []
    token, controller = uuid.uuid4().hex, f"127.0.0.1:{free_port()}"
    for node in range(2):
        run_dir, shm = tmp / f"{job}-run{node}", Path("/dev/shm") / f"flashckpt-bench-{job}-{node}"
        runs.append(run_dir)
        shms.append(shm)
        full = {**os.environ, "FLASHCKPT_SHM_DIR": str(shm), "FLASHCKPT_RUN_DIR": str(run_dir),
                "FLASHCKPT_NODE": f"node{node}", "FLASHCKPT_CONTROLLER_TOKEN": token, "FLASHCKPT_CONTROLLER": controller,
                "OMP_NUM_THREADS": "1", "STEPS": "40", **env}  # fmt: skip
        full.pop("FLASHCKPT_JOB", None)
        cmd = [str(BIN / launcher), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", "--max-restarts=3",
               "--monitor-interval=0.1", str(TRAIN)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=full, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        if node == 0:
            time.sleep(1.0)  # node 0 hosts the rendezvous store and the controller
    began, codes = time.monotonic(), []
    try:
        for p in procs:
            try:
                codes.append(p.wait(max(1.0, timeout - (time.monotonic() - began))))
            except subprocess.TimeoutExpired:
                codes.append(-999)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _kill_leftovers(shms)
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)
    return codes, time.monotonic() - began, [r / f"{job}.events.jsonl" for r in runs]


def _kill_leftovers(shms: list[Path]) -> None:
    """Workers run in their own sessions: end any that used these shared-memory dirs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if any(f"FLASHCKPT_SHM_DIR={s}".encode() in env for s in shms):
                os.kill(int(pid), signal.SIGKILL)


def measure(case: str, tmp: Path, hang_floor: float) -> dict:
    from flashckpt.events import read_events
    from flashckpt.report import summarize

    fault = {"kill": {"FAIL_AT_STEP": "20", "FAIL_RANK": "1"},
             "hang": {"HANG_AT_STEP": "20", "FAIL_RANK": "3",
                      "FLASHCKPT_HANG_FLOOR": str(hang_floor)}}[case]  # fmt: skip
    codes, _, logs = two_nodes("flashckpt-run", tmp, 240, **fault)
    if codes != [0, 0]:
        raise SystemExit(f"{case}: the job did not finish (exit codes {codes}); logs in {tmp}")
    events = [e for log in logs if log.exists() for e in read_events(log)]
    report = summarize(events)
    if not report.failures or report.failures[0].restore_s is None:
        raise SystemExit(f"{case}: no failure and restore in the event logs {logs}")
    f = report.failures[0]
    return {"detect": f.detect_s, "restart": f.restart_s, "restore": f.restore_s,
            "resumed": f.detect_s + f.restart_s + f.restore_s,
            "steps_lost": f.recomputed_steps()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hang-floor", type=float, default=3.0)
    p.add_argument("--baseline-timeout", type=float, default=60.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fc-recovery-"))
    try:
        rows = {case: [measure(case, tmp, args.hang_floor) for _ in range(args.rounds)]
                for case in ("kill", "hang")}  # fmt: skip
        codes, took, _ = two_nodes("torchrun", tmp, args.baseline_timeout, FAIL_AT_STEP="20",
                                   FAIL_RANK="1")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"fault -> training resumed, 2 nodes x 2 gloo ranks, median of {args.rounds} (seconds)")
    print(f"{'case':<6}{'resumed':>9}{'detect':>8}{'restart':>9}{'restore':>9}{'steps lost':>12}")
    for case, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{case:<6}{med['resumed']:>9.1f}{med['detect']:>8.1f}{med['restart']:>9.1f}"
              f"{med['restore']:>9.2f}{med['steps_lost']:>12.0f}")  # fmt: skip
    if codes == [0, 0]:
        print(f"baseline torchrun, kill case: finished in {took:.1f}s (whole job)")
    else:
        print(f"baseline torchrun, kill case: not finished after {took:.0f}s (exit codes {codes})")


if __name__ == "__main__":
    main()
