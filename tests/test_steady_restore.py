"""The steady restore: a state that holds what the snapshot holds but for tensor values is
filled by one batched, verified pass, without matching the tree node by node; anything else
(a scalar that differs, another structure, a target that is not plain bytes) is matched node
by node, and both end in the same state. Times are in ``benchmarks/snapshot.py --case
many-tensors``, never here."""

from __future__ import annotations

import pytest
import torch
from fake_device import installed
from test_many_tensors import Counted, assert_same, many, values

from flashckpt import Checkpointer
from flashckpt.errors import ChecksumError, ManifestError, PartlyRestoredError
from flashckpt.format import sealed
from flashckpt.format.checksum import crc
from flashckpt.format.manifest import Entry
from flashckpt.format.slot import HEADER_SIZE
from flashckpt.restore import device_upload, entry_copy, into_state, steady_load
from flashckpt.snapshot.slots import read_locked


class Spy:
    """Counts how often ``steady_load.producer`` gave a loader, and how often it declined."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken = self.declined = 0
        real = steady_load.producer

        def spy(manifest, walked):
            got = real(manifest, walked)
            if got is None:
                self.declined += 1
            else:
                self.taken += 1
            return got

        monkeypatch.setattr(steady_load, "producer", spy)


@pytest.fixture(params=["compiled", "compiled-pool", "python"])
def copy_path(request, monkeypatch):
    """Each chunk copied and checked by the compiled copy (on torch's OpenMP team, or on the
    restore workers where the process has no team), or from Python where it is not built:
    all must land the same bytes and refuse the same corrupt ones."""
    if request.param == "python":
        monkeypatch.setattr(entry_copy, "_native", None)
    elif entry_copy._native is None:
        pytest.skip("the compiled verified copy is not built here (no compiler, not x86-64)")
    elif request.param == "compiled-pool":
        monkeypatch.setattr(entry_copy._native, "team", lambda: False)
    return request.param


def test_a_state_shaped_as_the_snapshot_is_filled_in_one_pass(shm_dir, monkeypatch, copy_path):
    spy = Spy(monkeypatch)
    matched = []
    monkeypatch.setattr(into_state.Planner, "match",
                        lambda self, *a, real=into_state.Planner.match: matched.append(1)
                        or real(self, *a))  # fmt: skip
    state = many(2000)
    with Checkpointer(job="steady-restore") as ck:
        ck.save(1, state)
        expected = values(state)
        ck._sealer.drain()  # verified: the chunks carry their checksums
        target = many(2000, seed=3)
        for p in target["model"]:
            p.grad = torch.ones_like(p)
        for _ in range(3):  # the first restore walks the target in full, the rest compile
            assert ck.restore(target) == 1
            assert_same(values(target), expected)
    assert spy.taken == 3 and not matched  # never matched node by node
    assert all(p.grad is None for p in target["model"])  # gradients dropped, as node by node
    assert target["optim"].param_groups[0]["lr"] == 1e-3


def test_a_scalar_that_differs_is_matched_node_by_node_and_restored(shm_dir, monkeypatch):
    spy = Spy(monkeypatch)
    state = {**many(400), "step": 7, "note": "saved"}
    with Checkpointer(job="steady-scalar") as ck:
        ck.save(7, state)
        expected = values(state)
        target = {**many(400, seed=2), "step": 9, "note": "saved"}
        target["optim"].param_groups[0]["lr"] = 5.0
        assert ck.restore(target) == 7
        assert spy.declined == 1 and spy.taken == 0
        assert target["step"] == 7 and target["optim"].param_groups[0]["lr"] == 1e-3
        assert_same(values(target), expected)
        ck.restore(target)  # now it holds the snapshot's scalars: the steady path
        assert spy.taken == 1
        target["step"] = True  # equal to 1 in Python, not the same JSON: node by node
        state["step"] = 1
        ck.save(8, state)
        ck.restore(target)
        assert target["step"] == 1 and type(target["step"]) is int
        assert spy.declined == 2


class Copies:
    """A Stateful whose state_dict() returns copies: only load_state_dict() restores it."""

    def __init__(self, value: float) -> None:
        self.w = torch.full((5,), value)
        self.loads = 0

    def state_dict(self) -> dict:
        return {"w": self.w.clone(), "n": 3}

    def load_state_dict(self, sd: dict) -> None:
        self.loads += 1
        self.w = sd["w"].clone()


def test_a_stateful_returning_copies_is_loaded_with_the_dict_that_was_filled(shm_dir, monkeypatch):
    spy = Spy(monkeypatch)
    with Checkpointer(job="steady-copies") as ck:
        ck.save(1, {"extra": Copies(4.0), **many(40)})
        target = {"extra": Copies(-1.0), **many(40, seed=1)}
        for _ in range(2):  # full walk, then the compiled one
            target["extra"].w.fill_(-1.0)
            assert ck.restore(target) == 1
            assert torch.equal(target["extra"].w, torch.full((5,), 4.0))
    assert spy.taken == 2 and target["extra"].loads == 2


def test_targets_that_are_not_plain_bytes_take_the_typed_copy(shm_dir):
    w = torch.arange(12.0).reshape(3, 4)
    with Checkpointer(job="steady-strided") as ck:
        ck.save(1, {"t": w.t().contiguous(), "c": torch.tensor([1 + 2j, 3 - 4j])})
        strided = torch.zeros(4, 3).t().contiguous().t()  # a transposed view: strided
        assert not strided.is_contiguous()
        conj = torch.zeros(2, dtype=torch.complex64).conj()  # lazily conjugated
        target = {"t": strided, "c": conj}
        assert ck.restore(target) == 1
    assert torch.equal(target["t"], w.t())
    assert torch.equal(target["c"].resolve_conj(), torch.tensor([1 + 2j, 3 - 4j]))


def _flip(ck: Checkpointer, step: int, path: str, at: int) -> None:
    """Flip one byte of entry ``path`` in the slot holding ``step``."""
    for slot in ck._pair.ready():
        with read_locked(slot) as snap:
            if snap is None or snap.step != step:
                continue
            entry = next(e for e in snap.manifest.entries if e.path == path)
            slot.buf[HEADER_SIZE + entry.offset + at] ^= 0xFF
            return
    raise AssertionError(f"no slot holds step {step}")


@pytest.mark.parametrize("chunk", [0, 2])
def test_a_corrupt_chunk_falls_back_to_the_older_snapshot(shm_dir, monkeypatch, chunk, copy_path):
    spy = Spy(monkeypatch)
    # "big": three chunks of 4 KiB, queued chunk by chunk.
    with Checkpointer(job="steady-corrupt", chunk_size=4096) as ck:
        target, older = _restored_past_a_flip(ck, 3 * 1024, chunk * 4096 + 5)
    assert spy.taken == 2  # both tried on the steady path: the corrupt one, then the older
    assert_same(values(target) + [target["big"]], older)


def _restored_past_a_flip(ck: Checkpointer, big: int, at: int) -> tuple[dict, list]:
    """Steps 1 and 2 of a state of 400 small tensors and one of ``big`` floats, a byte of
    step 2's big one flipped at ``at``, then restored: the state it restored into, and step
    1's values (which it must hold)."""
    state = {**many(400), "big": torch.randn(big)}
    ck.save(1, state)
    ck.wait(1)  # landed (on a device, the copy runs on after save() returns) before the writes
    older = values(state) + [state["big"].clone()]
    with torch.no_grad():
        for p in state["model"]:
            p.add_(1.0)
        state["big"].add_(1.0)
    ck.save(2, state)
    ck.wait(2)  # its copies have landed (a device's too) and it is published
    ck._sealer.drain()
    _flip(ck, 2, "big", at)
    target = {**many(400, seed=4), "big": torch.zeros(big)}
    assert ck.restore(target) == 1
    return target, older


