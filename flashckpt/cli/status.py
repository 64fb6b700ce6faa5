"""``flashckpt status``: what this node's agent says of a job (each tier's health, lag, last
committed step and last error, over the agent's ``GetTierStatus``), and what the job's
controller says (nodes, detections, steps committed for every rank) when a launcher on this
node named one. No agent running for the job is a one-line error (exit 1), and so is a tier
the agent reports failing.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from ..errors import FlashCkptError
from ..faults import control
from ..pidfile import holder
from .common import (
    OK,
    PROBLEM,
    Output,
    Problem,
    add_dirs,
    add_job,
    chosen_job,
    describe_error,
    human_age,
    human_bytes,
    only_job,
    run_dir,
    shm_dir,
    shown,
)

NAME = "status"
HELP = "this node's agent's view of a job's tiers, and its controller's view"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_job(p)
    add_dirs(p, shm=True, run=True)


def agent_alive(pid_file: Path) -> bool:
    """Whether a live agent holds ``pid_file`` (its claim is an exclusive flock; looking
    never takes it, so a starting agent is never turned away)."""
    return holder(pid_file) is not None


def controller_view(run: Path, job: str) -> dict[str, Any] | None:
    """The controller's view of ``job``, if a launcher on this node named one; a controller
    that does not answer is said so, not raised."""
    endpoint = control.Endpoint.load(run, job)
    if endpoint is None:
        return None
    doc: dict[str, Any] = {"address": endpoint.address, "answered": False, "error": None}
    try:
        status = control.job_status(endpoint, job)
    except Exception as exc:  # a controller that is gone is worth a line, not a failure
        return {**doc, "error": exc.__class__.__name__}
    nodes = [{"node": n.node, "lost": n.lost, "last_seen_s": n.last_seen_s,
              "running_ranks": sorted(w.rank for w in n.workers
                                      if w.alive and w.phase != "closed")}
             for n in status.nodes]  # fmt: skip
    detections = [{"kind": d.kind, "node": d.node, "rank": d.rank if d.rank >= 0 else None,
                   "age_s": d.age_s, "action": d.action} for d in status.detections]  # fmt: skip
    commits = [{"url": shown(g.url), "step": g.step, "generation": g.generation}
               for g in status.commits]  # fmt: skip
    return {**doc, "answered": True, "policy": status.policy, "nodes": nodes,
            "detections": detections, "commits": commits}  # fmt: skip


def show_controller(doc: dict[str, Any] | None, out: Output) -> None:
    if doc is None:
        return
    if not doc["answered"]:
        out.line(f"controller {doc['address']}: does not answer ({doc['error']})")
        return
    out.line(f"controller {doc['address']} (policy {doc['policy']}):")
    for n in doc["nodes"]:
        state = "LOST" if n["lost"] else f"seen {n['last_seen_s']:.1f}s ago"
        out.line(f"  node {n['node']}: {state}, running ranks {n['running_ranks']}")
    for d in doc["detections"]:
        who = f"rank {d['rank']} on {d['node']}" if d["rank"] is not None else f"node {d['node']}"
        out.line(f"  {d['kind'].replace('_', ' ')}: {who}, {d['age_s']:.0f}s ago ({d['action']})")
    for g in doc["commits"]:
        branch = f" (generation {g['generation']})" if g["generation"] else ""
        out.line(f"  {g['url']}: step {g['step']}{branch} committed for every rank")


_SCOPES = {0: "unspecified", 1: "node", 2: "shared"}
_HEALTH = {0: "unknown", 1: "ok", 2: "failing"}


def _agent_view(run: Path, job: str) -> dict[str, Any]:
    from ..faults.agent_client import AgentClient

    try:
        client = AgentClient(job, run)
    except FlashCkptError as exc:
        raise Problem(describe_error(exc)) from None
    try:
        if not client.listening():
            raise Problem(f"no flashckpt agent runs for job {job} on this node (no socket "
                          f"{client.socket}); a trainer that names a tier starts one, or run "
                          f"'flashckpt-agent serve --job {job}'")  # fmt: skip
        if not client.answers(2.0):
            raise Problem(f"the agent socket {client.socket} does not answer: its agent is gone "
                          "or stopped ('flashckpt gc shm' removes what a gone one left)")  # fmt: skip
        tiers = client.tier_status()
    except FlashCkptError as exc:
        raise Problem(describe_error(exc)) from None
    except Exception as exc:  # grpc errors: the agent went away between the calls
        raise Problem(
            f"the agent on {client.socket} did not answer: {describe_error(exc)}"
        ) from None
    finally:
        client.close()
    return {"socket": str(client.socket), "tiers": [{
        "url": shown(t.url), "scope": _SCOPES.get(t.scope, str(t.scope)),
        "health": _HEALTH.get(t.health, str(t.health)),
        "last_committed_step": t.last_committed_step if t.last_committed_step >= 0 else None,
        "last_committed_generation": t.last_committed_generation,
        "lag_steps": t.lag_steps, "lag_seconds": t.lag_seconds,
        "bytes_persisted": t.bytes_persisted, "snapshots_persisted": t.snapshots_persisted,
        "last_error": t.last_error or None, "last_persist_seconds": t.last_persist_seconds,
        "last_persist_bytes": t.last_persist_bytes,
    } for t in tiers]}  # fmt: skip


def _show_agent(job: str, agent: dict[str, Any], out: Output) -> None:
    out.line(f"agent of job {job} on this node ({agent['socket']}): {len(agent['tiers'])} tier(s)")
    for t in agent["tiers"]:
        last = t["last_committed_step"]
        gen = (
            f" (generation {t['last_committed_generation']})"
            if t["last_committed_generation"]
            else ""
        )
        out.line(f"  {t['url']} ({t['scope']}): {t['health']}, last committed step "
                 f"{'none' if last is None else last}{gen}, lag {t['lag_steps']} step(s) "
                 f"({human_age(t['lag_seconds'])}), {human_bytes(t['bytes_persisted'])} in "
                 f"{t['snapshots_persisted']} snapshot(s)")  # fmt: skip
        if t["last_error"]:
            out.problem(f"{t['url']}: {t['last_error']}")


def _memory(shm: Path) -> dict[str, Any]:
    """What flashckpt holds in this node's memory (every job's slots and the replicas held for
    other nodes) against the node's cap (``FLASHCKPT_HOST_MEMORY``; None: no cap)."""
    from ..snapshot import host_memory

    return {"shm_dir": str(shm), "used_bytes": host_memory.used(shm),
            "cap_bytes": host_memory.enforced(shm)}  # fmt: skip


