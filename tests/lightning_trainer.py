"""A Lightning trainer for the tests: ``lightning_trainer.py RESULT --dir DIR [options]``.

A small ``LightningModule`` (three Linear layers with dropout, AdamW, a StepLR stepped every
batch) fits 48 synthetic samples in shuffled batches of 4 from a torchdata
``StatefulDataLoader`` (resumable mid-epoch), seeded with ``seed_everything(0)``, on CPU; under
torchrun it runs DDP over gloo (``strategy="ddp"``), each rank a shard. ``ModelCheckpoint(
dirpath=DIR, every_n_train_steps=--every, save_last=True)`` saves through
``flashckpt.lightning.CheckpointIO`` (``--tier URL``, or none: DIR/.flashckpt), or through
Lightning's own files with ``--plain``. ``--resume PATH|last`` fits from a checkpoint.
``--hang-after S`` stops after step S is saved (and stored in the first tier), writes
RESULT.ready and sleeps, to be SIGKILLed from outside.

Each rank writes RESULT.<rank> (JSON): after every step its parameters' digest, learning rate,
batch digest and the digest of the torch generator's state; at the start of training the
step it starts after and where flashckpt restored it from; at the end the parameters' and the
optimizer state's digests, the learning rate, the global step and the next random draws
(torch, NumPy, Python).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import flashckpt.lightning


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_digest(opt: torch.optim.Optimizer) -> str:
    state = opt.state_dict()["state"]
    return digest(*[v for k in sorted(state) for _, v in sorted(state[k].items())])


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, stateful: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
            torch.nn.Linear(32, 4),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(123)  # the same samples in every run
        data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g))
        loader = StatefulDataLoader if self.hparams.stateful else DataLoader
        return loader(data, batch_size=4, shuffle=True)


class Recorder(pl.Callback):
    """Writes what a user would compare between an interrupted and an uninterrupted run."""

    def __init__(self, out: str, io: flashckpt.lightning.CheckpointIO | None, hang_after: int):
        self.out, self.io, self.hang_after = out, io, hang_after
        self.result: dict = {"steps": {}}

    def on_train_start(self, trainer, module):
        self.result["started_after"] = trainer.global_step
        self.result["source"] = self.io and self.io.restored_from

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.hang_after:  # step S and its save are done
            if self.io is not None:
                ckpt = self.io.ckpt
                ckpt.wait(self.io.last, tier=ckpt.tiers[0], timeout=60)
            Path(f"{self.out}.ready.{trainer.global_rank}").write_text(str(trainer.global_step))
            time.sleep(600)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.result["steps"][trainer.global_step] = {
            "params": digest(*module.parameters()),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "batch": digest(batch[0]),
            "rng": digest(torch.get_rng_state()),
        }

    def finish(self, trainer, module) -> None:
        self.result.update(
            params=digest(*module.parameters()),
            optimizer=optimizer_digest(trainer.optimizers[0]),
            lr=trainer.optimizers[0].param_groups[0]["lr"],
            global_step=trainer.global_step,
            draws=[torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()],
        )
        Path(f"{self.out}.{trainer.global_rank}").write_text(json.dumps(self.result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--tier", action="append", default=[])
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--hang-after", type=int, default=-1)
    parser.add_argument("--loader", choices=["stateful", "plain"], default="stateful")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    model = Tiny(stateful=args.loader == "stateful")
    io = None if args.plain else flashckpt.lightning.CheckpointIO(*args.tier)
    recorder = Recorder(args.result, io, args.hang_after)
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_last=True),
            recorder,
        ],  # fmt: skip
        plugins=[] if io is None else [io],
    )
    trainer.fit(model, ckpt_path=args.resume)
    recorder.finish(trainer, model)


if __name__ == "__main__":
    main()
