"""Where a job's snapshots live inside a tier (see docs/FORMAT.md).

    <job>/step-<N>/rank-<R>/data            the rank's tensor bytes
    <job>/step-<N>/rank-<R>/manifest.json   its manifest with checksums, put after the data
    <job>/step-<N>/commit-<node>.json       put last, once every rank of that node is in

Steps of generation G >= 1 (saved after a restore that went back, see ``lineage``) live in
``step-<N>.g<G>`` instead, apart from the abandoned steps of the same number. A step is
committed in a tier when the ranks named by its commit markers of one incarnation of the job
cover the world (in a node-local tier: name the node's ranks); markers of an older
incarnation than the newest a step has are not counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from ..errors import ManifestError
from .lineage import Lineage
from .manifest import load_json

# ASCII digits only: ``\d`` also takes other scripts' digits, which int() reads (a stray
# ``step-١`` would commit step 1 under a name no key of step 1 has, never to be deleted).
_STEP = re.compile(r"step-([0-9]+)(?:\.g([1-9][0-9]*))?")
_COMMIT = re.compile(r"commit-([A-Za-z0-9._-]+)\.json")
_RANK = re.compile(r"rank-([0-9]+)")
_NODE = re.compile(r"[A-Za-z0-9._-]+")
MAX_WORLD_SIZE = 1 << 24
"""A marker naming a larger world is corrupt (no job has this many ranks)."""


def step_prefix(job: str, step: int, generation: int = 0) -> str:
    return f"{job}/step-{step:012d}" + (f".g{generation}" if generation else "")


def data_key(job: str, step: int, rank: int, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/rank-{rank}/data"


def manifest_key(job: str, step: int, rank: int, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/rank-{rank}/manifest.json"


def commit_key(job: str, step: int, node: str, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/commit-{node}.json"


@dataclass(frozen=True)
class CommitMarker:
    node: str
    ranks: tuple[int, ...]
    world_size: int
    lineage: Lineage = Lineage()  # the branch of the job's history the step belongs to
    incarnation: int = 0  # the run of the job that wrote it (0: written before they were kept)

    def to_json(self) -> bytes:
        doc: dict = {"node": self.node, "ranks": list(self.ranks), "world_size": self.world_size}
        if self.lineage.branches:
            doc["lineage"] = self.lineage.to_doc()
        if self.incarnation:
            doc["incarnation"] = self.incarnation
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "commit marker") -> CommitMarker:
        """Parse a marker read back from a tier; anything malformed is a ManifestError."""
        doc = load_json(raw, source, "commit marker")
        ok = (
            isinstance(doc, dict)
            and doc.keys() - {"lineage", "incarnation"} == {"node", "ranks", "world_size"}
            and type(doc.get("incarnation", 0)) is int and doc.get("incarnation", 0) >= 0
            and isinstance(doc["node"], str) and _NODE.fullmatch(doc["node"]) is not None
            and type(doc["world_size"]) is int and 1 <= doc["world_size"] <= MAX_WORLD_SIZE
            and isinstance(doc["ranks"], list)
            and all(type(r) is int and 0 <= r < doc["world_size"] for r in doc["ranks"])
            and len(doc["ranks"]) == len(set(doc["ranks"]))
        )  # fmt: skip
        if not ok:
            shown = raw[:120] if isinstance(raw, (bytes, str)) else raw
            raise ManifestError(
                f'{source}: expected a commit marker like {{"node": "n1", "ranks": [0, 1], '
                f'"world_size": 2}} (distinct ranks below world_size <= {MAX_WORLD_SIZE}), '
                f"found {shown!r}; the step's commit is corrupt, restore from another tier or an "
                "older step"
            )
        lineage = Lineage.from_doc(doc.get("lineage"), source)
        return cls(doc["node"], tuple(doc["ranks"]), doc["world_size"], lineage,
                   doc.get("incarnation", 0))  # fmt: skip


def parse_keys(job: str, keys: list[str]) -> dict[tuple[int, int], list[str]]:
    """Group a tier listing of ``job/`` by step: {(generation, step): [commit-marker keys]}."""
    steps: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != job or not (m := _STEP.fullmatch(parts[1])):
            continue
        markers = steps.setdefault((int(m.group(2) or 0), int(m.group(1))), [])
        if len(parts) == 3 and _COMMIT.fullmatch(parts[2]):
            markers.append(key)
    return steps


def written_by(job: str, key: str, node: str, ranks: Collection[int]) -> bool:
    """True if ``key`` (of ``job``) is one ``node`` writes: a shard of one of its ``ranks``, or
    its own commit marker."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != job or not _STEP.fullmatch(parts[1]):
        return False
    rank = _RANK.fullmatch(parts[2])
    return parts[2] == f"commit-{node}.json" or (rank is not None and int(rank.group(1)) in ranks)
