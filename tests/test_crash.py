"""A trainer SIGKILLed in the middle of save() leaves the previous step restorable, never a torn one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_python

from flashckpt.errors import CorruptSlotError
from flashckpt.format.slot import Slot, SlotState
from flashckpt.snapshot.slots import slot_path

SAVER = """
import sys, torch
from flashckpt import Checkpointer
ck = Checkpointer(job="crash")
a = torch.empty(24 * 2**20 // 4)          # 24 MiB per tensor: a save takes milliseconds
b = torch.empty(8 * 2**20 // 8, dtype=torch.float64)
ck.restore({"a": a, "b": b})
for step in range(1, 100000):
    a.fill_(step); b.fill_(-step)
    ck.save(step, {"a": a, "b": b, "step": step})
"""

CHECK = """
import torch
from flashckpt import Checkpointer
a = torch.zeros(24 * 2**20 // 4); b = torch.zeros(8 * 2**20 // 8, dtype=torch.float64)
state = {"a": a, "b": b, "step": None}
step = Checkpointer(job="crash").restore(state)
assert step is not None and state["step"] == step, (step, state["step"])
assert bool((a == step).all()) and bool((b == -step).all()), "torn snapshot restored"
print(step)
"""


def _kill_while_writing(shm_dir, min_step: int) -> int:
    """Start a saver, SIGKILL it while a slot is WRITING past ``min_step``; return that step."""
    proc = subprocess.Popen([sys.executable, "-c", SAVER], env=os.environ, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        slots: list[Slot] = []
        while time.monotonic() < deadline:
            try:
                if not slots and all(slot_path(shm_dir, "crash", 0, i).exists()
                                     for i in range(2)):  # fmt: skip
                    slots = [Slot.open_readonly(slot_path(shm_dir, "crash", 0, i))
                             for i in range(2)]  # fmt: skip
                hs = [s.header() for s in slots]
            except (CorruptSlotError, ValueError, OSError):  # made, not yet sized or written
                for s in slots:
                    s.close()
                slots = []
                time.sleep(0.05)
                continue
            if (
                any(h.state == SlotState.WRITING for h in hs)
                and max((h.step for h in hs), default=0) >= min_step
            ):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                newest = max(h.step for h in hs if h.state == SlotState.READY)
                for s in slots:
                    s.close()
                return newest
        raise AssertionError("the saver never reached the step")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("min_step", [3, 10, 25])
def test_sigkill_mid_save_restores_last_complete_step(shm_dir, min_step):
    newest_before_kill = _kill_while_writing(shm_dir, min_step)
    restored = int(run_python(CHECK).stdout.strip())
    # The slot being written is never readable; the other holds the last complete step.
    assert restored >= newest_before_kill >= min_step - 1


def test_shm_too_small_fails_at_start_with_the_size(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespaces here: {probe.stderr.decode().strip()}")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    code = (
        "import torch; from flashckpt import Checkpointer, SharedMemoryError\n"
        "try:\n"
        "    Checkpointer(job='small').restore({'w': torch.zeros(4 * 2**20)})\n"
        "except SharedMemoryError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=8m tmpfs "{mnt}" && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, env={**os.environ, "FLASHCKPT_SHM_DIR": str(mnt)}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert "cannot reserve 34.0 MiB of shared memory" in msg, msg
    assert "8.0 MiB free" in msg and "FLASHCKPT_SHM_DIR" in msg and "--shm-size" in msg
