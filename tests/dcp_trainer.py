"""A trainer that saves and loads through DCP's own calls with flashckpt's storage:
``dcp_trainer.py save|async|save-plain|save-replicated|load|load-plain RESULT``.

``save`` (``async``: with ``dcp.async_save``) trains steps 1-3 of a small model sharded per
layer with ``fully_shard`` and saves each with ``dcp.save(state, checkpoint_id=f"step-{step}",
storage_writer=flashckpt.dcp.Writer(ckpt))``, the state made by DCP's ``get_state_dict``.
``load`` builds the model and a fresh AdamW from another seed and loads with
``dcp.load(state, storage_reader=flashckpt.dcp.Reader(ckpt))`` and ``set_state_dict``. The
``-plain`` phases do the same in one process without a process group, with a model that is not
sharded; ``save-replicated`` saves such a model from every rank of the group, each rank
training on the same data (every rank holds the whole model, as under DDP). Rank 0 writes to RESULT the
full parameters and AdamW moments at step 3 (``at3``), the step the state says, and where the
load came from (or the error a user would see).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp2_trainer import build
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import flashckpt.dcp
from flashckpt import Checkpointer


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() and not os.environ["DCP_REPLICATED"] else 0
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(t: torch.Tensor) -> list:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).tolist()


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every parameter and AdamW moment as full tensors (collectives: every rank calls it)."""
    out = {k: _full(v) for k, v in model.state_dict().items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{i}"] = _full(opt.state[p][name])
    return out


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    alone = phase.endswith("-plain")
    replicated = phase == "save-replicated"  # under a process group, every rank the same model
    if not alone:
        dist.init_process_group("gloo")
    os.environ["DCP_REPLICATED"] = "1" if replicated else ""
    ckpt = Checkpointer(f"file://{os.environ['DCP_TIER']}")
    saving = phase in ("save", "async", "save-plain", "save-replicated")
    model, opt = build(0 if saving else 1, shard=not (alone or replicated))
    result: dict = {}
    if saving:
        pending = planning = None
        for step in range(1, 4):
            train_step(model, opt, step)
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            writer = flashckpt.dcp.Writer(ckpt)
            if phase == "async":
                if pending is not None:
                    pending.result()
                # Its own group for the background planning, as DCP asks: the training's
                # collectives keep the default one.
                planning = planning or dist.new_group(backend="gloo")
                pending = dcp.async_save(state, checkpoint_id=f"step-{step}",
                                         storage_writer=writer, process_group=planning)  # fmt: skip
            else:
                dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=writer)
        if pending is not None:
            pending.result()
        result["at3"] = full(model, opt)
        ckpt.wait(3, timeout=60)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        reader = flashckpt.dcp.Reader(ckpt)
        try:
            dcp.load(state, storage_reader=reader)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])  # fmt: skip
            result.update(loaded=reader.loaded, step=state["step"], at3=full(model, opt),
                          source=ckpt._restored_from)  # fmt: skip
        except Exception as exc:  # the test reads what a user would see
            result["error"] = f"{type(exc).__name__}: {exc}"
    ckpt.close()
    if alone or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if not alone:
        del model, opt  # FSDP2's gloo work freed while the group lives (else an abort at exit)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
