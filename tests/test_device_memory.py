"""Device memory on CPU, against the simulated device of ``fake_device``: slots page-locked
off the training thread (a restarted process's too), a refused registration, unregistering
before a slot grows or is unmapped, and verified, staged uploads into device tensors."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from conftest import run_python
from fake_device import installed

from flashckpt import Checkpointer
from flashckpt.restore import device_upload, optim_state
from flashckpt.snapshot.slots import slot_path


@pytest.fixture
def fake(shm_dir):
    with installed() as f:
        yield f


def sealed(ck: Checkpointer, step: int) -> None:
    """Wait until ``step`` is published and its checksums written (so a restore verifies)."""
    assert ck.wait(step, timeout=10) == step
    ck._sealer.drain()
    assert all(s.header().sealed for s in ck._pair.ready())


def settle(ck: Checkpointer) -> None:
    """Wait for the background preparation (and page-locking) in flight."""
    for fut in list(ck._prep.pending.values()):
        fut.result()


def slot_mappings(ck: Checkpointer) -> set[tuple[int, int]]:
    return {(s.buf.data_ptr(), s.capacity) for s in ck._pair.slots if s is not None}


def state_of(n: int = 300_000, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(n // 1000, 1000), torch.nn.Linear(1000, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, n // 1000)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def equal_states(a: dict, b: dict) -> None:
    for (k, x), y in zip(a["model"].state_dict().items(), b["model"].state_dict().values(),
                         strict=True):  # fmt: skip
        assert torch.equal(x, y), k
    sa, sb = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def test_no_registration_runs_on_the_training_thread_and_every_slot_gets_one(fake):
    state = state_of()
    with Checkpointer(job="pin") as ck:
        for step in range(3):
            ck.save(step, state)
        settle(ck)
        threads = {name for name, *_ in fake.registered}
        assert threads and all(name.startswith("flashckpt-prep") for name in threads)
        assert {dev for _, dev, _, _ in fake.registered} == {"fake:0"}  # its device made current
        assert {(p, n) for _, _, p, n in fake.registered} == slot_mappings(ck)
        assert all(ck._prep.pinner.pinned(s) for s in ck._pair.slots if s is not None)
        registered = {p for _, _, p, _ in fake.registered}
    assert {p for _, p in fake.unregistered} == registered  # all, before unmapping
    assert all(name.startswith("flashckpt-prep") for name, _ in fake.unregistered)


def test_a_restarted_process_page_locks_the_slots_it_finds(fake, shm_dir):
    """After a crash, restore() maps the slots left behind; they are page-locked in the
    background too, the one the next save goes to first."""
    run_python(f"""
import os, torch
from states import tiny_model
from flashckpt import Checkpointer
ck = Checkpointer(job="restart", shm_dir={str(shm_dir)!r})
m = tiny_model()
for step in range(2):
    ck.save(step, {{"model": m}})
