"""Lightning's checkpoints through ``flashckpt.lightning.CheckpointIO``: real ``pl.Trainer`` fits
in fresh processes (``tests/lightning_trainer.py``), alone and as two DDP ranks under torchrun
(gloo), SIGKILLed from outside after a save and resumed with ``fit(ckpt_path=...)``; each
resumed run is compared with a run of Lightning's own checkpointing that never stopped."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, descendants, requires, run_python, wait_for

pytestmark = [
    requires("pytorch_lightning", "'flashckpt[lightning]'"),
    requires("torchdata", "torchdata"),
]
TRAINER = ROOT / "tests" / "lightning_trainer.py"
MAGIC = b"FLASHCKPT-LIGHTNING-POINTER 1\n"


@pytest.fixture
def env(shm_dir, run_dir) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def start(ranks: int, result: Path, *args, env: dict) -> subprocess.Popen:
    """The trainer on ``ranks`` processes (torchrun for more than one)."""
    script = [str(TRAINER), str(result), *map(str, args)]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        script = launcher + script
    return subprocess.Popen([sys.executable, *script], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 180) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]


def kill_when_ready(proc: subprocess.Popen, result: Path, ranks: int) -> int:
    """SIGKILL every process of the run once each rank says it saved (and stored) its step;
    the step it stopped after."""
    ready = [Path(f"{result}.ready.{r}") for r in range(ranks)]
    wait_for(lambda: all(p.exists() for p in ready) or proc.poll() is not None, timeout=180,
             what="the run to stop after its save")  # fmt: skip
    assert proc.poll() is None, proc.communicate()[0][-6000:]
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers: sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    steps = {int(p.read_text()) for p in ready}
    assert len(steps) == 1
    return steps.pop()


def results(result: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(ranks)]


def pointer(path: Path) -> dict:
    raw = path.read_bytes()
    assert raw.startswith(MAGIC), raw[:200]
    return json.loads(raw[len(MAGIC) :])


def assert_as_uninterrupted(resumed: dict, reference: dict, after: int) -> None:
    """Every step after ``after`` and the end equal the uninterrupted run's, bit for bit."""
    assert resumed["started_after"] == after
    assert sorted(resumed["steps"], key=int) == [str(s) for s in range(after + 1, 17)]
    for step, seen in resumed["steps"].items():
        assert seen == reference["steps"][step], f"step {step} differs"  # weights, LR, batch, RNG
    for key in ("params", "optimizer", "lr", "global_step", "draws"):
        assert resumed[key] == reference[key], key


@pytest.mark.slow
def test_one_process_killed_mid_epoch_resumes_from_memory_as_if_never_stopped(env, tmp_path):
    """Saves every 5 steps into a named tier; SIGKILLed after the save of step 10 (an epoch
    has 12 batches); ``fit(ckpt_path=<the step-10 file>)`` in a new process restores it from
    this node's shared memory and trains to step 16 exactly as a run that never stopped."""
    ckpt, tier = tmp_path / "ckpt", tmp_path / "tier"
    reference = start(1, tmp_path / "ref", "--dir", tmp_path / "ref-ckpt", "--plain",
                      env={**env, "FLASHCKPT_JOB": "lt-ref"})  # fmt: skip
    flash = ("--dir", ckpt, "--tier", f"file://{tier}")
    job = {**env, "FLASHCKPT_JOB": "lt1"}
    victim = start(1, tmp_path / "victim", *flash, "--hang-after", 10, env=job)
    assert kill_when_ready(victim, tmp_path / "victim", 1) == 10
    # save_top_k=1 removed step 5's file; each file left is a pointer to its step.
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    assert pointer(ckpt / "epoch=0-step=10.ckpt") == {"job": "lt1", "step": 10, "tier": None}
    assert pointer(ckpt / "last.ckpt") == {"job": "lt1", "step": 11, "tier": None}
    assert (tier / "lt1" / "step-000000000011").is_dir()  # the agent stored it meanwhile

    finish(start(1, tmp_path / "resumed", *flash, "--resume", ckpt / "epoch=0-step=10.ckpt",
                 env=job))  # fmt: skip
    finish(reference)
    [resumed], [ref] = results(tmp_path / "resumed", 1), results(tmp_path / "ref", 1)
    assert resumed["source"] == "shared memory"
    assert_as_uninterrupted(resumed, ref, 10)


