"""Fault-tolerance demo: 2 ranks under flashckpt-run, a local directory tier, the agent auto-started.

    make demo        (or: python examples/demo.py)

1. the reference: 60 steps, undisturbed;
2. rank 1 is SIGKILLed after step 29; flashckpt-run restarts the workers, which restore the
   newest step every rank holds from shared memory;
3. rank 1 hangs (SIGSTOP) after step 19; the watchdog notices within its 3 s floor, logs its
   stacks, kills it, and the workers restart from shared memory;
4. rank 1 and its launcher are SIGKILLed after step 44 and the node's shared memory is lost
   with them; the job is started again and restores from the local directory the agent
   persisted to.

Every disturbed run must end with weights identical, bit for bit, to the reference.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashckpt import config
from flashckpt.faults.events import events_path

HERE = Path(__file__).resolve().parent


def launch(job: str, tmp: Path, **env: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "flashckpt.faults.launcher", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", str(HERE / "train.py")]  # fmt: skip
    full = {**os.environ, "FLASHCKPT_JOB": job, "DIGEST_FILE": str(tmp / job), "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "ERROR", "DEMO_TIERS": f"file://{tmp / 'ckpt'}?keep_last=3", **env}  # fmt: skip
    t0 = time.monotonic()
    # Its own process group: if the launcher is killed, the driver still reaps its workers.
    proc = subprocess.Popen(
        cmd,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = proc.communicate(timeout=600)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for line in out.splitlines():
        if line.startswith("[attempt") or "restored step" in line:
            print("   ", line.strip())
    print(f"    ({time.monotonic() - t0:.1f}s, exit code {proc.returncode})")
    return proc.returncode, out


def timeline_page(tag: int, jobs: list[str]) -> None:
    """``flashckpt report`` over the disturbed runs' event logs, and their timeline as a page."""
    run_dir = config.run_dir()
    logs = [str(events_path(run_dir, job)) for job in jobs]
    page = run_dir / f"demo-{tag}.report.html"
    print("5) the report of the three disturbed runs (flashckpt report ... --html)")
    out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "report", *logs, "--html", str(page)],
                         capture_output=True, text=True)  # fmt: skip
    for line in (out.stdout + out.stderr).splitlines():
        print("   ", line)
    if out.returncode == 0:
        print(f"timeline page: {page}")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="flashckpt-demo-"))
    shm = config.shm_dir()  # the trainers' own choice (a per-user one if the default is taken)
    tag = os.getpid()
    try:
        print("1) undisturbed run, 60 steps")
        launch(f"demo-ref-{tag}", tmp)
        print("2) rank 1 SIGKILLed after step 29; flashckpt-run restarts the workers")
        launch(f"demo-crash-{tag}", tmp, FAIL_AT_STEP="29")
        print("3) rank 1 hangs after step 19; the watchdog kills it (FLASHCKPT_HANG_FLOOR=3)")
        launch(f"demo-hang-{tag}", tmp, HANG_AT_STEP="19", FLASHCKPT_HANG_FLOOR="3")
        print("4) rank 1 and its launcher SIGKILLed after step 44; the node's shared memory lost")
        job = f"demo-node-{tag}"
        code, _ = launch(job, tmp, FAIL_AT_STEP="44", NODE_LOST="1")
        assert code != 0, "the run was meant to fail"
        time.sleep(2)  # the agent finishes persisting what the trainers left in memory
        shutil.rmtree(shm / job, ignore_errors=True)
        print("   shared memory wiped; starting the job again")
        launch(job, tmp, FAIL_AT_STEP="-1")
        ref = (tmp / f"demo-ref-{tag}").read_text()
        results = {
            name: (tmp / f"demo-{name}-{tag}").read_text() for name in ("crash", "hang", "node")
        }
        bad = [name for name, digest in results.items() if digest != ref]
        if bad:
            raise SystemExit(
                f"FAILED: the resumed runs {bad} ended with weights that differ from the reference"
            )
        print(
            "OK: every resumed run ends with weights identical bit for bit to the undisturbed run"
        )
        timeline_page(tag, [f"demo-{name}-{tag}" for name in ("crash", "hang", "node")])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
