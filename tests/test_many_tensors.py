"""States of thousands of tensors: a steady save reuses its layout, its manifest's entries and
its slot views and copies in a few calls, host and device alike, and still copies the
tensors the state holds at that save; lazy conjugate/negative views reach no device copy;
page-locking and graph captures in global mode never run at once; ``fence()`` orders every
copy in flight after the stream current when it is called. Times are in
``benchmarks/snapshot.py --case many-tensors``, never here."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fake_device import installed

from flashckpt import Checkpointer
from flashckpt import checkpointer as checkpointer_module
from flashckpt.snapshot import copy_plan
from flashckpt.snapshot.device import CaptureGate, gate_captures


def many(n: int, seed: int = 0) -> dict:
    """A module and AdamW state of about ``n`` tensors (a parameter and three of state each)."""
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(7)) for _ in range(n // 4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model, "optim": opt}


def values(state: dict) -> list:
    """The state's values in order: tensors cloned, an optimizer state's scalars as they are."""
    out: list = [p.detach().clone() for p in state["model"]]
    for st in state["optim"].state.values():
        out += [v.clone() if isinstance(v, torch.Tensor) else v for v in st.values()]
    return out


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert type(x) is type(y)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_a_steady_save_reuses_layout_entries_and_views_and_copies_the_current_tensors(
    shm_dir, monkeypatch
):
    encode = Counted(checkpointer_module.encode_entries)
    view = Counted(copy_plan.entry_view)
    monkeypatch.setattr(checkpointer_module, "encode_entries", encode)
    monkeypatch.setattr(copy_plan, "entry_view", view)
    state = many(4000)
    n = len(values(state))
    with Checkpointer(job="steady") as ck:
        for step in range(6):
            ck.save(step, state)
            layout = ck._layout
        assert encode.calls == 1  # the entries of one layout, encoded once
        assert ck._walker.full_walks == 1  # the state walked in full once, then compiled
        assert view.calls <= 3 * n  # once per slot (two, and a spare at most), not per save
        # load_state_dict replaces the optimizer's state tensors: the next save copies those
        other = many(4000, seed=5)
        state["optim"].load_state_dict(other["optim"].state_dict())
        with torch.no_grad():
            for p, q in zip(state["model"], other["model"], strict=True):
                p.copy_(q)
        expected = values(state)
        ck.save(6, state)
        assert ck._layout is layout and encode.calls == 1
        fresh = many(4000, seed=9)
        assert ck.restore(fresh) == 6
    assert_same(values(fresh), expected)


def test_a_changed_layout_is_planned_anew_and_sub_byte_dtypes_are_copied_as_bytes(shm_dir):
    int4 = getattr(torch, "int4", None)
    state = {"a": torch.arange(12.0), "b": [torch.ones(3, dtype=torch.int64)] * 2}
    if int4 is not None:
        state["packed"] = torch.arange(16, dtype=torch.uint8).view(int4)
    with Checkpointer(job="changed") as ck:
        ck.save(0, state)
        first = ck._layout
        state["a"] = torch.arange(20.0).view(4, 5)  # a new shape: a new layout
        ck.save(1, state)
        assert ck._layout is not first
        out = {"a": torch.zeros(4, 5), "b": [torch.zeros(3, dtype=torch.int64)] * 2}
        if int4 is not None:
            out["packed"] = torch.zeros(16, dtype=torch.uint8).view(int4)
        assert ck.restore(out) == 1
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"][1], state["b"][1])
    if int4 is not None:
        assert torch.equal(out["packed"].view(torch.uint8), state["packed"].view(torch.uint8))


@pytest.mark.parametrize("overlap", [False, True])
def test_device_copies_go_in_one_call_per_fence_side_with_lazy_bits_resolved(shm_dir, overlap):
    with installed() as fake:
        state = many(400)
        x = torch.randn(5, dtype=torch.complex64)
        state["conj"] = x.conj()  # a lazily conjugated view
        state["neg"] = torch._neg_view(torch.randn(5))  # a lazily negated one
        expected = {"conj": x.conj().resolve_conj(), "neg": state["neg"].resolve_neg()}
        with Checkpointer(job=f"dev-{overlap}", overlap=overlap) as ck:
            ck.save(0, state)  # FakeDevice.copy_many refuses a lazy bit
            assert ck.wait(0, timeout=30) == 0
            assert 1 <= fake.copy_calls <= 2  # before and after the fence, not per tensor
            out = {**many(400, seed=3), "conj": torch.zeros(5, dtype=torch.complex64),
                   "neg": torch.zeros(5)}  # fmt: skip
            assert ck.restore(out) == 0
        assert torch.equal(out["conj"], expected["conj"])
        assert torch.equal(out["neg"], expected["neg"])
        assert_same(values(out), values(state))


def test_fence_orders_every_copy_in_flight_after_the_stream_current_then(shm_dir):
    """Training that moves to another stream after save() calls fence() there: that stream
    then waits for the copies, those of tensors no optimizer step writes (buffers) too."""
    with installed() as fake:
        buf = {"running_mean": torch.randn(64)}  # no optimizer: copied before the fence event
        with Checkpointer(job="fence", overlap=True) as ck:
            ck.save(0, buf)
            other = fake.host_stream("fake:0")
            waits = other.waits
            ck.fence()
            assert other.waits > waits  # the stream current at fence() waited for the copies
            assert ck.wait(0, timeout=30) == 0


def test_page_locking_waits_for_a_global_capture_and_a_capture_waits_for_it():
    gate = CaptureGate()
    order: list[str] = []
    assert gate.capture_begins("global")

    def register() -> None:
        with gate.registering():
            order.append("registered")

    t = threading.Thread(target=register)
    t.start()
    time.sleep(0.1)
    assert order == []  # held while the capture runs
    order.append("capture ended")
    gate.capture_ends()
    t.join(5)
    assert order == ["capture ended", "registered"]

    assert gate.capture_begins("thread_local") is False  # other threads may register then
    with gate.registering():
        began = threading.Event()
        t = threading.Thread(target=lambda: (gate.capture_begins("global"), began.set()))
        t.start()
        assert not began.wait(0.1)  # a global capture waits for the registration
    assert began.wait(5)
    gate.capture_ends()
    t.join(5)


def test_torchs_graph_class_is_routed_through_the_gate():
    """The same wrapping the CUDA runtime applies to torch's CUDAGraph, on a stand-in."""

    class Graph:
        def __init__(self, fail: bool = False):
            self.fail, self.log = fail, []

        def capture_begin(self, pool=None, capture_error_mode="global"):
            if self.fail:
                raise RuntimeError("capture refused")
            self.log.append("begin")

        def capture_end(self):
            self.log.append("end")

    gate = CaptureGate()
    gate_captures(Graph, gate)
    gate_captures(Graph, gate)  # once only
    g = Graph()
    g.capture_begin(capture_error_mode="global")
    assert gate.capturing
    g.capture_end()
    assert not gate.capturing and g.log == ["begin", "end"]
    g.capture_begin(None, "relaxed")
    assert not gate.capturing
    g.capture_end()
    with pytest.raises(RuntimeError):
        Graph(fail=True).capture_begin()
    assert not gate.capturing  # a failed begin is not counted


