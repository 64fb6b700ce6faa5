"""``flashckpt export``: a committed step written as torch, safetensors and DCP files, each read
back in a separate interpreter that never imports flashckpt.

Steps are stored as the agent stores them (``tier_io.write_rank`` + ``commit_step``), nested
states flattened with the trainer's own ``flatten``; one is saved by a real ``Checkpointer``.
The command line is run as the installed ``flashckpt`` console script.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAFETENSORS
from flashckpt.storage_tiers import open_tier
from test_load import put_shards
from test_replicas_reshard import FULL

from flashckpt import Checkpointer
from flashckpt.errors import CheckpointNotFoundError, ConfigError, PickleNotAllowedError
from flashckpt.format import tier_io
from flashckpt.format.checksum import chunk_checksums
from flashckpt.format.manifest import Manifest
from flashckpt.restore.export import export, parse_size
from flashckpt.snapshot.flatten import flatten, plan_layout

JOB, STEP = "exp", 3

# Reads what the parent exported, with torch, safetensors and DCP only, and saves what it
# read for the parent to compare (a plain torch file).
READER = r"""
import json, sys
from pathlib import Path
import torch
tasks, out = json.loads(sys.argv[1]), sys.argv[2]
got = {}
for name, (kind, path) in tasks.items():
    path = Path(path)
    if kind == "torch":
        got[name] = torch.load(path, weights_only=True)
    elif kind == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        got[name] = {"tensors": load_file(path), "metadata": meta}
    elif kind in ("torch-index", "safetensors-index"):
        index = json.loads(path.read_text())
        merged, metas = {}, {}
        for f in sorted(set(index["weight_map"].values())):
            if kind == "torch-index":
                merged.update(torch.load(path.parent / f, weights_only=True))
            else:
                from safetensors import safe_open
                from safetensors.torch import load_file
                merged.update(load_file(path.parent / f))
                with safe_open(path.parent / f, "pt") as h:
                    metas[f] = h.metadata()
        got[name] = {"index": index, "merged": merged, "metadata": metas}
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp
        template = torch.load(path / "template.pt", weights_only=True)
        dcp.load(template["state"], checkpoint_id=path / "ckpt")
        got[name] = template["state"]
assert "flashckpt" not in sys.modules, "the reader imported flashckpt"
torch.save(got, out)
"""


def read_elsewhere(tmp_path: Path, tasks: dict[str, tuple[str, Path]]) -> dict:
    """What a fresh interpreter, without flashckpt, reads of each exported file."""
    out = tmp_path / "read-back.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    arg = json.dumps({k: (kind, str(p)) for k, (kind, p) in tasks.items()})
    proc = subprocess.run([sys.executable, "-c", READER, arg, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def cli(*args: str) -> subprocess.CompletedProcess:
    """``flashckpt ARGS`` as a user runs it: the installed console script."""
    argv = [str(Path(sys.executable).parent / "flashckpt"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def put_state(url: str, state: dict, job: str = JOB, step: int = STEP, chunk: int = 256) -> None:
    """Store ``state`` as one rank's committed step, as the trainer and agent store it."""
    tree, leaves = flatten(state)
    lay = plan_layout(leaves, chunk)
    data = bytearray(lay.data_len)
    for e, lf in zip(lay.entries, leaves, strict=True):
        raw = lf.tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        data[e.offset : e.offset + e.nbytes] = raw
    m = Manifest(job, 0, step, tree, lay.entries, lay.data_len, chunk_size=chunk, world_size=1)
    m = m.with_checksums(chunk_checksums(memoryview(data), m.entries, chunk))

    async def go():
        tier = open_tier(url)
        try:
            await tier_io.write_rank(tier, m, memoryview(data))
            await tier_io.commit_step(tier, job, step, "node0", [0], 1)
        finally:
            await tier.close()

    asyncio.run(go())


