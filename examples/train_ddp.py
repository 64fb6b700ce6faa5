"""Example: DistributedDataParallel training with flash checkpoints (the flashckpt lines are
marked ``# flashckpt``).

A small MLP learns a fixed random linear map on CPU with gloo. Every step is saved to shared
memory with ``ckpt.save(step, state)``; the node's agent persists the snapshots to the tiers
given with ``--tier``. At start ``ckpt.restore(state)`` loads the newest step every rank holds,
in place, and training goes on from the step after it.

Run it on 2 ranks (a rerun of the same command resumes where the last one stopped):

    torchrun --standalone --nproc-per-node=2 examples/train_ddp.py --tier file:///tmp/ckpt-ddp

With automatic restarts: ``KILL_AT_STEP=20`` makes rank 1 SIGKILL itself after saving step
20 on the first attempt; flashckpt-run restarts the workers and they resume at step 21:

    KILL_AT_STEP=20 flashckpt-run --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/train_ddp.py --tier file:///tmp/ckpt-ddp

Without the launcher, run the torchrun command twice: the first run dies, the second resumes.
Options may also come from the environment (STEPS, TIER, KILL_AT_STEP, KILL_RANK); an option
given in the environment keeps the job name, which is derived from the command line unless
FLASHCKPT_JOB is set, the same between the run that dies and the one that resumes.

Rank 0 ends with ``final: steps=N resumed_after_step=S sha256=...`` (S is ``none`` for a
fresh start): the digest of every parameter, equal bit for bit to an undisturbed run's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashckpt import Checkpointer

IN, HIDDEN, OUT, BATCH = 32, 128, 16, 16


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(env("STEPS", "40")), help="steps to train")
    p.add_argument(
        "--tier",
        action="append",
        default=[t for t in env("TIER", "").split(",") if t],
        help="where the agent persists each step, e.g. file:///tmp/ckpt-ddp (repeatable; "
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


def batch(step: int, rank: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same on every attempt, so a resumed run sees what an
    undisturbed one would."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x @ target


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    target = torch.randn(IN, OUT) / IN**0.5  # the map to learn, the same on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    state = {"model": model, "optim": opt}

    ckpt = Checkpointer(*args.tier)  # flashckpt: shared memory, plus the tiers
    restored = ckpt.restore(state)  # flashckpt: the newest step, in place (None: fresh start)
    start = 0 if restored is None else restored + 1
    # The first attempt: a fresh start, not a restart by torchrun/flashckpt-run.
    first = restored is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 0:
        how = "fresh" if restored is None else f"resuming after step {restored}"
        print(f"[rank 0] {how}: steps {start}..{args.steps - 1}", flush=True)

    for step in range(start, args.steps):
        x, y = batch(step, rank, target)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step, state)  # flashckpt: snapshot this step (returns in milliseconds)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if first and step == args.kill_at:  # the simulated failure
            dist.barrier()  # every rank has saved this step: the restart resumes after it
            if rank == args.kill_rank:
                print(f"[rank {rank}] SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    ckpt.close()  # waits until the tiers hold the last step
    if rank == 0:
        resumed = "none" if restored is None else restored
        print(f"final: steps={args.steps} resumed_after_step={resumed} sha256={digest(net)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
