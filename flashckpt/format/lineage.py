"""Branches of a job's history: which stored steps a restore may return after a rollback.

A job starts in generation 0. A ``restore()`` that goes back (to an older step than the
newest the job holds, asked for or forced by corrupt copies) starts a new generation: the
steps saved after it are stored apart from the abandoned ones (``step-<N>.g<G>`` in a tier,
see docs/FORMAT.md), and restore and the agents prefer them. A generation's ``Lineage`` lists
every branch point from generation 0 to it; a stored ``(generation, step)`` belongs to it when
the generation is on the path and the step is at or before every later branch point.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ManifestError

MAX_BRANCHES = 10_000


@dataclass(frozen=True)
class Lineage:
    """Branch points ``((generation, step branched after), ...)``, oldest first."""

    branches: tuple[tuple[int, int], ...] = ()

    @property
    def generation(self) -> int:
        return self.branches[-1][0] if self.branches else 0

    def holds(self, generation: int, step: int) -> bool:
        """Whether step ``step`` of ``generation`` is part of this branch's history."""
        gens = [0, *(g for g, _ in self.branches)]
        if generation not in gens:
            return False
        later = self.branches[gens.index(generation) :]
        return all(step <= at for _, at in later)

    def branch(self, generation: int, after_step: int) -> Lineage:
        """A new generation that continues this history after ``after_step`` (-1: from none)."""
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than {self.generation}")
        return Lineage((*self.branches, (generation, after_step)))

    def to_doc(self) -> list[list[int]]:
        return [[g, s] for g, s in self.branches]

    @classmethod
    def from_doc(cls, doc: object, source: str) -> Lineage:
        """Parse a stored lineage, checking it is a strictly rising list of [generation, step]."""
        if doc is None:
            return cls()
        if not isinstance(doc, list) or len(doc) > MAX_BRANCHES:
            raise ManifestError(f"{source}: lineage must be a list of [generation, step] pairs")
        out: list[tuple[int, int]] = []
        for item in doc:
            ok = (
                isinstance(item, list)
                and len(item) == 2
                and all(type(v) is int for v in item)
                and item[0] > (out[-1][0] if out else 0)
                and item[1] >= -1
            )
            if not ok:
                raise ManifestError(
                    f"{source}: lineage entry {item!r} is not [generation, step] with a generation "
                    "above the previous one; the copy is corrupt, restore from another source"
                )
            out.append((item[0], item[1]))
        return cls(tuple(out))


def newest(lineages: list[Lineage]) -> Lineage:
    """The lineage of the newest generation among ``lineages`` (generation 0's if none)."""
    return max(lineages, key=lambda lin: lin.generation, default=Lineage())
