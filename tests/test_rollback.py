"""A restore that goes back starts a new branch: the steps saved after it are persisted
(though older than the abandoned ones), and a later restore returns them, never the
abandoned branch."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from conftest import run_python, wait_for

from flashckpt import Checkpointer
from flashckpt.format import layout, tier_io
from flashckpt.restore.agreement import _warn_going_back
from flashckpt.restore.sources import run_with_tier


def fill(step: int, branch: int) -> dict:
    return {"t": torch.full((1000,), 100.0 * branch + step)}


def listing(url: str, job: str) -> dict:
    return run_with_tier(url, lambda t: tier_io.list_steps(t, job))


def fresh_restore(url: str, job: str, tmp_path: Path) -> list[str]:
    """Restore in a new process that has no shared memory, from ``url`` alone."""
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        "s = {'t': torch.zeros(1000)}\n"
        f"ck = Checkpointer({url!r}, job={job!r}, shm_dir={str(tmp_path / 'shm-fresh')!r}, "
        f"run_dir={str(tmp_path / 'run-fresh')!r})\n"
        "print(ck.restore(s), float(s['t'][0]), ck.generation); ck.close()\n"
    )
    return out.stdout.split()


def save_all(ck: Checkpointer, url: str, steps: range, branch: int) -> None:
    """Save ``steps``, each committed in ``url`` before the next (the agent skips ahead)."""
    for step in steps:
        ck.save(step, fill(step, branch))
        assert ck.wait(step, tier=url, timeout=60) == step


def test_saves_after_restoring_an_older_step_are_persisted_and_restored(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    with Checkpointer(url, job="back") as ck:
        save_all(ck, url, range(6), branch=0)
    with Checkpointer(url, job="back") as ck:
        state = fill(0, 9)
        assert ck.restore(state, step=2) == 2 and float(state["t"][0]) == 2.0
        assert ck.generation == 1
        save_all(ck, url, range(3, 5), branch=1)  # 3 and 4 are below the abandoned 5
    # With memory gone, restore takes the new branch's newest step, not the abandoned 5.
    assert fresh_restore(url, "back", tmp_path) == ["4", "104.0", "1"]
    steps = listing(url, "back")
    assert (0, 5) in steps and (1, 4) in steps  # the abandoned branch is kept by default
    assert run_with_tier(url, lambda t: tier_io.committed_steps(t, "back")) == [0, 1, 2, 3, 4]


def test_memory_restore_after_a_rollback_returns_the_new_branch(shm_dir, run_dir, tmp_path):
    with Checkpointer(job="mem") as ck:
        for step in range(6):
            ck.save(step, fill(step, 0))
        state = fill(0, 9)
        assert ck.restore(state, step=4) == 4  # the older of the two slots
        ck.save(5, fill(5, 1))  # overwrites step 5 of the abandoned branch in memory
        state = fill(0, 9)
        # Memory holds a step 5 of each branch: the new branch's is restored.
        assert ck.restore(state) == 5 and float(state["t"][0]) == 105.0


def test_a_corrupt_newest_step_restores_the_previous_and_the_redone_step_is_stored(
    shm_dir, run_dir, tmp_path
):
    url = f"file://{tmp_path / 'nvme'}"
    with Checkpointer(url, job="redo") as ck:
        save_all(ck, url, range(4), branch=0)
    data = tmp_path / "nvme" / layout.data_key("redo", 3, 0)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with Checkpointer(url, job="redo") as ck:  # memory was freed by close()
        state = fill(0, 9)
        assert ck.restore(state) == 2  # step 3 is corrupt everywhere
        assert ck.generation == 1
        save_all(ck, url, range(3, 5), branch=1)
    assert fresh_restore(url, "redo", tmp_path) == ["4", "104.0", "1"]


def test_retention_retires_the_abandoned_branch_when_asked(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}?keep_last=3&retire_abandoned=1"
    with Checkpointer(url, job="retire") as ck:
        save_all(ck, url, range(4), branch=0)
    with Checkpointer(url, job="retire") as ck:
        assert ck.restore(fill(0, 9), step=1) == 1
        save_all(ck, url, range(2, 4), branch=1)
    # The last 3 of the new branch's history are kept; the abandoned 2 and 3 are gone.
    assert sorted(k for k, c in listing(url, "retire").items() if c and c.complete) == [
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    assert fresh_restore(url, "retire", tmp_path) == ["3", "103.0", "1"]


def test_only_a_job_that_starts_over_without_restore_is_warned(shm_dir, run_dir, tmp_path):
    """Steady saving (each step committed, the next not yet saved) warns of nothing; a run
    that saves from step 0 again without restore() is told its steps are not stored."""
    url = f"file://{tmp_path / 'nvme'}"
    log = run_dir / "over.log"
    with Checkpointer(url, job="over") as ck:
        save_all(ck, url, range(4), branch=0)
    assert "is committed already" not in log.read_text()
    with Checkpointer(url, job="over") as ck:
        ck.save(0, fill(0, 1))

        def warned() -> bool:
            return "saves step 0, but step 3 is committed already" in log.read_text()

        wait_for(warned, timeout=30, what="the agent's warning")


def test_going_back_past_a_step_some_ranks_lack_is_warned_with_what_to_do(caplog):
    with caplog.at_level(logging.WARNING, logger="flashckpt.restore.agreement"):
        _warn_going_back("grown", 9, 19, [19, 19, 9])  # rank 2 joined; 10-19 saved by 2 ranks
    assert "ranks [2] hold no copy of it" in caplog.text
    assert "restart with as many as saved it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashckpt.restore.agreement"):
        _warn_going_back("corrupt", 9, 19, [19, 19, 19])  # every rank held it: bad copies
    assert caplog.text == ""
