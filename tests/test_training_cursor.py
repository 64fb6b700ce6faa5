"""The training cursor as Stateful leaves: a StatefulDataLoader and the RNGs go through
save/restore, so a resumed run draws the same batches and numbers as one that never stopped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashckpt import RNG, Checkpointer

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def loader() -> object:
    data = torch.arange(64, dtype=torch.float32).view(32, 2)
    return stateful_dataloader.StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


def draws(batches) -> list:
    """The next three batches, and a number from each generator after each."""
    out = []
    for _ in range(3):
        out.append((next(batches).tolist(), torch.rand(2).tolist(), np.random.rand(),
                    random.random()))  # fmt: skip
    return out


def test_a_resumed_run_draws_the_same_batches_and_random_numbers(shm_dir):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    first = loader()
    batches = iter(first)
    draws(batches)  # three batches into the epoch
    with Checkpointer(job="cursor") as ck:
        ck.save(3, {"data": first, "rng": RNG()})
        expected = draws(batches)
        # As a new run: another loader at the start of its epoch, generators seeded otherwise.
        torch.manual_seed(2), np.random.seed(2), random.seed(2)
        again = loader()
        assert ck.restore({"data": again, "rng": RNG()}) == 3
        assert draws(iter(again)) == expected


def test_cuda_rng_states_of_another_device_count_are_refused():
    state = RNG().state_dict()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    with pytest.raises(Exception, match="CUDA devices"):
        RNG().load_state_dict(state)
