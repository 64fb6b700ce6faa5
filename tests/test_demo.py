"""The README's demo: a flashckpt-run job survives a SIGKILLed rank, a hung rank and a lost node
with bit-identical results."""

import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_resumes_bit_exact(shm_dir, run_dir):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting at step 30 (restored step 29)" in out.stdout
    assert "starting at step 20 (restored step 19)" in out.stdout  # the hung rank's run
    assert "from file://" in out.stdout  # the lost node's run came back from the disk tier
    assert "identical bit for bit to the undisturbed run" in out.stdout
