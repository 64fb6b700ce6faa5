"""An Accelerate trainer for the tests: ``accel_trainer.py save|load DIR RESULT [NAME]``.

A real ``Accelerator(cpu=True)`` (DDP over gloo under torchrun) trains a small model with
dropout, AdamW, a LambdaLR schedule and a stateful, seedably shuffled dataloader of 24
samples in batches of 4, counting steps in an object given to ``register_for_checkpointing``.
``save`` trains steps 1-9 from seed 0 and ``accelerator.save_state`` s after step 4 into
DIR/a and after step 6 into DIR/b, through ``flashckpt.accelerate.attach``. ``load`` builds
everything from seed 1, ``accelerator.load_state(DIR/NAME)`` and trains on to step 9. Each
process writes RESULT.<rank>: after every step its parameter digest, learning rate, batch,
``accelerator.step`` and the process's next random draw; after a load, what was restored.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import flashckpt.accelerate as flash_accelerate

LAST = 9
SAVES = {4: "a", 6: "b"}


class Counter:
    """The training step, saved and restored through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    phase, directory, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    name = sys.argv[4] if len(sys.argv) > 4 else "b"
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=7
        ),
    )
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

    result: dict = {"steps": {}}
    if phase == "load":
        accelerator.load_state(str(directory / name))
        result["loaded"] = {
            "n": counter.n,
            "lr": sched.get_last_lr(),
            "step": accelerator.step,
            "save_iteration": accelerator.save_iteration,
            "epoch": loader.iteration,
            "source": flash.ckpt._restored_from,
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
            unwrapped = accelerator.unwrap_model(model)
            result["steps"][counter.n] = {
                "digest": digest(unwrapped),
                "lr": sched.get_last_lr(),
                "batch": ids.tolist(),
                "step": accelerator.step,
            }
            if phase == "save" and counter.n in SAVES:
                accelerator.save_state(str(directory / SAVES[counter.n]))
            if counter.n == LAST:
                break
    result["params"] = [p.tolist() for p in accelerator.unwrap_model(model).parameters()]
    result["draw"] = torch.rand(1).item()  # the generator went on as in the saving run
    flash.close()
    Path(f"{out}.{accelerator.process_index}").write_text(json.dumps(result))
    accelerator.end_training()  # ends the process group: gloo's threads outlive it otherwise


if __name__ == "__main__":
    main()
