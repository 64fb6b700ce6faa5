"""Agreement among the ranks of a job, through the process group when one is up.

Ranks must never restore different steps: each offers the steps it holds and all take the
newest one every rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable


def _world() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:
        pass
    return 1


def world_size() -> int:
    """The process group's size, else ``WORLD_SIZE``, else 1."""
    import os

    w = _world()
    return w if w > 1 else int(os.environ.get("WORLD_SIZE") or 1)


def gather(value: object) -> list[object]:
    """Every rank's ``value`` (just ours outside a process group)."""
    if _world() == 1:
        return [value]
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def newest_common(steps: Iterable[int]) -> int | None:
    """The newest step that every rank offers, or None."""
    sets = [set(s) for s in gather(sorted(set(steps)))]  # type: ignore[arg-type]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def all_true(flag: bool) -> bool:
    return all(gather(bool(flag)))
