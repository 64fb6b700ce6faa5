"""A small deterministic data-parallel job for the launcher tests, faults injected once per job.

Plain user code: ``init_process_group()`` with no watchdog and no store tricks, the two lines
of flashckpt. ``FT_FAULT``, ``FT_RANK``, ``FT_STEP``: right after saving that step, the first
time only (a marker in ``FT_MARKS``), that rank
- ``kill``: SIGKILLs itself; ``stop``: SIGSTOPs itself;
- ``pause``: waits until the step is committed in every tier (``FT_TIERS`` and the peer
  replica of a multi-node job; ``FT_WAIT_TIERS`` where set), writes ``FT_MARKS/paused`` and
  sleeps (the test then takes its whole node away);
- ``corrupt``: waits for the same commits, flips the last data byte of the step in its
  shared-memory slot, in every tier and in its peer's replica, then SIGKILLs itself.
Gradients are averaged with one all-reduce per parameter, not DDP: DDP rebuilds its buckets
after the first step, so a resumed run's first step sums four ranks' gradients in another
order than an undisturbed run, and the weights would differ in the last bits. Each rank prints ``restored <rank> <step|None>``; rank 0 writes the final weights' sha256 to
``FT_DIGEST`` once the last step is trained.

``FT_PREEMPT`` (``ask`` or ``ignore``): each step takes ``FT_STEP_S`` seconds more and each
rank touches ``FT_MARKS/saved-<rank>-<step>`` after saving it; with ``ask`` the loop stops
at the first step after which ``Checkpointer.preempted()`` says so, printing ``stopped <rank>
<step>``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashckpt import Checkpointer
from flashckpt.format import layout
from flashckpt.format.slot import HEADER_SIZE
from flashckpt.restore.sources import run_with_tier
from flashckpt.snapshot.slots import slot_path

STEPS = int(os.environ.get("FT_STEPS", "30"))


def fault_now(rank: int, step: int) -> str | None:
    kind = os.environ.get("FT_FAULT")
    if not kind or rank != int(os.environ["FT_RANK"]) or step != int(os.environ["FT_STEP"]):
        return None
    mark = Path(os.environ["FT_MARKS"]) / f"{kind}-{rank}-{step}"
    try:
        mark.touch(exist_ok=False)  # once per job, whatever the restarts
    except FileExistsError:
        return None
    return kind


def flip_last(raw: bytes, end: int) -> bytes:
    return raw[: end - 1] + bytes([raw[end - 1] ^ 0xFF]) + raw[end:]


def corrupt(ckpt: Checkpointer, tiers: list[str], step: int) -> None:
    """The last data byte of ``step`` (its newest chunk), flipped in memory and every tier."""
    first = slot_path(ckpt.shm_dir, ckpt.job, ckpt.rank, 0)
    for path in first.parent.glob(f"rank-{ckpt.rank}.slot-*"):  # the spare slot too
        raw = path.read_bytes()
        if struct.unpack_from("<q", raw, 24)[0] == step:  # the header's step
            data_len = struct.unpack_from("<q", raw, 32)[0]
            with open(path, "r+b") as f:
                f.seek(HEADER_SIZE + data_len - 1)
                f.write(bytes([raw[HEADER_SIZE + data_len - 1] ^ 0xFF]))
    key = layout.data_key(ckpt.job, step, ckpt.rank, ckpt.generation)

    async def flip(tier) -> None:
        raw = await tier.get(key)
        bad = flip_last(raw, len(raw))
        await tier.put(key, [memoryview(bad)], len(bad))
        # Its manifest again, unchanged: a peer's holder takes a rank's data with it.
        mkey = layout.manifest_key(ckpt.job, step, ckpt.rank, ckpt.generation)
        manifest = await tier.get(mkey)
        await tier.put(mkey, [memoryview(manifest)], len(manifest))

    for url in tiers:
        run_with_tier(url, flip)


def wait_tiers(tiers: list[str]) -> list[str]:
    """The tiers a ``pause`` waits for: ``FT_WAIT_TIERS`` (comma-separated), else every one
    (a multi-node job's peer replica included)."""
    chosen = os.environ.get("FT_WAIT_TIERS")
    return [t for t in chosen.split(",") if t] if chosen is not None else tiers


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One step: this rank's batch of ``step``, gradients averaged over every rank."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(8, 16, generator=g).to(next(model.parameters()).device)
    loss = (model(x) - x.flip(1)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    tiers = [t for t in os.environ.get("FT_TIERS", "").split(",") if t]

    ckpt = Checkpointer(*tiers)
    restored = ckpt.restore(state)
    sys.stdout.write(f"restored {rank} {restored}\n")  # one write: lines of ranks never mix
    sys.stdout.flush()
    preempt = os.environ.get("FT_PREEMPT")
    finished = True
    for step in range(0 if restored is None else restored + 1, STEPS):
        train_step(model, opt, rank, step)
        ckpt.save(step, state)
        if preempt:
            (Path(os.environ["FT_MARKS"]) / f"saved-{rank}-{step}").touch()
            time.sleep(float(os.environ.get("FT_STEP_S", "0")))
            if preempt == "ask" and ckpt.preempted():
                sys.stdout.write(f"stopped {rank} {step}\n")
                finished = False
                break
        kind = fault_now(rank, step)
        if kind in ("pause", "corrupt"):
            for tier in wait_tiers(ckpt.tiers):
                ckpt.wait(step, tier=tier, timeout=60)
        if kind == "corrupt":
            corrupt(ckpt, ckpt.tiers, step)  # a peer's replica of it too
        if kind in ("kill", "corrupt"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "pause":
            (Path(os.environ["FT_MARKS"]) / "paused").touch()
            time.sleep(3600)
    ckpt.close()
    if rank == 0 and finished:
        digest = hashlib.sha256()
        for v in model.state_dict().values():
            digest.update(v.detach().numpy().tobytes())
        Path(os.environ["FT_DIGEST"]).write_text(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