def test_a_restore_that_wrote_part_of_a_corrupt_copy_and_found_no_other_says_so(shm_dir, copy_path):
    """No step to fall back to: the state holds part of the corrupt copy, which the restore
    reports as such (never as a restore of nothing that left the state as it was)."""
    state = many(400)
    with Checkpointer(job="steady-only-corrupt") as ck:
        ck.save(1, state)
        ck._sealer.drain()
        _flip(ck, 1, "model/90", 3)
        with pytest.raises(PartlyRestoredError, match="holds part of a copy that failed"):
            ck.restore(many(400, seed=4))
        with pytest.raises(ChecksumError):  # what a caller of a corrupt-copy error catches
            ck.restore(many(400, seed=4), step=1)


def test_a_new_steps_sealed_entries_are_read_without_copying_one_per_entry(shm_dir, monkeypatch):
    """Each step's manifest holds its layout's entries (parsed once, shared) and a flat list
    of chunk checksums: the steady restore of a step never read before makes no entry copy,
    and the entries read as a sequence carry the checksums the sealer wrote."""
    spy = Spy(monkeypatch)
    made = Counted(sealed.SealedEntries.whole)
    monkeypatch.setattr(sealed.SealedEntries, "whole", lambda self: made(self))
    state, target = many(800), many(800, seed=5)
    with Checkpointer(job="steady-sealed") as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in state["model"]:
                    p.add_(1.0)
            ck.save(step, state)
            ck._sealer.drain()
            assert ck.restore(target) == step
            assert_same(values(target), values(state))
        assert spy.taken == 3 and made.calls == 0
        for slot in ck._pair.ready():
            with read_locked(slot) as snap:
                if snap is not None and snap.step == 3:
                    entries, sums = snap.manifest.entries, slot.checksums(snap.header)
        assert isinstance(entries, sealed.SealedEntries) and snap.manifest.sealed
        assert made.calls == 0
        assert [c for e in entries for c in e.checksums] == list(sums)  # made on first use
        assert made.calls >= 1 and entries[0] == entries.bare[0].but(checksums=(sums[0],))


