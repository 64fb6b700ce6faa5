"""``flashckpt gc``: remove what is no longer needed.

``gc URL --keep-last K [--keep-every M] [--dry-run]`` applies a tier's retention policy to a
job with exactly the agent's rules (``tier_io.apply_retention``): the newest K committed steps
of the current branch (and every M-th) stay, older ones go, with uncommitted leftovers older
than the newest committed step and what crashed uploads left (temporaries, unfinished
uploads, and the step directories that held only those) once older than the tier's
``temp_grace_s``; each is listed with its size. K must be at least 1, so the newest committed
step is never removed; ``--dry-run`` lists what would go. On a node-local tier of a
multi-node job, committed steps other nodes may lack are kept (offline, which steps every
node holds cannot be known) unless ``--node-alone``. Stray names under the job (not a
step or rank name flashckpt writes, see ``layout.strays``) are listed as kept: gc never
removes them.

``gc shm`` removes the slot files (and the agents' stale socket, pid and controller files in
``FLASHCKPT_RUN_DIR``) of every job on this node whose processes are gone: no live agent holds
its pid file, no live trainer owns a rank or beats a heartbeat page. The owner locks are held
while the files go, so no trainer can start on them meanwhile. The replicas the job's agent held
for other nodes go with them (its folder under ``_replicas``, and what crashed uploads left in
it). Logs stay unless ``--logs``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from .. import config
from ..errors import ConfigError, FlashCkptError
from ..faults import control
from ..faults.agent_client import agent_pid_path, socket_path
from ..faults.events import events_path
from ..faults.heartbeat import Phase, pages
from ..format import tier_io
from ..format.retention import Common, takes_part
from ..pidfile import PidFileBusy, holder, lock_pidfile, pid_alive
from ..snapshot.slots import free_rank, owner_path, unowned
from ..storage_tiers.base import TEMP_GRACE_S
from ..storage_tiers.registry import check_writable, option
from .common import (
    OK,
    SHM,
    Output,
    Problem,
    UsageError,
    add_dirs,
    add_job,
    chosen_job,
    locations,
    run_dir,
    shm_dir,
)
from .locations import TierLocation, job_at, newest_key, stray_line

NAME = "gc"
HELP = "apply retention to a tier's job, or remove dead jobs' files from this node ('gc shm')"
_RANK_FILE = re.compile(r"rank-([0-9]+)\.")


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs=1, metavar="URL", help="a tier URL, or 'shm' for this node")
    add_job(p)
    p.add_argument("--keep-last", type=_positive, default=None, metavar="K",
                   help="keep the newest K committed steps (at least 1; required for a tier)")  # fmt: skip
    p.add_argument("--keep-every", type=_positive, default=None, metavar="M",
                   help="also keep every committed step whose number is a multiple of M")  # fmt: skip
    p.add_argument("--node-alone", action="store_true",
                   help="a node-local tier of a multi-node job: apply --keep-last to this node's "
                        "steps alone, even to steps other nodes may not hold")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--logs", action="store_true",
                   help="gc shm: also remove dead jobs' agent logs and event logs")  # fmt: skip
    add_dirs(p, run=True)


async def _tier_gc(args: argparse.Namespace, url: str) -> dict[str, Any]:
    async with TierLocation(url) as loc:
        job = await job_at(loc, chosen_job(args))
        listing = await loc.listing(job)
        strays = await loc.strays(job)
        newest = newest_key(listing, None)
        grace = option(loc.tier.spec, "temp_grace_s", TEMP_GRACE_S, float)
        retention = (job, args.keep_last, args.keep_every, grace)
        # A node-local tier holds its node's ranks only: offline, which steps every other node
        # holds cannot be known, so no committed step goes that the job may need from it
        # (as the agent, which learns them from the controller, would keep them too).
        common = None if args.node_alone or not takes_part(loc.tier.spec) else Common()
        retired = await tier_io.apply_retention(loc.tier, *retention, dry_run=True,
                                                common=common)  # fmt: skip
        if newest in retired.steps:  # it keeps the newest with K >= 1; never trust that blindly
            raise Problem(f"retention would remove the newest committed step {newest[1]}; "
                          "nothing was removed")  # fmt: skip
        held_back = 0
        if common is not None:
            alone = await tier_io.apply_retention(loc.tier, *retention, dry_run=True)
            held_back = len(set(alone.steps) - set(retired.steps))
        if not args.dry_run:
            retired = await tier_io.apply_retention(loc.tier, *retention, common=common)
    doomed = retired.steps
    states = {k: ("uncommitted" if c is None else "committed" if c.complete else "partial")
              for k, c in listing.items()}  # fmt: skip
    steps = [{"step": s, "generation": g, "state": states.get((g, s), "uncommitted")}
             for g, s in doomed]  # fmt: skip
    kept = [{"step": s, "generation": g, "state": states[g, s]}
            for g, s in sorted(listing, key=lambda k: (k[1], k[0])) if (g, s) not in doomed]  # fmt: skip
    leftovers = [{"key": t.key, "bytes": t.size, "age_s": round(time.time() - t.modified, 1)}
                 for t in retired.leftovers]  # fmt: skip
    return {"location": loc.shown, "job": job, "removed": steps, "kept": kept,
            "leftovers_removed": leftovers, "strays": strays, "held_back": held_back,
            "newest_committed": newest[1] if newest else None}  # fmt: skip


def _jobs_on_node(shm: Path, run: Path) -> list[str]:
    names = set()
    with contextlib.suppress(OSError):
        names |= {d.name for d in shm.iterdir() if d.is_dir() and not d.is_symlink()}
    with contextlib.suppress(OSError):
        names |= {p.name[: -len(".pid")] for p in run.glob("*.pid")}
    with contextlib.suppress(OSError):  # jobs this node held other nodes' replicas for
        names |= {d.name for d in (shm / config.REPLICAS_DIR).iterdir() if d.is_dir()}
    return sorted(n for n in names if _valid(n))


def _valid(name: str) -> bool:
    try:
        config.validate_name("job", name)
    except FlashCkptError:
        return False
    return True


def _ranks(shm: Path, job: str) -> list[int]:
    with contextlib.suppress(OSError):
        return sorted({int(m.group(1)) for p in (shm / job).iterdir()
                       if (m := _RANK_FILE.match(p.name))})  # fmt: skip
    return []


def _run_files(run: Path, job: str, logs: bool) -> list[Path]:
    files = [control.file_path(run, job), control.launcher_path(run, job)]
    with contextlib.suppress(FlashCkptError):
        files.append(socket_path(run, job))
    files += sorted(run.glob(f"{job}.peer-listing-*"))  # a restore's listing, shared by ranks
    if logs:
        files += [run / f"{job}.log", events_path(run, job)]
    return [f for f in files if os.path.lexists(f)]


def _hold_agent_claim(stack: contextlib.ExitStack, pid_file: Path, dry: bool) -> str | None:
    """Hold the job's agent claim until ``stack`` closes (a dry run, which changes nothing,
    only looks); why not if a live agent holds it."""
    try:
        if dry:  # looked at, never locked: a starting agent is never turned away
            pid = holder(pid_file)
            return None if pid is None else f"its agent runs ({PidFileBusy(pid).holder()})"
        stack.callback(os.close, lock_pidfile(pid_file))
    except PidFileBusy as busy:
        return f"its agent runs ({busy.holder()})"
    except FileNotFoundError:
        pass
    except (FlashCkptError, OSError) as exc:
        return f"its agent's pid file {pid_file} cannot be checked ({exc})"
    return None


def _collect(shm: Path, run: Path, job: str, dry: bool, logs: bool) -> dict[str, Any]:
    """Remove (or with ``dry`` list) a job's files unless a live process still uses them."""
    with contextlib.ExitStack() as stack:
        pid_file = agent_pid_path(run, job)
        if pid_file.exists() and (why := _hold_agent_claim(stack, pid_file, dry)):
            return {"job": job, "live": why, "removed": []}
        if (launcher := holder(control.launcher_path(run, job))) is not None:
            why = f"its flashckpt-run runs ({PidFileBusy(launcher).holder()})"
            return {"job": job, "live": why, "removed": []}
        for rank in _ranks(shm, job):
            if owner_path(shm, job, rank).exists() and not stack.enter_context(
                unowned(shm, job, rank)
            ):
                return {"job": job, "live": f"a live process owns rank {rank}", "removed": []}
        for rank, beat in pages(shm, job):
            if beat.phase != Phase.CLOSED and pid_alive(beat.pid):
                return {"job": job, "live": f"rank {rank}'s trainer (pid {beat.pid}) is alive",
                        "removed": []}  # fmt: skip
        doomed = [p for p in sorted((shm / job).glob("rank-*")) if not p.is_dir()]
        doomed += _run_files(run, job, logs) + ([pid_file] if pid_file.exists() else [])
        held = config.replicas_dir(
            shm, job
        )  # other nodes' replicas, with what crashed uploads left
        if held.is_dir() and not held.is_symlink():
            doomed.append(held)
        if not dry:
            for rank in _ranks(shm, job):
                free_rank(shm, job, rank)
            for path in doomed:  # the pid file while its lock is held, as its owner would
                if path == held:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (shm / job).rmdir()
        return {"job": job, "live": None, "removed": [str(p) for p in doomed]}


