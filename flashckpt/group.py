"""Agreement among the ranks of a job, through the process group when one is up.

Ranks must never restore different steps: each offers the steps it holds and all take the
newest one every rank holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def from_first(compute: Callable[[], T]) -> T:
    """``compute()`` as the first rank returns it, on every rank: only rank 0 calls it (a
    listing of a shared tier, say, that every rank would otherwise make at once). What it
    raises there is raised on every rank."""
    if _world() == 1:
        return compute()
    import torch.distributed as dist

    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", compute())
        except Exception as exc:  # sent, so that no rank waits for a result that never comes
            box[0] = ("error", (type(exc).__name__, str(exc)))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]  # type: ignore[misc]
    if status == "error":
        kind, message = value  # type: ignore[misc]
        raise _same_kind(kind, f"rank 0 failed: {message}")
    return value  # type: ignore[return-value]


def newest_common(steps: Iterable[int]) -> int | None:
    """The newest step that every rank offers, or None."""
    sets = [set(s) for s in gather(sorted(set(steps)))]  # type: ignore[arg-type]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def warn_if_some_hold_none(holds: bool, job: str, asked: int | None = None) -> None:
    """Say so when some ranks hold steps and others none: no step is common, so every rank
    starts over, which is right for a first save cut short and a loss of progress otherwise.
    A restore of a step ``asked`` for fails on its own, and warns of nothing."""
    if asked is not None:
        return
    holders = gather(bool(holds))
    if any(holders) and not all(holders):
        empty = [r for r, h in enumerate(holders) if not h]
        log.warning(
            "job %s: ranks %s hold no snapshot while %d other ranks do, so every rank starts "
            "over. If the job was restarted with more ranks than it saved with, a new rank "
            "restores only DDP replicas or DTensor shards, from a tier holding the step of every "
            "rank that saved it; restart with %d ranks otherwise. If a node lost its memory and "
            "node-local tiers, give the job a shared tier (pfs://, s3://) to restore from",
            job, empty, len(holders) - len(empty), len(holders) - len(empty),
        )  # fmt: skip


def all_true(flag: bool, error: BaseException | None = None) -> bool:
    """True if every rank's ``flag`` is.

    The same all-gather carries ``error``: a failure on this rank that is not a bad copy (the
    state does not match the snapshot, a pickle is not allowed, a ``load_state_dict`` raised).
    If any rank had one, every rank raises (its own error, or one naming the rank that
    failed), so no rank dies alone and leaves the others waiting in a collective.
    """
    said = None if error is None else (type(error).__name__, str(error))
    outcomes = gather((bool(flag), said))
    if error is not None:
        raise error
    failed = [(rank, e) for rank, (_, e) in enumerate(outcomes) if e is not None]  # type: ignore[misc]
    if failed:
        rank, (kind, message) = failed[0]
        raise _same_kind(kind, f"rank {rank} failed to restore: {message}")
    return all(ok for ok, _ in outcomes)  # type: ignore[misc]


def _same_kind(kind: str, message: str) -> Exception:
    """A flashckpt error of the class named ``kind`` (so every rank can catch the same one),
    else the base FlashCkptError."""
    from . import errors

    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.FlashCkptError):
        return cls(message)
    return errors.FlashCkptError(f"{kind}: {message}")
