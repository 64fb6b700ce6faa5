"""What the example trainers share besides flashckpt: their command line, a rank's seeded
inputs, the simulated failure and the final digest.

None of it is needed to use flashckpt; it makes every example reproducible, so a run that
is killed and resumed can be compared bit for bit with one that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from collections.abc import Iterable

import torch
import torch.distributed as dist


def parser(doc: str, steps: int, tier_example: str, no_tier: str) -> argparse.ArgumentParser:
    """``--steps``, ``--tier``, ``--kill-at``, ``--kill-rank``; each may come from the
    environment instead (STEPS, TIER, KILL_AT_STEP, KILL_RANK)."""
    env = os.environ.get
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(env("STEPS", str(steps))),
                   help="steps to train")  # fmt: skip
    p.add_argument("--tier", action="append", default=[t for t in env("TIER", "").split(",") if t],
                   help=f"where the agent persists each step, e.g. {tier_example} (repeatable; "
                        f"none: {no_tier})")  # fmt: skip
    p.add_argument("--kill-at", type=int, default=int(env("KILL_AT_STEP", "-1")),
                   help="on a fresh start, --kill-rank SIGKILLs itself after saving this step")  # fmt: skip
    p.add_argument("--kill-rank", type=int, default=int(env("KILL_RANK", "1")),
                   help="the rank that fails (default 1)")  # fmt: skip
    return p


def inputs(step: int, rank: int, *shape: int) -> torch.Tensor:
    """This rank's inputs of ``step``: the same on every attempt, so a resumed run sees what
    an undisturbed one would."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def fresh_start(restored: int | None) -> bool:
    """Nothing restored and not a restart by torchrun/flashckpt-run: the attempt that fails."""
    return restored is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def fail_if_asked(args: argparse.Namespace, first: bool, step: int, rank: int) -> None:
    """The simulated failure: once every rank has saved ``step``, one SIGKILLs itself."""
    if first and step == args.kill_at:
        dist.barrier()  # every rank has saved this step: the restart resumes after it
        if rank == args.kill_rank:
            print(f"[rank {rank}] SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def report_start(rank: int, restored: int | None, start: int, steps: int, where: str = "") -> None:
    if rank == 0:
        how = "fresh" if restored is None else f"resuming after step {restored}{where}"
        print(f"[rank 0] {how}: steps {start}..{steps - 1}", flush=True)


def report_end(rank: int, steps: int, restored: int | None, params: Iterable) -> None:
    """Rank 0 prints ``final: steps=N resumed_after_step=S sha256=D``; ``params`` yields
    (name, full tensor) on every rank (gathering shards is a collective)."""
    h = hashlib.sha256()
    for name, full in params:
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    if rank == 0:
        resumed = "none" if restored is None else restored
        print(f"final: steps={steps} resumed_after_step={resumed} sha256={h.hexdigest()}")
