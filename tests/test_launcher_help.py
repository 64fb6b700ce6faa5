"""``flashckpt-run --help``: its own flag and settings first, then torchrun's options; a
``--help`` after the training script is the script's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flashckpt.faults.launcher_help import wants_help

LAUNCHER = Path(sys.executable).parent / "flashckpt-run"


def test_the_help_names_the_launchers_own_flag_and_settings_then_torchruns():
    out = subprocess.run([str(LAUNCHER), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ours, _, theirs = out.stdout.partition("torchrun's options:")
    for name in ("--spare", "FLASHCKPT_RESTART_POLICY", "FLASHCKPT_CONTROLLER",
                 "FLASHCKPT_NODE_TIMEOUT", "FLASHCKPT_HANG_FLOOR", "docs/CONFIG.md"):  # fmt: skip
        assert name in ours, name
    assert "--nnodes" in theirs and "--rdzv-backend" in theirs


def test_a_help_flag_after_the_training_script_is_the_scripts():
    assert wants_help(["--help"]) and wants_help(["-h", "--nnodes=2", "train.py"])
    assert wants_help(["--nnodes", "2", "--help", "train.py"])
    assert not wants_help(["--nnodes=2", "train.py", "--help"])
    assert not wants_help(["train.py", "--lr", "0.1"])
