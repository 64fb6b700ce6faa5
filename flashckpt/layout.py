"""Where a job's snapshots live inside a tier (see docs/FORMAT.md).

    <job>/step-<N>/rank-<R>/data            the rank's tensor bytes
    <job>/step-<N>/rank-<R>/manifest.json   its manifest with checksums, put after the data
    <job>/step-<N>/commit-<node>.json       put last, once every rank of that node is in

A step is committed in a tier when the ranks named by its commit markers cover the world.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_STEP = re.compile(r"^step-(\d+)$")
_COMMIT = re.compile(r"^commit-([A-Za-z0-9._-]+)\.json$")


def step_prefix(job: str, step: int) -> str:
    return f"{job}/step-{step:012d}"


def data_key(job: str, step: int, rank: int) -> str:
    return f"{step_prefix(job, step)}/rank-{rank}/data"


def manifest_key(job: str, step: int, rank: int) -> str:
    return f"{step_prefix(job, step)}/rank-{rank}/manifest.json"


def commit_key(job: str, step: int, node: str) -> str:
    return f"{step_prefix(job, step)}/commit-{node}.json"


@dataclass(frozen=True)
class CommitMarker:
    node: str
    ranks: tuple[int, ...]
    world_size: int

    def to_json(self) -> bytes:
        return json.dumps(
            {"node": self.node, "ranks": list(self.ranks), "world_size": self.world_size}
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CommitMarker:
        doc = json.loads(raw)
        return cls(doc["node"], tuple(doc["ranks"]), int(doc["world_size"]))


def parse_keys(job: str, keys: list[str]) -> dict[int, list[str]]:
    """Group a tier listing of ``job/`` by step: {step: [commit-marker keys]}."""
    steps: dict[int, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != job or not (m := _STEP.match(parts[1])):
            continue
        step = int(m.group(1))
        markers = steps.setdefault(step, [])
        if len(parts) == 3 and _COMMIT.match(parts[2]):
            markers.append(key)
    return steps
