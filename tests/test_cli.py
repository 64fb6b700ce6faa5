"""The flashckpt CLI: list what memory and tiers hold, verify a committed step."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from flashckpt import Checkpointer
from flashckpt.format import layout


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", *args],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=120,
    )


def test_list_and_verify_catch_a_corrupt_chunk(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    ck = Checkpointer(url, job="clijob")
    ck.save(2, {"t": torch.arange(300_000, dtype=torch.float32)})
    ck.wait(2, tier=url, timeout=60)
    listed = cli("list", "--job", "clijob", "--tier", url)
    assert listed.returncode == 0, listed.stderr
    assert "rank 0 slot" in listed.stdout and "READY step 2" in listed.stdout
    assert "step 2: ranks [0] of 1 committed" in listed.stdout
    ok = cli("verify", "--job", "clijob", "--tier", url)
    assert ok.returncode == 0 and "step 2 rank 0: 1 entries, 1 chunks OK" in ok.stdout
    data = tmp_path / "nvme" / layout.data_key("clijob", 2, 0)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 1
    data.write_bytes(bytes(raw))
    bad = cli("verify", "--job", "clijob", "--tier", url, "--step", "2")
    assert bad.returncode == 1 and "crc32c" in bad.stderr and "'t'" in bad.stderr
    missing = cli("verify", "--job", "clijob", "--tier", url, "--step", "9")
    # A step that is not there is a problem found (1); 2 is for a wrong command line.
    assert missing.returncode == 1 and "step 9 is not committed" in missing.stderr
    ck.close()
