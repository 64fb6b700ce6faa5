"""DeepSpeed engines (CPU, gloo) saving and loading through ``flashckpt.deepspeed.attach``."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, torchrun

pytest.importorskip("deepspeed")
TRAINER = ROOT / "tests" / "ds_trainer.py"


def run(ranks: int, *args, env: dict) -> dict:
    torchrun(ranks, TRAINER, *args, env=env)
    return json.loads(args[-1].read_text())


def test_the_cpu_allreduce_op_is_compiled_in_so_no_rank_builds_it_under_a_lock():
    """`make setup` builds DeepSpeed's CPU shared-memory op into its wheel. Built on first use
    instead, it is built under a lock file that a rank killed while holding it leaves behind,
    and every later DeepSpeed process on the machine then waits for it forever."""
    from deepspeed.git_version_info import installed_ops

    assert installed_ops.get("deepspeed_shm_comm"), (
        "this DeepSpeed builds its CPU shared-memory op on first use: "
        "reinstall it with `make clean setup`, or with DS_BUILD_SHM_COMM=1"
    )


@pytest.fixture
def ds_env(shm_dir, run_dir) -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "FLASHCKPT_JOB": "ds"}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_fresh_engine_loads_the_flash_checkpoint_and_takes_the_same_step(
    ds_env, tmp_path, stage, ranks
):
    """save_checkpoint() three times, then new processes with a model built from another seed
    load_checkpoint() the directory: the latest tag, its client state, and the next step's
    parameters bit-identical to the run that never stopped. The directory holds DeepSpeed's
    layout; its files point at the steps the agent persisted under ``.flashckpt``."""
    directory = tmp_path / "ckpt"
    saved = run(ranks, stage, "save", directory, tmp_path / "saved.json", env=ds_env)
    loaded = run(ranks, stage, "load", directory, tmp_path / "loaded.json", env=ds_env)
    assert (directory / "latest").read_text() == "global_step3"
    assert loaded["client"] == {"step": 3} and "global_step3" in loaded["path"]
    assert loaded["params"] == saved["params"]
    assert (directory / ".flashckpt").is_dir()
    files = sorted((directory / "global_step3").iterdir())
    assert len(files) >= 2, files  # model states and at least one rank's optimizer states
    for path in files:
        pointer = path.read_bytes()
        assert pointer.startswith(b"FLASHCKPT-DEEPSPEED-POINTER") and len(pointer) < 4096


@pytest.mark.slow
def test_a_checkpoint_deepspeed_wrote_itself_still_loads_after_attach(ds_env, tmp_path):
    directory = tmp_path / "plain"
    saved = run(1, 2, "plain", directory, tmp_path / "saved.json", env=ds_env)
    loaded = run(1, 2, "load", directory, tmp_path / "loaded.json", env=ds_env)
    assert loaded["client"] == {"step": 3} and loaded["params"] == saved["params"]