@pytest.mark.slow
def test_two_ddp_ranks_resume_last_from_the_default_tier_after_memory_is_lost(env, shm_dir,
                                                                                run_dir, tmp_path):  # fmt: skip
    """Two DDP ranks save every 6 steps with no tier named (the checkpoint directory's
    ``.flashckpt`` keeps them); SIGKILLed after the save of step 12, an epoch's last batch.
    With this node's memory gone (a fresh shared-memory directory), ``fit(ckpt_path="last")``
    restores every rank from that tier and both go on exactly as a run that never stopped."""
    ckpt = tmp_path / "ckpt"
    # A plain DataLoader: Lightning gives it a DistributedSampler, reshuffled every epoch.
    common = ("--every", 6, "--loader", "plain")
    reference = start(2, tmp_path / "ref", "--dir", tmp_path / "ref-ckpt", "--plain", *common,
                      env={**env, "FLASHCKPT_JOB": "lt-ref"})  # fmt: skip
    job = {**env, "FLASHCKPT_JOB": "lt2"}
    victim = start(2, tmp_path / "victim", "--dir", ckpt, *common, "--hang-after", 12, env=job)
    assert kill_when_ready(victim, tmp_path / "victim", 2) == 12
    assert pointer(ckpt / "last.ckpt") == {"job": "lt2", "step": 13, "tier": ".flashckpt"}
    # Step 6's files were removed (save_top_k=1); its step stays in the tier, under its retention.
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".flashckpt",
        "epoch=1-step=12.ckpt",
        "last.ckpt",
    ]
    stored = {p.name for p in (ckpt / ".flashckpt" / "lt2").iterdir()}
    assert {f"step-{s:012d}" for s in (6, 7, 12, 13)} <= stored
    # The checkpoint is a replica: rank 1's stored data holds its generators, not the weights
    # and AdamW moments (1,476 float32 each) that rank 0's copy holds for both.
    data = [
        ckpt / ".flashckpt" / "lt2" / "step-000000000012" / f"rank-{r}" / "data" for r in (0, 1)
    ]
    assert data[1].stat().st_size + 3 * 1476 * 4 <= data[0].stat().st_size

    fresh = {**job, "FLASHCKPT_SHM_DIR": str(shm_dir / "fresh"),
             "FLASHCKPT_RUN_DIR": str(run_dir / "fresh")}  # fmt: skip
    finish(start(2, tmp_path / "resumed", "--dir", ckpt, *common, "--resume", "last", env=fresh))
    finish(reference)
    refs = results(tmp_path / "ref", 2)
    assert refs[0]["steps"]["13"]["batch"] != refs[1]["steps"]["13"]["batch"]  # two shards
    for resumed, ref in zip(results(tmp_path / "resumed", 2), refs, strict=True):
        assert resumed["source"] == f"file://{ckpt / '.flashckpt'}"
        assert_as_uninterrupted(resumed, ref, 12)


