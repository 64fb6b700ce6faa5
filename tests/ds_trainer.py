"""A DeepSpeed trainer for the tests: ``ds_trainer.py STAGE save|load|plain DIR RESULT``.

``save`` trains steps 1-3 with ZeRO stage STAGE and saves each through
``flashckpt.deepspeed.attach`` with ``engine.save_checkpoint(DIR, client_state=...)``, then
takes step 4. ``plain`` does the same with DeepSpeed's own checkpoint engine. ``load``
builds the model from another seed, attaches flashckpt, ``engine.load_checkpoint(DIR)`` and
takes step 4. Rank 0 writes the full fp32 parameters after step 4, the loaded tag and
client state to RESULT.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

import flashckpt.deepspeed as flash_ds


def main() -> None:
    stage, phase, directory, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1 if phase == "load" else 0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    flash = None if phase == "plain" else flash_ds.attach(engine)

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        engine.backward(engine(torch.randn(2, 8, generator=g)).pow(2).mean())
        engine.step()

    result: dict = {}
    if phase == "load":
        path, client = engine.load_checkpoint(directory)
        result["path"], result["client"] = path, client.get("mine")
    else:
        for step in range(1, 4):
            train_step(step)
            engine.save_checkpoint(directory, client_state={"mine": {"step": step}})
    train_step(4)
    full = [safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()]
    if flash is not None:
        flash.close()
    if dist.get_rank() == 0:
        result["params"] = full
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # DeepSpeed's engine on gloo can abort in the interpreter's teardown ("terminate called
    # without an active exception"; seen with no flashckpt in the process at all), which
    # torchrun reports as a failed worker. Everything this run had to do is done and
    # written: end here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
