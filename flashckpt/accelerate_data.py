"""The position of Accelerate's prepared dataloaders, as one step of ``flashckpt.accelerate``.

What a prepared dataloader needs to go on where it stopped: a stateful dataloader's state
(``DataLoaderConfiguration(use_stateful_dataloader=True)``), the seedable sampler Accelerate
keeps for iterable datasets, and the epoch (``iteration``) a seedable sampler shuffles with,
which Accelerate itself does not keep. ``state_of`` takes it at a save, ``load`` puts it
back after a restore.

A loader resumed mid-epoch makes a new iterator, which draws its base seed from the global
torch generator: the run that saved had drawn it before saving. That one draw is undone, so
a resumed run draws the random numbers (dropout...) of a run that never stopped.
"""

from __future__ import annotations

from typing import Any

import torch


def state_of(dl: Any) -> dict[str, Any]:
    """What ``load`` needs to put ``dl`` back where it is now."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    state = None
    if getattr(dl, "use_stateful_dataloader", False):
        state = dl.state_dict()
    sampler = None
    if isinstance(dl.dataset, IterableDatasetShard):
        candidate = dl.get_sampler()
        if isinstance(candidate, SeedableRandomSampler):
            sampler = candidate
    iteration = getattr(dl, "iteration", None)
    iterating, finished = _iterating(dl), bool(getattr(dl, "end_of_dataloader", False))
    mid_epoch = iterating and not finished
    if iteration is not None and iterating and finished:
        # Saved at the last batch of an epoch: the loop that resumes starts the next one.
        iteration += 1
    return {"state": state, "sampler": sampler, "iteration": iteration, "mid_epoch": mid_epoch}


def load(dl: Any, saved: dict[str, Any], position: bool = True) -> None:
    """Put ``dl`` back as ``state_of`` found it. ``position=False`` (another number of
    processes, whose shards are other batches) keeps the epoch but not the place in it: the
    epoch in progress starts again from its first batch."""
    if saved.get("sampler") is not None:
        dl.set_sampler(saved["sampler"])
    state = saved.get("state")
    if position and state is not None and getattr(dl, "use_stateful_dataloader", False):
        # A finished epoch's state is not loaded: torchdata would make an iterator only to
        # find it finished and make another (one more draw from the generator than the run
        # that saved made); a loader with no state starts the next epoch as that run did.
        finished = bool(state.get("_iterator_finished"))
        dl.load_state_dict({} if finished else state)
        dl.dl_state_dict = dict(state)  # what state_dict() gives until it iterates
        if saved.get("mid_epoch") and not finished:
            _without_draws_on_resume(dl)
    if saved.get("iteration") is not None and hasattr(dl, "set_epoch"):
        dl.set_epoch(int(saved["iteration"]))


def _iterating(dl: Any) -> bool:
    """Whether ``dl`` is being iterated (between Accelerate's begin() and end())."""
    refs = getattr(getattr(dl, "gradient_state", None), "dataloader_references", [])
    return any(ref is dl for ref in refs)


def _without_draws_on_resume(dl: Any) -> None:
    """Let the iterator that resumes ``dl`` leave the global torch generator as it finds it.

    A DataLoader draws from the global generator as it makes each epoch's iterator (its base
    seed). The run that saved made this epoch's iterator before saving, so its draw is in the
    saved generator state; the resumed run makes one more, which would shift every random
    number after it (dropout, ...). The next ``iter()`` of this one loader undoes its draws.
    """
    base = getattr(dl, "base_dataloader", None)
    if base is None:
        return

    def first_iter() -> Any:
        del base.__iter__  # one epoch only: the next ones draw as in an uninterrupted run
        before = torch.get_rng_state()
        try:
            return type(base).__iter__(base)
        finally:
            torch.set_rng_state(before)

    base.__iter__ = first_iter  # Accelerate's DataLoaderShard calls base_dataloader.__iter__()
