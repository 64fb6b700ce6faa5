"""The launcher tests' job under in-process recovery: ``flashckpt.run_recoverable(train)``.

The model, data and steps are ``ft_trainer``'s, so a run ends bit-identical to its undisturbed
one. ``FT_FAULTS``: ``kind:rank:step`` items, comma-separated, each injected once per job (a
marker in ``FT_MARKS``) right after that rank saves that step: ``kill`` (SIGKILL), ``stop``
(SIGSTOP), ``raise`` (a Python exception in that rank's training function). Every time
``train`` starts, each rank prints ``restored <rank> <step|None> pid=<pid>``; when it ends,
``done <rank> pid=<pid> rounds=<n> rss_kb=... threads=... fds=...``, what the tests compare
across recoveries; rank 0 writes the weights' sha256 to ``FT_DIGEST``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from ft_trainer import STEPS, train_step

import flashckpt
from flashckpt import Checkpointer


def faults() -> dict[tuple[int, int], str]:
    out = {}
    for item in filter(None, os.environ.get("FT_FAULTS", "").split(",")):
        kind, rank, step = item.split(":")
        out[int(rank), int(step)] = kind
    return out


def inject(rank: int, step: int, planned: dict) -> None:
    kind = planned.get((rank, step))
    if kind is None:
        return
    try:  # once per job, whatever the recoveries and restarts
        (Path(os.environ["FT_MARKS"]) / f"{kind}-{rank}-{step}").touch(exist_ok=False)
    except FileExistsError:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "raise":
        raise RuntimeError(f"a fault injected in rank {rank} after step {step}")


def usage() -> str:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = len(os.listdir("/proc/self/fd"))
    return (f"rss_kb={fields['VmRSS'].split()[0]} threads={fields['Threads'].strip()} "
            f"fds={fds}")  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer()
    planned = faults()
    rounds = []

    def train() -> None:
        rank = dist.get_rank()
        rounds.append(1)
        restored = ckpt.restore(state)
        sys.stdout.write(f"restored {rank} {restored} pid={os.getpid()} {usage()}\n")
        sys.stdout.flush()
        for step in range(0 if restored is None else restored + 1, STEPS):
            train_step(model, opt, rank, step)
            ckpt.save(step, state)
            inject(rank, step, planned)

    flashckpt.run_recoverable(train, backend="gloo")
    rank = int(os.environ["RANK"])
    sys.stdout.write(f"done {rank} pid={os.getpid()} rounds={len(rounds)} {usage()}\n")
    sys.stdout.flush()
    ckpt.close()
    if rank == 0:
        digest = hashlib.sha256()
        for v in model.state_dict().values():
            digest.update(v.detach().numpy().tobytes())
        Path(os.environ["FT_DIGEST"]).write_text(digest.hexdigest())


if __name__ == "__main__":
    sys.exit(main())
