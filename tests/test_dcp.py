"""DCP's own calls (``dcp.save``, ``dcp.async_save``, ``dcp.load``) with flashckpt's storage
(``flashckpt.dcp``), in real gloo process groups under torchrun: FSDP2 saved and loaded at the
same size, at another, into a module that is not sharded and back; the step named by the
``checkpoint_id``; a damaged description refused; a step that is not there named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT, torchrun
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

import flashckpt
import flashckpt.dcp as fdcp
from flashckpt.errors import ConfigError, ManifestError

TRAINER = ROOT / "tests" / "dcp_trainer.py"


def run(ranks: int, phase: str, out, env: dict) -> dict:
    if ranks:
        torchrun(ranks, TRAINER, phase, out, env=env, timeout=240)
    else:  # one process, no process group
        import subprocess
        import sys

        done = subprocess.run([sys.executable, str(TRAINER), phase, str(out)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("how", ["save", "async"])
def test_fsdp2_through_dcp_loads_at_every_size_and_into_a_module_not_sharded(
    shm_dir, run_dir, tmp_path, how
):
    """Two FSDP2 ranks save steps 1-3 with ``dcp.save`` (or ``dcp.async_save``); fresh
    processes load the newest with ``dcp.load``, at two ranks, at one, and in one process into
    a plain module (after ``async_save``: at one): the full parameters and AdamW moments equal
    those saved, bit for bit."""
    env = {**os.environ, "FLASHCKPT_JOB": f"dcp-{how}", "DCP_TIER": str(tmp_path / "tier")}
    saved = run(2, how, tmp_path / "saved.json", env)
    for ranks in (2, 1, 0) if how == "save" else (1,):
        got = run(ranks, "load" if ranks else "load-plain", tmp_path / f"at{ranks}.json", env)
        assert "error" not in got, got
        assert (got["loaded"], got["step"]) == (3, 3), got
        assert got["at3"] == saved["at3"], f"{ranks or 'plain'}: other values"


@pytest.mark.slow
def test_a_module_not_sharded_through_dcp_loads_into_fsdp2(shm_dir, run_dir, tmp_path):
    """The reverse: two ranks that each hold the whole module (as under DDP) save it through
    DCP; two FSDP2 ranks load it, each taking its shard of every tensor."""
    env = {**os.environ, "FLASHCKPT_JOB": "dcp-ddp", "DCP_TIER": str(tmp_path / "tier")}
    saved = run(2, "save-replicated", tmp_path / "saved.json", env)
    got = run(2, "load", tmp_path / "at2.json", env)
    assert "error" not in got, got
    assert got["loaded"] == 3 and got["at3"] == saved["at3"]


def test_the_step_is_the_checkpoint_id_and_a_missing_one_is_named(shm_dir, run_dir, tmp_path):
    """One process: the step comes from the ``checkpoint_id`` (an int or a name ending in
    one), a load without one takes the newest, a step not saved is named, and a
    ``checkpoint_id`` that names no step is refused before anything is saved."""
    assert [fdcp.step_of(c) for c in (7, "step-12", "ckpt/step_0012/", "latest", -1, None)] == [
        7, 12, 12, None, None, None]  # fmt: skip
    tier = f"file://{tmp_path / 'tier'}"
    with flashckpt.Checkpointer(tier, job="ids") as ck:
        for step in (4, 9):
            dcp.save({"w": torch.full((3,), float(step))}, checkpoint_id=f"run/step-{step}",
                     storage_writer=fdcp.Writer(ck))  # fmt: skip
            ck.wait(step, tier=tier, timeout=60)  # stored (a tier behind skips to the newest)
        with pytest.raises(ConfigError, match="names no step"):
            dcp.save({"w": torch.ones(3)}, checkpoint_id="latest", storage_writer=fdcp.Writer(ck))
    with flashckpt.Checkpointer(tier, job="ids") as ck:
        state = {"w": torch.zeros(3)}
        dcp.load(state, storage_reader=fdcp.Reader(ck))
        assert state["w"].tolist() == [9.0] * 3
        dcp.load(state, checkpoint_id=4, storage_reader=fdcp.Reader(ck))
        assert state["w"].tolist() == [4.0] * 3
        # DCP hands on what its storage raised inside its own exception, traceback and all.
        with pytest.raises(CheckpointException, match="step 5 of job 'ids'"):
            dcp.load(state, checkpoint_id=5, storage_reader=fdcp.Reader(ck))
        with pytest.raises(CheckpointException, match=r"Size mismatch|does not fit"):
            dcp.load({"w": torch.zeros(4)}, storage_reader=fdcp.Reader(ck))  # saved (3,)


def test_a_damaged_description_is_refused_with_the_step_named():
    """What a step says it holds is read back from memory or a tier: it is checked before
    DCP plans with it."""
    good = json.dumps({"w": {"t": "tensor", "size": [3], "dtype": "float32"}, "n": {"t": "bytes"}})
    meta = fdcp._metadata(good, 5)
    assert list(meta["w"].size) == [3] and meta["w"].properties.dtype == torch.float32
    for bad in ("{", "[1]", json.dumps({"w": {"t": "tensor", "size": [-1], "dtype": "float32"}}),
                json.dumps({"w": {"t": "tensor", "size": [3], "dtype": "object"}}),
                json.dumps({"w": {"t": "pickle"}})):  # fmt: skip
        with pytest.raises(ManifestError, match="step 5: the DCP description it holds is damaged"):
            fdcp._metadata(bad, 5)


def test_the_writer_flattens_as_dcp_does():
    """``async_save`` stages before DCP's planner runs: the Writer describes the state by its
    keys flattened as DCP's default planner flattens them, key for key and value for value."""
    state = {
        "model": {f"l{i}.w": torch.full((2,), float(i)) for i in range(5)},
        "optim": {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "tuple": (1, torch.ones(1)), "nested": [[1, 2], [torch.ones(1)], [[3]]],
        "ints": [1, 2, 3], 7: "seven", "empty": {}, "none": None,
    }  # fmt: skip
    ours, theirs = fdcp.flatten(state), flatten_state_dict(state)[0]
    assert list(ours) == list(theirs) and all(ours[k] is theirs[k] for k in ours)
    with pytest.raises(ConfigError, match="two values flatten to the key 'a.b'"):
        fdcp.flatten({"a": {"b": 1}, "a.b": 2})


def _nested_state(v: float) -> dict:
    """A state as a training loop hands DCP: an optimizer's state under int keys, its groups in
    a list, a list that holds tensors, a tuple and scalars."""
    return {
        "model": {"l0.w": torch.full((3,), v), "l1.w": torch.full((2, 2), v)},
        "optim": {"state": {0: {"exp_avg": torch.full((3,), v), "step": torch.tensor(v)}},
                  "param_groups": [{"lr": v, "params": [0]}]},
        "lists": [torch.full((1,), v), {"x": torch.full((2,), v)}], "tup": (1, v), "n": int(v),
    }  # fmt: skip


def test_async_save_keeps_the_state_nested_and_describes_it_again_only_when_it_changes(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    """``dcp.async_save`` stages the state as given: it is flattened (for the description DCP
    plans a load with) at the first save and where the structure changed, not at each save.
    A load fills every kind of value of such a step, a step ``dcp.save`` flattened loads by
    the same Reader, from a tier too, and a key the step lacks is left as it is under DCP's
    ``allow_partial_load``."""
    flattened = []
    real = fdcp.flatten
    monkeypatch.setattr(fdcp, "flatten", lambda state: flattened.append(1) or real(state))
    tier = f"file://{tmp_path / 'tier'}"
    with flashckpt.Checkpointer(tier, job="nested") as ck:
        writer = fdcp.Writer(ck)
        for step in (1, 2, 3):
            dcp.async_save(_nested_state(float(step)), checkpoint_id=step,
                           storage_writer=writer).result(timeout=60)  # fmt: skip
        assert len(flattened) == 1
        ck.wait(3, tier=tier, timeout=60)  # stored (an agent behind skips to the newest)
        grown = {**_nested_state(4.0), "extra": torch.full((2,), 4.0)}
        dcp.async_save(grown, checkpoint_id=4, storage_writer=writer).result(timeout=60)
        assert len(flattened) == 2  # another structure: described again
        ck.wait(4, tier=tier, timeout=60)
        dcp.save(_nested_state(5.0), checkpoint_id=5, storage_writer=fdcp.Writer(ck))
        ck.wait(5, tier=tier, timeout=60)
    shutil.rmtree(shm_dir)  # the node's memory lost: the steps come from the tier
    with flashckpt.Checkpointer(tier, job="nested") as ck:
        for step in (3, 5):
            got, want = {**_nested_state(0.0), "extra": torch.zeros(2)}, _nested_state(step)
            reader = fdcp.Reader(ck)
            dcp.load(got, checkpoint_id=step, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True))  # fmt: skip
            assert reader._nested is (step == 3) and ck._restored_from.startswith("file")
            assert got.pop("extra").tolist() == [0.0, 0.0]  # not in the step: left as it is
            assert sorted(flatten_state_dict(got)[0]) == sorted(flatten_state_dict(want)[0])
            for key, value in flatten_state_dict(want)[0].items():
                mine = flatten_state_dict(got)[0][key]
                assert (torch.equal(mine, value) if isinstance(value, torch.Tensor)
                        else mine == value), (step, key)  # fmt: skip
        got = {**_nested_state(0.0), "extra": torch.zeros(2)}
        dcp.load(got, checkpoint_id=4, storage_reader=fdcp.Reader(ck))
        assert got["extra"].tolist() == [4.0, 4.0] and got["lists"][1]["x"].tolist() == [4.0] * 2


class Renaming(DefaultSavePlanner):
    """A planner that renames every key, as some wrappers do."""

    def set_up_planner(self, state_dict, *args, **kwargs):
        renamed = {f"wrapped.{k}": v for k, v in state_dict.items()}
        super().set_up_planner(renamed, *args, **kwargs)


def test_async_save_stages_the_copy_and_the_step_comes_from_its_background(
    shm_dir, run_dir, tmp_path
):
    """``dcp.async_save`` returns once the snapshot is copied: what training writes after it
    is not in the step. The step's description follows the state when a tensor's size
    changes under the same key. A reused Writer asked to save with no ``checkpoint_id`` is
    refused rather than saving as the step before; it cannot be sent to another process, and
    a planner that renames what it staged is named."""
    import pickle

    with flashckpt.Checkpointer(job="async") as ck:
        writer = fdcp.Writer(ck)
        state = {"w": torch.full((4,), 1.0), "n": 1}
        pending = dcp.async_save(state, checkpoint_id="step-1", storage_writer=writer)
        state["w"].fill_(-1.0)  # the next step's update, while the background save runs
        pending.result(timeout=60)
        state = {"w": torch.full((6,), 2.0), "n": 2}  # grown under the same key
        dcp.async_save(state, checkpoint_id=2, storage_writer=writer).result(timeout=60)
        got = {"w": torch.zeros(4), "n": 0}
        dcp.load(got, checkpoint_id=1, storage_reader=fdcp.Reader(ck))
        assert got["w"].tolist() == [1.0] * 4 and got["n"] == 1
        with pytest.raises(CheckpointException, match="no step to save as"):
            dcp.async_save(state, storage_writer=writer).result(timeout=60)
        with pytest.raises(ConfigError, match="cannot be sent to another process"):
            pickle.dumps(writer)
        with pytest.raises(CheckpointException, match="the planner changed what dcp.async_save"):
            dcp.async_save(state, checkpoint_id=3, storage_writer=writer,
                           planner=Renaming()).result(timeout=60)  # fmt: skip
        got = {"w": torch.zeros(6), "n": 0}
        dcp.load(got, storage_reader=fdcp.Reader(ck))
        assert got["w"].tolist() == [2.0] * 6 and got["n"] == 2
        with pytest.raises(CheckpointException, match="Size mismatch"):
            dcp.load({"w": torch.zeros(4), "n": 0}, storage_reader=fdcp.Reader(ck))
