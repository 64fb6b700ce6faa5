"""``Checkpointer.stage``: a snapshot copied before its step is known (DCP's ``async_save``
stages first and learns the step in its background thread). Nothing reads it until
``commit(step)``; a later save or ``close()`` drops one never committed; a trainer killed
between the two leaves the step before as the newest, whole."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import flashckpt
from flashckpt.errors import FlashCkptError


def state_of(value: float) -> dict:
    return {"w": torch.full((64, 64), value), "b": torch.full((7,), value), "step": int(value)}


def restored(job: str, tier: str | None = None) -> tuple[int | None, dict]:
    target = state_of(0.0)
    with flashckpt.Checkpointer(*([tier] if tier else []), job=job) as ck:
        step = ck.restore(target)
    return step, target


def test_a_staged_snapshot_is_read_only_once_committed_and_then_as_a_save_of_that_step(
    shm_dir, run_dir, tmp_path
):
    tier = f"file://{tmp_path / 'tier'}"
    with flashckpt.Checkpointer(tier, job="st") as ck:
        ck.save(1, state_of(1.0))
        live = state_of(2.0)
        staged = ck.stage(live)
        live["w"].fill_(99.0)  # training goes on: the staged copy is not touched
        # Not readable yet: a reader of this rank's memory sees step 1 as the newest.
        with flashckpt.Checkpointer(job="st") as other:
            assert other.wait(timeout=5) == 1
        staged.commit(2)
        assert ck.wait(2, tier=tier, timeout=60) == 2  # stored as a save of step 2 is
    step, got = restored("st", tier)
    assert step == 2 and torch.equal(got["w"], torch.full((64, 64), 2.0)) and got["step"] == 2


def test_a_later_save_or_close_drops_a_staged_snapshot_and_its_commit_says_so(shm_dir, caplog):
    caplog.set_level(logging.WARNING, logger="flashckpt")
    with flashckpt.Checkpointer(job="drop", close_timeout=2) as ck:  # close() waits 2 s
        first = ck.stage(state_of(1.0))
        ck.save(5, state_of(5.0))
        assert "dropped by a later save" in caplog.text
        with pytest.raises(FlashCkptError, match="step 3 of rank 0 was staged but not snapshot"):
            first.commit(3)
        second = ck.stage(state_of(6.0))
        second.drop()
        with pytest.raises(FlashCkptError, match=r"drop\(\) came first"):
            second.commit(6)
        last = ck.stage(state_of(7.0))
        target = state_of(0.0)
        assert ck.restore(target) == 5 and target["step"] == 5  # none staged was published
        with pytest.raises(FlashCkptError, match=r"restore\(\) came first"):
            last.commit(7)  # staged from the state before the restore
        last = ck.stage(state_of(8.0))
    with pytest.raises(FlashCkptError, match=r"close\(\) came first"):
        last.commit(8)


CRASH = """
import os, signal, sys, torch, flashckpt
from test_staged import state_of
ck = flashckpt.Checkpointer(job=sys.argv[1])
ck.save(1, state_of(1.0))
staged = ck.stage(state_of(2.0))
if sys.argv[2] == "after":
    staged.commit(2)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_trainer_killed_between_stage_and_commit_loses_only_the_uncommitted_step(shm_dir, when):
    job = f"kill-{when}"
    proc = subprocess.run([sys.executable, "-c", CRASH, job, when], cwd=ROOT / "tests",
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    step, got = restored(job)
    want = 2 if when == "after" else 1
    assert step == want and torch.equal(got["w"], torch.full((64, 64), float(want)))
    assert got["step"] == want


def test_close_waits_for_a_commit_on_its_way(shm_dir, run_dir, tmp_path):
    """A loop that ends with ``dcp.async_save`` and ``close()``, not waiting for the save's
    future: its background commit lands before close() drops anything, and the step is
    stored."""
    import threading

    tier = f"file://{tmp_path / 'tier'}"
    with flashckpt.Checkpointer(tier, job="late") as ck:
        ck.save(1, state_of(1.0))
        staged = ck.stage(state_of(2.0))
        threading.Timer(0.5, staged.commit, (2,)).start()
    step, got = restored("late", tier)
    assert step == 2 and got["step"] == 2
