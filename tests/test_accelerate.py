"""Hugging Face Accelerate's ``save_state``/``load_state`` through ``flashckpt.accelerate``: real
Accelerators in fresh processes, alone, as two DDP processes, and under DeepSpeed (ZeRO-3) and
FSDP2 (gloo, CPU), killed with SIGKILL and resumed, and at fewer processes than saved."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, descendants, requires, run_python, torchrun, wait_for

from flashckpt.format import pointer as pointer_file

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


def run_trainer(ranks: int, *args, env: dict) -> str:
    """The trainer as ``ranks`` processes: plain Python for one (no process group), else
    torchrun (which FSDP2 needs even at one). Returns what it wrote to stderr."""
    if ranks == 1 and env.get("ACCEL_SETUP", "ddp") == "ddp":
        cmd = [sys.executable, str(TRAINER), *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    else:
        proc = torchrun(ranks, TRAINER, *args, env=env, timeout=120)
    return proc.stderr


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
    assert loaded["moments"] == saved["moments"]  # AdamW's, whole
    assert loaded["draw"] == saved["draw"]  # the process's generator went on as if unbroken


def assert_pointer(
    directory: Path, step: int, world_size: int, tier: str, setup: str = "ddp"
) -> None:
    raw = (directory / "flashckpt.pointer").read_bytes()
    assert raw.startswith(MAGIC)
    body = json.loads(raw[len(MAGIC) :])
    assert body == {
        "job": "accel", "step": step, "world_size": world_size, "tier": tier, "setup": setup
    }  # fmt: skip
    if setup != "ddp":
        return  # DeepSpeed writes its own layout next to it
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
def test_two_processes_resume_mid_epoch_and_one_process_takes_the_replicas(env, tmp_path):
    """Two DDP processes under torchrun: each restores its own snapshot of the step saved
    mid-epoch (its own RNG and its shard's dataloader position). A directory saved by one
    process is refused at two. One process (no process group) loads the two processes' step:
    the weights and AdamW state saved, and epoch 1 started again from its first batch."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "saved"
    run_trainer(2, "save", ckpt, out, env=env)
    assert_pointer(ckpt / "a", 0, 2, ".flashckpt")
    write_pointer(ckpt / "solo", step=0, world_size=1, tier="../a/.flashckpt")
    run_trainer(2, "load", ckpt, tmp_path / "loaded", "a", env={**env, "ACCEL_TRY": "solo"})
    saved, loaded = results(out, 2), results(tmp_path / "loaded", 2)
    assert saved[0]["steps"]["5"]["batch"] != saved[1]["steps"]["5"]["batch"]  # two shards
    for s, lo in zip(saved, loaded, strict=True):
        assert lo["loaded"]["epoch"] == 1
        assert_resumed_as_uninterrupted(s, lo, 4)
        refused = lo["tried"]["solo"]
        assert refused.startswith("StateMismatchError") and "saved by 1 processes" in refused
        assert "this run has 2" in refused and "launch at most 1 processes" in refused

    said = run_trainer(1, "load", ckpt, tmp_path / "alone", "a", env=env)
    assert "saved by 2 processes; this run has 1" in said
    assert "each dataloader's epoch, started again from its first batch" in said
    [alone] = results(tmp_path / "alone", 1)
    at4 = saved[0]["saved"]["4"]
    assert saved[1]["saved"]["4"] == at4  # replicas
    assert whole(alone["loaded"]) == at4  # the weights and AdamW moments saved
    assert alone["loaded"]["n"] == 4 and alone["loaded"]["lr"] == saved[0]["steps"]["4"]["lr"]
    assert alone["loaded"]["epoch"] == 1
    # Step 4 was epoch 1's first batch for process 0: one process starts that epoch again.
    assert alone["steps"]["5"]["batch"] == saved[0]["steps"]["4"]["batch"]


def whole(loaded: dict) -> dict:
    """The digests of the whole parameters and AdamW moments just after a load."""
    return {"params": loaded["params"], "moments": loaded["moments"]}


def write_pointer(directory: Path, **fields) -> None:
    """A pointer as save_state() writes it, naming what ``fields`` say."""
    directory.mkdir(parents=True)
    body = {"job": "accel", "tier": ".flashckpt", "setup": "ddp", **fields}
    (directory / "flashckpt.pointer").write_bytes(pointer_file.dumps("ACCELERATE", body))


def run_then_kill(ranks: int, *args, env: dict, log: Path) -> None:
    """The trainer under torchrun, told to wait once it has written its results; once every
    process has, SIGKILL torchrun and every process below it (the workers, and the agent if
    it is one): nothing is closed, the snapshots stay where the kill finds them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(TRAINER), *map(str, args)]  # fmt: skip
    out = Path(args[2])
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env={**env, "ACCEL_HOLD": "1"}, cwd=ROOT, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_for(
                lambda: proc.poll() is not None
                or all(Path(f"{out}.{r}").exists() for r in range(ranks)),
                timeout=180, what="every process's results",
            )  # fmt: skip
            assert proc.poll() is None, log.read_text()[-4000:]
        finally:
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


DEEPSPEED = requires("deepspeed", "'flashckpt[deepspeed]'")


@pytest.mark.slow
@DEEPSPEED
def test_deepspeed_zero3_killed_resumes_as_if_never_stopped(env, tmp_path):
    """Accelerate with DeepSpeed ZeRO-3 on two processes (CPU, gloo): saved after steps 4 and
    6, SIGKILLed from outside; new processes from another seed load b/ (step 6, an epoch's
    end) from shared memory, and steps 7-9 are the uninterrupted run's bit for bit. The
    directory keeps DeepSpeed's layout, every file a pointer. At fewer processes, refused."""
    env = {**env, "ACCEL_SETUP": "zero3", "DS_ACCELERATOR": "cpu"}
    ckpt, out = tmp_path / "ckpt", tmp_path / "saved"
    run_then_kill(2, "save", ckpt, out, env=env, log=tmp_path / "save.log")
    assert_pointer(ckpt / "b", 1, 2, "../a/.flashckpt", "deepspeed")
    assert (ckpt / "b" / "latest").read_text() == "pytorch_model"
    files = sorted((ckpt / "b" / "pytorch_model").iterdir())
    assert len(files) == 4, files  # model and optimizer states of each process
    for path in files:
        assert path.read_bytes().startswith(b"FLASHCKPT-DEEPSPEED-POINTER 1\n")
    write_pointer(ckpt / "fewer", step=1, world_size=4, tier="../a/.flashckpt", setup="deepspeed")
    run_trainer(2, "load", ckpt, tmp_path / "loaded", "b", env={**env, "ACCEL_TRY": "fewer"})
    saved, loaded = results(out, 2), results(tmp_path / "loaded", 2)
    for s, lo in zip(saved, loaded, strict=True):
        assert lo["loaded"]["source"] == "shared memory"
        assert lo["loaded"]["epoch"] == 2
        assert whole(lo["loaded"]) == s["saved"]["6"]
        assert_resumed_as_uninterrupted(s, lo, 6)
        refused = lo["tried"]["fewer"]
        assert refused.startswith("StateMismatchError") and "saved by 4 processes" in refused
        assert "DeepSpeed ZeRO keeps each process's partition" in refused
        assert "launch 4 processes to load it" in refused


@pytest.mark.slow
def test_fsdp2_killed_resumes_as_if_never_stopped_and_reshards_to_one_process(env, tmp_path):
    """Accelerate with FSDP2 on two processes: saved after steps 4 and 6, SIGKILLed; two new
    processes load a/ (mid-epoch) from shared memory and go on bit for bit as the run that
    never stopped. One process loads the same step: its whole parameters and AdamW moments
    are those the two processes' shards held."""
    env = {**env, "ACCEL_SETUP": "fsdp2"}
    ckpt, out = tmp_path / "ckpt", tmp_path / "saved"
    run_then_kill(2, "save", ckpt, out, env=env, log=tmp_path / "save.log")
    assert_pointer(ckpt / "a", 0, 2, ".flashckpt", "fsdp2")
    run_trainer(2, "load", ckpt, tmp_path / "loaded", "a", env=env)
    saved, loaded = results(out, 2), results(tmp_path / "loaded", 2)
    for s, lo in zip(saved, loaded, strict=True):
        assert lo["loaded"]["source"] == "shared memory"
        assert lo["loaded"]["epoch"] == 1
        assert_resumed_as_uninterrupted(s, lo, 4)

    run_trainer(1, "load", ckpt, tmp_path / "alone", "a", env=env)
    [alone] = results(tmp_path / "alone", 1)
    assert alone["loaded"]["source"] == "shared memory"  # both processes' shards are there
    at4 = saved[0]["saved"]["4"]
    assert whole(alone["loaded"]) == at4  # the weights and AdamW moments saved
    assert alone["loaded"]["n"] == 4 and alone["loaded"]["lr"] == saved[0]["steps"]["4"]["lr"]
    assert alone["steps"]["5"]["batch"] == saved[0]["steps"]["4"]["batch"]  # epoch 1 again


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
for name, body in [("gone", fields), ("setup", {**fields, "setup": "fsdp2"})]:
    (root / name).mkdir()
    (root / name / "flashckpt.pointer").write_bytes(pointer.dumps("ACCELERATE", body))
(root / "damaged").mkdir()
(root / "damaged" / "flashckpt.pointer").write_bytes(pointer.magic("ACCELERATE") + b"{oops")
attempt("damaged", lambda: acc.load_state(str(root / "damaged")))
attempt("setup", lambda: acc.load_state(str(root / "setup")))
attempt("strict", lambda: acc.load_state(str(root / "gone"), strict=False))
attempt("gone", lambda: acc.load_state(str(root / "gone")))
# What a GPU machine's Accelerator says under an FSDP1 plugin: refused at attach.
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
acc.state.distributed_type = DistributedType.FSDP
acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
del acc.save_state, acc.load_state
attempt("fsdp1", lambda: fa.attach(acc))
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
    assert report["setup"].startswith("StateMismatchError")
    assert "saved by 1 processes under FSDP2; this run uses one process or DDP" in report["setup"]
    assert report["fsdp1"].startswith("ConfigError") and "fsdp_version=2" in report["fsdp1"]
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