def test_a_corrupt_small_entry_is_named_with_the_checksum_recorded(
    shm_dir, monkeypatch, caplog, copy_path
):
    """A flipped byte in one of many one-chunk entries: the steady restore refuses that
    step, saying which entry and what the seal recorded, and restores the older one."""
    state = many(400)
    with Checkpointer(job="steady-small-corrupt") as ck:
        ck.save(1, state)
        older = values(state)
        with torch.no_grad():
            for p in state["model"]:
                p.add_(1.0)
        ck.save(2, state)
        ck._sealer.drain()
        path = "model/50"
        with read_locked(next(iter(ck._pair.ready()))) as snap:
            assert any(e.path == path for e in sealed.bare_entries(snap.manifest.entries))
        _flip(ck, 2, path, 3)
        target = many(400, seed=4)
        with caplog.at_level("WARNING"):
            assert ck.restore(target) == 1
    assert_same(values(target), older)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "chunk 0 of 'model/50'" in said and "the manifest recorded" in said


def test_a_mismatch_names_the_entry_and_the_chunk(copy_path):
    data = torch.zeros(4096 * 3, dtype=torch.uint8)
    entry = Entry("w", "tensor", "uint8", (8192,), offset=0, nbytes=8192, first_chunk=0,
                  checksums=(0, 1))  # fmt: skip
    src = entry_copy.Source(data, "a test buffer")
    src.copy_many([torch.empty(8192, dtype=torch.uint8)], [entry], 4096)
    with pytest.raises(ChecksumError, match="'w'"):
        src.flush()
    with pytest.raises(ValueError, match="2 targets for 1 entries"):
        src.copy_many([torch.empty(1), torch.empty(1)], [entry], 4096)
    past = Entry("w", "tensor", "uint8", (64,), offset=12288, nbytes=64, first_chunk=0,
                 checksums=(0,))  # fmt: skip
    with pytest.raises(ManifestError, match="past the 12288 bytes stored"):
        src.copy_many([torch.empty(64, dtype=torch.uint8)], [past], 4096)


def test_device_targets_on_the_steady_path_are_queued_at_once_and_uploaded(
    shm_dir, monkeypatch, copy_path
):
    spy = Spy(monkeypatch)
    uploads, one_by_one = [], []
    real = entry_copy.Source._upload
    monkeypatch.setattr(entry_copy.Source, "_upload",
                        lambda self, rows, outs, rt, dev: uploads.append((len(rows.size), dev))
                        or real(self, rows, outs, rt, dev))  # fmt: skip
    real_to = entry_copy.Source.copy_to
    monkeypatch.setattr(entry_copy.Source, "copy_to",
                        lambda self, *a: one_by_one.append(1) or real_to(self, *a))  # fmt: skip
    with installed():  # every tensor is a device tensor of the simulated device
        state = many(400)
        with Checkpointer(job="steady-device") as ck:
            ck.save(1, state)
            ck._sealer.drain()
            for seed in (6, 7):  # the first restore of the layout, and one after it
                target = many(400, seed=seed)
                assert ck.restore(target) == 1
                assert_same(values(target), values(state))
    assert spy.taken == 2
    n = len(values(state))
    assert uploads == [(n, "fake:0")] * 2  # every tensor uploaded, in one pass
    assert not one_by_one  # queued in a few C-level passes, not a call a tensor