def _show_memory(memory: dict[str, Any], out: Output) -> None:
    used, limit = memory["used_bytes"], memory["cap_bytes"]
    of = "no cap (FLASHCKPT_HOST_MEMORY)" if limit is None else (
        f"{used / limit:.0%} of the {human_bytes(limit)} cap (FLASHCKPT_HOST_MEMORY)")  # fmt: skip
    out.line(f"host memory: {human_bytes(used)} in {memory['shm_dir']}, {of}")


def run(args: argparse.Namespace, out: Output) -> int:
    run_d = run_dir(args)
    job = chosen_job(args)
    if job is None:
        live = []
        with contextlib.suppress(OSError):
            live = sorted(p.name[: -len(".pid")] for p in run_d.glob("*.pid") if agent_alive(p))
        if not live:
            raise Problem(f"no flashckpt agent runs on this node (none in {run_d}); name the job "
                          "with --job, or check --run-dir / FLASHCKPT_RUN_DIR")  # fmt: skip
        job = only_job(live, f"{run_d} (agents running)")
    agent = _agent_view(run_d, job)
    controller = controller_view(run_d, job)
    memory = _memory(shm_dir(args))
    _show_agent(job, agent, out)
    _show_memory(memory, out)
    show_controller(controller, out)
    failing = [t["url"] for t in agent["tiers"] if t["health"] == "failing"]
    out.document({"command": NAME, "ok": not failing, "job": job, "agent": agent,
                  "host_memory": memory, "controller": controller})  # fmt: skip
    return PROBLEM if failing else OK
