"""Example: DeepSpeed (ZeRO stage 2) training with flash checkpoints (the flashckpt line is
marked ``# flashckpt``).

``flashckpt.deepspeed.attach(engine, *tiers)`` routes the engine's own
``save_checkpoint``/``load_checkpoint`` through flashckpt: ``save_checkpoint(dir)`` snapshots
each rank's files into shared memory and returns, the node's agent persists them to the
tiers (with none, to ``dir/.flashckpt``), and ``dir`` keeps DeepSpeed's layout (``latest``,
one folder per tag) with small pointer files. ``load_checkpoint(dir)`` at start loads the
latest tag from this node's memory, else from the tiers. A small MLP learns a fixed random
linear map; every step is saved.

On CPU, with DeepSpeed's launcher (``--num_gpus`` is the number of CPU processes here;
DeepSpeed picks its CPU accelerator itself when there is no GPU, or set DS_ACCELERATOR=cpu):

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_deepspeed.py \\
        --save-dir /tmp/ds-ckpt

``KILL_AT_STEP=12`` (or ``--kill-at 12``) makes rank 1 SIGKILL itself after saving step 12
when the run starts fresh; the launcher then stops the other ranks and fails. Run the same
command again and it resumes at step 13 from ``load_checkpoint``. torchrun works as well
(``torchrun --standalone --nproc-per-node=2 examples/train_deepspeed.py --save-dir ...``),
as does ``flashckpt-run --max-restarts=1`` for a restart without a second command.

Options may also come from the environment (STEPS, SAVE_DIR, TIER, KILL_AT_STEP, KILL_RANK).
Rank 0 ends with ``final: steps=N resumed_after_step=S sha256=...`` (S is ``none`` for a
fresh start): the digest of every full fp32 parameter, equal bit for bit to an undisturbed
run's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
import torch.distributed as dist

IN, HIDDEN, OUT, BATCH = 32, 128, 16, 16


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher")
    p.add_argument("--steps", type=int, default=int(env("STEPS", "30")), help="steps to train")
    p.add_argument(
        "--save-dir",
        default=env("SAVE_DIR", "ds-ckpt"),
        help="the directory given to save_checkpoint/load_checkpoint",
    )
    p.add_argument(
        "--tier",
        action="append",
        default=[t for t in env("TIER", "").split(",") if t],
        help="where the agent persists each step, e.g. file:///tmp/ds-tier (repeatable; "
        "none: SAVE_DIR/.flashckpt)",
    )
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    p.add_argument(
        "--kill-at",
        type=int,
        default=int(env("KILL_AT_STEP", "-1")),
        help="in a fresh run, --kill-rank SIGKILLs itself after saving this step",
    )
    p.add_argument("--kill-rank", type=int, default=int(env("KILL_RANK", "1")))
    return p.parse_args()


def batch(step: int, rank: int, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same on every attempt, so a resumed run sees what an
    undisturbed one would."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x @ target


def main() -> None:
    args = parse_args()
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # after DS_ACCELERATOR is settled
    from deepspeed.utils import safe_get_full_fp32_param

    import flashckpt.deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    target = torch.randn(IN, OUT) / IN**0.5  # the map to learn, the same on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,  # a plain torch AdamW, no compiled ops needed
    }
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    flash = flashckpt.deepspeed.attach(engine, *args.tier)  # flashckpt: the one added line
    path, client = engine.load_checkpoint(args.save_dir)  # the latest tag, or (None, None)
    restored = None if path is None else int(client["step"])
    start = 0 if restored is None else restored + 1
    # The first attempt: a fresh start, not a restart by torchrun/flashckpt-run.
    first = restored is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 0:
        how = "fresh" if restored is None else f"resuming after step {restored} ({path})"
        print(f"[rank 0] {how}: steps {start}..{args.steps - 1}", flush=True)

    for step in range(start, args.steps):
        x, y = batch(step, rank, target)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(args.save_dir, client_state={"step": step})  # to shared memory
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if first and step == args.kill_at:  # the simulated failure
            dist.barrier()  # every rank has saved this step: the rerun resumes after it
            if rank == args.kill_rank:
                print(f"[rank {rank}] SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    flash.close()  # waits until the tiers hold the last step
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)  # a collective: every rank takes part
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    if rank == 0:
        resumed = "none" if restored is None else restored
        print(f"final: steps={args.steps} resumed_after_step={resumed} sha256={h.hexdigest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
