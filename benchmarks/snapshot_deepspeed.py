"""The snapshot benchmark's DeepSpeed case, run on each of two gloo ranks (see snapshot.py).

One ZeRO-2 engine (DS_ACCELERATOR=cpu) of square Linear layers with AdamW state made by a
training step. Each round times the blocking part of ``engine.save_checkpoint(dir, tag)``
twice on the same engine, so both save the same state: once through
``flashckpt.deepspeed.attach(engine)`` (a new step each time; the agent persists it to the
directory's ``.flashckpt`` tier, waited for untimed) and once with DeepSpeed's own checkpoint
engine, put back for that call, to the same directory; and a memcpy of the bytes the
attached engine snapshots on this rank. DeepSpeed writes the model states from rank 0 only,
the attached engine keeps them on every rank: rank 0 saves the same bytes either way, and
``save_checkpoint`` ends in a barrier, so every rank waits for rank 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from snapshot_harness import Memcpy, Method, linear_stack, local_tensors, remove_together, timed
from snapshot_harness import report as print_report
from snapshot_harness import rounds as time_rounds

import flashckpt.deepspeed as flash_ds

WIDTH = 2048


def build(params_m: int) -> Any:
    torch.manual_seed(0)
    model = linear_stack(params_m, WIDTH)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.backward(engine(torch.randn(2, WIDTH)).pow(2).mean())
    engine.step()  # AdamW state exists from here on
    return engine


def recording(checkpoint_engine: Any) -> dict[str, Any]:
    """The files (path -> state) ``checkpoint_engine`` is handed, kept until cleared."""
    files: dict[str, Any] = {}
    inner = checkpoint_engine.save

    def save(state_dict: Any, path: str) -> None:
        files[path] = state_dict
        inner(state_dict, path)

    checkpoint_engine.save = save
    return files


def main(args: argparse.Namespace) -> None:
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(args.params_m)
    directory = Path(args.work_dir) / "ckpt"
    own = (engine.checkpoint_engine, engine.save_non_zero_checkpoint)
    own_files = recording(own[0])
    flash = flash_ds.attach(engine)
    flash_files = recording(flash)
    attached = (flash, engine.save_non_zero_checkpoint)

    def save_with(how: tuple[Any, bool], tag: str) -> None:
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = how
        engine.save_checkpoint(str(directory), tag=tag)

    def flash_saved(_round: int) -> None:
        flash.ckpt._sealer.drain()  # checksums run in the background
        flash.ckpt.wait(flash.last, tier=flash.ckpt.tiers[0], timeout=600)
        flash_files.clear()

    def own_saved(i: int) -> None:
        plain.nbytes = sum(os.path.getsize(p) for p in own_files)
        own_files.clear()
        remove_together(directory / f"deepspeed-{i}")

    save_with(attached, "first")  # untimed: the first snapshot, and the bytes it holds
    copy = Memcpy(local_tensors(list(flash_files.values())))
    flash_saved(0)
    inner, snapshot = [], flash.ckpt.save

    def timed_snapshot(step: int, state: Any) -> None:  # the Checkpointer's part of the save
        inner.append(timed(lambda: snapshot(step, state)))

    flash.ckpt.save = timed_snapshot
    plain = Method("deepspeed", "save_checkpoint(), DeepSpeed's own",
                   lambda i: save_with(own, f"deepspeed-{i}"), own_saved)  # fmt: skip
    methods = [
        Method("memcpy", "memcpy of the same bytes (baseline)", copy, nbytes=copy.nbytes),
        Method("flashckpt", "save_checkpoint(), flashckpt attached",
               lambda i: save_with(attached, f"flash-{i}"), flash_saved, copy.nbytes),
        Method("snapshot", "  of which Checkpointer.save()", None, nbytes=copy.nbytes),
        plain,
    ]  # fmt: skip
    times = time_rounds(methods, args.rounds)
    times["snapshot"] = inner[1:]  # not the warm-up round's
    flash.close()
    layers = len(engine.module)
    print_report(
        "deepspeed",
        f"ZeRO-2, {layers} Linear({WIDTH}, {WIDTH}) layers + AdamW; files in {directory}",
        methods,
        times,
        [
            ("flashckpt/memcpy_bandwidth", "memcpy", "flashckpt"),
            ("deepspeed_save/flashckpt", "deepspeed", "flashckpt"),
        ],
    )
    dist.destroy_process_group()