def test_no_slot_is_page_locked_during_a_capture_in_a_checkpointers_background(shm_dir):
    with installed() as fake:
        state = {"w": torch.randn(1 << 16)}
        with Checkpointer(job="capture") as ck:
            assert fake.begin_capture("global")
            ck.save(0, state)  # readies and page-locks the other slot in the background
            time.sleep(0.2)
            assert fake.registered == []  # held: a registration would break the capture
            fake.end_capture()
            for fut in list(ck._prep.pending.values()):
                fut.result(timeout=30)
            assert fake.registered and fake.during_capture == 0


def test_a_capture_that_does_not_end_delays_page_locking_only_for_a_while(shm_dir, caplog):
    with installed() as fake:
        fake.capture_wait_s = 0.2
        with Checkpointer(job="long-capture") as ck:
            assert fake.begin_capture("global")
            ck.save(0, {"w": torch.randn(1 << 12)})
            for fut in list(ck._prep.pending.values()):
                fut.result(timeout=30)  # gave up waiting: no hang
            assert fake.registered == [] and "graph is being captured" in caplog.text
            fake.end_capture()


def test_a_slot_being_page_locked_is_not_chosen_for_a_write(shm_dir):
    with Checkpointer(job="pinning") as ck:
        state = {"w": torch.ones(1000)}
        for step in range(3):
            ck.save(step, state)
        pair = ck._pair
        target = pair.write_order()[0]
        pair.pinning.add(target)
        try:
            slot = pair.acquire_for_write(1)
            assert slot is None or slot is not pair.slots[target]
            if slot is not None:
                slot.unlock()
                pair.writing.clear()
        finally:
            pair.pinning.discard(target)


