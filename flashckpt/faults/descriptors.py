"""File descriptors for the recovery store: enough of them, or a clear refusal at start.

The process that serves the job's recovery store holds a few descriptors per client (every
worker and every node's launcher connects), so a large job needs tens of thousands, far past
the usual soft limit of 1,024. At start that process raises its soft ``RLIMIT_NOFILE`` to the
hard limit, and a launcher that serves the store refuses to start a job the limit cannot
take, instead of failing with a ``DistNetworkError`` when the clients connect.
"""

from __future__ import annotations

import logging
import resource

from ..errors import ConfigError

log = logging.getLogger(__name__)

# Through the gate (``store_gate.StoreGate``) a client costs the serving process three
# descriptors: the gate's accepted connection, the gate's own connection to the loopback
# store, and the store's accepted end of that one. (With the soft limit at 256, the 79th
# client failed: (256 - the process's own) / 3.)
DESCRIPTORS_PER_CLIENT = 3
# The serving process's own files: its imports, logs, pages, its agent and controller sockets.
RESERVED_DESCRIPTORS = 128
# Each node's launcher connects three times: its supervisor, its round relay and the job's
# culprit vote (``inprocess_agent.Supervisor``, ``RoundRelay``, ``culprit.JobCulprit``).
LAUNCHER_CLIENTS = 3


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit it has after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # an infinite hard limit the kernel caps
            log.debug("soft RLIMIT_NOFILE stays %s (hard %s): %s", soft, hard, exc)
    return soft


NODE_RESERVED = 256  # a launcher's and an agent's own files, sockets and gRPC channels
PER_WORKER = 32  # a worker's pipes, heartbeat page, slots and agent connection, on its node


def require_for_node(nproc_per_node: str | int) -> int:
    """Raise the soft limit; ConfigError when the hard one cannot take this node's launcher,
    agent and ``nproc_per_node`` workers (a container started with a tiny nofile limit fails
    here, not with EMFILE in the middle of a save). The limit it has after."""
    try:
        workers = int(nproc_per_node)
    except (TypeError, ValueError):  # gpu, auto: the machine's count, not known here
        workers = 8
    want = NODE_RESERVED + PER_WORKER * workers
    limit = raise_soft_limit()
    if limit != resource.RLIM_INFINITY and limit < want:
        raise ConfigError(
            f"this process's open-file limit is {limit} (the hard limit), below the {want} a "
            f"node of {workers} workers needs (its launcher, agent and workers: {NODE_RESERVED} "
            f"+ {PER_WORKER} a worker); raise it before starting (`ulimit -n {want}`, or the "
            f"container's nofile limit, e.g. docker run --ulimit nofile={want}:{want})"
        )
    return limit


def store_capacity(limit: int) -> int:
    """How many clients a store served under descriptor limit ``limit`` can take."""
    if limit == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, (limit - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CLIENT)


def prepare_store(needed: int | None = None) -> int:
    """Raise the limit, log how many clients the store can take, and refuse (ConfigError)
    when that is fewer than ``needed``. Returns the capacity."""
    limit = raise_soft_limit()
    capacity = store_capacity(limit)
    log.info("recovery store: descriptor limit %s takes %d clients (%d descriptors each)",
             limit, capacity, DESCRIPTORS_PER_CLIENT)  # fmt: skip
    if needed is not None and capacity < needed:
        want = needed * DESCRIPTORS_PER_CLIENT + RESERVED_DESCRIPTORS
        raise ConfigError(
            f"the recovery store needs {needed} clients (every worker, and "
            f"{LAUNCHER_CLIENTS} per node's launcher), but this process's open-file limit "
            f"({limit}, the hard limit) takes {capacity}: raise it to at least {want} before "
            f"starting (`ulimit -n {want}`, or the container's nofile limit, e.g. docker run "
            f"--ulimit nofile={want}:{want})"
        )
    return capacity


def clients_needed(nnodes: str | int, nproc_per_node: str | int) -> int | None:
    """The store's clients of a job of ``nnodes`` (N or MIN:MAX) nodes of ``nproc_per_node``
    workers; None when the workers per node are not a number (``gpu``, ``auto``)."""
    try:
        nodes = int(str(nnodes).split(":")[-1])
        per_node = int(nproc_per_node)
    except ValueError:
        return None
    return nodes * (per_node + LAUNCHER_CLIENTS)
