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

import gc
import os

import simulate  # the examples' seeded inputs, simulated failure and digest: not flashckpt
import torch
import torch.distributed as dist

IN, HIDDEN, OUT, BATCH = 32, 128, 16, 16


def parse_args():
    p = simulate.parser(__doc__, 30, "file:///tmp/ds-tier", "SAVE_DIR/.flashckpt")
    p.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher")
    p.add_argument("--save-dir", default=os.environ.get("SAVE_DIR", "ds-ckpt"),
                   help="the directory given to save_checkpoint/load_checkpoint")  # fmt: skip
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    return p.parse_args()


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
    first = simulate.fresh_start(restored)
    simulate.report_start(rank, restored, start, args.steps, f" ({path})")

    for step in range(start, args.steps):
        x = simulate.inputs(step, rank, BATCH, IN)
        y = x @ target
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(args.save_dir, client_state={"step": step})  # to shared memory
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        simulate.fail_if_asked(args, first, step, rank)

    flash.close()  # waits until the tiers hold the last step
    full = ((n, safe_get_full_fp32_param(p)) for n, p in engine.module.named_parameters())
    simulate.report_end(rank, args.steps, restored, full)  # gathers: every rank takes part
    del engine, model, opt, full  # their gloo work is freed while the process group is alive
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
