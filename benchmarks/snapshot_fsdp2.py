"""The snapshot benchmark's FSDP2 case, run on each of two gloo ranks (see snapshot.py).

A model of square Linear layers, ``fully_shard`` per layer and on the whole, with AdamW
state made by a training step. Per rank, the blocking time of
``Checkpointer(tier).save(step, {"model": model, "optim": opt})`` (a new step each time; the
agent persists it to a file tier in the work directory, waited for untimed) against a
memcpy of the same bytes (the rank's local shards and optimizer state) into allocated
memory, and against DCP ``save`` and the blocking part of ``async_save`` of the same state
to the same directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from snapshot_harness import Memcpy, Method, linear_stack, local_tensors, remove_together
from snapshot_harness import report as print_report
from snapshot_harness import rounds as time_rounds
from torch.distributed.fsdp import fully_shard

from flashckpt import Checkpointer

WIDTH = 2048


def build(params_m: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = linear_stack(params_m, WIDTH)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, WIDTH)).pow(2).mean().backward()
    opt.step()  # AdamW state exists from here on
    opt.zero_grad()
    return model, opt


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    model, opt = build(args.params_m)
    state = {"model": model, "optim": opt}
    work = Path(args.work_dir)
    tier = f"file://{work / 'flash'}"
    ck = Checkpointer(tier)
    ck.restore(state)  # finds nothing; readies the slots, as a job's start does
    copy = Memcpy(local_tensors(state))

    def saved(step: int) -> None:
        ck._sealer.drain()  # checksums run in the background: keep them out of the next call
        ck.wait(step, tier=tier, timeout=600)

    def dcp_state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    pending: list = []

    def async_done(i: int) -> None:
        response = pending.pop()
        getattr(response, "upload_completion", response).result()
        remove_together(work / f"async-{i}")

    methods = [
        Method("memcpy", "memcpy of the same bytes (baseline)", copy),
        Method("flashckpt", "flashckpt save() (FSDP2 shards)", lambda i: ck.save(i, state), saved),
        Method("dcp", "torch.distributed.checkpoint.save",
               lambda i: dcp.save(dcp_state(), checkpoint_id=work / f"dcp-{i}"),
               lambda i: remove_together(work / f"dcp-{i}")),
        Method("dcp_async", "torch.distributed.checkpoint.async_save",
               lambda i: pending.append(dcp.async_save(dcp_state(), checkpoint_id=work / f"async-{i}")),
               async_done),
    ]  # fmt: skip
    for m in methods:
        m.nbytes = copy.nbytes
    times = time_rounds(methods, args.rounds)
    ck.close()
    layers = len(model)
    print_report(
        "fsdp2",
        f"{layers} Linear({WIDTH}, {WIDTH}) layers fully_shard each + AdamW; files in {work}",
        methods,
        times,
        [
            ("flashckpt/memcpy_bandwidth", "memcpy", "flashckpt"),
            ("dcp_save/flashckpt", "dcp", "flashckpt"),
            ("dcp_async_save/flashckpt", "dcp_async", "flashckpt"),
        ],
    )
    dist.destroy_process_group()