def same(a, b) -> bool:
    """Deep equality of plain states, tensors by value and dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b and type(a) is type(b)


def layers(n: int, width: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"{i}.weight": torch.randn(width, width, generator=g) for i in range(n)}


@SAFETENSORS
def test_a_saved_step_reads_back_in_each_format_without_flashckpt(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    state = {"model": model, "optim": opt, "step": 5, "meta": {"lr": 0.5, "tag": "run"},
             "arr": arr, "odd": {"dtype": torch.bfloat16}}  # fmt: skip
    with Checkpointer(url, job="real") as ck:
        ck.save(5, state)
        ck.wait(5, tier=url, timeout=60)
    plain = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5,
             "meta": {"lr": 0.5, "tag": "run"}, "arr": torch.from_numpy(arr),
             "odd": {"dtype": torch.bfloat16}}  # fmt: skip

    pt = export(url, tmp_path / "state.pt", "torch")
    assert (pt.job, pt.step, pt.files) == ("real", 5, [str(tmp_path / "state.pt")])
    assert any("numpy array(s) exported as tensors: 'arr'" in n for n in pt.notes)
    st = export(url, tmp_path / "st", "safetensors")
    assert st.files == [str(tmp_path / "st" / "model.safetensors")] and st.index is None
    assert any("'odd (a dtype)'" in n for n in st.notes), st.notes
    dc = export(url, tmp_path / "dcp" / "ckpt", "dcp")
    assert dc.tensors == len(model.state_dict()) + 3 * 4 + 1  # AdamW: step, exp_avg(_sq)
    template = {"state": _zeroed(plain)}
    torch.save(template, tmp_path / "dcp" / "template.pt")
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # no temporaries left

    got = read_elsewhere(tmp_path, {
        "pt": ("torch", tmp_path / "state.pt"),
        "st": ("safetensors", tmp_path / "st" / "model.safetensors"),
        "dcp": ("dcp", tmp_path / "dcp"),
    })  # fmt: skip
    assert same(got["pt"], plain)
    assert same(got["dcp"], plain)
    names = got["st"]["tensors"]
    assert set(names) == {f"model.{k}" for k in model.state_dict()} | {
        f"optim.state.{i}.{k}" for i in range(4) for k in ("step", "exp_avg", "exp_avg_sq")
    } | {"arr"}  # fmt: skip
    assert torch.equal(names["model.2.weight"], model.state_dict()["2.weight"])
    assert torch.equal(names["optim.state.1.exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
    meta = got["st"]["metadata"]
    assert meta["format"] == "pt" and json.loads(meta["step"]) == 5
    assert json.loads(meta["meta"]) == {"lr": 0.5, "tag": "run"}
    groups = json.loads(meta["optim.param_groups"])
    assert groups[0]["lr"] == opt.state_dict()["param_groups"][0]["lr"]
    assert "odd" not in meta


def _zeroed(v):
    """A DCP load target of ``v``'s structure: tensors zeroed, other values replaced."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _zeroed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_zeroed(x) for x in v]
    return None


