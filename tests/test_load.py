"""``flashckpt.load`` (a stored step as plain Python) and ``restore(strict=False, key_map=)``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from test_replicas_reshard import FULL, JOB, STEP, manifest_of, shard_of

import flashckpt
from flashckpt import Checkpointer
from flashckpt.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    ConfigError,
    PickleNotAllowedError,
    StateMismatchError,
)
from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier


class Opaque:
    """A leaf only pickle can store."""

    def __init__(self, v: int):
        self.v = v


def test_a_saved_state_comes_back_as_plain_python(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    ck = Checkpointer(url, job="plain", allow_pickle=True)
    state = {"model": model, "optim": opt, "step": 5, "meta": {"lr": 0.5, "pair": (1, "a")},
             "arr": arr, "odd": Opaque(7)}  # fmt: skip
    ck.save(5, state)
    ck.wait(5, tier=url, timeout=60)
    ck.close()

    with pytest.raises(PickleNotAllowedError, match="'odd'.*allow_pickle=True"):
        flashckpt.load(url)
    back = flashckpt.load(url, allow_pickle=True)  # the only job, the newest step
    assert back["step"] == 5 and back["meta"] == {"lr": 0.5, "pair": (1, "a")}
    assert isinstance(back["meta"]["pair"], tuple)
    assert back["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    saved_opt = opt.state_dict()
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert back["optim"]["param_groups"][0]["lr"] == saved_opt["param_groups"][0]["lr"]
    assert np.array_equal(back["arr"], arr) and back["arr"].dtype == np.int16
    assert back["odd"].v == 7

    with pytest.raises(CheckpointNotFoundError, match=r"no committed step 4; the newest .* \[5\]"):
        flashckpt.load(url, "plain", step=4)
    with pytest.raises(ConfigError, match="rank 1 is not one of the 1 ranks"):
        flashckpt.load(url, "plain", rank=1)


def put_shards(url: str) -> None:
    shards = [
        manifest_of(r, [shard_of(s, 2)], 2) for r, s in enumerate([slice(0, 5), slice(5, 10)])
    ]

    async def go(tier):
        for m, d in shards:
            await tier_io.write_rank(tier, m, memoryview(d))
        await tier_io.commit_step(tier, JOB, STEP, "node0", [0, 1], 2)

    run_with_tier(url, go)


def test_sharded_entries_come_back_whole_or_as_one_ranks_shard(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    put_shards(url)
    assert torch.equal(flashckpt.load(url)["w"], FULL)
    assert torch.equal(flashckpt.load(url, rank=1)["w"], FULL[5:])
    data = tmp_path / "tier" / tier_io.layout.data_key(JOB, STEP, 1)
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="'w'"):
        flashckpt.load(url)


def test_several_jobs_must_be_named(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    put_shards(url)
    partial = tmp_path / "tier" / "other" / "step-000000000001" / "rank-0"
    partial.mkdir(parents=True)
    (partial / "data").write_bytes(b"")  # a step never committed
    with pytest.raises(ConfigError, match="several jobs \\(other, rep\\); name one"):
        flashckpt.load(url)
    assert flashckpt.load(url, JOB)["w"].shape == (10, 6)
    with pytest.raises(CheckpointNotFoundError, match="no committed step"):
        flashckpt.load(url, "other")


def test_restore_with_a_key_map_and_without_strictness(shm_dir):
    ck = Checkpointer(job="lenient")
    weight, bias = torch.arange(6.0).view(2, 3), torch.tensor([1.0, 2.0])
    ck.save(1, {"model": {"module.weight": weight, "module.bias": bias}, "epoch": 3})

    renamed = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, "epoch": 0}
    assert ck.restore(renamed, key_map=lambda k: k.removeprefix("module.")) == 1
    assert torch.equal(renamed["model"]["weight"], weight) and renamed["epoch"] == 3

    other = {"model": {"weight": torch.zeros(3, 3), "bias": torch.zeros(2), "extra": torch.ones(1)}}
    with pytest.raises(StateMismatchError, match="3 mismatches"):
        ck.restore(other, key_map=lambda k: k.removeprefix("module."))
    step, unmatched = ck.restore(other, key_map=lambda k: k.removeprefix("module."), strict=False)
    assert step == 1
    assert {(m.path, m.kind) for m in unmatched} == {
        ("model/weight", "shape"),
        ("model/extra", "missing"),
        ("epoch", "unexpected"),
    }
    assert torch.equal(other["model"]["bias"], bias)  # what matches is loaded
    assert torch.equal(other["model"]["weight"], torch.zeros(3, 3))  # the rest left alone
    assert torch.equal(other["model"]["extra"], torch.ones(1))
    dropped = {"model": {"weight": torch.zeros(2, 3)}, "epoch": 0}
    keep_weight = lambda k: None if k == "module.bias" else k.removeprefix("module.")  # noqa: E731
    assert ck.restore(dropped, key_map=keep_weight) == 1
    ck.close()


def test_the_package_starts_without_torch_and_load_stays_the_function():
    """The launcher, the controller and the command line import ``flashckpt`` and start
    without torch (a second or two each); what needs torch comes when first used, and
    importing the module behind ``flashckpt.load`` does not hide the function."""
    code = (
        "import sys, flashckpt, flashckpt.faults.launcher, flashckpt.cli, flashckpt.agent.controller\n"
        "assert 'torch' not in sys.modules, 'torch imported at start'\n"
        "import flashckpt.restore.export\n"
        "assert callable(flashckpt.load) and flashckpt.load.__name__ == 'load'\n"
        "assert flashckpt.Checkpointer.__name__ == 'Checkpointer' and flashckpt.FORMAT_VERSION\n"
        "assert {'Checkpointer', 'load', 'RNG', 'run_recoverable'} <= set(dir(flashckpt))\n"
        "try:\n"
        "    flashckpt.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
