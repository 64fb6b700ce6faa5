"""A Hugging Face Trainer for the tests: ``hf_trainer.py SETUP PHASE DIR``.

A real ``Trainer`` trains a 2-layer GPT-2 (dropout on) built in code, on 40 synthetic
sequences whose first token is the sample's index, for 14 steps of 2 sequences per process
(10 steps an epoch on 2 processes), saving every 5 steps and keeping 2 checkpoints. SETUP is
``ddp`` (``TrainingArguments(use_cpu=True)``: DDP over gloo under torchrun), ``fsdp2``
(``fsdp="full_shard"`` with ``fsdp_version: 2``; Accelerate turns FSDP on only for GPUs, so
the Trainer's Accelerator is told to use it, and ``fully_shard`` runs on CPU with gloo) or
``zero2``/``zero3`` (the Trainer's ``deepspeed=`` config on CPU, DS_ACCELERATOR=cpu).

``first``: the reference, a plain Trainer without flashckpt saving its own checkpoints
under DIR/ref, trains to the end; then, in the same process, the flash run (DIR/run,
``flashckpt.hf.attach(trainer, *TIER)``) trains from scratch, and after step KILL_AT rank 1
writes its pid to DIR/killme and waits to be SIGKILLed from outside. ``resume``: the flash
run builds its model from another seed, resumes with ``train(resume_from_checkpoint=...)``
(RESUME: ``true``, or a directory name under DIR/run) and trains to the end. With EXTRAS=1
it then writes the model with ``save_model()``, resumes a fresh attached Trainer from the
reference's own checkpoint-10, tries directories naming a step no source holds and one saved
by 3 processes, and rank 0 tries set-ups that ``attach`` refuses.

Each process writes DIR/<phase>-<run>.<rank>.json: each step's batch (first tokens), loss
and learning rate; the digests of the parameters and optimizer state at the end, the last
learning rate, the step and epoch, the next random draws of torch, NumPy and Python, and
for a resumed run where its step came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import flashckpt.hf

SETUP, PHASE, DIR = sys.argv[1], sys.argv[2], Path(sys.argv[3])
RANK = int(os.environ.get("RANK", "0"))
LAST, SAVE_EVERY, SAMPLES = 14, 5, 40


class Sequences(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, 64, (SAMPLES, 8), generator=g)
        self.tokens[:, 0] = torch.arange(SAMPLES)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Record(TrainerCallback):
    """Each step's learning rate; the wait to be killed after step ``kill_at``."""

    def __init__(self, steps: dict, kill_at: int | None) -> None:
        self.steps, self.kill_at = steps, kill_at

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.steps.setdefault(state.global_step, {})["lr"] = lr_scheduler.get_last_lr()[0]
        if state.global_step == self.kill_at and RANK == 1:
            (DIR / "killme").write_text(str(os.getpid()))
            while True:  # mid-run, after the step: the test SIGKILLs this process
                time.sleep(0.05)


def arguments(output_dir: Path, **extra) -> TrainingArguments:
    common = dict(
        output_dir=str(output_dir), max_steps=LAST, per_device_train_batch_size=2,
        save_steps=SAVE_EVERY, save_total_limit=2, learning_rate=3e-3, warmup_steps=3, weight_decay=0.01,
        seed=7, report_to=[], disable_tqdm=True, logging_steps=1000,
    )  # fmt: skip
    if SETUP in ("ddp", "fsdp2"):
        common["use_cpu"] = True
    if SETUP == "fsdp2":
        common["fsdp"] = True
        common["fsdp_config"] = {"version": 2}
    elif SETUP != "ddp":
        common["accelerator_config"] = {"use_configured_state": True}
        common["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": int(SETUP[-1])},
            "zero_allow_untested_optimizer": True,
        }
    return TrainingArguments(**{**common, **extra})


