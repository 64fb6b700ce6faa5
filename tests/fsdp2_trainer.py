"""An FSDP2 trainer for the tests: ``fsdp2_trainer.py save|restore RESULT``.

``save`` trains steps 1-3 of a small model sharded per layer with ``fully_shard``, saving
each with the two-line API, then takes step 4. ``restore`` builds the model and a fresh
AdamW from another seed, restores (the newest step must be 3) and takes step 4. Rank 0
writes to RESULT the full parameters and AdamW moments at step 3 (``at3``: saved, or just
restored) and the full parameters after step 4, so runs can be compared bit for bit (at
another world size, step 4 sees other data: only ``at3`` compares). A restore that fails
writes its error to RESULT instead. ``crash`` is ``save`` that ends without ``close()``, as a
killed job would: its snapshots stay in shared memory. With FSDP_TIER empty the Checkpointer
has no tier (memory only). Rank 0 also writes where the restore came from (``source``).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from flashckpt import Checkpointer


def build(seed: int, shard: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (sharded per layer unless ``shard`` is False) and its AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if shard:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every parameter and AdamW moment as full tensors (collectives: every rank calls it)."""
    out = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{i}"] = opt.state[p][name].full_tensor().tolist()
    return out


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    tier = os.environ.get("FSDP_TIER")
    ckpt = Checkpointer(*([f"file://{tier}"] if tier else []))
    model, opt = build(0 if phase in ("save", "crash") else 1)
    result: dict = {}
    if phase in ("save", "crash"):
        for step in range(1, 4):
            train_step(model, opt, step)
            ckpt.save(step, {"model": model, "optim": opt, "step": step})
        result["at3"] = full(model, opt)
    else:
        state = {"model": model, "optim": opt, "step": 0}
        try:
            result["restored"] = ckpt.restore(state)
            result["at3"] = full(model, opt)
            result["source"] = ckpt._restored_from
        except Exception as exc:  # the test reads what a user would see
            result["error"] = f"{type(exc).__name__}: {exc}"
    if "error" not in result:
        train_step(model, opt, 4)
        result["params"] = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    if phase != "crash":
        ckpt.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if phase == "crash":
        dist.barrier()
        os._exit(0)  # no close(), no clean-up: the snapshots stay in shared memory
    del model, opt  # FSDP2's gloo work freed while the group lives (else an abort at exit)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
