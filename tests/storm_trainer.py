"""The trainer the storm tests kill: a job whose every step's state is a function of the step.

Run as a program, it imports torch, prints ``ready`` and waits for one JSON line on stdin
(``job``, ``tiers``, ``steps``, ``pace`` seconds between steps, an optional ``kill`` plan whose
step counts from the first step this trainer saves, an optional ``stop_file``). Then it
restores, checks what it restored against ``expected(step)``, and trains: for each step it
fills the state in place, saves it, and reports. Lines printed::

    restored <step|None> <source> <ok|bad:key,key>
    saving <step> / saved <step>   around each save() (skipped <step>: not snapshotted)
    over-newest <step> held|free   this save writes over the newest snapshot (see faults.py)
    closing <step> / closed <step> around close()
    missed <phase>                 the kill plan never fired (exit 3)

The test process imports ``expected``, ``new_state`` and ``mismatches`` to check tiers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
from typing import Any

import torch

CHUNK = 256 * 2**10  # small chunks: a few MiB still make a checksum of many chunks
STEPS_WITHOUT_STOP = 100_000


@functools.cache
def _base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(384, 1024, generator=g),
        "h": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
        "noise": torch.randint(0, 256, (256 * 1024,), dtype=torch.uint8, generator=g),
    }


def _xor(t: torch.Tensor, bits: torch.dtype, step: int) -> torch.Tensor:
    """``t`` with every element's bits XORed with the step: two steps differ in every element."""
    return (t.view(bits) ^ step).view(t.dtype)


def expected(step: int) -> dict[str, Any]:
    """What step ``step`` holds: ~3 MiB in five tensors of four dtypes, plus plain values.
    Every element differs between any two steps (below 32768), so no byte of one step can
    pass for another's; cheap enough to build every step."""
    base = _base()
    return {
        "w": _xor(base["w"], torch.int32, step),
        "h": _xor(base["h"], torch.int16, step & 0x7FFF),
        "opt": {
            "idx": torch.arange(65536, dtype=torch.int64) * (step + 1) - step,
            "noise": _xor(base["noise"], torch.int32, step),
        },
        "bias": torch.full((1000,), float(step), dtype=torch.float64),
        "step": step,
        "meta": {"lr": 0.1 / (step + 1), "tag": f"step-{step}", "hist": [step - 1, step]},
    }


def new_state() -> dict[str, Any]:
    """A state of the right shapes holding no step's data: zeros, and None for plain values
    (which a restore replaces)."""

    def blank(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: blank(v) for k, v in value.items()}
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else None

    return blank(expected(0))


def fill(state: dict[str, Any], want: dict[str, Any]) -> None:
    """Make ``state`` hold ``want``: tensors copied in place (as training updates them),
    plain values replaced."""
    for key, value in want.items():
        if isinstance(value, dict):
            fill(state[key], value)
        elif isinstance(value, torch.Tensor):
            state[key].copy_(value)
        else:
            state[key] = value


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    """Top-level keys of ``state`` that differ (bit for bit, type for type) from ``step``'s."""
    from states import same

    want = expected(step)
    return sorted(k for k in want.keys() | state.keys() if not same(want.get(k), state.get(k)))


class _Source(logging.Handler):
    """Keeps the source the Checkpointer logs a restore from."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.name_seen = "none"

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("restored step"):
            self.name_seen = record.getMessage().split(" from ", 1)[1].split(" ")[0]


def main() -> None:
    import faults

    from flashckpt import Checkpointer

    torch.set_num_threads(1)  # the storm's processes share a few cores
    print("ready", flush=True)
    cfg = json.loads(sys.stdin.readline())
    plan = faults.KillPlan(**cfg["kill"]) if cfg.get("kill") else None
    warnings_out = logging.StreamHandler(sys.stderr)  # the library's warnings, as usual
    warnings_out.setLevel(logging.WARNING)
    logging.getLogger().addHandler(warnings_out)
    source = _Source()
    logger = logging.getLogger("flashckpt.checkpointer")
    logger.addHandler(source)
    logger.setLevel(logging.INFO)

    ck = Checkpointer(*cfg["tiers"], job=cfg["job"], chunk_size=CHUNK)
    state = new_state()
    restored = ck.restore(state)
    bad = mismatches(state, restored) if restored is not None else []
    print(f"restored {restored} {source.name_seen} {'bad:' + ','.join(bad) if bad else 'ok'}",
          flush=True)  # fmt: skip
    stop = cfg.get("stop_file")
    first = 0 if restored is None else restored + 1
    # The plan counts steps from the first this trainer saves.
    switch = faults.kill_at(
        plan and dataclasses.replace(plan, step=first + plan.step),
        lambda line: print(line, flush=True),
    )
    last, skipped = restored, 0
    for step in range(first, first + cfg.get("steps", STEPS_WITHOUT_STOP)):
        if stop and os.path.exists(stop):
            break
        switch.step(step)
        fill(state, expected(step))
        print(f"saving {step}", flush=True)
        ck.save(step, state)
        # A save that found both slots held by readers returns without a snapshot.
        print(f"{'skipped' if ck.skipped > skipped else 'saved'} {step}", flush=True)
        skipped = ck.skipped
        last = step
        switch.saved(step)
        time.sleep(cfg.get("pace", 0.01))
    switch.closing()
    print(f"closing {last}", flush=True)
    ck.close()
    print(f"closed {last}", flush=True)
    if not switch.may_miss:
        print(f"missed {plan.phase}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
