"""PyTorch Lightning training whose checkpoints go through flashckpt (its line is marked
``# flashckpt``; the rest is plain Lightning).

    python examples/train_lightning.py --dir /tmp/run --steps 60 --kill-at 35

A small regression MLP (dropout, AdamW, a StepLR stepped every batch, a shuffled torchdata
``StatefulDataLoader`` that Lightning resumes mid-epoch) trains on CPU. ``ModelCheckpoint(
every_n_train_steps=--save-every, save_last=True)`` saves through
``flashckpt.lightning.CheckpointIO``: each save is snapshotted into shared memory and returns,
the flashckpt agent persists it under ``DIR/.flashckpt`` (or to ``--tier``), and the
checkpoint files in DIR are small pointers to the steps. A run that finds ``DIR/last.ckpt``
resumes with ``trainer.fit(..., ckpt_path="last")``. A run that starts from scratch SIGKILLs
itself after step ``--kill-at``; run the command again and it resumes from the last save. The
final line is a digest of the weights, identical bit for bit to that of a run that was never
killed. One process; options also come from the environment: STEPS, KILL_AT_STEP,
SAVE_EVERY, TRAIN_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

import flashckpt.lightning

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as exc:
    raise SystemExit(
        "this example resumes its dataloader mid-epoch: pip install torchdata"
    ) from exc


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 1),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        data = torch.Generator().manual_seed(42)
        x = torch.randn(512, 32, generator=data)
        y = torch.sin(x @ torch.randn(32, 1, generator=data))
        return StatefulDataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


class KillAfter(pl.Callback):
    """Simulates a crash: SIGKILL after step ``step`` (its save, if any, is done)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            print(f"killed after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Resumed(pl.Callback):
    def on_train_start(self, trainer, module):
        if trainer.global_step:
            print(f"resumed at step {trainer.global_step}", flush=True)


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=env("TRAIN_DIR", "/tmp/flashckpt-lightning"))
    parser.add_argument("--steps", type=int, default=int(env("STEPS", "60")))
    parser.add_argument("--kill-at", type=int, default=int(env("KILL_AT_STEP", "-1")),
                        help="SIGKILL this run after that step, unless it resumed")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=int(env("SAVE_EVERY", "10")))
    parser.add_argument("--tier", action="append", default=[],
                        help="where the agent persists the steps (default: DIR/.flashckpt)")  # fmt: skip
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    model = Regression()
    resume = "last" if (Path(args.dir) / "last.ckpt").exists() else None
    callbacks = [
        ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.save_every, save_last=True),
        Resumed(),
    ]
    if resume is None and args.kill_at >= 0:
        callbacks.append(KillAfter(args.kill_at))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[flashckpt.lightning.CheckpointIO(*args.tier)],  # flashckpt
    )
    trainer.fit(model, ckpt_path=resume)  # "last": restored from memory, else from a tier
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(f"digest {digest.hexdigest()}")


if __name__ == "__main__":
    main()
