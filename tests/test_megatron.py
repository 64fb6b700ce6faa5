"""Megatron-Core through ``flashckpt.megatron``: a GPTModel's and its AdamW's sharded state
saved at one tensor-parallel size and restored at another (gloo, CPU), the full tensors
assembled from the restored blocks equal to those assembled from the saved ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, torchrun

pytest.importorskip("megatron.core", reason="the megatron extra: pip install 'flashckpt[megatron]'")

from flashckpt import megatron as flash_mcore  # noqa: E402
from flashckpt.errors import FlashCkptError  # noqa: E402
from flashckpt.restore.export_megatron import parse_block_name  # noqa: E402

TRAINER = ROOT / "tests" / "megatron_trainer.py"


def run(phase: str, tp: int, ranks: int, out, env: dict, pp: int = 1) -> list[dict]:
    torchrun(ranks, TRAINER, phase, tp, out, env={**env, "MEGATRON_PP": str(pp)}, timeout=240)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(ranks)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


def assembled(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every global tensor, put together from the blocks the ranks held (each element
    written by some block; replicas must agree)."""
    parts: dict[str, list] = {}
    for r in results:
        for name, (offset, t) in r["blocks"].items():
            parts.setdefault(name, []).append((offset, t))
    out = {}
    for name, blocks in parts.items():
        shape = [max(o[i] + t.shape[i] for o, t in blocks) for i in range(blocks[0][1].dim())]
        whole = torch.full(shape, float("nan"))
        for offset, t in blocks:
            box = tuple(slice(o, o + n) for o, n in zip(offset, t.shape, strict=True))
            assert torch.isnan(whole[box]).all() or torch.equal(whole[box], t), name
            whole[box] = t
        assert not torch.isnan(whole).any(), f"{name}: the blocks leave a gap"
        out[name] = whole
    return out


def stored_once(tier, ranks: int) -> dict[int, int]:
    """Checks that the tier stores each replicated block once: a rank's entry that another
    rank stores (``stored_at``) points into the entry's replica group, at a rank that stores
    the same block itself. Returns how many blocks each rank stores for the others."""
    [step] = (tier / "mcore").glob("step-*")
    docs = [json.loads((step / f"rank-{r}" / "manifest.json").read_text()) for r in range(ranks)]
    own = [{e["path"]: e for e in d["entries"] if "stored_at" not in e} for d in docs]
    serves = dict.fromkeys(range(ranks), 0)
    for r, doc in enumerate(docs):
        for e in doc["entries"]:
            if "replicas" in e:
                assert e["replicated"] and r in range(*e["replicas"]), e
            if "stored_at" in e:
                at = e["stored_at"]
                assert at != r and at in range(*e["replicas"]), e
                there = own[at][e["path"]]
                assert there["shard"] == e["shard"] and there["replicas"] == e["replicas"]
                serves[at] += 1
    return serves


