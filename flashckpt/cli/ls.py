"""``flashckpt ls URL``: what a location holds. Without a job (and more than one there): the
jobs. With one (``--job``, FLASHCKPT_JOB, or the only one): its steps, oldest first, each
with the ranks present, whether it is committed (for every rank) or partial, its size and age.
A location, bucket or job that does not exist is a one-line error (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from .. import config
from ..errors import TierUnavailableError
from .common import (
    OK,
    Output,
    Problem,
    Progress,
    add_dirs,
    add_job,
    chosen_job,
    human_age,
    human_bytes,
    locations,
    ranks_text,
    shm_dir,
)
from .locations import SHM, StepInfo, age, open_location, require_job

NAME = "ls"
HELP = "list the jobs at a location, or a job's steps there"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs=1, metavar="URL",
                   help="a tier URL (file:///dir, pfs:///dir, s3://bucket/prefix?..., or any fsspec URL: gs://...) or 'shm'")  # fmt: skip
    add_job(p)
    add_dirs(p, run=True)


def _step_doc(info: StepInfo, memory: bool) -> dict[str, Any]:
    c = info.committed
    return {
        "step": info.step, "generation": info.generation, "state": info.state(memory),
        "ranks": info.present, "committed_ranks": sorted(c.ranks) if c else [],
        "world_size": c.world_size if c else None, "bytes": info.bytes,
        "created_at": info.created_at, "age_s": age(info.created_at), "sealed": info.sealed,
        "problems": info.problems,
    }  # fmt: skip


def _show_steps(out: Output, where: str, job: str, steps: list[dict], problems: list[str]) -> None:
    out.line(f"job {job} in {where}: {len(steps)} step(s)")
    if steps:
        rows = [("step", "ranks", "state", "size", "age")]
        for s in steps:
            gen = f" (gen {s['generation']})" if s["generation"] else ""
            world = f" of {s['world_size']}" if s["world_size"] else ""
            state = s["state"] + (", not sealed" if s["sealed"] is False else "")
            rows.append((f"{s['step']}{gen}", ranks_text(s["ranks"]) + world, state,
                         human_bytes(s["bytes"]), human_age(s["age_s"])))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            out.line("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    for s in steps:
        for p in s["problems"]:
            out.line(f"  step {s['step']}: {p}")
    for p in problems:
        out.line(f"  {p}")


async def _ls(args: argparse.Namespace, out: Output) -> dict[str, Any]:
    url = locations(args)[0]
    loc = open_location(url, shm_dir(args))
    async with loc:
        job = chosen_job(args)
        if job is None:
            jobs = await loc.jobs()
            if len(jobs) != 1:
                what = "rank(s)" if url == SHM else "step(s)"
                out.line(f"jobs in {loc.shown}:" if jobs else f"no jobs in {loc.shown}")
                for name, n in sorted(jobs.items()):
                    out.line(f"  {name}  {n} {what}")
                key = "ranks" if url == SHM else "steps"
                return {"location": loc.shown,
                        "jobs": [{"job": j, key: n} for j, n in sorted(jobs.items())]}  # fmt: skip
            job = next(iter(jobs))
        else:
            try:
                await require_job(loc, job)
            except Problem:
                # A node started again wiped holds nothing of the job: its peers may.
                if url != SHM or not _any_held(
                    peers := await _peer_replicas(out, job, shm_dir(args), args)
                ):
                    raise
                out.line(f"job {job} in {loc.shown}: nothing in this node's memory")
                return {"location": loc.shown, "job": job, "steps": [], "problems": [],
                        "peer_replicas": peers}  # fmt: skip
        with Progress("reading manifests", unit="manifests") as progress:
            infos, problems = await loc.steps(job, progress)
    steps = [_step_doc(i, url == SHM) for i in infos]
    _show_steps(out, loc.shown, job, steps, problems)
    doc = {"location": loc.shown, "job": job, "steps": steps, "problems": problems}
    if url == SHM:
        doc["peer_replicas"] = await _peer_replicas(out, job, shm_dir(args), args)
    return doc


def _any_held(doc: dict) -> bool:
    return bool(doc["elsewhere"] or doc["here"])


async def _peer_replicas(out: Output, job: str, shm: Path, args: argparse.Namespace) -> dict:
    """What other nodes hold of this node's ranks (their reports to the job's controller),
    and what this node holds for them (its replica store)."""
    from ..agent.replicas import held_replicas, store_root
    from ..storage_tiers.peer import replicas_of

    me = config.node_name()
    doc: dict[str, Any] = {"node": me, "elsewhere": [], "here": [], "unknown": ""}
    try:
        found = await replicas_of(job, me, getattr(args, "run_dir", None))
        doc["elsewhere"] = [{"holder": h, "generation": g, "step": s, "ranks": r}
                            for h, g, s, r in found]  # fmt: skip
    except TierUnavailableError as exc:
        doc["unknown"] = str(exc)
    held = await held_replicas(store_root(shm, job), job)
    doc["here"] = [{"source": n, "generation": g, "step": s, "ranks": r} for n, g, s, r in held]
    if not _any_held(doc):
        return doc
    out.line(f"peer replicas of job {job} (this node: {me}):")
    for e in doc["elsewhere"]:
        out.line(
            f"  step {e['step']} of ranks {ranks_text(e['ranks'])} in node {e['holder']}'s memory"
        )
    for e in doc["here"]:
        out.line(
            f"  step {e['step']} of node {e['source']}'s ranks {ranks_text(e['ranks'])} held here"
        )
    return doc


def run(args: argparse.Namespace, out: Output) -> int:
    doc = asyncio.run(_ls(args, out))
    out.document({"command": NAME, "ok": True, **doc})
    return OK
