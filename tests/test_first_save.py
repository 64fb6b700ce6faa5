"""A job's first save() prepares only the slot it writes into; the other slot is readied in
the background and never waited for (timings live in benchmarks/snapshot.py)."""

from __future__ import annotations

import threading

import torch
from conftest import wait_for

from flashckpt import Checkpointer
from flashckpt.snapshot.slots import SlotPair


def gate_background(
    monkeypatch, let_through: int = 0
) -> tuple[threading.Event, list[tuple[int, str, bool]]]:
    """Make every background slot preparation after the first ``let_through`` block until the
    returned event is set; record each preparation as (slot index, thread name, prefault)."""
    release = threading.Event()
    calls: list[tuple[int, str, bool]] = []
    real = SlotPair.prepare_slot

    def prepare_slot(self, i, capacity, prefault=True):
        name = threading.current_thread().name
        calls.append((i, name, prefault))
        background = [c for c in calls if c[1].startswith("flashckpt-prep")]
        if name.startswith("flashckpt-prep") and len(background) > let_through:
            assert release.wait(60), "the test never released the background preparation"
        return real(self, i, capacity, prefault)

    monkeypatch.setattr(SlotPair, "prepare_slot", prepare_slot)
    return release, calls


def test_first_save_without_restore_prepares_one_slot_and_readies_the_other_later(
    shm_dir, monkeypatch
):
    release, calls = gate_background(monkeypatch)
    state = {"t": torch.arange(100_000, dtype=torch.float32)}
    ck = Checkpointer(job="first")
    try:
        ck.save(0, state)  # returns although the second slot's preparation is blocked
        assert calls[0] == (0, threading.current_thread().name, False)  # faulted by the copy
        assert ck.wait(timeout=5) == 0
        release.set()
        for step in (1, 2, 3):
            state["t"].add_(1)
            ck.save(step, state)
        assert [(i, name.startswith("flashckpt-prep")) for i, name, _ in calls] == [
            (0, False),
            (1, True),
        ]
        restored = {"t": torch.zeros(100_000)}
        assert ck.restore(restored) == 3
        assert torch.equal(restored["t"], state["t"])
    finally:
        release.set()
        ck.close()


def test_first_save_after_restore_waits_only_for_the_slot_it_writes_into(shm_dir, monkeypatch):
    state = {"t": torch.full((100_000,), 7.0)}
    with Checkpointer(job="warm") as first:  # leaves nothing behind: close() frees the slots
        first.save(0, state)
    # restore() readies both slots in the background, the one the first save goes to first;
    # the second one is held back.
    release, calls = gate_background(monkeypatch, let_through=1)
    ck = Checkpointer(job="warm")
    try:
        assert ck.restore({"t": torch.zeros(100_000)}) is None  # nothing left: both slots new
        ck.save(1, state)  # must not wait for the second slot, still blocked
        assert ck.wait(timeout=5) == 1
        # The second slot's preparation reached the gate and waits there, unfinished.
        background = wait_for(
            lambda: sorted(i for i, name, _ in calls if name.startswith("flashckpt-prep"))
            == [0, 1],
            timeout=30, what="the second slot's preparation to start",
        )  # fmt: skip
        assert background and not release.is_set() and 1 in ck._prep.pending
        release.set()
        ck.save(2, state)
        ck.save(3, state)
        assert sorted(ck._pair.slots[i].header().step for i in range(2)) == [2, 3]
    finally:
        release.set()
        ck.close()
