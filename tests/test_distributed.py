"""Real multi-process runs under torchrun (gloo): DTensor shards and cross-rank agreement."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from conftest import ROOT, torchrun

WORKER = textwrap.dedent(
    """
    import os, json, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, Replicate, distribute_tensor
    from flashckpt import Checkpointer
    from flashckpt.snapshot.slots import read_locked

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = distribute_tensor(torch.ones(3), mesh, [Replicate()])
    ck = Checkpointer()
    assert ck.restore({"w": sharded, "r": replicated}) is None
    # Rank 1 saves one step fewer: only steps both ranks hold may be restored.
    last = 5 if rank == 0 else 4
    for step in range(1, last + 1):
        ck.save(step, {"w": sharded, "r": replicated, "step": step})
    ck.wait(last, timeout=30)
    with read_locked(ck._pair.ready()[0]) as snap:
        shard = snap.manifest.entries[0].shard
    dist.barrier()
    target = distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)])
    state = {"w": target, "r": distribute_tensor(torch.zeros(3), mesh, [Replicate()]), "step": None}
    ck._pair.release()
    step = Checkpointer().restore(state)
    ok = torch.equal(target.full_tensor(), full) and state["step"] == step
    out = os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json")
    with open(out, "w") as f:
        json.dump({"rank": rank, "step": step, "ok": ok, "global_shape": shard.global_shape,
                      "offset": shard.global_offset, "placements": shard.placements}, f)
    import gc
    del sharded, replicated, target, state  # DTensors freed while the group lives
    gc.collect()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_dtensor_shards_and_ranks_agree_on_a_step(shm_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "FLASHCKPT_JOB": "dist", "RESULT_DIR": str(tmp_path)}
    torchrun(2, script, env=env, timeout=180)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in rows] == [4, 4]  # the newest step both ranks hold
    assert all(r["ok"] for r in rows)
    assert [r["offset"] for r in rows] == [[0, 0], [5, 0]]
    assert all(r["global_shape"] == [10, 6] and r["placements"] == ["Shard(dim=0)"] for r in rows)


def resize_run(ranks: int, url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLASHCKPT_JOB": "resize"}
    return torchrun(ranks, ROOT / "tests" / "resize_trainer.py", url, 3, env=env, timeout=180)


def reports(out: subprocess.CompletedProcess) -> dict[int, dict[str, str]]:
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("rank ")]
    return {int(r[1]): dict(zip(r[2::2], r[3::2], strict=True)) for r in rows}


@pytest.mark.slow
def test_a_ddp_job_restarted_at_another_world_size(shm_dir, run_dir, tmp_path):
    """Two DDP ranks save steps 0-2: the tier holds the replicated model and optimizer once
    per step (rank 1's stored copy points at rank 0's). One rank restores step 2, saves 3-5,
    they are persisted and close() returns promptly. Three ranks restore step 5 (the new ranks
    from rank 0's copy), persist 6-8 and close promptly."""
    url = f"file://{tmp_path / 'tier'}"
    resize_run(2, url)
    step2 = tmp_path / "tier" / "resize" / "step-000000000002"
    sizes = [(step2 / f"rank-{r}" / "data").stat().st_size for r in range(2)]
    assert sizes[0] > 0 and sizes[1] == 0, sizes
    pointer = json.loads((step2 / "rank-1" / "manifest.json").read_text())
    assert {e.get("stored_at") for e in pointer["entries"]} == {0}, pointer["entries"]
    one = reports(resize_run(1, url))
    assert one[0]["restored"] == "2" and one[0]["last"] == "5", one
    assert float(one[0]["close"]) < 10, one
    assert (tmp_path / "tier" / "resize" / "step-000000000005").is_dir()
    three = reports(resize_run(3, url))
    assert {r["restored"] for r in three.values()} == {"5"}, three
    assert {r["start"] for r in three.values()} == {one[0]["end"]}, (one, three)
    assert {r["last"] for r in three.values()} == {"8"}, three
    assert all(float(r["close"]) < 10 for r in three.values()), three
    step8 = tmp_path / "tier" / "resize" / "step-000000000008"
    assert [(step8 / f"rank-{r}" / "manifest.json").is_file() for r in range(3)] == [True] * 3
    assert [(step8 / f"rank-{r}" / "data").stat().st_size for r in range(3)][1:] == [0, 0]


LISTING = textwrap.dedent(
    """
    import asyncio, json, os, torch.distributed as dist
    from flashckpt import group
    from flashckpt.format import layout, tier_io
    from flashckpt.restore.sources import TierSource, run_with_tier

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    url = os.environ["TIER"]
    if rank == 0:  # step 7 committed by two "nodes" for ranks 0-1 and 2
        async def commit(tier):
            for r in range(world):  # a rank counts where its manifest is stored
                await tier.put(layout.manifest_key("lst", 7, r), [memoryview(b"{}")], 2)
            await tier_io.commit_step(tier, "lst", 7, "a", [0, 1], world)
            await tier_io.commit_step(tier, "lst", 7, "b", [2], world)
        run_with_tier(url, commit)
    dist.barrier()
    listed = []
    real = tier_io.list_steps
    async def counted(tier, job):
        listed.append(job)
        return await real(tier, job)
    tier_io.list_steps = counted
    together = TierSource(url, "lst", rank, verify=True, together=True)
    alone = TierSource(url, "lst", rank, verify=True)
    row = {"rank": rank, "together": sorted(together.snapshots()), "listed": len(listed)}
    row["alone"] = sorted(alone.snapshots())
    row["listed_alone"] = len(listed) - row["listed"]
    # What rank 0 fails with, every rank raises: none waits for a listing that never comes.
    def broken():
        raise OSError("the store said 503")
    try:
        group.from_first(broken)
        row["error"] = None
    except Exception as exc:
        row["error"] = str(exc)
    # Rank 2 has no shared tier: the others cannot wait for it in a broadcast, so each lists
    # for itself, and the restore ends (nothing to load: the step has no data) without a hang.
    from flashckpt.restore.agreement import restore_agreed
    before = len(listed)
    sources = [] if rank == 2 else [TierSource(url, "lst", rank, verify=True, together=True)]
    got = restore_agreed({}, sources, None, False, {}, "lst")
    row["uneven_listed"] = len(listed) - before
    row["uneven_step"] = got.step
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()
    """
)


def test_a_restore_lists_a_shared_tier_once_for_every_rank(tmp_path):
    """Every rank of a restore asks for a shared tier's steps at once: rank 0 lists it and
    sends the listing, so a store sees one listing per job, not one per rank."""
    script = tmp_path / "worker.py"
    script.write_text(LISTING)
    env = {**os.environ, "RESULT_DIR": str(tmp_path), "TIER": f"pfs://{tmp_path / 'pfs'}"}
    torchrun(3, script, env=env, timeout=180)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["listed"] for r in rows] == [1, 0, 0]
    assert all(r["together"] == [[0, 7]] == r["alone"] for r in rows), rows
    assert [r["listed_alone"] for r in rows] == [1, 1, 1]  # a rank alone (a wait) lists itself
    assert all("rank 0 failed: the store said 503" in r["error"] for r in rows), rows
    assert [r["uneven_listed"] for r in rows] == [1, 1, 0]
    assert [r["uneven_step"] for r in rows] == [None, None, None]
