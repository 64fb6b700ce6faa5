"""Example: FSDP2 (``fully_shard``) training with flash checkpoints (the flashckpt lines are
marked ``# flashckpt``).

A tiny transformer (two pre-norm attention + MLP blocks, each block sharded with
``fully_shard``) learns to copy the previous token of random sequences, on CPU with gloo.
Each rank saves its own shards every step with ``ckpt.save(step, state)``; the node's agent
persists the snapshots to the tiers given with ``--tier``. At start ``ckpt.restore(state)``
loads the newest step every rank holds into the sharded model and optimizer, in place.
A restore needs the same number of ranks as the save (shards are not resharded).

Run it on 2 ranks (a rerun of the same command resumes where the last one stopped):

    torchrun --standalone --nproc-per-node=2 examples/train_fsdp2.py --tier file:///tmp/ckpt-fsdp2

With automatic restarts: ``KILL_AT_STEP=12`` makes rank 1 SIGKILL itself after saving step
12 on the first attempt; flashckpt-run restarts the workers and they resume at step 13:

    KILL_AT_STEP=12 flashckpt-run --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/train_fsdp2.py --tier file:///tmp/ckpt-fsdp2

Options may also come from the environment (STEPS, TIER, KILL_AT_STEP, KILL_RANK); given
there, they leave the job name (derived from the command line unless FLASHCKPT_JOB is set)
the same between the run that dies and the one that resumes.

Rank 0 ends with ``final: steps=N resumed_after_step=S sha256=...`` (S is ``none`` for a
fresh start): the digest of every parameter gathered to its full tensor, equal bit for bit
to an undisturbed run's.
"""

from __future__ import annotations

import gc

import simulate  # the examples' seeded inputs, simulated failure and digest: not flashckpt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from flashckpt import Checkpointer

DIM, HEADS, SEQ, BATCH = 32, 4, 8, 8


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.LayerNorm(DIM))
    for block in model[:2]:
        fully_shard(block)  # each block's parameters sharded across the ranks
    fully_shard(model)
    return model


def full_parameters(model: torch.nn.Module):
    """Every parameter as a full tensor: a collective (each rank gathers the shards)."""
    for name, p in model.named_parameters():
        yield name, p.full_tensor() if isinstance(p, DTensor) else p


def main() -> None:
    args = simulate.parser(__doc__, 30, "file:///tmp/ckpt-fsdp2", "shared memory only").parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = {"model": model, "optim": opt}

    ckpt = Checkpointer(*args.tier)  # flashckpt: shared memory, plus the tiers
    restored = ckpt.restore(state)  # flashckpt: this rank's shards of the newest step
    start = 0 if restored is None else restored + 1
    first = simulate.fresh_start(restored)
    simulate.report_start(rank, restored, start, args.steps)

    for step in range(start, args.steps):
        x = simulate.inputs(step, rank, BATCH, SEQ, DIM)
        y = F.pad(x[:, :-1], (0, 0, 1, 0))  # each position's target: the token before it
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, state)  # flashckpt: snapshot this rank's shards (milliseconds)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        simulate.fail_if_asked(args, first, step, rank)

    ckpt.close()  # waits until the tiers hold the last step
    simulate.report_end(rank, args.steps, restored, full_parameters(model))
    # FSDP2 keeps gloo work objects on the model; freed at interpreter exit, after the process
    # group, they abort the process now and then ("terminate called without an active
    # exception"). Free them while the group is alive.
    del model, opt, state
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
