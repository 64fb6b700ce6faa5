"""A Megatron-Core trainer for the tests: ``megatron_trainer.py save|restore TP OUT``.

Megatron-Core's forward pass needs CUDA, so "training" here is an AdamW step on gradients
made by hand: each block's gradient is its slice of one global tensor drawn from the block's
name, so every layout sees the same global gradients and replicas stay identical. ``save``
builds a 2-layer GPTModel (CPU initialisation) at tensor-parallel size TP, takes that step
and saves step 1 through ``flashckpt.megatron`` to MEGATRON_TIER, then closes (the tier holds
every rank). ``restore`` builds the model and a fresh AdamW from another seed at TP and
restores. Each rank writes ``OUT.<rank>``: every block of the model and of the optimizer's
state it holds (name, global offset, values), and the step restored.
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from flashckpt import Checkpointer  # noqa: E402
from flashckpt import megatron as flash_mcore  # noqa: E402


def build(seed: int) -> tuple[GPTModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )  # fmt: skip
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=8,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_by_hand(model: GPTModel, opt: torch.optim.Optimizer) -> None:
    """One AdamW step on each block's slice of a global gradient drawn from its name."""
    state = flash_mcore.state(model)
    for name, leaf in state.state_dict()["model"].items():
        if not isinstance(leaf, flash_mcore.Sharded):
            continue
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        whole = torch.randn(leaf.shard.global_shape, generator=g)
        box = tuple(slice(o, o + n) for o, n in
                    zip(leaf.shard.global_offset, leaf.local.shape, strict=True))  # fmt: skip
        for p in model.parameters():  # the parameter the block is (or views)
            if p.data_ptr() == leaf.local.data_ptr() and p.shape == leaf.local.shape:
                p.grad = whole[box].clone()
    opt.step()
    opt.zero_grad()


def blocks(state: flash_mcore.MegatronState) -> dict:
    """Every block this rank holds, model and optimizer: name -> (global offset, values)."""
    sd = state.state_dict()
    out = {}
    for part in (sd["model"], sd.get("optimizer", {}).get("state", {})):
        for name, leaf in part.items():
            if isinstance(leaf, flash_mcore.Sharded):
                out[name] = (leaf.shard.global_offset, leaf.local.detach().clone())
    return out


def dist_checkpointing_phase(phase: str, model: GPTModel, opt, out: str) -> None:
    """``dcsave``/``dcload``: the model through Megatron's own ``dist_checkpointing.save``
    and ``load`` with the flashckpt backend, into MEGATRON_DIR/iter_0000007; ``dcexported``:
    ``dist_checkpointing.load`` (torch_dist, no flashckpt backend) of MEGATRON_EXPORT."""
    from megatron.core import dist_checkpointing

    import flashckpt.megatron_dist

    if phase != "dcexported":
        flashckpt.megatron_dist.register()
    where = os.path.join(os.environ.get("MEGATRON_DIR", ""), "iter_0000007")
    result: dict = {}
    if phase == "dcexported":  # written by flashckpt export: Megatron's own torch_dist
        from megatron.core.dist_checkpointing.validation import StrictHandling

        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                         os.environ["MEGATRON_EXPORT"],
                                         strict=StrictHandling.LOG_ALL)  # fmt: skip
        model.load_state_dict(loaded["model"], strict=False)
    elif phase == "dcsave":
        step_by_hand(model, opt)
        os.makedirs(where, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 7}, where,
                                sharded_strategy=("flashckpt", 1))  # fmt: skip
    else:
        try:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, where)
            model.load_state_dict(loaded["model"])
            result["iteration"] = loaded["iteration"]
        except Exception as exc:  # the test reads what a user would see
            result["error"] = f"{type(exc).__name__}: {exc}"
    flashckpt.megatron_dist.close()
    result["blocks"] = blocks(flash_mcore.state(model))
    torch.save(result, f"{out}.{dist.get_rank()}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    phase, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    pp = int(os.environ.get("MEGATRON_PP", "1"))  # pipeline stages
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)  # fmt: skip
    model, opt = build(0 if phase in ("save", "dcsave") else 1)
    if phase.startswith("dc"):
        dist_checkpointing_phase(phase, model, opt, out)
        return
    ckpt = Checkpointer(f"file://{os.environ['MEGATRON_TIER']}")
    state = flash_mcore.state(model, opt)
    result: dict = {}
    if phase == "save":
        step_by_hand(model, opt)
        ckpt.save(1, {"megatron": state})
        result["step"] = 1
    else:
        try:
            result["step"] = ckpt.restore({"megatron": state})
            result["source"] = ckpt._restored_from
        except Exception as exc:  # the test reads what a user would see
            result["error"] = f"{type(exc).__name__}: {exc}"
    result["blocks"] = blocks(state)
    result["steps"] = {int(v.item()) for st in opt.state.values() for k, v in st.items()
                       if k == "step"}  # fmt: skip
    result["lr"] = opt.param_groups[0]["lr"]
    ckpt.close()
    torch.save(result, f"{out}.{dist.get_rank()}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
