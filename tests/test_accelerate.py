"""Hugging Face Accelerate's ``save_state``/``load_state`` through ``flashckpt.accelerate``: real
``Accelerator(cpu=True)`` runs in fresh processes, alone and as two DDP processes (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_python, torchrun

pytest.importorskip("accelerate")
TRAINER = ROOT / "tests" / "accel_trainer.py"
EXAMPLE = ROOT / "examples" / "train_accelerate.py"
MAGIC = b"FLASHCKPT-ACCELERATE-POINTER 1\n"


@pytest.fixture
def env(shm_dir, run_dir) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "FLASHCKPT_JOB": "accel"}


def results(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def run_trainer(ranks: int, *args, env: dict) -> None:
    if ranks == 1:
        cmd = [sys.executable, str(TRAINER), *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    else:
        torchrun(ranks, TRAINER, *args, env=env, timeout=120)


def assert_resumed_as_uninterrupted(saved: dict, loaded: dict, at: int) -> None:
    """After load_state of the step saved after step ``at``, every step after it is the
    uninterrupted run's: bit-identical parameters, learning rate, batch and step counter."""
    before = saved["steps"][str(at)]
    assert loaded["loaded"]["n"] == at  # register_for_checkpointing
    assert loaded["loaded"]["lr"] == before["lr"]  # the scheduler
    assert loaded["loaded"]["step"] == before["step"]  # accelerator.step
    assert sorted(loaded["steps"], key=int) == [str(s) for s in range(at + 1, 10)]
    for s in range(at + 1, 10):
        assert loaded["steps"][str(s)] == saved["steps"][str(s)], f"step {s} differs"
    assert loaded["params"] == saved["params"]
    assert loaded["draw"] == saved["draw"]  # the process's generator went on as if unbroken


def assert_pointer(directory: Path, step: int, world_size: int, tier: str) -> None:
    raw = (directory / "flashckpt.pointer").read_bytes()
    assert raw.startswith(MAGIC)
    body = json.loads(raw[len(MAGIC) :])
    assert body == {"job": "accel", "step": step, "world_size": world_size, "tier": tier}
    assert sorted(p.name for p in directory.iterdir() if p.name != ".flashckpt") == [
        "flashckpt.pointer"
    ]  # none of Accelerate's own files: the state is in the snapshot


