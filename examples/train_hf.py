"""Example: a Hugging Face ``Trainer`` whose checkpoints go through flashckpt (the flashckpt
lines are marked ``# flashckpt``).

A 2-layer GPT-2 built in code learns sequences that count up from a random start, on CPU.
Every ``--save-every`` steps the Trainer saves a checkpoint; after
``flashckpt.hf.attach(trainer)`` that save is a snapshot into shared memory which returns at
once, and the node's agent persists it to the tiers (``--tier``; none: ``DIR/.flashckpt``).
``DIR/checkpoint-N`` keeps the Trainer's ``trainer_state.json`` and a pointer to the step. A
run that finds a checkpoint in DIR resumes with ``trainer.train(resume_from_checkpoint=True)``.

    python examples/train_hf.py --dir /tmp/flashckpt-hf --kill-at 30   # dies after step 30
    python examples/train_hf.py --dir /tmp/flashckpt-hf --kill-at 30   # resumes after it

On a fresh start, ``--kill-at S`` makes ``--kill-rank`` (the last process by default) SIGKILL
itself once the first checkpoint at or after step S is saved. Under torchrun each process
does the same, as DDP over gloo (``torchrun --standalone --nproc-per-node=2
examples/train_hf.py --dir /tmp/flashckpt-hf``); under ``flashckpt-run --max-restarts=1`` the
restarted workers resume by themselves. Options may also come from the environment (STEPS,
TIER, KILL_AT_STEP, KILL_RANK, TRAIN_DIR, SAVE_EVERY).

The last line, ``final: steps=N resumed_after_step=S sha256=...`` (S is ``none`` for a
fresh start), is the digest of every parameter, equal bit for bit to an undisturbed run's.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import simulate  # the examples' command line, simulated failure and digest: not flashckpt
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import flashckpt.hf

SAMPLES, LENGTH, VOCAB = 256, 16, 64


class Counting(torch.utils.data.Dataset):
    """Sequences ``s, s+1, s+2, ...`` (mod the vocabulary) from a seeded random start ``s``."""

    def __init__(self) -> None:
        starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=torch.Generator().manual_seed(3))
        self.tokens = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class FailOnce(TrainerCallback):
    """The simulated failure: once the first checkpoint at or after ``step`` is saved, the
    chosen process SIGKILLs itself (a fresh start only)."""

    def __init__(self, step: int, rank: int, fresh: bool) -> None:
        self.step, self.rank, self.fresh = step, rank, fresh

    def on_save(self, args, state, control, **kwargs):
        if self.fresh and 0 <= self.step <= state.global_step:
            if dist.is_initialized():
                dist.barrier()  # every process has saved it: the rerun resumes after it
            if args.process_index == self.rank:
                print(f"[rank {self.rank}] SIGKILL after step {state.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = simulate.parser(__doc__, 60, "file:///tmp/ckpt-hf", "DIR/.flashckpt")
    parser.add_argument("--dir", default=os.environ.get("TRAIN_DIR", "/tmp/flashckpt-hf"),
                        help="the Trainer's output_dir: checkpoint-N directories")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=int(os.environ.get("SAVE_EVERY", "5")))
    args = parser.parse_args()

    training = TrainingArguments(
        output_dir=args.dir, use_cpu=True, max_steps=args.steps, save_steps=args.save_every,
        save_total_limit=2, per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=5,
        weight_decay=0.01, logging_steps=10, seed=0, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=LENGTH,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=training, train_dataset=Counting())
    flashckpt.hf.attach(trainer, *args.tier)  # flashckpt: saves go to shared memory, then tiers

    last = get_last_checkpoint(args.dir) if os.path.isdir(args.dir) else None
    resumed = None if last is None else int(Path(last).name.split("-")[-1])
    world, rank = training.world_size, training.process_index
    kill_rank = min(args.kill_rank, world - 1)
    trainer.add_callback(FailOnce(args.kill_at, kill_rank, simulate.fresh_start(resumed)))
    simulate.report_start(rank, resumed, (resumed or 0) + 1, args.steps + 1)
    # flashckpt: resumes in place from the freshest copy of the newest checkpoint's step
    trainer.train(resume_from_checkpoint=True if last else None)
    simulate.report_end(rank, args.steps, resumed, model.named_parameters())


if __name__ == "__main__":
    main()