ck.wait(1, timeout=10)
os._exit(0)  # no close(): as a crash leaves them
""")
    from states import tiny_model

    assert slot_path(shm_dir, "restart", 0, 1).exists()
    model = tiny_model(seed=3)
    with Checkpointer(job="restart") as ck:
        assert ck.restore({"model": model}) == 1
        settle(ck)
        assert {(p, n) for _, _, p, n in fake.registered} == slot_mappings(ck)
        first = ck._pair.write_order()[0]
        assert fake.registered[0][2] == ck._pair.slots[first].buf.data_ptr()
        ck.save(2, {"model": model})
        assert ck._prep.pinner.pinned(ck._pair.slots[first])  # written into while page-locked


def test_a_refused_registration_leaves_the_slot_pageable_until_it_is_tried_again_later(
    fake, caplog, monkeypatch
):
    from flashckpt.snapshot import pinning

    monkeypatch.setattr(pinning, "RETRY_S", 0.3)
    fake.refuse = "operation not supported (error 801)"
    state = state_of()
    with Checkpointer(job="refused") as ck:
        for step in range(4):
            ck.save(step, state)
            settle(ck)
        assert len(fake.registered) == 2  # each slot tried once: not again at once
        assert caplog.text.count("page-locking") == 1 and "error 801" in caplog.text
        assert not fake.unregistered
        restored = state_of(seed=1)
        assert ck.restore(restored) == 3
        equal_states(restored, state)
        fake.refuse = None  # e.g. the graph capture or the memory pressure that refused it ended
        time.sleep(0.35)
        for step in range(4, 7):
            ck.save(step, state)
            settle(ck)
        assert len(fake.registered) == 4  # tried again once the wait was over, and locked
        assert all(ck._prep.pinner.pinned(s) for s in ck._pair.slots if s is not None)


def test_a_page_locked_slot_is_unregistered_before_it_grows(fake):
    small = {"t": torch.ones(1000)}
    with Checkpointer(job="grow") as ck:
        ck.save(0, small)
        ck.save(1, small)
        settle(ck)
        before = slot_mappings(ck)
        big = {"t": torch.ones(2_000_000)}  # past the headroom: every slot grows
        for step in (2, 3):
            ck.save(step, big)
            settle(ck)
        assert {p for _, p in fake.unregistered} == {p for p, _ in before}
        assert all(name.startswith("flashckpt-prep") for name, _ in fake.unregistered)
        assert slot_mappings(ck) <= {(p, n) for _, _, p, n in fake.registered}
        out = {"t": torch.zeros(2_000_000)}
        assert ck.restore(out) == 3 and torch.equal(out["t"], big["t"])


def test_restore_into_device_tensors_is_staged_verified_and_uploaded_a_buffer_at_a_time(fake):
    state = state_of()
    with Checkpointer(job="upload", chunk_size=1 << 16) as ck:
        ck.save(0, state)
        sealed(ck, 0)
        calls: list[tuple[str, int, set[int]]] = []
        real_copy_many, real_pinned = fake.copy_many, fake.pinned_empty
        buffers: list[torch.Tensor] = []

        def copy_many(stream, dsts, srcs):
            ptrs = {s.untyped_storage().data_ptr() for s in srcs}
            calls.append((threading.current_thread().name, len(dsts), ptrs))
            real_copy_many(stream, dsts, srcs)

        def pinned_empty(nbytes):
            buffers.append(real_pinned(nbytes))
            return buffers[-1]

        fake.copy_many, fake.pinned_empty = copy_many, pinned_empty
        ck._prep.pinner.pinned = lambda slot: False  # read through the staging buffers
        restored = state_of(seed=1)
        assert ck.restore(restored) == 0
        equal_states(restored, state)
    nbytes = sum(t.nbytes for t in restored["model"].state_dict().values()) * 3
    assert nbytes < device_upload.STAGE  # the whole state fits one staging buffer...
    assert len(calls) == 1  # ...so its ~60 chunks of 64 KiB go up in one call
    name, rows, ptrs = calls[0]
    assert rows > 50 and ptrs <= {b.data_ptr() for b in buffers}  # each from a staging buffer
    # Only the restoring thread talks to the device: no restore worker waits on it either.
    assert name == threading.current_thread().name
    assert fake.waits and not [t for t, _ in fake.waits if t.startswith("flashckpt-restore")]


def test_a_page_locked_slot_is_uploaded_from_directly(fake):
    state = state_of()
    with Checkpointer(job="direct") as ck:
        for step in range(2):  # the slot a save writes into is page-locked by the next one
            ck.save(step, state)
            sealed(ck, step)
            settle(ck)
        assert all(ck._prep.pinner.pinned(s) for s in ck._pair.slots if s is not None)
        restored = state_of(seed=1)
        assert ck.restore(restored) == 1
        equal_states(restored, state)
        assert fake.pinned_buffers == 0


def test_a_corrupt_chunk_is_caught_on_the_way_to_the_device(fake, caplog):
    caplog.set_level(logging.WARNING)
    state = state_of()
    with Checkpointer(job="corrupt", chunk_size=1 << 16) as ck:
        ck.save(0, state)
        ck.save(1, state)
        sealed(ck, 1)
        newest = ck._pair.ready()[0]
        h = newest.header()
        data = newest.data_tensor(h)
        data[len(data) // 2] ^= 0xFF  # a flipped byte in the middle of the newest snapshot
        restored = state_of(seed=1)
        assert ck.restore(restored) == 0  # the older, intact one
        equal_states(restored, state)
    assert "crc32c" in caplog.text


def test_a_fresh_optimizer_gets_its_state_on_the_device_before_the_upload(fake, monkeypatch):
    created = []
    real = optim_state.create_state
    monkeypatch.setattr(
        optim_state, "create_state", lambda opt, idx: created.append(opt) or real(opt, idx)
    )
    state = state_of()
    with Checkpointer(job="fresh") as ck:
        ck.save(0, state)
        sealed(ck, 0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 8))
        restored = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}
        assert ck.restore(restored) == 0
        assert created == [restored["optim"]]
        equal_states(restored, state)


def test_a_mismatched_restore_leaves_a_fresh_optimizer_fresh(fake):
    state = state_of()
    with Checkpointer(job="mismatch") as ck:
        ck.save(0, state)
        model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 9))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        with pytest.raises(Exception, match="shape"):
            ck.restore({"model": model, "optim": opt})
        assert not opt.state


def test_when_optimizer_state_appears_only_the_target_slot_grows_on_the_training_thread(
    fake, monkeypatch
):
    """restore() at start sizes the slots for a fresh optimizer (no state yet); the first
    step makes the state three times larger. The save grows only the slot it writes into;
    the other slot grows, and every slot is page-locked again, in the background."""
    from flashckpt.snapshot.slots import SlotPair

    calls: list[tuple[int, str]] = []
    real = SlotPair.prepare_slot

    def prepare_slot(self, i, capacity, prefault=True):
        calls.append((i, threading.current_thread().name))
        return real(self, i, capacity, prefault)

    monkeypatch.setattr(SlotPair, "prepare_slot", prepare_slot)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 8))
    state = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}
    with Checkpointer(job="regrow") as ck:
        assert ck.restore(state) is None
        settle(ck)
        small = slot_mappings(ck)
        calls.clear()
        model(torch.ones(2, 300)).sum().backward()
        state["optim"].step()  # AdamW's moments appear: the state triples
        ck.save(0, state)
        assert [name for _, name in calls if not name.startswith("flashckpt-prep")] == [
            threading.current_thread().name
        ]  # the target alone
        settle(ck)
        assert ck.wait(0, timeout=10) == 0
        ck.save(1, state)
        settle(ck)
        big = slot_mappings(ck)
        assert min(n for _, n in big) > max(n for _, n in small)
        assert big <= {(p, n) for _, _, p, n in fake.registered}
        assert {p for p, _ in small} <= {p for _, p in fake.unregistered}
        threads = {name for name, *_ in fake.registered} | {n for n, _ in fake.unregistered}
        assert all(name.startswith("flashckpt-prep") for name in threads)
