"""Two ranks under torchrun (gloo): one rank's corrupt newest step moves both to an older one.

Rank 1's step 2 is corrupt in every source (its slot's manifest and its tier copy), rank 0's
is good. A rank that raised instead of reporting would leave the other waiting in gloo; both
must agree on step 1 and restore it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, run_python
from flashckpt.storage_tiers import open_tier
from test_corruption import edit, slot_manifest

from flashckpt.format import layout, tier_io
from flashckpt.format.slot import Slot
from flashckpt.snapshot.slots import read_locked, slot_path

JOB = "ranks"

SAVER = textwrap.dedent(
    """
    import os, time, torch
    from flashckpt import Checkpointer, config
    from flashckpt.format.slot import Slot
    from flashckpt.snapshot.slots import slot_path
    rank = int(os.environ["RANK"])
    ck = Checkpointer(chunk_size=65536)
    for step in (1, 2):
        ck.save(step, {"w": torch.full((50_000,), float(step + 10 * rank)), "step": step})
    paths = [slot_path(config.shm_dir(), ck.job, rank, i) for i in range(2)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slots = [Slot.open_readonly(p) for p in paths]
        sealed = all(s.header().sealed for s in slots)
        for s in slots:
            s.close()
        if sealed:
            break
        time.sleep(0.01)
    os._exit(0)  # no close(): the slots stay, as a crashed trainer leaves them
    """
)

RESTORER = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    from flashckpt import Checkpointer
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"w": torch.zeros(50_000), "step": None}
    ck = Checkpointer(os.environ["TIER"])
    step = ck.restore(state)
    ok = step is not None and state["step"] == step and bool((state["w"] == step + 10 * rank).all())
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "ok": ok}, f)
    ck.close()
    dist.destroy_process_group()
    """
)


def torchrun(code: str, tmp_path, **env: str) -> list[dict]:
    """Run ``code`` on 2 ranks under torchrun; each rank's JSON result, rank order."""
    script = tmp_path / "worker.py"
    script.write_text(code)
    full = {**os.environ, "FLASHCKPT_JOB": JOB, "RESULT_DIR": str(tmp_path), **env}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, env=full, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _to_tier(url: str, shm_dir, rank: int) -> None:
    """Store the rank's slots in the tier as the agent would, one commit marker per rank."""

    async def go() -> None:
        tier = open_tier(url)
        try:
            for i in range(2):
                slot = Slot.open_readonly(slot_path(shm_dir, JOB, rank, i))
                with read_locked(slot) as snap:
                    await tier_io.write_rank(tier, snap.manifest, slot.data(snap.header))
                    await tier_io.commit_step(tier, JOB, snap.step, f"node{rank}", [rank], 2)
                slot.close()
        finally:
            await tier.close()

    asyncio.run(go())


def _slot_of(shm_dir, rank: int, step: int):
    for i in range(2):
        slot = Slot.open_readonly(slot_path(shm_dir, JOB, rank, i))
        try:
            if slot.header().step == step:
                return slot.path
        finally:
            slot.close()
    raise AssertionError(f"rank {rank} holds no slot of step {step}")


@pytest.mark.slow
def test_one_ranks_corrupt_newest_step_moves_both_ranks_to_the_older_one(
    shm_dir, run_dir, tmp_path
):
    url = f"file://{tmp_path / 'nvme'}"
    for rank in (0, 1):
        run_python(SAVER, env={"FLASHCKPT_JOB": JOB, "RANK": str(rank), "WORLD_SIZE": "2"})
        _to_tier(url, shm_dir, rank)
    chunk_size_zero = edit(lambda d: d.update(chunk_size=0))
    slot_manifest(chunk_size_zero)(_slot_of(shm_dir, 1, 2))
    bad = tmp_path / "nvme" / layout.manifest_key(JOB, 2, 1)
    bad.write_bytes(chunk_size_zero(bad.read_bytes()))

    rows = torchrun(RESTORER, tmp_path, TIER=url)
    assert rows == [{"step": 1, "ok": True}, {"step": 1, "ok": True}]


MISMATCH = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    from flashckpt import Checkpointer, StateMismatchError
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Rank 1 builds its state wrong: a user error, to be raised on both ranks together.
    state = {"w": torch.zeros(50_000 if rank == 0 else 7), "step": None}
    try:
        Checkpointer().restore(state)
        raised = None
    except StateMismatchError as exc:
        raised = str(exc)
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"raised": raised}, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_state_mismatch_on_one_rank_is_raised_on_every_rank(shm_dir, tmp_path):
    for rank in (0, 1):
        run_python(SAVER, env={"FLASHCKPT_JOB": JOB, "RANK": str(rank), "WORLD_SIZE": "2"})
    rows = [row["raised"] for row in torchrun(MISMATCH, tmp_path)]
    assert "w: shape: (50000,) in snapshot, (7,) in state" in rows[1]
    assert rows[0].startswith("rank 1 failed to restore: snapshot of step 2")
    assert "w: shape: (50000,) in snapshot, (7,) in state" in rows[0]
