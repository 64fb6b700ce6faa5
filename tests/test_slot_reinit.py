"""A slot file that is not a valid slot never blocks saving: its owner reinitialises it.

A writer SIGKILLed between reserving a slot file and writing its header leaves a file of the
right size full of zeros; one overwritten by something else holds garbage. The rank's next
owner starts it over on its first save(), with or without a restore() first; a reader (a
process only waiting for snapshots) leaves it alone.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.snapshot.slots import slot_path

JOB = "reinit"
CAPACITY = 1 << 20


def killed_while_reserving(path) -> None:
    """What Slot.create leaves when killed right after reserving the file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, CAPACITY)
    finally:
        os.close(fd)


def overwritten(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(os.urandom(CAPACITY))
    path.chmod(0o600)


def state(step: int) -> dict:
    return {"w": torch.arange(50_000, dtype=torch.float32) * step, "step": step}


@pytest.mark.parametrize("leftover", [killed_while_reserving, overwritten])
@pytest.mark.parametrize("restore_first", [False, True])
def test_the_first_save_after_a_leftover_slot_file_succeeds(shm_dir, leftover, restore_first):
    for i in range(2):
        leftover(slot_path(shm_dir, JOB, 0, i))
    with Checkpointer(job=JOB) as ck:
        if restore_first:
            assert ck.restore(state(0)) is None  # nothing readable: nothing restored
        ck.save(1, state(1))
        ck.save(2, state(2))
        assert ck.wait(2, timeout=10) == 2
        target = {"w": torch.zeros(50_000), "step": None}
        assert ck.restore(target) == 2
        assert torch.equal(target["w"], state(2)["w"]) and target["step"] == 2


def test_a_reader_leaves_an_invalid_slot_file_alone(shm_dir):
    path = slot_path(shm_dir, JOB, 0, 0)
    killed_while_reserving(path)
    before = path.read_bytes()
    reader = Checkpointer(job=JOB)  # never saves: not the owner
    try:
        with pytest.raises(TimeoutError, match="is not in shared memory"):
            reader.wait(timeout=0.3)
        assert path.exists() and path.read_bytes() == before
    finally:
        reader.close()
