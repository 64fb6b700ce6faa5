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

import argparse
import hashlib
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from flashckpt import Checkpointer

DIM, HEADS, SEQ, BATCH = 32, 4, 8, 8


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(env("STEPS", "30")), help="steps to train")
    p.add_argument(
        "--tier",
        action="append",
        default=[t for t in env("TIER", "").split(",") if t],
        help="where the agent persists each step, e.g. file:///tmp/ckpt-fsdp2 (repeatable; "
        "none: shared memory only)",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=int(env("KILL_AT_STEP", "-1")),
        help="on the first attempt, --kill-rank SIGKILLs itself after saving this step",
    )
    p.add_argument("--kill-rank", type=int, default=int(env("KILL_RANK", "1")))
    return p.parse_args()


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


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step`` and its target (each position: the token before it).
    The same on every attempt, so a resumed run sees what an undisturbed one would."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    return x, F.pad(x[:, :-1], (0, 0, 1, 0))


def digest(model: torch.nn.Module) -> str:
    """sha256 of every full parameter: a collective (each rank gathers the shards)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = {"model": model, "optim": opt}

    ckpt = Checkpointer(*args.tier)  # flashckpt: shared memory, plus the tiers
    restored = ckpt.restore(state)  # flashckpt: this rank's shards of the newest step
    start = 0 if restored is None else restored + 1
    # The first attempt: a fresh start, not a restart by torchrun/flashckpt-run.
    first = restored is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 0:
        how = "fresh" if restored is None else f"resuming after step {restored}"
        print(f"[rank 0] {how}: steps {start}..{args.steps - 1}", flush=True)

    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, state)  # flashckpt: snapshot this rank's shards (milliseconds)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if first and step == args.kill_at:  # the simulated failure
            dist.barrier()  # every rank has saved this step: the restart resumes after it
            if rank == args.kill_rank:
                print(f"[rank {rank}] SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    ckpt.close()  # waits until the tiers hold the last step
    sha = digest(model)  # every rank takes part in the gather
    if rank == 0:
        resumed = "none" if restored is None else restored
        print(f"final: steps={args.steps} resumed_after_step={resumed} sha256={sha}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