@pytest.fixture
def env(shm_dir, run_dir, tmp_path) -> dict:
    return {**os.environ, "FLASHCKPT_JOB": "mcore", "MEGATRON_TIER": str(tmp_path / "tier")}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_at", "restored_at"),
    [((2, 1, 2), [(1, 1, 2), (1, 1, 1), (2, 1, 2)]),
     ((1, 1, 2), [(2, 1, 2), (1, 1, 2), (1, 2, 2)]),
     ((1, 2, 2), [(1, 1, 2)])],
    ids=["tp2-to-tp1-dp2-one-rank-and-tp2", "tp1-dp2-to-tp2-dp2-and-pp2", "pp2-to-pp1-dp2"],
)  # fmt: skip
def test_a_restore_at_another_parallel_layout_assembles_the_same_tensors(
    env, tmp_path, saved_at, restored_at
):
    """(TP, PP, ranks) saved once, then restored at each layout of ``restored_at`` (the same
    one too) into a model and fresh AdamW built from another seed: every model block and
    AdamW moment, assembled whole, equals the saved one; the step counts and the learning
    rate come back too. Across pipeline sizes a rank restores layers its own snapshot does
    not hold, from the old ranks' that do. The tier stores each replicated block once: at
    data-parallel size 2 (TP 1, PP 1) rank 1 stores none of its blocks, at TP 2 only the
    blocks tensor parallelism does not split are shared, and across pipeline stages nothing
    is; the restore reads them from the rank that stores them."""
    tp, pp, ranks = saved_at
    saved = run("save", tp, ranks, tmp_path / "saved", env, pp)
    assert all(r["steps"] == {1} for r in saved)  # saving leaves the optimizer as it was
    serves = stored_once(tmp_path / "tier", ranks)
    blocks = len(saved[1]["blocks"])
    assert serves[1] == 0 and (serves[0] == blocks if tp == pp == 1 else 0 < serves[0] < blocks
                               if tp == 2 else serves[0] == 0), (serves, blocks)  # fmt: skip
    want = assembled(saved)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in want)  # the moments too
    for tp2, pp2, ranks2 in restored_at:
        at = f"tp{tp2}-pp{pp2}-{ranks2}"
        loaded = run("restore", tp2, ranks2, tmp_path / f"loaded-{at}", env, pp2)
        got = assembled(loaded)
        assert want.keys() == got.keys(), (at, [
            (r.get("source"), r["step"], len(r["blocks"])) for r in loaded])  # fmt: skip
        assert all(r["source"].startswith("file://") for r in loaded), (at, loaded)  # the tier
        assert all(torch.equal(want[k], got[k]) for k in want), at
        assert all(r["step"] == 1 and r["steps"] == {1} and r["lr"] == 1e-2 for r in loaded), at


