"""FSDP2 (``fully_shard``) through the two-line API, in real gloo process groups."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, torchrun

TRAINER = ROOT / "tests" / "fsdp2_trainer.py"


def run(ranks: int, phase: str, out, env: dict) -> dict:
    torchrun(ranks, TRAINER, phase, out, env=env, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp2_restores_into_a_fresh_model_and_optimizer(shm_dir, run_dir, tmp_path):
    """New processes, a model built from another seed and a fresh AdamW (no optimizer state
    yet): restore() brings back step 3 and the next step's parameters are bit-identical to
    the uninterrupted run's. At one rank and at four, the shards are resharded: the full
    parameters and AdamW moments restored equal those saved."""
    env = {**os.environ, "FLASHCKPT_JOB": "fsdp2", "FSDP_TIER": str(tmp_path / "tier")}
    saved = run(2, "save", tmp_path / "saved.json", env)
    resumed = run(2, "restore", tmp_path / "resumed.json", env)
    assert resumed["restored"] == 3
    assert resumed["params"] == saved["params"]  # floats through JSON: exact, bit for bit
    assert resumed["at3"] == saved["at3"]
    for ranks in (1, 4):
        other = run(ranks, "restore", tmp_path / f"at{ranks}.json", env)
        assert other.get("restored") == 3, other
        assert other["at3"] == saved["at3"], f"{ranks} ranks restored other values"


@pytest.mark.slow
def test_a_crashed_fsdp2_job_restarted_smaller_reshards_from_shared_memory(shm_dir, tmp_path):
    """No tier: two ranks save and die without close(), leaving their snapshots in shared
    memory. One rank restores step 3 from memory, assembling its whole-tensor block from both
    old ranks' shards there: the full parameters and moments equal the saved ones."""
    env = {**os.environ, "FLASHCKPT_JOB": "fsdp2mem", "FSDP_TIER": ""}
    saved = run(2, "crash", tmp_path / "saved.json", env)
    alone = run(1, "restore", tmp_path / "alone.json", env)
    assert alone.get("restored") == 3, alone
    assert alone["source"] == "shared memory", alone
    assert alone["at3"] == saved["at3"]
