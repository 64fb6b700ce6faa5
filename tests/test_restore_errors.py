"""Bad inputs get clear errors that list what is wrong, and load nothing."""

from __future__ import annotations

import json

import pytest
import torch
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
