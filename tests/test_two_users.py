"""Two users on one node: ``nobody`` prepares the shared-memory and run directories (or files
in them) as symlinks to files root owns, then a root trainer and its agent run.

The victims must come out unchanged: the default paths are replaced by private per-user ones,
explicit paths are refused with a clear error. Most cases use directories under a private
world-writable parent (like /tmp) with the defaults pointed there; one runs against the real
default paths when they are free, and removes everything it made.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import run_python

try:
    NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
    NOBODY = None

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None, reason="needs root and a user named nobody"
)
JOB = "victimjob"


def as_nobody(script: str) -> None:
    """Run shell commands as ``nobody`` (no supplementary groups)."""
    subprocess.run(
        ["sh", "-ec", script], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def plant(shm: Path, run: Path, victims: dict[str, Path]) -> None:
    """``nobody`` makes ``shm`` and ``run`` with every file flashckpt would use in them as a
    symlink to a victim."""
    as_nobody(
        f"mkdir -p '{shm}/{JOB}' '{run}'\n"
        f"ln -s '{victims['slot']}' '{shm}/{JOB}/rank-0.slot-0'\n"
        f"ln -s '{victims['owner']}' '{shm}/{JOB}/rank-0.owner'\n"
        f"ln -s '{victims['pid']}' '{run}/{JOB}.pid'\n"
        f"ln -s '{victims['log']}' '{run}/{JOB}.log'\n"
    )


@pytest.fixture
def victims(tmp_path: Path) -> dict[str, Path]:
    """Root-owned files in a directory only root can enter."""
    out = {}
    for name in ("slot", "owner", "pid", "log"):
        out[name] = tmp_path / "root-only" / f"{name}.victim"
        out[name].parent.mkdir(mode=0o700, exist_ok=True)
        out[name].write_bytes(f"root's {name}\n".encode())
    return out


def untouched(victims: dict[str, Path]) -> bool:
    return all(p.read_bytes() == f"root's {n}\n".encode() for n, p in victims.items())


@pytest.fixture
def public() -> Path:
    """A private stand-in for /tmp or /dev/shm: root-owned, mode 1777."""
    path = Path(tempfile.mkdtemp(prefix="fc-pub-", dir="/dev/shm"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


TRAINER = """
import os, torch
from flashckpt import Checkpointer, ConfigError, config
if os.environ.get("DEFAULT_BASE"):
    config.DEFAULT_SHM_DIR = os.environ["DEFAULT_BASE"] + "/flashckpt"
    config.DEFAULT_RUN_DIR = os.environ["DEFAULT_BASE"] + "/flashckpt-run"
tier = os.environ["TIER"]
try:
    with Checkpointer(tier, job=os.environ["JOB"]) as ck:
        ck.save(3, {"t": torch.arange(8.0)})
        ck.wait(3, tier=tier, timeout=60)
        print("USED", ck.shm_dir, ck.run_dir)
except ConfigError as exc:
    print("REFUSED", exc)
"""


def trainer(env: dict[str, str]) -> str:
    clean = {
        "FLASHCKPT_SHM_DIR": "",
        "FLASHCKPT_RUN_DIR": "",
        "DEFAULT_BASE": "",
        "JOB": JOB,
        **env,
    }
    return run_python(TRAINER, env=clean).stdout


def stop_agents(run_dir: Path) -> None:
    for pidfile in run_dir.glob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, OSError):
            os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)


def test_taken_default_paths_fall_back_to_private_ones(public, victims, tmp_path):
    plant(public / "flashckpt", public / "flashckpt-run", victims)
    out = trainer({"DEFAULT_BASE": str(public), "TIER": f"file://{tmp_path / 'tier'}"})
    try:
        assert f"USED {public}/flashckpt-0 {public}/flashckpt-run-0" in out, out
        assert (tmp_path / "tier" / JOB).is_dir()  # the agent persisted from the private dir
        assert untouched(victims)
    finally:
        stop_agents(public / "flashckpt-run-0")


def test_both_default_and_per_user_paths_taken_is_a_clear_error(public, victims, tmp_path):
    plant(public / "flashckpt", public / "flashckpt-run", victims)
    plant(public / "flashckpt-0", public / "flashckpt-run-0", victims)
    out = trainer({"DEFAULT_BASE": str(public), "TIER": f"file://{tmp_path / 'tier'}"})
    assert "REFUSED neither the default shm_dir" in out and "set FLASHCKPT_SHM_DIR" in out, out
    assert "owned by nobody (uid 65534)" in out
    assert untouched(victims)


@pytest.mark.parametrize("which", ["FLASHCKPT_SHM_DIR", "FLASHCKPT_RUN_DIR"])
def test_explicit_paths_of_another_user_are_refused(public, victims, tmp_path, which):
    plant(public / "shm", public / "run", victims)
    env = {"FLASHCKPT_SHM_DIR": str(tmp_path / "shm"), "FLASHCKPT_RUN_DIR": str(tmp_path / "run")}
    env[which] = str(public / which.split("_")[1].lower())
    out = trainer({**env, "TIER": f"file://{tmp_path / 'tier'}"})
    assert f"REFUSED {which} '{env[which]}' cannot be used: it is owned by nobody" in out, out
    assert "another user may have" in out
    assert untouched(victims)


def test_a_job_directory_planted_in_a_shared_shm_dir_is_refused(public, victims, tmp_path):
    """FLASHCKPT_SHM_DIR may be a sticky shared tmpfs (like /dev/shm itself); the job's own
    directory inside it must still be ours."""
    plant(public, public / "run", victims)
    try:
        out = trainer(
            {"FLASHCKPT_SHM_DIR": str(public), "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
             "TIER": f"file://{tmp_path / 'tier'}"}
        )  # fmt: skip
    finally:
        stop_agents(tmp_path / "run")
    assert f"REFUSED the directory of job '{JOB}' in the shm dir '{public}/{JOB}'" in out, out
    assert "it is owned by nobody" in out
    assert untouched(victims)


def test_the_real_default_paths(victims, tmp_path):
    uid = os.geteuid()
    made = [Path("/dev/shm/flashckpt"), Path("/tmp/flashckpt-run")]
    fallbacks = [Path(f"{p}-{uid}") for p in made]
    if any(os.path.lexists(p) for p in made + fallbacks):
        pytest.skip("the default paths are in use on this node")
    try:
        plant(made[0], made[1], victims)
        out = trainer({"TIER": f"file://{tmp_path / 'tier'}"})
        assert f"USED {fallbacks[0]} {fallbacks[1]}" in out, out
        assert untouched(victims)
    finally:
        if fallbacks[1].exists():
            stop_agents(fallbacks[1])
        for path in made + fallbacks:
            shutil.rmtree(path, ignore_errors=True)