@pytest.mark.parametrize("pinned", [False, True], ids=["staged", "from-the-slot"])
def test_a_flipped_byte_in_a_small_tensor_on_its_way_to_the_device_is_refused(
    shm_dir, monkeypatch, copy_path, pinned
):
    """The steady path's device uploads, staged a small buffer at a time (many buffers, the
    ring reused) or from a page-locked slot directly: a flipped byte in one small tensor sends
    the restore to the older step, whose bytes land whole, and nothing of the corrupt copy is
    still in flight when it does."""
    monkeypatch.setattr(device_upload, "STAGE", 1024)  # a few tensors a staging buffer
    with installed() as fake, Checkpointer(job=f"steady-device-flip-{pinned}") as ck:
        ck._prep.pinner.pinned = lambda slot: pinned
        state = many(400)
        ck.save(1, state)
        ck.wait(1)  # landed (the device's copy runs on after save() returns) before the writes
        older = values(state)
        with torch.no_grad():
            for p in state["model"]:
                p.add_(1.0)
        ck.save(2, state)
        ck.wait(2)
        ck._sealer.drain()
        _flip(ck, 2, "model/90", 3)
        calls = fake.copy_calls
        target = many(400, seed=4)
        assert ck.restore(target) == 1
        assert_same(values(target), older)
        # From the slot: one call a step tried; staged: the older step alone (400 tensors of
        # 22 bytes, each at a cache line of its own in a 1 KiB buffer) takes 25 calls.
        assert fake.copy_calls - calls == 2 if pinned else fake.copy_calls - calls >= 25


def test_a_corrupt_chunk_on_its_way_to_the_device_is_refused(shm_dir, copy_path):
    """Device targets: each piece is checked as it is staged for its upload (the compiled
    copy, or a copy then a checksum from Python); a flipped byte sends the restore to the
    older step, whose bytes land whole."""
    with installed(), Checkpointer(job="steady-device-corrupt") as ck:
        # "big": 12 MiB, several staged pieces.
        target, older = _restored_past_a_flip(ck, 3 * 1024 * 1024, 9 * 1024 * 1024 + 5)
        assert_same(values(target) + [target["big"]], older)


def test_gradients_are_dropped_as_zero_grad_drops_them_and_an_own_zero_grad_is_called():
    """The restore drops gradients by walking parameters directly (shared and nested ones
    included) where the class keeps torch's ``zero_grad``, and calls a class's own."""
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.Sequential(shared, torch.nn.Linear(3, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for target in (model, opt):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        into_state.drop_grads(target)
        assert all(p.grad is None for p in model.parameters())

    class Own(torch.nn.Linear):
        def zero_grad(self, set_to_none: bool = True) -> None:
            self.called = set_to_none

    own = Own(2, 2)
    own.weight.grad = torch.ones_like(own.weight)
    into_state.drop_grads(own)
    assert own.called is True and own.weight.grad is not None  # its own, as it chose


@pytest.mark.parametrize("n", [3, 100])  # a layout's plan is kept from 64 entries on
def test_received_chunks_go_in_offset_order_and_overlapping_ones_are_refused(copy_path, n):
    """A source that receives its bytes (a peer's scatter) gets the chunks in offset order,
    whatever the entries' order; entries whose bytes overlap (a corrupt manifest) are refused
    before a byte is received."""
    data = torch.arange(64 * n, dtype=torch.int64).to(torch.uint8)

    def entries(offsets: list[int]) -> list[Entry]:
        return [Entry(f"t{i}", "tensor", "uint8", (64,), offset=at, nbytes=64, first_chunk=i,
                      checksums=(crc(data[at : at + 64].numpy().tobytes()),))
                for i, at in enumerate(offsets)]  # fmt: skip

    def source(got: list) -> entry_copy.Source:
        def scatter(pieces):
            got.extend(pieces)
            for at, to, size in pieces:
                dst = (entry_copy.ctypes.c_char * size).from_address(to)
                dst[:] = data[at : at + size].numpy().tobytes()

        return entry_copy.Source(None, "a peer", size=64 * n, fetch=lambda: data, scatter=scatter)

    shuffled = [64 * i for i in reversed(range(n))]
    got: list = []
    src, dsts = source(got), [torch.zeros(64, dtype=torch.uint8) for _ in range(n)]
    src.copy_many(dsts, entries(shuffled), 4096)
    src.flush()
    assert [at for at, _, _ in got] == sorted(shuffled)
    assert all(torch.equal(d, data[at : at + 64]) for d, at in zip(dsts, shuffled, strict=True))
    overlapping = [64 * i for i in range(n)]
    overlapping[-1] -= 32  # the last entry's bytes begin inside the one before
    got.clear()
    src = source(got)
    src.copy_many([torch.zeros(64, dtype=torch.uint8) for _ in range(n)], entries(overlapping),
                  4096)  # fmt: skip
    with pytest.raises(ManifestError, match=f"entries overlap at byte {64 * (n - 1) - 32}"):
        src.flush()
    assert not got