def test_the_steady_walk_follows_scalars_and_falls_back_on_any_change(shm_dir):
    """After the first save the state is not walked in full again while only its scalars
    move (a learning rate schedule, step counts); a new key, a bool where an int was, a
    tensor reshaped or an ndarray leaf walk in full, and every restore gets what was saved."""
    import numpy as np

    state = many(400)
    opt = state["optim"]
    state["meta"] = {
        "epoch": 1,
        "lr_scale": 0.5,
        "name": "run",
        "flag": True,
        "dtype": torch.float16,
    }
    with Checkpointer(job="walk") as ck:
        walker = ck._walker
        for step in range(4):
            for group in opt.param_groups:
                group["lr"] = 1e-3 / (step + 1)
            state["meta"]["epoch"] = step
            state["meta"]["lr_scale"] = float("nan") if step == 2 else step / 3
            ck.save(step, state)
        assert walker.full_walks == 1
        fresh = many(400, seed=4)
        fresh["meta"] = dict.fromkeys(state["meta"])  # scalars: the snapshot's replace them
        assert ck.restore(fresh) == 3
        assert fresh["optim"].param_groups[0]["lr"] == 1e-3 / 4
        assert fresh["meta"] == {"epoch": 3, "lr_scale": 1.0, "name": "run", "flag": True,
                                 "dtype": torch.float16}  # fmt: skip
        assert_same(values(fresh), values(state))

        state["meta"]["flag"] = 1  # same value, another type: the JSON differs
        ck.save(4, state)
        state["meta"]["new"] = torch.arange(3)  # a new key
        ck.save(5, state)
        assert walker.full_walks == 2  # a type swap of a scalar is refilled, not walked
        state["meta"]["arr"] = np.arange(4)  # an ndarray leaf: walked in full every save
        ck.save(6, state)
        ck.save(7, state)
        assert walker.full_walks == 4
        del state["meta"]["arr"]
        state["model"][0].data = torch.randn(9)  # a reshaped parameter: a new layout
        ck.save(8, state)
        assert walker.full_walks == 5
        got = {"meta": {"flag": None, "new": torch.zeros(3, dtype=torch.int64)}}
        assert ck.restore(got, strict=False)[0] == 8
        assert got["meta"]["flag"] == 1 and type(got["meta"]["flag"]) is int
        assert torch.equal(got["meta"]["new"], torch.arange(3))


