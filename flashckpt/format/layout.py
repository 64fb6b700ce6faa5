"""Where a job's snapshots live inside a tier (see docs/FORMAT.md).

    <job>/step-<N>/rank-<R>/data            the rank's tensor bytes
    <job>/step-<N>/rank-<R>/manifest.json   its manifest with checksums, put after the data
    <job>/step-<N>/commit-<node>.json       put last, once every rank of that node is in

Steps of generation G >= 1 (saved after a restore that went back, see ``lineage``) live in
``step-<N>.g<G>`` instead, apart from the abandoned steps of the same number. A step is
committed in a tier when the ranks named by its commit markers of one incarnation of the job
cover the world (in a node-local tier: name the node's ranks); markers of an older
incarnation than the newest a step has are not counted, and a rank counts only where its
manifest is stored.

A job's runs claim their epochs in ``<job>/fence/epoch-<E>.json`` (see ``fence.py``).

Only canonical names count: ``step-`` with the step in 12 digits or more (no leading zero
beyond those), ``rank-`` with no leading zero. Anything else under a job (``step-1``,
``step-99``, ``rank-01``) is a stray: never a step, never listed, never removed by retention,
reported by ``flashckpt verify`` and ``gc``. A stray copy cannot merge with a real step or
make retention count it.
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
_CLAIM = re.compile(r"epoch-([0-9]+)\.json")
FENCE_DIR = "fence"
"""Where the runs of a job claim their epochs in a shared tier (``fence.py``)."""
MAX_WORLD_SIZE = 1 << 24
"""A marker naming a larger world is corrupt (no job has this many ranks)."""


def step_dir(step: int, generation: int = 0) -> str:
    """A step's directory name: the only name its keys are ever stored or found under."""
    return f"step-{step:012d}" + (f".g{generation}" if generation else "")


def step_prefix(job: str, step: int, generation: int = 0) -> str:
    return f"{job}/{step_dir(step, generation)}"


def parse_step(name: str) -> tuple[int, int] | None:
    """(generation, step) of a canonical step directory name; None for anything else."""
    m = _STEP.fullmatch(name)
    if m is None:
        return None
    key = (int(m.group(2) or 0), int(m.group(1)))
    return key if step_dir(key[1], key[0]) == name else None


def parse_rank(name: str) -> int | None:
    """The rank of a canonical rank directory name (``rank-3``); None for anything else."""
    m = _RANK.fullmatch(name)
    return int(m.group(1)) if m and name == f"rank-{int(m.group(1))}" else None


def data_key(job: str, step: int, rank: int, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/rank-{rank}/data"


def manifest_key(job: str, step: int, rank: int, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/rank-{rank}/manifest.json"


def commit_key(job: str, step: int, node: str, generation: int = 0) -> str:
    return f"{step_prefix(job, step, generation)}/commit-{node}.json"


def claim_key(job: str, epoch: int) -> str:
    """Where run ``epoch`` of ``job`` claimed its epoch: ``<job>/fence/epoch-<E, 12 digits>.json``."""
    return f"{job}/{FENCE_DIR}/epoch-{epoch:012d}.json"


def parse_claim(name: str) -> int | None:
    """The epoch of a canonical claim's file name; None for anything else."""
    m = _CLAIM.fullmatch(name)
    if m is None:
        return None
    epoch = int(m.group(1))
    return epoch if f"epoch-{epoch:012d}.json" == name else None


def claims(job: str, keys: list[str]) -> list[int]:
    """The epochs claimed in a tier listing of ``job/`` (or of its fence), oldest first."""
    prefix = f"{job}/{FENCE_DIR}/"
    found = (parse_claim(k[len(prefix) :]) for k in keys if k.startswith(prefix))
    return sorted(e for e in found if e is not None)


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


@dataclass(frozen=True)
class StepKeys:
    """What a listing holds of one step: its commit markers' keys, the ranks whose manifest
    is stored."""

    markers: tuple[str, ...] = ()
    manifests: frozenset[int] = frozenset()


_RANK_FILES = ("data", "manifest.json")


def scan(job: str, keys: list[str]) -> dict[tuple[int, int], StepKeys]:
    """Group a tier listing of ``job/`` by canonical step: {(generation, step): StepKeys}."""
    markers: dict[tuple[int, int], list[str]] = {}
    manifests: dict[tuple[int, int], set[int]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != job or (step := parse_step(parts[1])) is None:
            continue
        found = markers.setdefault(step, [])
        if len(parts) == 3 and _COMMIT.fullmatch(parts[2]):
            found.append(key)
        elif parts[3:] == ["manifest.json"] and (rank := parse_rank(parts[2])) is not None:
            manifests.setdefault(step, set()).add(rank)
    return {k: StepKeys(tuple(m), frozenset(manifests.get(k, ()))) for k, m in markers.items()}


def parse_keys(job: str, keys: list[str]) -> dict[tuple[int, int], list[str]]:
    """Group a tier listing of ``job/`` by step: {(generation, step): [commit-marker keys]}."""
    return {k: list(found.markers) for k, found in scan(job, keys).items()}


def strays(job: str, keys: list[str]) -> list[str]:
    """The names under ``job/`` in a tier listing that are no part of a step: a step or rank
    directory of a name flashckpt never writes (``step-1``, ``rank-01``), or anything else
    besides a step's commit markers, its ranks' data and manifest, and the runs' claims in
    ``fence/``. Each is ignored by
    listings, commits and retention, and never removed by them."""
    found: set[str] = set()
    for key in keys:
        parts = key.split("/")
        if not parts or parts[0] != job:
            continue
        if len(parts) == 3 and parts[1] == FENCE_DIR and parse_claim(parts[2]) is not None:
            continue
        if len(parts) < 3 or parse_step(parts[1]) is None:
            found.add("/".join(parts[:2]))
        elif len(parts) == 3:
            if not _COMMIT.fullmatch(parts[2]):
                found.add(key)
        elif parse_rank(parts[2]) is None:
            found.add("/".join(parts[:3]))
        elif len(parts) != 4 or parts[3] not in _RANK_FILES:
            found.add(key)
    return sorted(found)


def written_by(job: str, key: str, node: str, ranks: Collection[int]) -> bool:
    """True if ``key`` (of ``job``) is one ``node`` writes: a shard of one of its ``ranks``, or
    its own commit marker."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != job or parse_step(parts[1]) is None:
        return False
    rank = parse_rank(parts[2])
    return parts[2] == f"commit-{node}.json" or (rank is not None and rank in ranks)
