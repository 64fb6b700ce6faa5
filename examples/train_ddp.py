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

import simulate  # the examples' seeded inputs, simulated failure and digest: not flashckpt
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashckpt import Checkpointer

IN, HIDDEN, OUT, BATCH = 32, 128, 16, 16


def main() -> None:
    args = simulate.parser(__doc__, 40, "file:///tmp/ckpt-ddp", "shared memory only").parse_args()
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
    first = simulate.fresh_start(restored)
    simulate.report_start(rank, restored, start, args.steps)

    for step in range(start, args.steps):
        x = simulate.inputs(step, rank, BATCH, IN)
        y = x @ target
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step, state)  # flashckpt: snapshot this step (returns in milliseconds)
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        simulate.fail_if_asked(args, first, step, rank)

    ckpt.close()  # waits until the tiers hold the last step
    simulate.report_end(rank, args.steps, restored, net.named_parameters())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
