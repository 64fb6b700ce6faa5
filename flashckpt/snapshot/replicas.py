"""Which parts of a state are replicas: the same bytes on every rank of a replica group.

Under DDP every rank holds the same model and optimizer. Each rank still snapshots its own
state into its node's memory, but a tier needs only one copy: the agent stores a replicated
entry once per replica group in a shared tier (by the group's first rank) and once per node
in a node-local tier (by the node's first rank of the group); the other ranks' stored copies
point at it. Any rank can then restore from any replica's copy, and a job restarted with more
or fewer ranks restores its replicated state.

``replicated=None`` (the default) finds them: a top-level value that is a
``DistributedDataParallel`` module, and an optimizer all of whose parameters belong to such
modules. ``replicated=False`` turns it off; a collection of top-level keys names them
explicitly (their group is then every rank of the job). DTensor entries are never replicas
here: they are shards, and their placements say how to put them back together.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch

from .. import group

log = logging.getLogger(__name__)

Replicas = tuple[int, int, int]
"""range(start, stop, step) of the ranks holding the same replicated entries."""


def as_range(ranks: list[int]) -> Replicas | None:
    """``ranks`` as a range, or None if they are not evenly spaced."""
    if len(ranks) < 2:
        return (ranks[0], ranks[0] + 1, 1) if ranks else None
    step = ranks[1] - ranks[0]
    if step <= 0 or ranks != list(range(ranks[0], ranks[-1] + 1, step)):
        return None
    return (ranks[0], ranks[-1] + 1, step)


def _ddp_ranks(module: Any) -> list[int]:
    import torch.distributed as dist

    pg = getattr(module, "process_group", None)
    try:
        return sorted(dist.get_process_group_ranks(pg)) if pg is not None else []
    except (RuntimeError, ValueError, AttributeError):
        return list(range(group.world_size()))


def find(state: Mapping[str, Any]) -> tuple[frozenset[str], Replicas | None]:
    """The top-level keys of ``state`` that DDP replicates, and their replica group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    modules = {k: v for k, v in state.items() if isinstance(v, DDP)}
    if not modules:
        return frozenset(), None
    groups = {tuple(_ddp_ranks(m)) for m in modules.values()}
    if len(groups) != 1:
        log.info("DDP modules of different process groups: every rank stores its own copy")
        return frozenset(), None
    replicas = as_range(list(groups.pop()))
    if replicas is None:
        return frozenset(), None
    params = {id(p) for m in modules.values() for p in m.parameters()}
    keys = set(modules)
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer) and type(v).__name__ != "ZeroRedundancyOptimizer":
            mine = [p for g in v.param_groups for p in g["params"]]
            if mine and all(id(p) in params for p in mine):
                keys.add(k)
    return frozenset(keys), replicas


class ReplicaFinder:
    """The replicated keys of the states a Checkpointer saves, found once per state."""

    def __init__(self, setting: bool | Collection[str] | None):
        if setting is True:
            setting = None
        if setting is not None and setting is not False:
            if isinstance(setting, (str, bytes)) or not all(isinstance(k, str) for k in setting):
                raise TypeError(
                    "replicated must be None (find DDP replicas), False (off) or a collection "
                    f"of the state's top-level keys, got {setting!r}"
                )
            setting = frozenset(setting)
        self.setting = setting
        self._cache: tuple[tuple, tuple[frozenset[str], Replicas | None]] | None = None

    def __call__(self, state: Mapping[str, Any]) -> tuple[frozenset[str], Replicas | None]:
        if self.setting is False or not isinstance(state, Mapping):  # flatten() says why
            return frozenset(), None
        ident = tuple((k, id(v)) for k, v in state.items())
        if self._cache is not None and self._cache[0] == ident:
            return self._cache[1]
        if self.setting is None:
            found = find(state)
        else:
            keys = frozenset(k for k in self.setting if k in state)
            found = (keys, (0, group.world_size(), 1)) if keys else (frozenset(), None)
        self._cache = (ident, found)
        return found