@SAFETENSORS
def test_large_exports_are_sharded_with_an_index_and_load_whole(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    model = layers(5)  # five 256-byte tensors
    put_state(url, {"model": model, "epoch": 2})
    out = tmp_path / "out"
    st = export(url, out / "st", "safetensors", max_shard_size="600B")
    assert [Path(f).name for f in st.files] == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    pt = export(url, out / "pt", "torch", max_shard_size=600)
    assert len(pt.files) == 4 and pt.index == str(out / "pt" / "pytorch_model.bin.index.json")

    got = read_elsewhere(tmp_path, {
        "st": ("safetensors-index", out / "st" / "model.safetensors.index.json"),
        "pt": ("torch-index", out / "pt" / "pytorch_model.bin.index.json"),
    })  # fmt: skip
    expect = {f"model.{k}": t for k, t in model.items()}
    assert got["st"]["index"]["metadata"]["total_size"] == 5 * 256
    assert set(got["st"]["index"]["weight_map"]) == set(expect)  # tensors only
    assert got["st"]["index"]["metadata"]["epoch"] == "2"
    assert same(got["st"]["merged"], expect)
    assert got["st"]["metadata"]["model-00001-of-00003.safetensors"]["epoch"] == "2"
    assert got["pt"]["index"]["metadata"]["total_size"] == 5 * 256
    assert same(got["pt"]["merged"], expect | {"epoch": 2})

    # Exported again into the same directory, in one file: the shards and index go.
    export(url, out / "st", "safetensors")
    assert sorted(p.name for p in (out / "st").iterdir()) == ["model.safetensors"]


@SAFETENSORS
def test_select_picks_a_subtree_and_names_its_keys(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    model = layers(2)
    put_state(url, {"model": model, "optim": {"state": {0: {"m": torch.ones(2)}}}, "step": 9})
    r = export(url, tmp_path / "m.safetensors", "safetensors", select="model")
    r2 = export(url, tmp_path / "opt.pt", "torch", select="optim/state/0")
    got = read_elsewhere(tmp_path, {"m": ("safetensors", tmp_path / "m.safetensors"),
                                    "o": ("torch", tmp_path / "opt.pt")})  # fmt: skip
    assert same(got["m"]["tensors"], model) and got["m"]["metadata"] == {"format": "pt"}
    assert same(got["o"], {"m": torch.ones(2)})
    assert (r.tensors, r2.tensors) == (2, 1)
    with pytest.raises(ConfigError, match="'model' has no key 'bias'"):
        export(url, tmp_path / "x.pt", "torch", select="model/bias")


@SAFETENSORS
def test_a_dtensor_sharded_step_exports_the_full_tensor(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    put_shards(url)  # two ranks, each with half of the rows of "w"
    export(url, tmp_path / "w.safetensors", "safetensors")
    export(url, tmp_path / "w.pt", "torch")
    export(url, tmp_path / "dcp" / "ckpt", "dcp")
    torch.save({"state": {"w": torch.zeros(10, 6)}}, tmp_path / "dcp" / "template.pt")
    got = read_elsewhere(tmp_path, {"st": ("safetensors", tmp_path / "w.safetensors"),
                                    "pt": ("torch", tmp_path / "w.pt"),
                                    "dcp": ("dcp", tmp_path / "dcp")})  # fmt: skip
    assert torch.equal(got["st"]["tensors"]["w"], FULL)
    assert same(got["pt"], {"w": FULL}) and same(got["dcp"], {"w": FULL})


def test_a_failed_write_leaves_no_file_under_its_name(tmp_path, monkeypatch):
    url = f"file://{tmp_path / 'tier'}"
    put_state(url, {"model": layers(3)})
    target = tmp_path / "out" / "model.pt"
    export(url, target, "torch")
    before = target.read_bytes()

    def half_then_crash(obj, path):
        Path(path).write_bytes(b"PK\x03\x04 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="No space left"):
        export(url, target, "torch")
    assert target.read_bytes() == before  # the earlier export, whole
    with pytest.raises(OSError, match="No space left"):
        export(url, tmp_path / "out" / "shards", "torch", max_shard_size=300)
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["model.pt", "shards"]


@SAFETENSORS
def test_pickles_are_refused_unless_allowed(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    put_state(url, {"w": torch.ones(2), "fn": Path("/x")})  # a Path only pickle can store
    with pytest.raises(PickleNotAllowedError, match="'fn'.*allow_pickle=True"):
        export(url, tmp_path / "a.pt", "torch")
    r = export(url, tmp_path / "a.pt", "torch", allow_pickle=True)
    assert any("weights_only=False" in n for n in r.notes)
    assert torch.load(tmp_path / "a.pt", weights_only=False)["fn"] == Path("/x")
    r = export(url, tmp_path / "a.safetensors", "safetensors", allow_pickle=True)
    assert any("'fn (a PosixPath)'" in n for n in r.notes), r.notes


def test_sizes_and_formats_are_checked(tmp_path):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("600B") == parse_size(600) == 600 and parse_size("1.5MB") == 1_500_000
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("five")
    with pytest.raises(ConfigError, match="not one of torch, safetensors, dcp"):
        export("file:///nonexistent", tmp_path, "onnx")
    url = f"file://{tmp_path / 'tier'}"
    put_state(url, {"w": torch.ones(1)})
    with pytest.raises(CheckpointNotFoundError, match=r"no committed step 4; the newest .* \[3\]"):
        export(url, tmp_path / "x.pt", "torch", step=4)


def test_safetensors_is_asked_for_only_when_used(tmp_path, monkeypatch):
    url = f"file://{tmp_path / 'tier'}"
    put_state(url, {"w": torch.ones(1)})
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'flashckpt\[export\]'"):
        export(url, tmp_path / "w.safetensors", "safetensors")
    assert export(url, tmp_path / "w.pt", "torch").tensors == 1


@SAFETENSORS
def test_the_command_line_exports_and_says_what_is_wrong_in_one_line(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    model = layers(3)
    put_state(url, {"model": model, "step": 1})
    out = tmp_path / "hf"
    ok = cli("export", url, "--step", str(STEP), "--format", "safetensors", "--to", str(out),
             "--select", "model", "--max-shard-size", "600B", "--json")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert (doc["command"], doc["ok"], doc["job"], doc["step"]) == ("export", True, JOB, STEP)
    assert doc["index"] == str(out / "model.safetensors.index.json") and doc["tensors"] == 3
    got = read_elsewhere(tmp_path, {"st": ("safetensors-index", Path(doc["index"]))})
    assert same(got["st"]["merged"], model)

    text = cli("export", url, "--format", "torch", "--to", str(tmp_path / "all.pt"))
    assert text.returncode == 0 and "exported as torch: 3 tensors" in text.stdout

    def fails(code: int, *args: str) -> str:
        p = cli("export", url, *args)
        assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and p.stdout == ""
        return p.stderr.strip().splitlines()[-1]

    to = ["--to", str(tmp_path / "bad")]
    assert "invalid choice: 'onnx'" in fails(2, "--format", "onnx", *to)
    line = fails(1, "--format", "torch", "--step", "99", *to)
    assert line.startswith("flashckpt export: ") and "no committed step 99" in line
    assert "has no key 'nope'" in fails(2, "--format", "torch", "--select", "nope", *to)
    assert "not a size" in fails(2, "--format", "torch", "--max-shard-size", "lots", *to)
    assert not (tmp_path / "bad").exists()
