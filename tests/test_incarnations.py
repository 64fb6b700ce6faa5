"""Runs of a job (incarnations): every restore starts a newer one, recorded in what it saves;
writes of an earlier run (an agent of a dead run still uploading, a second job under the same
name) never complete a step together with a newer run's, nor pass for its shards."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from flashckpt.storage_tiers import open_tier

from flashckpt import Checkpointer
from flashckpt.errors import StaleWriterError
from flashckpt.format import layout, tier_io
from flashckpt.format.manifest import Manifest
from flashckpt.restore.sources import run_with_tier


def dirs(tmp_path, name: str) -> dict:
    return {"shm_dir": tmp_path / f"shm-{name}", "run_dir": tmp_path / f"run-{name}"}


def test_markers_of_an_earlier_run_never_complete_a_step_with_a_newer_ones(tmp_path):
    url = f"pfs://{tmp_path / 'pfs'}"

    async def go():
        tier = open_tier(url)
        try:
            for step, rank in [(s, r) for s in (6, 7) for r in range(4)]:  # a rank counts once
                await tier.put(layout.manifest_key("j", step, rank), [memoryview(b"{}")], 2)
            # Step 7 of a 4-rank job: node0 of the new run (2) and a zombie node1 of run 1.
            await tier_io.commit_step(tier, "j", 7, "node0", [0, 1], 4, incarnation=2)
            await tier_io.commit_step(tier, "j", 7, "node1", [2, 3], 4, incarnation=1)
            # Step 6 entirely of run 1, before the restart: still a whole step.
            await tier_io.commit_step(tier, "j", 6, "node0", [0, 1], 4, incarnation=1)
            await tier_io.commit_step(tier, "j", 6, "node1", [2, 3], 4, incarnation=1)
            return await tier_io.list_steps(tier, "j")
        finally:
            await tier.close()

    listing = asyncio.run(go())
    assert listing[0, 6].complete and listing[0, 6].incarnation == 1
    assert not listing[0, 7].complete  # before runs were told apart: complete, and torn
    assert listing[0, 7].incarnation == 2 and listing[0, 7].ranks == {0, 1}


def test_each_restore_starts_a_newer_run_and_a_shard_of_an_earlier_run_is_a_corrupt_copy(
    tmp_path, caplog
):
    url = f"pfs://{tmp_path / 'pfs'}"
    with Checkpointer(url, job="fence", **dirs(tmp_path, "a")) as ck:
        assert ck.restore({"t": torch.zeros(64)}) is None
        for step in (1, 2):
            ck.save(step, {"t": torch.full((64,), float(step))})
            ck.wait(step, tier=url, timeout=60)
    with Checkpointer(url, job="fence", **dirs(tmp_path, "b")) as ck:  # a restarted run
        assert ck.restore({"t": torch.zeros(64)}) == 2
        ck.save(3, {"t": torch.full((64,), 3.0)})
        ck.wait(3, tier=url, timeout=60)
    root = tmp_path / "pfs"
    runs = {
        step: json.loads((root / layout.manifest_key("fence", step, 0)).read_bytes())["incarnation"]
        for step in (1, 2, 3)
    }
    assert runs == {1: 1, 2: 1, 3: 2}
    marker = json.loads((root / "fence" / "step-000000000003").glob("commit-*.json").__next__()
                        .read_bytes())  # fmt: skip
    assert marker["incarnation"] == 2

    # The first run's agent, cut off, uploads its own step 3 late, over the new run's shard:
    # refused (the second run claimed the job having seen step 2), and the shard stays.
    async def late_upload(tier):
        new = await tier_io.read_manifest(tier, "fence", 3, 0)
        data = (root / layout.data_key("fence", 3, 0)).read_bytes()
        await tier_io.write_rank(tier, dataclasses.replace(new, incarnation=1), memoryview(data))

    with pytest.raises(StaleWriterError, match="step 3 of run 1 of job fence is not written"):
        run_with_tier(url, late_upload)
    # Were its manifest to land all the same (a writer that raced the claim), it is no copy of
    # the step the markers name: a corrupt copy, and the restore goes back a step.
    stale = dataclasses.replace(run_with_tier(url, lambda t: tier_io.read_manifest(t, "fence", 3, 0)),
                                incarnation=1).to_json()  # fmt: skip
    run_with_tier(url, lambda t: t.put(layout.manifest_key("fence", 3, 0), [memoryview(stale)],
                                       len(stale)))  # fmt: skip
    with pytest.raises(Exception, match="written by run 1 of the job, but the step is committed"):
        run_with_tier(url, lambda t: tier_io.read_rank(t, "fence", 3, 0, 0, incarnation=2))
    restored = {"t": torch.zeros(64)}
    with Checkpointer(url, job="fence", **dirs(tmp_path, "c")) as ck:
        assert ck.restore(restored) == 2  # step 3's only copy is not the run's: the one before
    assert float(restored["t"][0]) == 2.0
    assert any("written by run 1" in r.getMessage() for r in caplog.records)


def test_a_manifest_and_a_marker_written_before_runs_were_numbered_read_as_run_0(tmp_path):
    m = Manifest("old", 0, 5, {"t": "dict", "items": []}, (), 0, world_size=1)
    doc = json.loads(m.to_json())
    assert doc["incarnation"] == 0 and doc["format_version"] == 4
    del doc["incarnation"]
    doc["format_version"] = 2
    assert Manifest.from_json(json.dumps(doc).encode()).incarnation == 0
    old = layout.CommitMarker.from_json(b'{"node": "n", "ranks": [0], "world_size": 1}')
    assert old.incarnation == 0 and b"incarnation" not in old.to_json()
    with pytest.raises(Exception, match="expected a commit marker"):
        layout.CommitMarker.from_json(
            b'{"node": "n", "ranks": [0], "world_size": 1, "incarnation": -1}'
        )
