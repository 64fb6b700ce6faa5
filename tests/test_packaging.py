"""The package as users install it: a wheel built from this tree, installed into a fresh
environment, holds every module of the tree and answers at every documented door."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

# Folders installed under the one import root (pyproject's package-dir mapping).
INSTALLED = {"flashckpt": "flashckpt", "agent": "flashckpt/agent",
             "storage_tiers": "flashckpt/storage_tiers", "proto": "flashckpt/proto"}  # fmt: skip

DOORS = r"""
import importlib, importlib.metadata as md, json, sys
import flashckpt
from flashckpt import Checkpointer, RNG, load, run_recoverable
for name in flashckpt.__all__:
    getattr(flashckpt, name)
import flashckpt.accelerate, flashckpt.deepspeed, flashckpt.megatron, flashckpt.cli, flashckpt.agent.cli
assert callable(flashckpt.accelerate.attach) and callable(flashckpt.deepspeed.attach)
assert callable(flashckpt.megatron.state)
for module in ("flashckpt.faults.launcher", "flashckpt.faults.standby", "flashckpt.cli"):
    assert importlib.util.find_spec(module), module
scripts = {e.name: e.value for e in md.entry_points(group="console_scripts")
           if e.name.startswith("flashckpt")}
for script in scripts.values():
    module, _, attr = script.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), script
md.entry_points(group="flashckpt.tiers")  # the group third-party tiers register in
print(json.dumps({"file": flashckpt.__file__, "scripts": scripts}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy without build/ or *.egg-info: setuptools would take modules left there by
    # an earlier build, and a package missing from pyproject would go unseen.
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (found,) = out.glob("flashckpt-*.whl")
    return found


def test_the_wheel_holds_every_module_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, installed in INSTALLED.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                expected.add(f"{installed}/{path.relative_to(ROOT / folder).as_posix()}")
    missing = sorted(expected - names)
    assert not missing, (
        f"modules of the tree missing from the wheel (pyproject packages): {missing}"
    )


def test_every_door_answers_from_an_installed_wheel(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    # The dependencies (torch, grpc, ...) from this environment, after the wheel's own files;
    # a plain path entry, so the editable install's finder is not loaded.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)  # fmt: skip
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "DS_ACCELERATOR": "cpu",
           "HOME": str(tmp_path)}  # fmt: skip
    run = subprocess.run([python, "-c", DOORS], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    doors = json.loads(run.stdout.strip().splitlines()[-1])
    assert doors["file"].startswith(str(site)), doors["file"]
    assert set(doors["scripts"]) == {"flashckpt", "flashckpt-run", "flashckpt-agent"}
    for script in doors["scripts"]:
        answer = subprocess.run([env_dir / "bin" / script, "--help"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert answer.returncode == 0 and "usage" in answer.stdout.lower(), (script, answer.stderr)
