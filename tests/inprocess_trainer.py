"""The launcher tests' job under in-process recovery: ``flashckpt.run_recoverable(train)``.

The model, data and steps are ``ft_trainer``'s, so a run ends bit-identical to its undisturbed
one. ``FT_FAULTS``: ``kind:rank:step`` items, comma-separated, each injected once per job (a
marker in ``FT_MARKS``) right after that rank saves that step: ``kill`` (SIGKILL), ``stop``
(SIGSTOP), ``raise`` (a Python exception in that rank's training function), ``savehang`` (the
rank's next ``save()`` never returns: it hangs inside it, in the heartbeat's save phase), ``mark``
(the marker alone: the test knows the rank got there), ``pause``
(``ft_trainer``'s: the step in every tier of ``FT_TIERS`` or ``FT_WAIT_TIERS``, then sleep);
and
``recurring-raise``, raised at that step and every one after (worded as NCCL words its own
errors, so only the recovery budget stops it); ``bug``, raised at that step and every one
after, worded as the rank's own error (the "same error twice" guard stops it), in the first
worker group only (a restart clears it). Every time
``train`` starts, each rank prints ``restored <rank> <step|None> pid=<pid>``; when it ends,
``done <rank> pid=<pid> rounds=<n> rss_kb=... threads=... fds=... groups=...``, what the tests compare
across recoveries; rank 0 writes the weights' sha256 to ``FT_DIGEST``.

``FT_CRASH_AFTER_CLOSE``: ranks (comma-separated) that exit with status 1 after their last
step and ``ckpt.close()``, as a crash in teardown.

``FT_DIE_FORMING``: ``rank:what``: that rank SIGKILLs itself the first time it forms a round
after its first (after arriving in it, before its process group connects: ``what`` = ``init``;
or after connecting, in the round's first barrier: ``barrier``), once per job.

``FT_SUBGROUPS``: each round makes ``new_group``s of rank pairs ({0, 1}, {2, 3}, ...) and,
after each step's save (and its fault), all-reduces a counter in the rank's pair: a rank's
pair partner blocks there when it dies. The model is untouched by it.

``FT_BACKEND``: the process groups' backend (default gloo; nccl puts the model on the rank's
GPU).

For a long run (``benchmarks/recovery.py --effective``): ``FT_STEP_S`` seconds of simulated
compute per step, and ``FT_EVERY`` seconds: the n-th fault of ``FT_SCHEDULE``
(``kind:rank,...``, cycled) is injected once ``n x FT_EVERY`` seconds have passed since
``FT_T0`` (an epoch time every node shares).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ft_trainer import STEPS, train_step, wait_tiers

import flashckpt
from flashckpt import Checkpointer


def faults() -> dict[tuple[int, int], str]:
    out = {}
    for item in filter(None, os.environ.get("FT_FAULTS", "").split(",")):
        kind, rank, step = item.split(":")
        out[int(rank), int(step)] = kind
    return out


def scheduled(rank: int) -> tuple[str, str] | None:
    """The fault of ``FT_SCHEDULE`` due now for this rank, and its mark."""
    every = float(os.environ.get("FT_EVERY", "0"))
    if every <= 0:
        return None
    plan = [item.split(":") for item in os.environ["FT_SCHEDULE"].split(",")]
    n = int((time.time() - float(os.environ["FT_T0"])) // every)
    if n < 1:
        return None
    kind, victim = plan[(n - 1) % len(plan)]
    return (kind, f"{kind}-{victim}-at-{n}") if int(victim) == rank else None


def inject(rank: int, step: int, planned: dict, ckpt: Checkpointer | None = None) -> None:
    kind, mark = planned.get((rank, step)), f"{planned.get((rank, step))}-{rank}-{step}"
    if any(k == "recurring-raise" and r == rank and step >= s for (r, s), k in planned.items()):
        # from that step on, every time: a deterministic fault
        raise RuntimeError("NCCL error: invalid usage (a fault injected every time)")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and any(
            k == "bug" and r == rank and step >= s for (r, s), k in planned.items()):  # fmt: skip
        raise ValueError(f"a bug in rank {rank}'s training function")
    if kind is None:
        due = scheduled(rank)
        if due is None:
            return
        kind, mark = due
    try:  # once per job, whatever the recoveries and restarts
        (Path(os.environ["FT_MARKS"]) / mark).touch(exist_ok=False)
    except FileExistsError:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "raise":
        raise RuntimeError(f"a fault injected in rank {rank} after step {step}")
    elif kind == "sleep":  # alive, makes no progress, blocks no signal
        time.sleep(3600)
    elif kind == "spin":  # alive and busy in a Python loop that never returns
        while True:
            pass
    elif kind == "savehang" and ckpt is not None:  # the next save() hangs inside, phase "save"
        real = ckpt._snapshot
        ckpt._snapshot = lambda *a, **k: time.sleep(3600) or real(*a, **k)
    elif kind == "pause" and ckpt is not None:  # as ft_trainer's: the test takes the node
        for tier in wait_tiers(ckpt.tiers):
            ckpt.wait(step, tier=tier, timeout=60)
        (Path(os.environ["FT_MARKS"]) / "paused").touch()
        time.sleep(3600)


def usage() -> str:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = len(os.listdir("/proc/self/fd"))
    groups = len(dist.distributed_c10d._world.pg_map)  # the process groups this process holds
    return (f"rss_kb={fields['VmRSS'].split()[0]} threads={fields['Threads'].strip()} "
            f"fds={fds} groups={groups}")  # fmt: skip


def die_forming(rank: int) -> None:
    """``FT_DIE_FORMING``: wrap the call in which this rank dies (see the module doc)."""
    spec = os.environ.get("FT_DIE_FORMING")
    if not spec or int(spec.split(":")[0]) != rank:
        return
    what = spec.split(":")[1]
    name = "init_process_group" if what == "init" else "barrier"
    real, calls = getattr(dist, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            with contextlib.suppress(FileExistsError):
                (Path(os.environ["FT_MARKS"]) / f"die-forming-{rank}").touch(exist_ok=False)
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(dist, name, wrapped)


def pairs() -> dist.ProcessGroup:
    """This rank's pair group; every rank makes every pair, as ``new_group`` requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    return made[rank // 2]


