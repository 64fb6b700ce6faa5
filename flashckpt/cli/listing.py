"""``flashckpt list --job J [--tier URL...]``: the older overview, kept for scripts that use
it. One screen of everything about a job on this node: its slots in shared memory (state,
step, size, or why a slot file is corrupt), the steps of each tier named and whether each is
committed, and what the job's controller says. ``ls`` and ``status`` show the same per
location, with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..errors import FlashCkptError, SharedMemoryError
from ..format import tier_io
from ..format.slot import Slot
from ..snapshot.slots import N_SLOTS, ranks_in, slot_path
from .common import (
    OK,
    PROBLEM,
    Output,
    Problem,
    UsageError,
    add_dirs,
    chosen_job,
    describe_error,
    locations,
    run_dir,
    shm_dir,
    shown,
)
from .locations import TierLocation
from .status import controller_view, show_controller

NAME = "list"
HELP = "a job's slots in memory, its steps in the tiers named, and its controller's view"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=None, help="the job (default: FLASHCKPT_JOB)")
    p.add_argument("--tier", action="append", default=[], metavar="URL",
                   help="also list the steps of this tier (repeatable)")  # fmt: skip
    add_dirs(p, run=True)


def _slots(shm, job: str, out: Output) -> list[dict[str, Any]]:
    out.line(f"memory ({shm / job}):" + ("" if (shm / job).is_dir() else " no slots"))
    found = []
    for rank in ranks_in(shm, job):
        for i in range(N_SLOTS):
            doc: dict[str, Any] = {"rank": rank, "slot": i}
            try:
                slot = Slot.open_readonly(slot_path(shm, job, rank, i))
            except FileNotFoundError:
                continue
            except OSError as exc:  # not a slot (any more), or unreadable: say so, go on
                found.append({**doc, "corrupt": describe_error(exc)})
                out.line(f"  rank {rank} slot {i}: corrupt ({describe_error(exc)})")
                continue
            try:
                h = slot.header()
            except SharedMemoryError as exc:
                found.append({**doc, "corrupt": describe_error(exc)})
                out.line(f"  rank {rank} slot {i}: corrupt ({describe_error(exc)})")
                continue
            finally:
                slot.close()
            state = (f"READY step {h.step}" + (" sealed" if h.sealed else "")
                     if h.readable else h.state.name)  # fmt: skip
            found.append({**doc, "state": h.state.name, "step": h.step if h.readable else None,
                          "sealed": h.sealed, "bytes": h.data_len})  # fmt: skip
            out.line(f"  rank {rank} slot {i}: {state} ({h.data_len / 2**20:.1f} MiB)")
    return found


async def _steps(url: str, job: str) -> tier_io.Listing:
    async with TierLocation(url) as loc:  # a directory that does not exist says so
        return await loc.listing(job)


def commit_state(c: tier_io.CommittedStep | None) -> str:
    if c is None:
        return "uncommitted"
    what = f"ranks {sorted(c.ranks)} of {c.world_size}" + (
        " partial"
        if not c.complete
        else " committed (the node's)"
        if c.node_local
        else " committed"
    )
    if c.problems:
        what += f", corrupt: {len(c.problems)} problem(s): " + "; ".join(c.problems)
    return what


def run(args: argparse.Namespace, out: Output) -> int:
    job = chosen_job(args)
    if job is None:
        raise UsageError("name the job with --job (or FLASHCKPT_JOB); 'flashckpt ls shm' "
                         "lists the jobs on this node")  # fmt: skip
    urls = locations(args, at_least=0)
    doc: dict[str, Any] = {"command": NAME, "job": job, "memory": _slots(shm_dir(args), job, out)}
    doc["tiers"], failed = [], False
    for url in urls:
        out.line(f"{shown(url)}:")
        entry: dict[str, Any] = {"location": shown(url), "steps": [], "error": None}
        doc["tiers"].append(entry)
        try:
            steps = asyncio.run(_steps(url, job))
        except (Problem, FlashCkptError, OSError) as exc:
            entry["error"] = describe_error(exc)
            out.line(f"  cannot be listed: {entry['error']}")
            failed = True
            continue
        for (gen, step), c in sorted(steps.items(), key=lambda kc: (kc[0][1], kc[0][0])):
            branch = f" (generation {gen})" if gen else ""
            out.line(f"  step {step}{branch}: {commit_state(c)}")
            entry["steps"].append({"step": step, "generation": gen, "state": commit_state(c)})
    doc["controller"] = controller_view(run_dir(args), job)
    show_controller(doc["controller"], out)
    out.document({**doc, "ok": not failed})
    return PROBLEM if failed else OK