CHECKS = """
import json
from fractions import Fraction
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

import flashckpt.lightning as fl
from flashckpt.format import pointer
from lightning_trainer import Tiny

root = Path(root)
report = {}


def trainer(io, steps, name):
    return pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[] if io is None else [io],
                      callbacks=[ModelCheckpoint(dirpath=root / name, every_n_train_steps=2)])


def attempt(name, call):
    try:
        out = call()
        report[name] = "ok"
        return out
    except Exception as exc:
        report[name] = f"{type(exc).__name__}: {exc}"


pl.seed_everything(0, verbose=False)
plain = Tiny(stateful=False)
trainer(None, 2, "plain").fit(plain)  # Lightning's own file, no plugin
io = fl.CheckpointIO()
model = Tiny(stateful=False)
t = trainer(io, 2, "flash")
attempt("own_format", lambda: t.fit(model, ckpt_path=str(root / "plain" / "epoch=0-step=2.ckpt")))
report["own_format_same"] = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
report["own_format_step"] = t.global_step

model = Tiny(stateful=False)
model.on_save_checkpoint = lambda checkpoint: checkpoint.update(note=Fraction(1, 3))
t = trainer(io, 4, "flash")
t.fit(model)
flash = root / "flash" / "epoch=0-step=4.ckpt"
report["files"] = sorted(p.name for p in (root / "flash").iterdir())
attempt("weights_only", lambda: io.load_checkpoint(flash, weights_only=True))
report["note"] = str(io.load_checkpoint(flash)["note"])
attempt("remote", lambda: t.save_checkpoint("s3://bucket/run/x.ckpt"))
attempt("missing", lambda: io.load_checkpoint(root / "flash" / "nothing.ckpt"))
(root / "damaged.ckpt").write_bytes(pointer.magic("LIGHTNING") + b"{oops")
attempt("damaged", lambda: io.load_checkpoint(root / "damaged.ckpt"))
body = {"job": "lt3", "step": 99, "tier": "flash/.flashckpt"}
(root / "gone.ckpt").write_bytes(pointer.dumps("LIGHTNING", body))
attempt("gone", lambda: io.load_checkpoint(root / "gone.ckpt"))
(root / "other.ckpt").write_bytes(pointer.dumps("LIGHTNING", {**body, "job": "someone-else"}))
attempt("other_job", lambda: fl.CheckpointIO().load_checkpoint(root / "other.ckpt"))
io.save_checkpoint({"global_step": 7, "w": torch.ones(2)}, root / "direct.ckpt")
report["direct"] = torch.load(root / "direct.ckpt")["global_step"]
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow
def test_lightning_files_still_load_and_bad_paths_get_a_clear_error(env, tmp_path):
    """In one process: a checkpoint Lightning wrote itself loads through the plugin; a value
    that is pickled is refused to a ``weights_only=True`` load; damaged, missing, foreign and
    remote paths get errors that say what to do; a call that bypasses the strategy (a strategy
    that saves its own way) writes Lightning's own file."""
    out = run_python(f"root = {str(tmp_path)!r}\n" + CHECKS, env={**env, "FLASHCKPT_JOB": "lt3"})
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT")]
    report = json.loads(line[len("REPORT") :])
    assert report["own_format"] == "ok" and report["own_format_same"] is True
    assert report["own_format_step"] == 2
    assert report["files"] == [".flashckpt", "epoch=0-step=4.ckpt"]  # step 2's file removed
    assert report["weights_only"].startswith("PickleNotAllowedError"), report["weights_only"]
    assert report["note"] == "1/3"  # pickled, and allowed by default
    assert report["remote"].startswith("ConfigError: checkpoint path 's3://bucket/run/x.ckpt' is")
    assert "name the remote store as a tier" in report["remote"]
    assert report["missing"].startswith("CheckpointNotFoundError: Checkpoint file not found")
    assert report["damaged"] == (
        f"FlashCkptError: {tmp_path / 'damaged.ckpt'} is a damaged flashckpt pointer; load "
        "another checkpoint"
    )
    assert report["gone"].startswith(
        f"CheckpointNotFoundError: {tmp_path / 'gone.ckpt'} names step 99 of job lt3, which is "
        "neither in this node's shared memory nor committed in "
        f"file://{tmp_path / 'flash' / '.flashckpt'}"
    )
    assert "set FLASHCKPT_JOB=someone-else" in report["other_job"]
    assert report["direct"] == 7