def test_an_optimizers_state_is_walked_in_one_pass_and_any_change_in_it_walks_in_full(shm_dir):
    """An optimizer's per-parameter states (dicts of one type, the same keys, tensors only)
    are checked and collected in a few C-level passes; a key added, dropped, renamed or of
    another type, a state of another mapping type, or a value no longer a tensor in any one
    of them walks the state in full, and every save restores as saved."""
    from collections import OrderedDict

    state = many(80)
    states = state["optim"].state
    one = list(states.values())[7]
    changes = [
        lambda: one.__setitem__("extra", torch.zeros(2)),  # a key added
        lambda: one.pop("extra"),  # and dropped again: the compiled walk's keys come back
        lambda: one.__setitem__("exp_avg", 0.5),  # a tensor replaced by a scalar
        lambda: one.__setitem__("exp_avg", torch.zeros_like(one["exp_avg_sq"])),
        lambda: states.__setitem__(state["model"][3], OrderedDict(states[state["model"][3]])),
    ]
    with Checkpointer(job="optim-walk") as ck:
        walker = ck._walker
        ck.save(0, state)
        ck.save(1, state)
        assert walker.full_walks == 1
        assert "MD" in repr(walker._program)  # the optimizer's state, as one op
        for step, change in enumerate(changes, start=2):
            change()
            before = walker.full_walks
            ck.save(step, state)
            assert walker.full_walks == before + 1, step
            ck.wait(step)
            target = many(80, seed=step)
            target["optim"].load_state_dict(state["optim"].state_dict())
            assert ck.restore(target) == step
            assert_same(values(target), values(state))
    # Keys in another order, or equal to the compiled ones but of another type (True where 1
    # was), are no match either.
    numbered = {"s": {i: {0: torch.full((2,), float(i)), 1: torch.ones(2)} for i in range(4)}}
    with Checkpointer(job="optim-walk-keys") as ck:
        walker = ck._walker
        ck.save(0, numbered)
        ck.save(1, numbered)
        assert walker.full_walks == 1 and "MD" in repr(walker._program)
        inner = numbered["s"][2]
        numbered["s"][2] = {0: inner[0], True: inner[1]}  # True == 1, another type
        ck.save(2, numbered)
        assert walker.full_walks == 2
        numbered["s"][2] = inner
        ck.save(3, numbered)
        assert walker.full_walks == 3 and "MD" in repr(walker._program)
        inner[0] = inner.pop(0)  # the same keys, 1 then 0
        ck.save(4, numbered)
        assert walker.full_walks == 4
        ck.wait(4)
        got = {"s": {i: {0: torch.zeros(2), 1: torch.zeros(2)} for i in range(4)}}
        got["s"][2] = {1: torch.zeros(2), 0: torch.zeros(2)}
        assert ck.restore(got) == 4
        assert torch.equal(got["s"][2][0], torch.full((2,), 2.0))
        assert torch.equal(got["s"][2][1], torch.ones(2))


def test_the_compiled_check_of_tensor_metadata_sees_every_change_the_python_one_sees(shm_dir):
    """From the second steady walk on, torch's compiled tensor check compares the tensors'
    metadata; what it refuses is compared in Python. A tensor resized or retyped in place (the
    same object) is still a new layout; what only it notices (strides, requires_grad, the
    thread's inference mode) keeps the walk steady, and the check is made again once two walks
    passed in Python that it refused."""
    state = many(40)
    with Checkpointer(job="guard") as ck:
        walker = ck._walker
        for step in range(3):
            ck.save(step, state)
        assert walker.full_walks == 1 and walker._meta.guard is not None
        exp_avg = next(iter(state["optim"].state.values()))["exp_avg"]
        exp_avg.resize_(exp_avg.numel() - 1)  # the same tensor, one element shorter
        ck.save(3, state)
        assert walker.full_walks == 2
        for step in (4, 5):
            ck.save(step, state)
        param = state["model"][1]
        param.data = param.data.double()  # the same Parameter, another dtype
        ck.save(6, state)
        assert walker.full_walks == 3
        for step in (7, 8):
            ck.save(step, state)
        avg_sq = next(iter(state["optim"].state.values()))["exp_avg_sq"]
        avg_sq.requires_grad_(True)  # the compiled check refuses it, Python does not
        ck.save(9, state)
        with torch.inference_mode():
            ck.save(10, state)
        assert walker.full_walks == 3
        avg_sq.requires_grad_(False)
        # Two walks the check refused and Python passed: it is made again, and passes.
        assert [walker.walk(state, frozenset(), None).plain for _ in range(3)] == [
            False, False, True
        ]  # fmt: skip
        one = next(iter(state["optim"].state.values()))
        strided = torch.zeros(one["exp_avg_sq"].numel() * 2)[::2]
        strided.copy_(one["exp_avg_sq"])
        one["exp_avg_sq"] = strided  # same shape, another stride: the copy checks it
        assert not walker.walk(state, frozenset(), None).plain
        ck.save(11, state)
        assert walker.full_walks == 3
        target = many(40, seed=1)
        target["model"][1].data = target["model"][1].data.double()
        next(iter(target["optim"].state.values()))["exp_avg"].resize_(exp_avg.numel())
        first = next(iter(target["optim"].state.values()))
        first["exp_avg_sq"] = torch.zeros(first["exp_avg_sq"].numel() * 2)[::2]
        assert ck.restore(target) == 11
        assert_same(values(target), values(state))


