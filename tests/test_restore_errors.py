"""Bad inputs get clear errors that list what is wrong, and load nothing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_python
from states import tiny_model

from flashckpt import (
    Checkpointer,
    CheckpointNotFoundError,
    ConfigError,
    ManifestError,
    StateMismatchError,
)
from flashckpt.format.manifest import FORMAT_VERSION, Entry, Manifest, ShardInfo


def test_wrong_shape_model_lists_mismatches_and_loads_nothing(shm_dir):
    with Checkpointer(job="shape") as ck:
        ck.save(1, {"model": tiny_model()})
        wide = torch.nn.Sequential(
            torch.nn.Linear(16, 48), torch.nn.LayerNorm(48), torch.nn.ReLU(), torch.nn.Linear(48, 4)
        )
        before = {k: v.clone() for k, v in wide.state_dict().items()}
        with pytest.raises(StateMismatchError) as err:
            ck.restore({"model": wide})
        msg = str(err.value)
        assert "5 mismatches (5 shape)" in msg
        assert "model/0.weight: shape: (32, 16) in snapshot, (48, 16) in state" in msg
        assert "model/3.weight" in msg and "Nothing was loaded" in msg
        assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())


def test_missing_unexpected_and_dtype_are_listed(shm_dir):
    with Checkpointer(job="keys") as ck:
        ck.save(
            1, {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2, dtype=torch.int32)}
        )
        with pytest.raises(StateMismatchError) as err:
            ck.restore({"a": torch.zeros(2), "c": torch.zeros(2), "d": torch.zeros(2)})
        msg = str(err.value)
        assert "b: unexpected: in snapshot, not in state" in msg
        assert "d: missing: in state, not in snapshot" in msg
        assert "c: dtype: int32 in snapshot, torch.float32 in state" in msg


def test_long_mismatch_lists_are_cut_with_counts(shm_dir):
    with Checkpointer(job="many") as ck:
        ck.save(1, {f"t{i}": torch.zeros(2) for i in range(25)})
        with pytest.raises(
            StateMismatchError, match=r"25 mismatches \(25 shape\)[\s\S]*and 15 more"
        ):
            ck.restore({f"t{i}": torch.zeros(3) for i in range(25)})


def test_nothing_saved_and_unknown_step(shm_dir):
    with Checkpointer(job="none") as ck:
        assert ck.restore({"a": torch.zeros(1)}) is None
        ck.save(4, {"a": torch.ones(1)})
        with pytest.raises(CheckpointNotFoundError, match="step 9 .* neither in shared memory"):
            ck.restore({"a": torch.zeros(1)}, step=9)


def test_manifest_json_round_trips_entries_shards_and_checksums():
    shard = ShardInfo((8, 4), (4, 0), ("Shard(dim=0)",), (2,))
    entries = (
        Entry("w", "tensor", "bfloat16", (4, 4), 0, 32, 0, (0xDEADBEEF,), shard),
        Entry("o", "pickle", "uint8", (5,), 32, 5, 1),
    )
    tree = {"t": "dict", "items": [["w", {"t": "tensor", "i": 0}], ["o", {"t": "pickle", "i": 1}]]}
    m = Manifest("j", 3, 7, tree, entries, 37, chunk_size=32, world_size=2, meta={"k": [1, 2]})
    doc = json.loads(m.to_json())
    assert doc["entries"][0]["shard"] == {
        "global_shape": [8, 4], "global_offset": [4, 0],
        "placements": ["Shard(dim=0)"], "mesh_shape": [2],
    }  # fmt: skip
    assert doc["entries"][1]["checksums"] is None and doc["entries"][1]["shard"] is None
    assert Manifest.from_json(m.to_json()) == m


def test_an_entry_past_the_stored_bytes_or_short_of_checksums_is_refused_not_read():
    # Large entries are copied with raw memory moves: a corrupt manifest must fail first.
    from flashckpt.restore.into_state import Source

    mib = 2**20
    data = torch.zeros(2 * mib, dtype=torch.uint8)
    dst = torch.empty(2 * mib, dtype=torch.uint8)
    past = Entry("t", "tensor", "uint8", (2 * mib,), mib, 2 * mib, 0, (0,))
    with pytest.raises(ManifestError, match="past the 2097152 bytes stored"):
        Source(data, "here").copy_to(dst, past, mib)
    short = Entry("t", "tensor", "uint8", (2 * mib,), 0, 2 * mib, 0, (0,))
    with pytest.raises(ManifestError, match="1 checksums for 2 chunks"):
        Source(data, "here").copy_to(dst, short, mib)


def test_newer_manifest_format_is_refused():
    m = Manifest("j", 0, 1, {"t": "dict", "items": []}, (), 0)
    doc = json.loads(m.to_json())
    doc["format_version"] = 99
    with pytest.raises(
        ManifestError,
        match=f"format_version 99, newer than the {FORMAT_VERSION} .* upgrade flashckpt",
    ):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".", "x" * 200])
def test_job_names_cannot_escape(shm_dir, bad):
    with pytest.raises(ConfigError, match="job name"):
        Checkpointer(job=bad)


def test_bad_steps_and_states(shm_dir):
    with Checkpointer(job="bad") as ck:
        with pytest.raises(ConfigError, match="step must be a non-negative int"):
            ck.save(-1, {"a": torch.zeros(1)})
        with pytest.raises(TypeError, match="state must be a dict"):
            ck.save(1, [torch.zeros(1)])
        with pytest.raises(TypeError, match="sparse|layout"):
            ck.save(1, {"s": torch.zeros(3, 3).to_sparse()})


def test_a_state_nested_deeper_than_a_restore_accepts_fails_at_save(shm_dir):
    deep: dict = {"t": torch.ones(1)}
    for _ in range(150):
        deep = {"d": deep}
    with Checkpointer(job="deep") as ck:
        with pytest.raises(TypeError, match="deeper than 100 levels"):
            ck.save(1, {"s": deep})
        shallow = {"s": {"d": {"d": {"t": torch.ones(1)}}}}
        ck.save(2, shallow)
        assert ck.restore({"s": {"d": {"d": {"t": torch.zeros(1)}}}}) == 2


def leave_snapshot(job: str, step: int, rank: int, local_rank: int, per_node: int, world: int):
    """A trainer of ``rank`` saves ``step`` and dies without closing: its slots stay."""
    run_python(
        "import os, torch; from flashckpt import Checkpointer\n"
        f"ck = Checkpointer(job={job!r})\n"
        f"ck.save({step}, {{'a': torch.full((4,), {float(rank)})}})\n"
        "os._exit(0)\n",
        env={"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(per_node)},
    )  # fmt: skip


def moved(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ranks moved" in r.getMessage()]


def test_a_node_whose_memory_holds_only_other_ranks_says_the_ranks_moved(
    shm_dir, monkeypatch, caplog
):
    """The node ran ranks 2 and 3; after a restart it runs ranks 0 and 1, whose snapshots are
    elsewhere. Rank 0 finds nothing of its own here and says why, once, naming the fix."""
    for rank in (2, 3):
        leave_snapshot("moved", 12, rank, rank - 2, per_node=2, world=4)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                        "LOCAL_WORLD_SIZE": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with Checkpointer(job="moved") as ck, caplog.at_level("WARNING", "flashckpt"):
        assert ck.restore({"a": torch.zeros(4)}) is None
        assert ck.restore({"a": torch.zeros(4)}) is None
    said = moved(caplog)
    assert len(said) == 1, said
    assert "holds snapshots of ranks [2, 3], but it runs ranks [0, 1]" in said[0]
    assert "--local-addr" in said[0]


def test_a_rank_that_finds_its_own_snapshots_says_nothing_of_moved_ranks(
    shm_dir, monkeypatch, caplog
):
    leave_snapshot("kept", 5, 1, 0, per_node=1, world=2)  # another node's rank, left here
    leave_snapshot("kept", 5, 0, 0, per_node=1, world=2)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with Checkpointer(job="kept") as ck, caplog.at_level("WARNING", "flashckpt"):
        a = torch.full((4,), 9.0)
        assert ck.restore({"a": a}) == 5 and a[0] == 0
    assert not moved(caplog)