class CpuFsdpTrainer(Trainer):
    """The Trainer with FSDP2 on CPU: Accelerate's state drops an FSDP plugin on a CPU-only
    machine, so it is told to keep it (both states: AcceleratorState copies PartialState's)."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        PartialState().distributed_type = DistributedType.FSDP
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            **self.args.fsdp_plugin_args
        )
        self.is_fsdp_enabled = True


def trainer(output_dir: Path, seed: int, steps: dict, kill_at: int | None = None,
            evaluate: bool = False, **extra):  # fmt: skip
    if SETUP.startswith("zero"):
        # As TrainingArguments does for the next Trainer of a process, less the distributed
        # state set up above: Accelerate takes a DeepSpeed config only in a fresh state.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    data = Sequences()
    kind = CpuFsdpTrainer if SETUP == "fsdp2" else Trainer
    tr = kind(model=model, args=arguments(output_dir, **extra), train_dataset=data,
              eval_dataset=data if evaluate else None)  # fmt: skip

    def seen(module, args, kwargs, output):
        step = steps.setdefault(tr.state.global_step + 1, {})
        step["batch"] = kwargs["input_ids"][:, 0].tolist()
        step["loss"] = output.loss.item()

    model.register_forward_hook(seen, with_kwargs=True)
    tr.add_callback(Record(steps, kill_at))
    return tr


def tensors_digest(values) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def result(tr, steps: dict, flash=None) -> dict:
    if SETUP == "ddp":
        params = [p for _, p in tr.model.named_parameters()]
    elif SETUP == "fsdp2":  # gathered whole from the shards (a collective)
        params = [p.full_tensor() for _, p in tr.model.named_parameters()]
    else:  # gathered whole from the ZeRO partitions (a collective)
        from deepspeed.utils import safe_get_full_fp32_param

        params = [safe_get_full_fp32_param(p) for p in tr.model_wrapped.module.parameters()]
    # Every tensor of this process's optimizer state (under ZeRO, its partition of it).
    optimizer = tr.model_wrapped.optimizer if SETUP.startswith("zero") else tr.optimizer
    moments = list(tensors_in(optimizer.state_dict()))
    if SETUP == "fsdp2":
        moments = [m.full_tensor() if hasattr(m, "full_tensor") else m for m in moments]
    return {
        "steps": {str(k): v for k, v in sorted(steps.items())},
        "params": tensors_digest(params),
        "optimizer": tensors_digest(moments),
        "lr": tr.lr_scheduler.get_last_lr(),
        "global_step": tr.state.global_step,
        "epoch": tr.state.epoch,
        "draws": [torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()],
        "restored_from": None if flash is None else flash.restored_from,
        "restored_step": None if flash is None else flash.restored_step,
    }


def write(name: str, data: dict) -> None:
    (DIR / f"{PHASE}-{name}.{RANK}.json").write_text(json.dumps(data))


def tiers() -> list[str]:
    return [t for t in os.environ.get("TIER", "").split(",") if t]


def refusals() -> dict:
    """What attach says to set-ups it does not support (one process's Trainers)."""
    said = {}
    for option in ("save_only_model", "load_best_model_at_end"):
        extra = {option: True}
        if option == "load_best_model_at_end":
            extra.update(eval_strategy="steps", eval_steps=SAVE_EVERY)
        tr = trainer(DIR / "refused", 0, {}, evaluate=True, **extra)
        try:
            flashckpt.hf.attach(tr)
            said[option] = "attached"
        except Exception as exc:
            said[option] = f"{type(exc).__name__}: {exc}"
    tr = trainer(DIR / "refused", 0, {})
    flashckpt.hf.attach(tr)
    try:
        flashckpt.hf.attach(tr)
        said["twice"] = "attached"
    except Exception as exc:
        said["twice"] = f"{type(exc).__name__}: {exc}"
    return said


def resume_errors() -> dict:
    """What resuming says from a directory whose pointer names a step no source holds, and
    one saved by another number of processes (copies of checkpoint-14, edited)."""
    import torch.distributed as dist

    from flashckpt.format import pointer

    said = {}
    for name, change in (("gone", {"step": 99}), ("ranks", {"world_size": 3})):
        directory = DIR / name / f"checkpoint-{LAST}"
        if RANK == 0:
            shutil.copytree(DIR / "run" / f"checkpoint-{LAST}", directory)
            body = {"job": os.environ["FLASHCKPT_JOB"], "step": LAST, "world_size": 2,
                    "deepspeed": SETUP.startswith("zero"), **change}  # fmt: skip
            (directory / "flashckpt.pointer").write_bytes(pointer.dumps("HF", body))
        dist.barrier()
        tr = trainer(DIR / name, 1, {})
        flash = flashckpt.hf.attach(tr, *tiers())
        try:
            tr.train(resume_from_checkpoint=str(directory))
            said[name] = "resumed"
        except Exception as exc:
            said[name] = f"{type(exc).__name__}: {exc}"
        flash.close()
    return said


def main() -> None:
    if SETUP.startswith("zero"):
        # Accelerate finds no device for DeepSpeed on CPU and would count one process: the
        # distributed state is set up first, on gloo, and the Trainer told to use it.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        from accelerate import PartialState

        PartialState(backend="gloo")
    if PHASE == "first":
        ref_steps: dict = {}
        ref = trainer(DIR / "ref", 0, ref_steps)
        ref.train()
        write("ref", result(ref, ref_steps))
        steps: dict = {}
        tr = trainer(DIR / "run", 0, steps, kill_at=int(os.environ["KILL_AT"]))
        flashckpt.hf.attach(tr, *tiers())
        tr.train()
        raise SystemExit("the flash run was meant to be killed")
    steps = {}
    tr = trainer(DIR / "run", 1, steps)
    flash = flashckpt.hf.attach(tr, *tiers())
    resume = os.environ["RESUME"]
    tr.train(resume_from_checkpoint=True if resume == "true" else str(DIR / "run" / resume))
    write("run", result(tr, steps, flash))
    if os.environ.get("EXTRAS"):
        tr.save_model(str(DIR / "saved-model"))  # the Trainer's own, as before attach
        own: dict = {}
        tr = trainer(DIR / "own", 1, own, save_strategy="no")
        flashckpt.hf.attach(tr, *tiers())
        tr.train(resume_from_checkpoint=str(DIR / "ref" / f"checkpoint-{2 * SAVE_EVERY}"))
        write("own", result(tr, own))
        write("errors", resume_errors())
        if RANK == 0:
            write("refused", refusals())


if __name__ == "__main__":
    main()
    # DeepSpeed's engine on gloo can abort in the interpreter's teardown, which torchrun
    # reports as a failed worker: everything is written, so end here without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
