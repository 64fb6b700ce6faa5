"""The Hugging Face ``Trainer`` through ``flashckpt.hf.attach``: real Trainer runs of a tiny
GPT-2 on two gloo processes under torchrun (``tests/hf_trainer.py``): under DDP, FSDP2 and
DeepSpeed ZeRO-3 on CPU. In each, a run killed with SIGKILL from outside mid-run is
resumed through ``trainer.train(resume_from_checkpoint=...)`` and ends as a plain Trainer
that never stopped: the same batches, losses and learning rates at every step after the
checkpoint, the same parameters, optimizer state and random draws, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, descendants, requires, torchrun, wait_for

TRAINER = ROOT / "tests" / "hf_trainer.py"
LAST = 14  # the runs' last step; they save every 5 and keep 2 checkpoints
MAGIC = b"FLASHCKPT-HF-POINTER 1\n"

pytestmark = [requires("transformers", "'flashckpt[hf]'"), pytest.mark.slow]


@pytest.fixture
def env(shm_dir, run_dir) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "FLASHCKPT_JOB": "hf", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def killed_mid_run(setup: str, directory: Path, env: dict, kill_at: int) -> None:
    """``hf_trainer.py SETUP first``: the reference to the end, then the flash run, whose rank 1
    is SIGKILLed from here once it has finished step ``kill_at``; torchrun then ends the job."""
    log = directory / "first.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(TRAINER), setup, "first", str(directory)]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**env, "KILL_AT": str(kill_at)}, start_new_session=True)  # fmt: skip
    try:
        pidfile = directory / "killme"
        wait_for(lambda: pidfile.exists() or proc.poll() is not None, 240, 0.05, "step reached")
        assert pidfile.exists(), log.read_text()[-4000:]
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        for child in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.wait()
    assert f"Signal 9 (SIGKILL) received by PID {pid}" in log.read_text()


def results(directory: Path, name: str) -> list[dict]:
    return [json.loads((directory / f"{name}.{r}.json").read_text()) for r in range(2)]


def assert_as_uninterrupted(ref: dict, run: dict, resumed_after: int) -> None:
    """Every step after the checkpoint is the uninterrupted run's: the same samples (those
    before it skipped), loss and learning rate; the end the same bit for bit."""
    assert sorted(run["steps"], key=int) == [str(s) for s in range(resumed_after + 1, LAST + 1)]
    for step, seen in run["steps"].items():
        assert seen == ref["steps"][step], f"step {step} differs"
    assert run["global_step"] == ref["global_step"] == LAST
    assert run["epoch"] == ref["epoch"] == 1.4
    for key in ("params", "optimizer", "lr", "draws"):
        assert run[key] == ref[key], f"{key} differs from the uninterrupted run's"


def pointer(directory: Path) -> dict:
    raw = (directory / "flashckpt.pointer").read_bytes()
    assert raw.startswith(MAGIC)
    return json.loads(raw[len(MAGIC) :])


def steps_in(tier: Path) -> set[int]:
    return {int(p.name.removeprefix("step-")) for p in tier.glob("step-*") if p.is_dir()}


def test_ddp_run_killed_mid_epoch_resumes_from_memory_as_if_never_stopped(env, tmp_path):
    """Saved at step 5 (into shared memory, persisted to a named tier), killed after step 7,
    resumed with ``resume_from_checkpoint=True``: the newest directory, checkpoint-5, is
    restored from memory and the Trainer skips the 5 batches of the epoch trained before it.
    The same processes then save the model with ``save_model()``, resume a Trainer-written
    checkpoint (the reference's own) after attach, try directories naming a step no source
    holds and one saved by 3 processes, and show what attach refuses."""
    tier = tmp_path / "tier"
    env = {**env, "TIER": f"file://{tier}"}
    killed_mid_run("ddp", tmp_path, env, kill_at=7)
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-5"]
    torchrun(2, TRAINER, "ddp", "resume", tmp_path, env={**env, "RESUME": "true", "EXTRAS": "1"},
             timeout=240)  # fmt: skip

    refs, runs = results(tmp_path, "first-ref"), results(tmp_path, "resume-run")
    assert refs[0]["steps"]["6"]["batch"] != refs[1]["steps"]["6"]["batch"]  # a shard each
    for ref, run in zip(refs, runs, strict=True):
        assert (run["restored_step"], run["restored_from"]) == (5, "shared memory")
        assert_as_uninterrupted(ref, run, 5)
    # The Trainer's layout, without its files: the state is in the flash step.
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-10", "checkpoint-14"]
    for step in (10, 14):
        directory = run_dir / f"checkpoint-{step}"
        assert sorted(p.name for p in directory.iterdir()) == [
            "flashckpt.pointer", "trainer_state.json"
        ]  # fmt: skip
        assert pointer(directory) == {"job": "hf", "step": step, "world_size": 2,
                                      "deepspeed": False}  # fmt: skip
        assert json.loads((directory / "trainer_state.json").read_text())["global_step"] == step
    assert steps_in(tier / "hf") >= {5, 10, 14}  # the agent persisted them: close() waited
    stored = [(tier / "hf" / "step-000000000014" / f"rank-{r}" / "data").stat().st_size
              for r in range(2)]  # fmt: skip
    assert stored[1] < stored[0] / 10  # DDP's model and optimizer: stored once, by rank 0

    # A checkpoint the Trainer wrote itself still loads, its own way, after attach.
    for ref, own in zip(refs, results(tmp_path, "resume-own"), strict=True):
        assert_as_uninterrupted(ref, own, 10)
    assert (tmp_path / "saved-model" / "model.safetensors").is_file()  # save_model() as before
    for said in results(tmp_path, "resume-errors"):
        assert said["gone"].startswith("CheckpointNotFoundError: ")
        assert (
            "names step 99 of job hf, which is neither in this node's shared memory nor "
            f"committed in file://{tier} for every process; resume from an older" in said["gone"]
        )
        assert said["ranks"].startswith("StateMismatchError: ")
        assert "saved by 3 processes; this run has 2" in said["ranks"]
    refused = json.loads((tmp_path / "resume-refused.0.json").read_text())
    assert refused["save_only_model"].startswith("ConfigError: flashckpt.hf cannot save with ")
    assert "load_best_model_at_end=True" in refused["load_best_model_at_end"]
    assert "already attached" in refused["twice"]


def test_fsdp2_run_killed_mid_epoch_resumes_its_shards_from_memory(env, tmp_path):
    """FSDP2 (``fsdp_version: 2``): each process's step holds its shards of the model and of
    AdamW's moments. Killed after step 8, resumed from checkpoint-5 in memory by processes
    whose model comes from another seed: every step after it, and the whole parameters and
    moments at the end, are the uninterrupted run's."""
    killed_mid_run("fsdp2", tmp_path, env, kill_at=8)
    torchrun(2, TRAINER, "fsdp2", "resume", tmp_path, env={**env, "RESUME": "true"}, timeout=240)
    for ref, run in zip(results(tmp_path, "first-ref"), results(tmp_path, "resume-run"),
                        strict=True):  # fmt: skip
        assert (run["restored_step"], run["restored_from"]) == (5, "shared memory")
        assert_as_uninterrupted(ref, run, 5)
    assert pointer(tmp_path / "run" / "checkpoint-14") == {
        "job": "hf", "step": 14, "world_size": 2, "deepspeed": False
    }  # fmt: skip


@requires("deepspeed", "'flashckpt[deepspeed]'")
def test_deepspeed_zero3_killed_resumes_a_named_directory_from_the_tier(
    env, shm_dir, run_dir, tmp_path
):
    """ZeRO-3 through the Trainer's ``deepspeed=`` config, saving through DeepSpeed's engine
    (``flashckpt.deepspeed``) into ``output_dir/.flashckpt``. Killed after step 12; resumed
    from ``checkpoint-10`` (an epoch's end) by processes with empty shared memory, so the
    step comes from the tier; the tier then keeps the last ``save_total_limit`` steps."""
    env = {**env, "DS_ACCELERATOR": "cpu"}
    killed_mid_run("zero3", tmp_path, env, kill_at=12)
    tier = tmp_path / "run" / ".flashckpt"
    wait_for(lambda: any((tier / "hf" / "step-000000000010").glob("commit-*.json")), 60,
             what="step 10 committed in the tier")  # fmt: skip
    fresh = {**env, "FLASHCKPT_SHM_DIR": str(shm_dir / "fresh"),
             "FLASHCKPT_RUN_DIR": str(run_dir / "fresh"), "RESUME": "checkpoint-10"}  # fmt: skip
    torchrun(2, TRAINER, "zero3", "resume", tmp_path, env=fresh, timeout=240)

    for ref, run in zip(results(tmp_path, "first-ref"), results(tmp_path, "resume-run"),
                        strict=True):  # fmt: skip
        assert run["restored_step"] == 10
        assert run["restored_from"].startswith(f"file://{tier}")
        assert_as_uninterrupted(ref, run, 10)
    directory = tmp_path / "run" / "checkpoint-14"
    assert pointer(directory) == {"job": "hf", "step": 14, "world_size": 2, "deepspeed": True}
    assert (directory / "latest").read_text() == "global_step14"  # DeepSpeed's own layout
    assert {"trainer_state.json", "global_step14"} <= {p.name for p in directory.iterdir()}
    assert not list(directory.glob("*.safetensors"))
    for name in (directory / "global_step14").iterdir():  # pointers to the step, not state
        assert name.read_bytes().startswith(b"FLASHCKPT-DEEPSPEED-POINTER 1\n")
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-14"
    ]  # fmt: skip
    wait_for(lambda: steps_in(tier / "hf") == {10, 14}, 30, what="the tier to keep 2 steps")


