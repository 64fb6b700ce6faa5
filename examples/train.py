"""A DDP training loop with flashckpt: the two added lines are marked.

Run under flashckpt-run (or torchrun). FAIL_AT_STEP / FAIL_RANK make one rank SIGKILL itself
on the first attempt, HANG_AT_STEP makes it SIGSTOP itself (a hang: flashckpt-run's watchdog
kills it); the launcher restarts the workers and they resume from the last snapshot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashckpt import Checkpointer

STEPS = int(os.environ.get("STEPS", "60"))
FAIL_AT = int(os.environ.get("FAIL_AT_STEP", "-1"))
FAIL_RANK = int(os.environ.get("FAIL_RANK", "1"))
HANG_AT = int(os.environ.get("HANG_AT_STEP", "-1"))
NODE_LOST = os.environ.get("NODE_LOST") == "1"
TIERS = [t for t in os.environ.get("DEMO_TIERS", "").split(",") if t]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="    %(message)s")
    logging.getLogger("flashckpt.checkpointer").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}

    ckpt = Checkpointer(*TIERS)  # line 1: memory, plus the tiers in DEMO_TIERS
    restored = ckpt.restore(state)
    start = 0 if restored is None else restored + 1
    if rank == 0:
        print(
            f"[attempt {attempt}] starting at step {start}"
            + ("" if restored is None else f" (restored step {restored})"),
            flush=True,
        )

    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(32, 64, generator=g)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, state)  # line 2
        if step == FAIL_AT and rank == FAIL_RANK and attempt == 0:
            lost = " and its launcher are" if NODE_LOST else " is"
            print(f"[attempt {attempt}] rank {rank}{lost} SIGKILLed after step {step}", flush=True)
            if NODE_LOST:  # the launcher goes too, as when the whole node is lost
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == HANG_AT and rank == FAIL_RANK and attempt == 0:
            print(f"[attempt {attempt}] rank {rank} hangs (SIGSTOP) after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    ckpt.close()
    if rank == 0:
        digest = hashlib.sha256()
        for v in model.module.state_dict().values():
            digest.update(v.numpy().tobytes())
        print(
            f"[attempt {attempt}] finished {STEPS} steps; weights sha256 {digest.hexdigest()[:16]}",
            flush=True,
        )
        out = os.environ.get("DIGEST_FILE")
        if out:
            with open(out, "w") as f:
                f.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