@pytest.mark.slow
def test_one_process_resumes_from_the_tier_alone_at_an_epoch_end(env, shm_dir, run_dir, tmp_path):
    """Saved after step 4 into a/ and after step 6 (an epoch's last batch) into b/; a fresh
    process with empty shared memory, a model from another seed and fresh objects loads b/ from
    the disk tier under a/.flashckpt and goes on exactly as the run that never stopped."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "saved"
    run_trainer(1, "save", ckpt, out, env=env)
    assert_pointer(ckpt / "a", 0, 1, ".flashckpt")
    assert_pointer(ckpt / "b", 1, 1, "../a/.flashckpt")
    assert (ckpt / "a" / ".flashckpt" / "accel").is_dir() and not (
        ckpt / "b" / ".flashckpt"
    ).exists()
    fresh = {
        **env,
        "FLASHCKPT_SHM_DIR": str(shm_dir / "fresh"),
        "FLASHCKPT_RUN_DIR": str(run_dir / "fresh"),
    }
    run_trainer(1, "load", ckpt, tmp_path / "loaded", "b", env=fresh)
    [saved], [loaded] = results(out, 1), results(tmp_path / "loaded", 1)
    assert loaded["loaded"]["source"] == f"file://{ckpt / 'a' / '.flashckpt'}"
    assert loaded["loaded"]["epoch"] == 1  # the next epoch's shuffle
    assert loaded["loaded"]["save_iteration"] == 2
    assert_resumed_as_uninterrupted(saved, loaded, 6)


@pytest.mark.slow
def test_two_processes_resume_mid_epoch(env, tmp_path):
    """Two DDP processes under torchrun: each restores its own snapshot of the step saved
    mid-epoch (its own RNG and its shard's dataloader position)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "saved"
    run_trainer(2, "save", ckpt, out, env=env)
    assert_pointer(ckpt / "a", 0, 2, ".flashckpt")
    run_trainer(2, "load", ckpt, tmp_path / "loaded", "a", env=env)
    saved, loaded = results(out, 2), results(tmp_path / "loaded", 2)
    assert saved[0]["steps"]["5"]["batch"] != saved[1]["steps"]["5"]["batch"]  # two shards
    for s, lo in zip(saved, loaded, strict=True):
        assert lo["loaded"]["epoch"] == 1
        assert_resumed_as_uninterrupted(s, lo, 4)


BAD_INPUTS = """
import json, torch
from pathlib import Path
root = Path(root)
from accelerate import Accelerator
import flashckpt.accelerate as fa
from flashckpt.format import pointer

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
acc.save_state(str(root / "plain"))  # Accelerate's own files, before attach
saved = [p.detach().clone() for p in model.parameters()]
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
fa.attach(acc)
report = {}

def attempt(name, call):
    try:
        call()
        report[name] = "ok"
    except Exception as exc:
        report[name] = f"{type(exc).__name__}: {exc}"

attempt("plain", lambda: acc.load_state(str(root / "plain")))
report["plain_params"] = all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
(root / "empty").mkdir()
(root / "empty" / "notes.txt").write_text("not a checkpoint")
attempt("empty", lambda: acc.load_state(str(root / "empty")))
attempt("missing_dir", lambda: acc.load_state(str(root / "nowhere")))
attempt("no_dir_arg", lambda: acc.load_state())
attempt("save_no_dir", lambda: acc.save_state())
attempt("attach_twice", lambda: fa.attach(acc))
fields = {"job": "accel", "step": 99, "world_size": 1, "tier": ".flashckpt"}
for name, body in [("gone", fields), ("ranks", {**fields, "world_size": 2})]:
    (root / name).mkdir()
    (root / name / "flashckpt.pointer").write_bytes(pointer.dumps("ACCELERATE", body))
(root / "damaged").mkdir()
(root / "damaged" / "flashckpt.pointer").write_bytes(pointer.magic("ACCELERATE") + b"{oops")
attempt("damaged", lambda: acc.load_state(str(root / "damaged")))
attempt("ranks", lambda: acc.load_state(str(root / "ranks")))
attempt("strict", lambda: acc.load_state(str(root / "gone"), strict=False))
attempt("gone", lambda: acc.load_state(str(root / "gone")))
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow
def test_bad_directories_get_a_clear_error_and_accelerate_s_own_still_loads(env, tmp_path):
    out = run_python(f"root = {str(tmp_path)!r}\n" + BAD_INPUTS, env=env, timeout=120)
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT")]
    report = json.loads(line[len("REPORT") :])
    assert report["plain"] == "ok" and report["plain_params"] is True
    assert report["empty"].startswith("CheckpointNotFoundError")
    assert "neither a flashckpt pointer (flashckpt.pointer) nor a checkpoint" in report["empty"]
    assert report["missing_dir"].startswith("CheckpointNotFoundError: ")
    assert "needs input_dir" in report["no_dir_arg"]
    assert "needs output_dir" in report["save_no_dir"]
    assert "already attached" in report["attach_twice"]
    assert "damaged flashckpt pointer" in report["damaged"]
    assert (
        report["ranks"].startswith("StateMismatchError")
        and "saved by 2 processes" in report["ranks"]
    )
    assert report["strict"].startswith("ConfigError") and "strict" in report["strict"]
    assert report["gone"].startswith("CheckpointNotFoundError")
    assert "names step 99 of job accel" in report["gone"]
    assert "load an older checkpoint directory" in report["gone"]


def example(directory: Path, env: dict, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXAMPLE), "--dir", str(directory), "--steps", "40", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def digest(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("digest ")]
    return line.split()[1]


@pytest.mark.slow
def test_the_example_killed_mid_run_resumes_to_the_same_weights(env, tmp_path):
    """examples/train_accelerate.py SIGKILLs itself after step 25 (saves every 10, automatic
    checkpoint naming, total_limit 2); run again, it load_state()s checkpoint_1 (step 20) and
    ends with the weights of a run that was never killed."""
    whole = digest(example(tmp_path / "whole", {**env, "FLASHCKPT_JOB": "whole"}))
    broken = {**env, "FLASHCKPT_JOB": "broken"}
    first = example(tmp_path / "broken", broken, "--kill-at", "25")
    assert first.returncode == -signal.SIGKILL, first.stdout[-2000:] + first.stderr[-4000:]
    assert "killed after step 25" in first.stdout
    second = example(tmp_path / "broken", broken, "--kill-at", "25")
    assert "resumed at step 20" in second.stdout
    assert digest(second) == whole
    checkpoints = tmp_path / "broken" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    for path in checkpoints.iterdir():
        assert (path / "flashckpt.pointer").read_bytes().startswith(MAGIC)
    assert (tmp_path / "broken" / ".flashckpt" / "broken").is_dir()
