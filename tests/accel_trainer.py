"""An Accelerate trainer for the tests: ``accel_trainer.py save|load DIR RESULT [NAME]``.

A real Accelerator trains a small model with dropout, AdamW, a LambdaLR schedule and a
stateful, seedably shuffled dataloader of 24 samples in batches of 4, counting steps in an
object given to ``register_for_checkpointing``. ACCEL_SETUP picks how: ``ddp`` (default:
``Accelerator(cpu=True)``, DDP over gloo under torchrun), ``zero1``/``zero2``/``zero3``
(``DeepSpeedPlugin`` at that ZeRO stage, DeepSpeed's CPU accelerator, gloo) or ``fsdp2``
(``FullyShardedDataParallelPlugin(fsdp_version=2)``).

``save`` trains steps 1-9 from seed 0 and ``accelerator.save_state`` s after step 4 into
DIR/a and after step 6 into DIR/b, through ``flashckpt.accelerate.attach``. ``load`` builds
everything from seed 1, tries to load each directory ACCEL_TRY names (a comma-separated list;
what it raised is recorded), ``accelerator.load_state(DIR/NAME)`` and trains on to step 9.
Each process writes RESULT.<rank>: after every step its parameter digest, learning rate,
batch, ``accelerator.step``; at each save the digests of the full parameters and AdamW
moments (under ZeRO 1-2, this process's partition of the moments); after a load, what was
restored; at the end the process's next random draw. With ACCEL_HOLD=1 it then waits,
without closing anything, to be killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType
from torch.utils.data import DataLoader, TensorDataset

import flashckpt.accelerate as flash_accelerate

LAST = 9
SAVES = {4: "a", 6: "b"}
SETUP = os.environ.get("ACCEL_SETUP", "ddp")


class Counter:
    """The training step, saved and restored through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def make_accelerator() -> Accelerator:
    data = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True,
                                   data_seed=7)  # fmt: skip
    if SETUP.startswith("zero"):
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        plugin = DeepSpeedPlugin(zero_stage=int(SETUP[-1]), gradient_accumulation_steps=1)
        gloo = InitProcessGroupKwargs(backend="gloo")  # with no GPU, Accelerate picks none
        return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[gloo], dataloader_config=data)
    if SETUP == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        acc = Accelerator(cpu=True, fsdp_plugin=plugin, dataloader_config=data)
        # Accelerate turns FSDP on only for GPU-type devices; fully_shard itself runs on CPU
        # with gloo, so here the state is told to use it and prepare() shards as on GPUs.
        # AcceleratorState copies PartialState's values each time it is made: both are told.
        PartialState().distributed_type = DistributedType.FSDP
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        return acc
    return Accelerator(cpu=True, dataloader_config=data)


def full_tensors(acc: Accelerator, model, opt) -> tuple[list, list]:
    """Every parameter and AdamW moment as a whole tensor (collectives: every rank calls it)."""
    if SETUP.startswith("zero"):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = list(model.module.parameters())
        if SETUP == "zero3":
            moments = [safe_get_full_optimizer_state(p, k) for p in params
                       for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        else:  # ZeRO 1-2 link a parameter to its moments only at a step: this partition's
            inner = model.optimizer.optimizer
            moments = [inner.state[p][k] for g in inner.param_groups for p in g["params"]
                       for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        return [safe_get_full_fp32_param(p) for p in params], moments
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    moments = [inner.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    if SETUP == "fsdp2":
        return [p.full_tensor() for p in params], [m.full_tensor() for m in moments]
    return [p.detach() for p in params], moments


def digest(tensors: list) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def write(out: str, rank: int, result: dict) -> None:
    path = Path(f"{out}.{rank}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # whole or absent: a test reading it may kill this process next


def main() -> None:
    phase, directory, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    name = sys.argv[4] if len(sys.argv) > 4 else "b"
    accelerator = make_accelerator()
    torch.manual_seed(0 if phase == "save" else 1)
    data = torch.Generator().manual_seed(123)  # the same samples in every phase
    dataset = TensorDataset(
        torch.arange(24), torch.randn(24, 8, generator=data), torch.randn(24, 4, generator=data)
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    flash = flash_accelerate.attach(accelerator)

    result: dict = {"steps": {}, "saved": {}, "tried": {}}
    if phase == "load":
        for tried in filter(None, os.environ.get("ACCEL_TRY", "").split(",")):
            try:
                accelerator.load_state(str(directory / tried))
                result["tried"][tried] = "loaded"
            except Exception as exc:  # the test reads what a user would see
                result["tried"][tried] = f"{type(exc).__name__}: {exc}"
        accelerator.load_state(str(directory / name))
        params, moments = full_tensors(accelerator, model, opt)
        result["loaded"] = {
            "n": counter.n,
            "lr": sched.get_last_lr(),
            "step": accelerator.step,
            "save_iteration": accelerator.save_iteration,
            "epoch": loader.iteration,
            "source": flash.ckpt._restored_from,
            "params": digest(params),
            "moments": digest(moments),
        }
    while counter.n < LAST:
        for ids, x, y in loader:
            with accelerator.accumulate(model):
                loss = (model(x) - y).pow(2).mean()
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            counter.n += 1
            params, moments = full_tensors(accelerator, model, opt)
            result["steps"][counter.n] = {
                "digest": digest(params),
                "lr": sched.get_last_lr(),
                "batch": ids.tolist(),
                "step": accelerator.step,
            }
            if phase == "save" and counter.n in SAVES:
                accelerator.save_state(str(directory / SAVES[counter.n]))
                result["saved"][counter.n] = {"params": digest(params), "moments": digest(moments)}
            if counter.n == LAST:
                break
    params, moments = full_tensors(accelerator, model, opt)
    result["params"] = [p.tolist() for p in params]
    result["moments"] = digest(moments)
    result["draw"] = torch.rand(1).item()  # the generator went on as in the saving run
    rank = accelerator.process_index
    if os.environ.get("ACCEL_HOLD") == "1":
        write(out, rank, result)
        while True:  # killed from outside: no close(), the snapshots stay where they are
            time.sleep(1)
    flash.close()
    write(out, rank, result)
    if SETUP.startswith("zero"):
        # DeepSpeed's engine on gloo can abort in the interpreter's teardown; all is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    del model, opt  # FSDP2's gloo work freed while the group lives (else an abort at exit)
    accelerator.end_training()  # ends the process group: gloo's threads outlive it otherwise


if __name__ == "__main__":
    main()