def _shm_gc(args: argparse.Namespace) -> dict[str, Any]:
    shm, run = shm_dir(args), run_dir(args)
    named = chosen_job(args)
    jobs = [named] if named else _jobs_on_node(shm, run)
    return {"location": f"shared memory ({shm})", "run_dir": str(run),
            "jobs": [_collect(shm, run, j, args.dry_run, args.logs) for j in jobs]}  # fmt: skip


def run(args: argparse.Namespace, out: Output) -> int:
    url = locations(args)[0]
    verb = "would remove" if args.dry_run else "removed"
    if url == SHM:
        if args.keep_last is not None or args.keep_every is not None:
            raise UsageError("gc shm takes no --keep-last/--keep-every: it removes only the "
                             "files of jobs whose processes are gone")  # fmt: skip
        doc = _shm_gc(args)
        for j in doc["jobs"]:
            if j["live"]:
                out.line(f"kept job {j['job']}: {j['live']}")
            else:
                out.line(f"{verb} job {j['job']}: {len(j['removed'])} file(s)")
                for path in j["removed"]:
                    out.line(f"  {path}")
        if not doc["jobs"]:
            out.line(f"no jobs in {doc['location']} or {doc['run_dir']}")
    else:
        if args.keep_last is None:
            raise UsageError("gc of a tier needs --keep-last K (K >= 1: the newest committed "
                             "step always stays)")  # fmt: skip
        if args.logs:
            raise UsageError("--logs is for 'gc shm' only")
        if not args.dry_run:
            try:
                check_writable(url)  # removing needs a tier that can remove
            except ConfigError as exc:
                raise UsageError(f"{exc} (--dry-run lists what would go)") from exc
        doc = asyncio.run(_tier_gc(args, url))
        out.line(f"job {doc['job']} in {doc['location']}: {verb} {len(doc['removed'])} "
                 f"step(s), kept {len(doc['kept'])}")  # fmt: skip
        for s in doc["removed"]:
            gen = f" (generation {s['generation']})" if s["generation"] else ""
            out.line(f"  {verb} step {s['step']}{gen}: {s['state']}")
        if doc["held_back"]:
            out.line(f"  kept {doc['held_back']} committed step(s) past --keep-last: this "
                     "node-local tier holds only its node's ranks, and which of its steps every "
                     "other node of the job holds cannot be known here (the agent prunes it by "
                     "the steps every node holds, learned from the controller). A step whose "
                     "commit marker names every rank of the job is pruned as usual; pass "
                     "--node-alone to prune this node's steps alone")  # fmt: skip
        for t in doc["leftovers_removed"]:
            size = "size unknown" if t["bytes"] is None else f"{t['bytes']} bytes"
            out.line(f"  {verb} what a crashed write of {t['key']} left: {size}, "
                     f"{t['age_s']:.0f}s old")  # fmt: skip
        for name in doc["strays"]:
            out.line(f"  kept {stray_line(doc['location'], name)}")
    out.document({"command": NAME, "ok": True, "dry_run": args.dry_run, **doc})
    return OK
