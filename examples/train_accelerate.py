"""Hugging Face Accelerate training whose save_state/load_state go through flashckpt.

    python examples/train_accelerate.py --dir /tmp/run --steps 60 --kill-at 35

A small regression MLP (dropout, AdamW, warm-up then cosine LR, a shuffled stateful
dataloader) trains on CPU with Accelerate's automatic checkpoint naming: every ``--save-every``
steps ``accelerator.save_state()`` snapshots everything into shared memory and returns; the
flashckpt agent persists it under ``DIR/.flashckpt`` and ``DIR/checkpoints/checkpoint_N`` holds
a pointer to it (the newest ``--total-limit`` are kept). A run that finds a checkpoint resumes
with ``accelerator.load_state()``. A run that starts from scratch SIGKILLs itself after step
``--kill-at``; run the command again and it resumes. The final line is a digest of the
weights, identical bit for bit to that of a run that was never killed. Under torchrun (or
``accelerate launch``) each process does the same. Options also come from the environment:
STEPS, KILL_AT_STEP, SAVE_EVERY, TRAIN_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

import flashckpt.accelerate as flash_accelerate


class Progress:
    """The training step, saved by ``save_state`` through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def schedule(total: int):
    warmup = max(1, total // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=env("TRAIN_DIR", "/tmp/flashckpt-accelerate"))
    parser.add_argument("--steps", type=int, default=int(env("STEPS", "60")))
    parser.add_argument("--kill-at", type=int, default=int(env("KILL_AT_STEP", "-1")),
                        help="SIGKILL this run after that step, unless it resumed")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=int(env("SAVE_EVERY", "10")))
    parser.add_argument("--total-limit", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=args.dir, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=1
        ),
    )
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(42)
    x = torch.randn(512, 32, generator=data)
    y = torch.sin(x @ torch.randn(32, 1, generator=data)) + 0.05 * torch.randn(
        512, 1, generator=data
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args.steps))
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    flash = flash_accelerate.attach(accelerator)  # save_state/load_state now go through flashckpt
    resumed = any((Path(args.dir) / "checkpoints").glob("checkpoint_*/flashckpt.pointer"))
    if resumed:
        accelerator.load_state()  # the newest checkpoint_N
        accelerator.print(f"resumed at step {progress.step}", flush=True)

    while progress.step < args.steps:
        for xb, yb in loader:
            loss = (model(xb) - yb).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            if progress.step % args.save_every == 0:
                accelerator.save_state()  # returns once the snapshot is in shared memory
            if progress.step == args.kill_at and not resumed:
                accelerator.print(f"killed after step {progress.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.step == args.steps:
                break

    flash.close()  # waits until the tier holds the last step saved
    digest = hashlib.sha256()
    for p in accelerator.unwrap_model(model).parameters():
        digest.update(p.detach().numpy().tobytes())
    accelerator.print(f"loss {loss.item():.5f}")
    accelerator.print(f"digest {digest.hexdigest()}")
    accelerator.end_training()  # ends the process group, as destroy_process_group() does


if __name__ == "__main__":
    main()
