"""A DDP trainer for world-size changes: ``resize_trainer.py TIER STEPS``.

Restores from a ``file://`` tier, trains and saves STEPS more steps, closes, and prints
``rank R restored S last L close C start D end E`` (C: seconds ``close()`` took; D and E:
digests of the parameters just after the restore and at the end).
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch
import torch.distributed as dist

from flashckpt import Checkpointer


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    url, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(url)
    restored = ckpt.restore({"model": model, "optim": opt})
    first = 0 if restored is None else restored + 1
    start = digest(model)
    for step in range(first, first + steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, {"model": model, "optim": opt})
    began = time.monotonic()
    ckpt.close()
    sys.stdout.write(f"rank {dist.get_rank()} restored {restored} last {first + steps - 1} "
                     f"close {time.monotonic() - began:.2f} start {start} end {digest(model)}\n")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