def test_tensors_a_save_copied_are_not_kept_alive_after_they_are_replaced(shm_dir):
    """The compiled walk keeps no tensor: an optimizer state replaced by load_state_dict is
    freed (on a GPU, its memory goes back to the allocator)."""
    import gc
    import weakref

    state = many(40)
    with Checkpointer(job="alive") as ck:
        ck.save(0, state)
        ck.save(1, state)
        first = next(iter(state["optim"].state.values()))
        ref = weakref.ref(first["exp_avg"])
        del first
        state["optim"].load_state_dict(many(40, seed=2)["optim"].state_dict())
        ck.save(2, state)
        assert ck._walker.full_walks == 1
        gc.collect()
        assert ref() is None


def test_an_optimizer_filled_in_place_gets_its_settings_without_load_state_dict(shm_dir):
    """A restore fills an optimizer's existing state tensors in place; torch's
    load_state_dict (13 us a tensor) then runs only where it must: an optimizer class with
    its own, a load hook, a state value that is not a tensor."""
    from flashckpt.restore import optim_state

    saved = many(40)
    for group in saved["optim"].param_groups:
        group["lr"], group["betas"] = 0.123, (0.8, 0.9)
    with Checkpointer(job="inplace") as ck:
        ck.save(0, saved)
        target = many(40, seed=1)
        before = [st["exp_avg"] for st in target["optim"].state.values()]
        assert ck.restore(target) == 0
        assert [st["exp_avg"] for st in target["optim"].state.values()] == before  # in place
        group = target["optim"].param_groups[0]
        assert group["lr"] == 0.123 and tuple(group["betas"]) == (0.8, 0.9)
        assert_same(values(target), values(saved))

        hooked = many(40, seed=2)
        calls = []
        hooked["optim"].register_load_state_dict_post_hook(lambda opt: calls.append(opt))
        assert ck.restore(hooked) == 0 and calls == [hooked["optim"]]
        assert hooked["optim"].param_groups[0]["lr"] == 0.123

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["calls"] = 3  # a scalar: load_state_dict sets it
    sd = opt.state_dict()
    assert not optim_state.loaded_in_place(opt, sd)

    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert all(sd["state"][i] is opt.state[p] for i, p in enumerate(model.parameters()))
    assert optim_state.loaded_in_place(opt, sd)  # the state's own dicts, filled in place
    copied = {
        "state": {i: dict(v) for i, v in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    assert optim_state.loaded_in_place(opt, copied)  # copies holding the same tensors
    copied["state"][1]["exp_avg"] = torch.zeros_like(copied["state"][1]["exp_avg"])
    assert not optim_state.loaded_in_place(opt, copied)  # a tensor replaced: loaded
    renumbered = {
        "state": {0: sd["state"][0], 5: sd["state"][1]},
        "param_groups": sd["param_groups"],
    }
    assert not optim_state.loaded_in_place(opt, renumbered)  # no parameter 5

    class Own(torch.optim.SGD):
        def load_state_dict(self, state_dict):  # noqa: D102
            super().load_state_dict(state_dict)

    own = Own(model.parameters(), lr=0.1)
    assert not optim_state.loaded_in_place(own, own.state_dict())


def test_manifests_with_the_entries_anywhere_are_read_alike():
    """flashckpt writes a manifest's entries last and checks them once per distinct JSON; a
    manifest with them elsewhere (an older flashckpt's order), with a key after them or
    repeated, is read whole, as before."""
    import json

    from flashckpt.errors import ManifestError
    from flashckpt.format.manifest import Manifest
    from flashckpt.snapshot.flatten import flatten, plan_layout

    tree, leaves = flatten({"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    layout = plan_layout(leaves, 1 << 20)
    m = Manifest("job", 0, 7, tree, layout.entries, layout.data_len)
    ours = m.to_json()
    assert ours.endswith(b"]}") and b',"entries":' in ours
    doc = json.loads(ours)
    older = {k: doc[k] for k in ("job", "rank", "step", "tree", "entries")}
    older |= {k: v for k, v in doc.items() if k not in older}  # entries mid-way
    for raw in (
        ours,
        json.dumps(older).encode(),
        json.dumps(older, separators=(",", ":")).encode(),
    ):
        got = Manifest.from_json(raw)
        assert (got.step, got.entries, got.data_len) == (7, m.entries, m.data_len)
    repeated = ours[:-1] + b',"step":9}'  # a key after the entries: the last one counts
    assert Manifest.from_json(repeated).step == 9
    bad = ours.replace(b'"nbytes":12', b'"nbytes":13')
    with pytest.raises(ManifestError, match="nbytes"):
        Manifest.from_json(bad)
    # Its size, as a restore counts it to size the slots, without writing it out; with a
    # tree whose text is not ASCII too.
    for entries_json, tree_json in ((None, None), (None, json.dumps(tree)),
                                    (None, '{"t":"str","v":"\u00e9t\u00e9 \u65e5"}')):  # fmt: skip
        assert m.json_size(entries_json, tree_json) == len(m.to_json(entries_json, tree_json))


def test_the_sealers_cpu_time_is_counted(shm_dir):
    from flashckpt.snapshot import sealer

    before = sealer.cpu_seconds()
    with Checkpointer(job="sealer-cpu") as ck:
        ck.save(0, {"w": torch.randn(4 << 20)})  # 16 MiB to checksum
        assert ck._sealer.drain(30)
    assert sealer.cpu_seconds() > before


def test_a_slot_unmapped_while_queued_is_skipped_and_sealing_goes_on(shm_dir):
    """A slot mapped anew (grown) or closed after its seal was queued holds nothing to seal
    any more: the sealer skips it and seals what comes next."""
    from flashckpt.snapshot.sealer import Sealer

    with Checkpointer(job="sealer-skip") as ck:
        ck.save(0, {"w": torch.randn(1000)})
        assert ck._sealer.drain(30)
        slot = next(s for s in ck._pair.slots if s is not None)
        sealer = Sealer()
        try:
            closed = copy_plan.Slot.open_readonly(slot.path)
            closed.close()
            sealer.submit(closed, 1, None)  # unmapped before its turn
            assert sealer.drain(10) and sealer._thread.is_alive()
        finally:
            sealer.close()


def test_results_kept_by_identity_serve_several_layouts_in_turn():
    """A layout's restore plans are kept by the identity of its objects (equal numbers count
    as the same), a few at once: two Checkpointers restoring in turn (memory, a tier's
    reader) each find theirs; an equal list that is another object is not taken for it."""
    from flashckpt.format.kept import Kept

    kept: Kept[str] = Kept(2, identity=True)
    a, b, c = [1, 2], [1, 2], [3]
    big = 2**40
    kept.put((a, big), "a")
    kept.put((b, big), "b")
    assert kept.get((a, int(str(big)))) == "a" and kept.get((b, big)) == "b"
    assert kept.get(([1, 2], big)) is None  # equal, not the same
    assert kept.get((a, big + 1)) is None and kept.get((a, float(big))) is None
    kept.put((c, 1), "c")  # the least recently used goes
    assert kept.get((a, big)) is None and kept.get((b, big)) == "b"
    by_value: Kept[str] = Kept(2)
    by_value.put(b"x" * 10, "bytes")
    assert by_value.get(b"x" * 10) == "bytes"