def main() -> None:
    backend = os.environ.get("FT_BACKEND", "gloo")
    die_forming(int(os.environ["RANK"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer(*filter(None, os.environ.get("FT_TIERS", "").split(",")))
    planned = faults()
    step_s = float(os.environ.get("FT_STEP_S", "0"))
    rounds = []

    def train() -> None:
        rank = dist.get_rank()
        rounds.append(1)
        restored = ckpt.restore(state)
        sys.stdout.write(f"restored {rank} {restored} pid={os.getpid()} {usage()}\n")
        sys.stdout.flush()
        pair = pairs() if os.environ.get("FT_SUBGROUPS") else None
        for step in range(0 if restored is None else restored + 1, STEPS):
            time.sleep(step_s)  # a real step's compute, before its collectives
            train_step(model, opt, rank, step)
            ckpt.save(step, state)
            inject(rank, step, planned, ckpt)
            if pair is not None:
                count = torch.ones(1)
                dist.all_reduce(count, group=pair)
                assert count.item() == 2, count
        sys.stdout.write(f"trained {rank} pid={os.getpid()} {usage()}\n")  # groups still made

    flashckpt.run_recoverable(train, backend=backend)
    rank = int(os.environ["RANK"])
    sys.stdout.write(f"done {rank} pid={os.getpid()} rounds={len(rounds)} {usage()}\n")
    sys.stdout.flush()
    ckpt.close()
    if rank == 0:
        digest = hashlib.sha256()
        for v in model.state_dict().values():
            digest.update(v.detach().cpu().numpy().tobytes())
        Path(os.environ["FT_DIGEST"]).write_text(digest.hexdigest())
    if str(rank) in os.environ.get("FT_CRASH_AFTER_CLOSE", "").split(","):
        os._exit(1)  # a crash in teardown, after the last step and close()


if __name__ == "__main__":
    sys.exit(main())