def example(directory: Path, env: dict, job: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "examples" / "train_hf.py"), "--dir", str(directory),
           "--steps", "20", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**env, "FLASHCKPT_JOB": job})  # fmt: skip


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def final(out: str) -> tuple[str, str]:
    [line] = [ln for ln in out.splitlines() if ln.startswith("final: ")]
    _, steps, resumed, digest = line.split()
    assert steps == "steps=20", line
    return resumed, digest


def test_the_example_killed_after_a_checkpoint_resumes_to_the_same_weights(env, tmp_path):
    """``python examples/train_hf.py`` as documented (one process, a checkpoint every 5
    steps): a run that SIGKILLs itself once step 10 is saved, then the same command again,
    which resumes after step 10 and ends with the weights of a run that never stopped (run
    alongside the first)."""
    whole = example(tmp_path / "whole", env, "whole")
    code, out = finished(example(tmp_path / "broken", env, "broken", "--kill-at", "10"))
    assert code == -signal.SIGKILL, out[-4000:]
    assert "[rank 0] fresh: steps 1..20" in out and "[rank 0] SIGKILL after step 10" in out
    code, out = finished(example(tmp_path / "broken", env, "broken", "--kill-at", "10"))
    assert code == 0, out[-4000:]
    assert "[rank 0] resuming after step 10: steps 11..20" in out
    resumed, digest = final(out)
    code, out = finished(whole)
    assert code == 0, out[-4000:]
    assert final(out) == ("resumed_after_step=none", digest)
    assert resumed == "resumed_after_step=10"
    assert sorted(p.name for p in (tmp_path / "broken").glob("checkpoint-*")) == [
        "checkpoint-15", "checkpoint-20"
    ]  # fmt: skip


def test_fsdp1_is_refused_at_attach_with_the_setting_that_takes_fsdp2(tmp_path):
    """FSDP1's flat parameters are refused, naming FSDP2's setting. Accelerate cannot build an
    FSDP1 plugin without a GPU, so the Trainer's state is given one that says version 1."""
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import flashckpt.hf

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16, n_positions=4))
    tr = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                     report_to=[]))  # fmt: skip
    tr.accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1))
    )
    tr.is_fsdp_enabled = True
    with pytest.raises(flashckpt.hf.ConfigError, match="supports FSDP2, not FSDP1") as refused:
        flashckpt.hf.attach(tr)
    assert 'fsdp_config={"version": 2}' in str(refused.value)
    assert "_save_checkpoint" not in vars(tr)  # nothing was replaced