@pytest.mark.slow
def test_dist_checkpointing_save_and_load_go_through_the_flashckpt_backend(env, tmp_path):
    """Megatron's own ``dist_checkpointing.save(..., sharded_strategy=("flashckpt", 1))`` at
    TP 2, then ``dist_checkpointing.load`` at TP 1 into a model from another seed: the
    backend is read from the directory, the blocks come back resharded and the common part
    (the iteration) as Megatron stores it."""
    env = {**env, "MEGATRON_DIR": str(tmp_path / "ckpt")}
    saved = run("dcsave", 2, 2, tmp_path / "saved", env)
    where = tmp_path / "ckpt" / "iter_0000007"
    assert json.loads((where / "metadata.json").read_text())["sharded_backend"] == "flashckpt"
    assert (where / "flashckpt.json").read_bytes().startswith(b"FLASHCKPT-MEGATRON-POINTER")
    loaded = run("dcload", 1, 2, tmp_path / "loaded", env)
    want, got = assembled(saved), assembled(loaded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(r["iteration"] == 7 for r in loaded)
    from flashckpt.restore.export import export  # what the backend saved exports as well

    done = export(f"file://{tmp_path / 'ckpt' / '.flashckpt'}", tmp_path / "out", "megatron")
    assert done.step == 7 and done.tensors == len({k.split("@")[0] for k in want})


@pytest.mark.slow
def test_an_exported_step_loads_with_megatrons_own_torch_dist_at_another_layout(env, tmp_path):
    """Saved at TP 2 through the door, ``flashckpt export --format megatron``, then
    Megatron's ``dist_checkpointing.load`` (its torch_dist strategy, no flashckpt backend)
    at TP 1: the model's tensors equal the saved ones; the layers are stacked as Megatron
    describes them."""
    saved = run("save", 2, 2, tmp_path / "saved", env)
    out = tmp_path / "exported"
    tier = f"file://{env['MEGATRON_TIER']}"
    done = subprocess.run([sys.executable, "-m", "flashckpt.cli", "export", tier, "--format",
                           "megatron", "--to", str(out)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    loaded = run("dcexported", 1, 2, tmp_path / "loaded", {**env, "MEGATRON_EXPORT": str(out)})
    want, got = assembled(saved), assembled(loaded)
    model = {k for k in want if not k.startswith("optimizer.")}
    assert model == got.keys() and all(torch.equal(want[k], got[k]) for k in model)
    from flashckpt.restore.export import export

    moments = export(tier, tmp_path / "moments", "megatron", select="megatron/optimizer/state")
    assert moments.tensors == len({k.split("@")[0] for k in want if k.startswith("optimizer.")})
    with pytest.raises(Exception, match="no Megatron blocks"):
        export(tier, tmp_path / "none", "megatron", select="megatron/nothing")


def test_a_directory_without_its_pointer_is_refused_with_what_happened(tmp_path):
    from flashckpt import megatron_dist

    _, load = megatron_dist.register()
    with pytest.raises(FlashCkptError, match="has no flashckpt.json: it was not saved with"):
        load.load({}, tmp_path)
    (tmp_path / "flashckpt.json").write_text("not a pointer")
    with pytest.raises(FlashCkptError, match="is not a flashckpt pointer"):
        load.load({}, tmp_path)
    with pytest.raises(FlashCkptError, match="version 2"):
        load.check_version_compatibility(2)


class _Block:
    """What ``flashckpt.megatron`` reads of a ShardedTensor."""

    def __init__(self, **kw):
        defaults = dict(key="w", prepend_axis_num=0, flattened_range=None,
                        axis_fragmentations=None)  # fmt: skip
        self.__dict__.update(defaults | kw)


def test_a_block_is_named_by_its_key_and_layer_and_placed_without_the_layer_axes():
    data = torch.zeros(4, 3)
    st = _Block(key="decoder.layers.w", data=data, local_shape=(4, 3), global_shape=(2, 8, 3),
                global_offset=(1, 4, 0), prepend_axis_num=1, axis_fragmentations=(2, 2, 1))  # fmt: skip
    assert flash_mcore.block_name(st) == "decoder.layers.w@1/2"
    assert parse_block_name("decoder.layers.w@1/2") == ("decoder.layers.w", (1,), (2,))
    assert parse_block_name("odd@name") == ("odd@name", (), ())
    assert parse_block_name("w@3/2") == ("w@3/2", (), ())
    leaf = flash_mcore.to_leaf(st)
    assert leaf.local is data
    assert leaf.shard.global_shape == (8, 3) and leaf.shard.global_offset == (4, 0)
    assert flash_mcore.block_name(_Block(global_offset=(0,))) == "w"


def test_what_the_door_cannot_store_is_refused_with_what_to_do():
    flat = _Block(data=torch.zeros(6), local_shape=(2, 3), global_shape=(4, 3),
                  global_offset=(0, 0), flattened_range=slice(0, 6))  # fmt: skip
    with pytest.raises(FlashCkptError, match="DistributedOptimizer.*torch.optim optimizer"):
        flash_mcore.to_leaf(flat)
    wrong = _Block(data=torch.zeros(3), local_shape=(2, 3), global_shape=(4, 3),
                   global_offset=(0, 0))  # fmt: skip
    with pytest.raises(FlashCkptError, match=r"holds \(3,\), its ShardedTensor says \(2, 3\)"):
        flash_mcore.to_leaf(wrong)
    with pytest.raises(FlashCkptError, match="pass the optimizer it wraps"):
        flash_mcore.state(torch.nn.Linear(2, 2), optimizer=object())  # type: ignore[arg-type]


def test_a_fresh_optimizer_gets_state_only_for_a_snapshot_that_holds_one():
    """Before a restore the door creates a fresh optimizer's state (for the snapshot's
    moments to fill in place, resharded): only if the snapshot holds an optimizer, and
    without moving a parameter."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    state = flash_mcore.state(model, opt)
    assert state.before_restore({"model"}) == [] and not opt.state
    assert state.before_restore({"model", "optimizer"}) == [opt]
    assert len(opt.state) == 2 and all("exp_avg" in s for s in opt.state.values())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert opt.param_groups[0]["lr"] == 0.1
