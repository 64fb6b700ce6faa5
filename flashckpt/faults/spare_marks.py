"""What a spare node and the launchers mark in the job's recovery store, so that each of a
node's ranks is run by one process only.

A node a spare takes was found lost because its agent went silent: its launcher and workers
may still run, or come back later. Neither side can ask the other, so both leave marks in the
job's recovery store (the store the controller's node serves, ``store_gate``) and read them:

- every node's launcher, when its worker group starts, says which run is the job's current one
  (``run_started``: that worker group's round namespace) and publishes what a spare needs to
  take its ranks if the node is lost whole (``publish_node``: the namespace, the script's
  arguments, each rank's launch variables);
- a spare that takes a lost node marks it taken in that run (``mark_replaced``) before it moves
  the job to the next round. The node's own launcher, if it still runs, looks for the mark
  (``was_replaced``) when it sees the round move or a worker of its own fail, and stops its
  workers (each a second claimant of a rank the spare holds now); a lost node that comes back
  looks for it before it joins the rendezvous, and serves as the job's spare instead;
- a mark belongs to its run: it is void once the run ends (the job restarts whole,
  ``run_ended``), so that every node joins the restart under its own name, and removed when
  the spare gives the node up (``unmark_replaced``), so that the node may rejoin.

The marks are under keys of the job's own (``job_key``): a controller's store may serve several
jobs, whose node names can be the same. The launcher's supervisor (``inprocess_agent``) and the
spare (``spare``) both use these functions, which need nothing but the store.
"""

from __future__ import annotations

import json
from typing import Any

# What a rank's launch variables carry that belongs to the node that launched it.
NODE_OWN = frozenset({"TORCHELASTIC_ERROR_FILE"})


def node_key(node: str) -> str:
    return f"flashckpt/nodes/{node}"


def job_key(job: str, name: str) -> str:
    """A key of the job's own in the recovery store (a controller's store may serve several
    jobs, whose node names can be the same)."""
    return f"flashckpt/jobs/{job}/{name}"


def replaced_key(job: str, node: str) -> str:
    return job_key(job, f"replaced/{node}")


def run_key(job: str) -> str:
    return job_key(job, "run")


def run_started(store: Any, job: str, ns: str) -> None:
    """The job's current run is the worker group of namespace ``ns`` (every node's launcher
    says so when its workers start): marks of earlier runs are void from now on."""
    store.set(run_key(job), ns)


def run_ended(store: Any, job: str, ns: str) -> None:
    """The run of namespace ``ns`` is over (the job restarts whole): its marks are void, so a
    node a spare took rejoins the restart under its own name. A later run is left alone."""
    store.compare_set(run_key(job), ns, "")


def current_run(store: Any, job: str) -> str:
    key = run_key(job)
    return store.get(key).decode() if store.check([key]) else ""


def mark_replaced(store: Any, job: str, node: str, spare: str, ns: str) -> None:
    """Spare ``spare`` takes ``node``'s ranks in the run of namespace ``ns``."""
    store.set(replaced_key(job, node), json.dumps({"spare": spare, "ns": ns}))


def unmark_replaced(store: Any, job: str, node: str, spare: str) -> None:
    """``spare`` gives ``node`` up: the node may rejoin (another spare's mark is left)."""
    key = replaced_key(job, node)
    if store.check([key]) and json.loads(store.get(key).decode()).get("spare") == spare:
        store.delete_key(key)


def publish_node(store: Any, node: str, ns: str, args: list[str], world: int,
                 ranks: dict[int, dict[str, str]]) -> None:  # fmt: skip
    """What a spare needs to take this node's ranks: the round namespace, the script's
    arguments and each rank's launch variables (``ranks``: global rank -> what TorchElastic set
    for it), in the job's recovery store."""
    record = {"ns": ns, "args": list(args), "world": world,
              "ranks": {str(r): {k: v for k, v in env.items() if k not in NODE_OWN}
                        for r, env in ranks.items()}}  # fmt: skip
    store.set(node_key(node), json.dumps(record))


def was_replaced(store: Any, node: str, job: str) -> str | None:
    """The spare that took ``node``'s ranks in the job's current run, if one did and has not
    given them up. ``job``: the launcher's (FLASHCKPT_JOB, else its event log's)."""
    key = replaced_key(job, node)
    if not store.check([key]):
        return None
    mark = json.loads(store.get(key).decode())
    return mark["spare"] if mark.get("ns") == current_run(store, job) else None
