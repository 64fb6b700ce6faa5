"""Fault-tolerance demo: train 2 ranks under torchrun, SIGKILL one mid-run, resume, compare.

    make demo        (or: python examples/demo.py)

Runs the same training twice: once undisturbed, once with rank 1 killed after step 29.
torchrun restarts the workers, every rank restores the newest step all ranks hold, and the
final weights must equal the undisturbed run's bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def torchrun(job: str, digest: Path, tiers: str, **env: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", str(HERE / "train.py")]  # fmt: skip
    full = {**os.environ, "FLASHCKPT_JOB": job, "DIGEST_FILE": str(digest), "DEMO_TIERS": tiers,
            "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", **env}  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("[attempt"):
            print("   ", line)
    if proc.returncode != 0:
        print(proc.stdout[-3000:])
        raise SystemExit(f"torchrun failed with exit code {proc.returncode}")
    return time.monotonic() - t0


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="flashckpt-demo-") as tmp:
        tmp_path = Path(tmp)
        tiers = os.environ.get("DEMO_TIERS", "")
        print("1) undisturbed run, 60 steps")
        t_ref = torchrun(f"demo-ref-{os.getpid()}", tmp_path / "ref", tiers)
        print("2) the same run, rank 1 SIGKILLed after step 29; torchrun restarts the workers")
        t_ft = torchrun(f"demo-ft-{os.getpid()}", tmp_path / "ft", tiers, FAIL_AT_STEP="29")
        ref, ft = (tmp_path / "ref").read_text(), (tmp_path / "ft").read_text()
        print(f"undisturbed {t_ref:.1f}s, with a crash and restart {t_ft:.1f}s")
        if ref != ft:
            raise SystemExit("FAILED: the resumed run's weights differ from the undisturbed run's")
        print(
            "OK: resumed from the snapshot of the crashed step; final weights identical bit for bit"
        )


if __name__ == "__main__":
    main()
