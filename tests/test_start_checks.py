"""What a job refuses at start, with what to do, instead of failing in the middle of a save: a
tier directory this user cannot write, and an open-file limit too low for the node."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from flashckpt import Checkpointer
from flashckpt.errors import ConfigError

LAUNCHER = Path(sys.executable).parent / "flashckpt-run"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot create files in: a read-only mount where it runs as
    root (root ignores modes), else mode 0500."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                              capture_output=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
        yield path
        subprocess.run(["umount", str(path)], check=False)
    else:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)


@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_a_tier_directory_that_cannot_be_written_is_refused_when_the_checkpointer_is_made(
    read_only_dir, shm_dir, run_dir, scheme
):
    with pytest.raises(ConfigError, match=r"cannot be written: .*(read-only mount)") as err:
        Checkpointer(f"{scheme}://{read_only_dir}/ckpt", job="ro", rank=0)
    assert str(read_only_dir) in str(err.value) and "read-write" in str(err.value)


def test_the_launcher_refuses_an_open_file_limit_too_low_for_its_node(tmp_path):
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    env = {**os.environ, "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
           "FLASHCKPT_SHM_DIR": str(tmp_path / "shm")}  # fmt: skip
    done = subprocess.run(
        [str(LAUNCHER), "--standalone", "--nproc-per-node=4", "-m", "this"], env=env,
        capture_output=True, text=True, timeout=60, preexec_fn=low_limit,
    )  # fmt: skip
    assert done.returncode != 0
    assert "open-file limit is 200" in done.stderr and "ulimit -n 384" in done.stderr, done.stderr
