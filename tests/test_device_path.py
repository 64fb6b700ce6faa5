"""The device path on CPU, against the simulated device of ``fake_device``: overlapped and
blocking snapshots, one fence per device, torn and graph-captured snapshots dropped, errors on
the copy stream, no slot touched under a copy, sources kept until their copies land, and no
spinning wait. Page-locking and verified uploads are in ``test_device_memory.py``; the same
behaviour on a real GPU in ``test_cuda.py`` (marked ``gpu``)."""

from __future__ import annotations

import gc
import inspect
import logging
import threading
import time

import pytest
import torch
from fake_device import installed

from flashckpt import Checkpointer
from flashckpt.snapshot import step_fence
from flashckpt.snapshot.device import CudaRuntime
from flashckpt.snapshot.step_fence import storage_key


@pytest.fixture
def fake(shm_dir):
    with installed() as f:
        yield f


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def forward_backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()


def train_step(model, opt, seed: int) -> None:
    forward_backward(model, seed)
    opt.step()
    opt.zero_grad()


def copy_of(state: dict) -> dict:
    """The values of a {"model", "optim"} state, cloned."""
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def assert_restores(ck: Checkpointer, step: int, expected: dict) -> None:
    model, opt = model_and_opt(seed=99)
    fresh = {"model": model, "optim": opt}
    assert ck.restore(fresh, step=step) == step
    got = copy_of(fresh)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def published(ck: Checkpointer) -> set[int]:
    return {s.header().step for s in ck._pair.ready()}


def blocked_for(fn, release, delay: float = 0.3) -> float:
    """Seconds ``fn()`` took while ``release`` ran ``delay`` seconds after it started."""
    timer = threading.Timer(delay, release)
    began = time.monotonic()
    timer.start()
    try:
        fn()
    finally:
        timer.join()
    return time.monotonic() - began


def started(fake, state: dict, ck: Checkpointer):
    """A first step and a first save, so the optimizer is seen stepping and the device's side
    stream exists; the side stream is returned."""
    train_step(state["model"], state["optim"], 0)
    ck.save(0, state)
    assert ck.wait(0, timeout=10) == 0
    return fake.side_stream()


def test_the_cuda_runtime_names_only_what_this_torch_has():
    """Every torch.cuda attribute the device path calls is looked up when the runtime is
    made, so a CPU build fails here on a typo; the keywords it passes exist too."""
    rt = CudaRuntime()
    assert rt.capturing() is False  # asked on every optimizer step, CPU jobs included
    assert not rt.is_device_tensor(torch.ones(1))
    assert "blocking" in inspect.signature(torch.cuda.Event.__new__).parameters
    assert "device" in inspect.signature(torch.cuda.Stream.__new__).parameters


def test_the_step_hook_is_installed_while_a_checkpointer_overlaps(shm_dir, monkeypatch):
    monkeypatch.setattr(step_fence, "_fences", {})  # as in a process with no other Checkpointer
    monkeypatch.setattr(step_fence, "_hook", None)
    with Checkpointer(job="hook"):
        assert step_fence._hook is not None
        model, opt = model_and_opt()
        train_step(model, opt, 0)  # a CPU job's step goes through the hook unharmed
        assert opt in step_fence._seen
    assert step_fence._hook is None
    with Checkpointer(job="hook", overlap=False):
        assert step_fence._hook is None


def test_an_overlapped_save_copies_parameters_during_forward_and_backward(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="overlap") as ck:
        side = started(fake, state, ck)
        train_step(model, opt, 1)
        expected = copy_of(state)
        side.hold(after_events=1)  # buffers land before save() returns; parameters wait
        ck.save(1, state)
        forward_backward(model, 2)  # BatchNorm's running stats change: copied already
        assert 1 not in published(ck), "published before its copies landed"
        # The next step waits, on the device, for the parameter and optimizer copies.
        assert blocked_for(opt.step, side.release) >= 0.25
        opt.zero_grad()
        assert ck.wait(1, timeout=10) == 1
        assert_restores(ck, 1, expected)


def test_a_blocking_save_returns_once_every_copy_has_landed(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="blocking", overlap=False) as ck:
        side = started(fake, state, ck)
        expected = copy_of(state)
        side.hold()
        assert blocked_for(lambda: ck.save(1, state), side.release) >= 0.25
        assert 1 in published(ck)
        train_step(model, opt, 1)
        assert_restores(ck, 1, expected)


def test_a_staged_save_of_device_tensors_returns_once_its_copies_land_even_overlapped(fake):
    """``stage`` (``dcp.async_save``'s way in) is not overlapped: the step is committed later,
    from another thread, and the copy must be whole by then whatever training did since."""
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="staged") as ck:
        side = started(fake, state, ck)
        train_step(model, opt, 1)
        expected = copy_of(state)
        side.hold()
        staged = []
        assert blocked_for(lambda: staged.append(ck.stage(state)), side.release) >= 0.25
        train_step(model, opt, 2)  # after the copy: not in the staged snapshot
        assert 1 not in published(ck)
        threading.Thread(target=staged[0].commit, args=(1,)).start()
        assert ck.wait(1, timeout=10) == 1
        assert_restores(ck, 1, expected)


def test_a_state_of_dicts_or_wrappers_overlaps_like_modules_and_optimizers(fake):
    """The optimizers seen stepping decide what only a step writes, whatever holds their
    tensors: state dicts, Stateful wrappers, detached views."""
    model, opt = model_and_opt()

    class Wrapper:
        def state_dict(self):
            return {"m": model.state_dict()}

        def load_state_dict(self, sd):
            model.load_state_dict(sd["m"])

    with Checkpointer(job="dicts") as ck:
        train_step(model, opt, 0)
        deferred = ck._copier.deferrable([model.state_dict(), opt.state_dict(), Wrapper()])
        params = {storage_key(p) for p in model.parameters()}
        moments = {storage_key(s["momentum_buffer"]) for s in opt.state.values()}
        buffers = {storage_key(b) for b in model.buffers()}
        assert params | moments <= deferred and not buffers & deferred


def test_a_deferred_tensor_written_before_the_step_drops_the_snapshot(fake, caplog):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="torn") as ck:
        side = started(fake, state, ck)
        side.hold(after_events=1)
        ck.save(1, state)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # a hand-written update, not through the optimizer
        side.release()
        train_step(model, opt, 1)
        with pytest.raises(TimeoutError):
            ck.wait(1, timeout=1)
        assert ck.skipped == 1 and published(ck) == {0}
        assert "'model/0.weight' was written in place" in caplog.text
        # From now on that tensor is copied before save() returns, and saves go through.
        expected = copy_of(state)
        side.hold(after_events=1)
        ck.save(2, state)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # copied already: this write is after the snapshot
        side.release()
        assert ck.wait(2, timeout=10) == 2 and ck.skipped == 1
        assert_restores(ck, 2, expected)


def test_a_step_captured_in_a_graph_drops_the_snapshot_and_is_never_deferred_again(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="graph") as ck:
        side = started(fake, state, ck)
        side.hold(after_events=1)
        ck.save(1, state)
        forward_backward(model, 1)
        fake.capture = True  # its replays would write the parameters without any fence
        opt.step()
        fake.capture = False
        side.release()
        with pytest.raises(TimeoutError):
            ck.wait(1, timeout=1)
        assert ck.skipped == 1
        params = {storage_key(p) for p in model.parameters()}
        assert not params & ck._copier.deferrable(state.values())


def test_each_device_gets_its_own_stream_and_fence(fake):
    """Tensors on a second device are copied on that device's side stream, and that device's
    streams wait for them: before save() returns for its buffers, before the step for the
    rest."""
    model, opt = model_and_opt()
    for t in (*model[2].parameters(), *model[1].buffers()):
        fake.place(t, 1)
    state = {"model": model, "optim": opt}
    with Checkpointer(job="two") as ck:
        train_step(model, opt, 0)
        for p in model[2].parameters():  # the moments live with their parameters
            fake.place(opt.state[p]["momentum_buffer"], 1)
        ck.save(0, state)
        ck.wait(0, timeout=10)
        on_1 = sum(t.numel() * t.element_size() for t in (*model[2].parameters(),
                   *model[1].buffers(), *(opt.state[p]["momentum_buffer"]
                                         for p in model[2].parameters())))  # fmt: skip
        assert sum(n for n, _ in fake.side_stream("fake:1").copies) == on_1
        expected = copy_of(state)
        waits = {d: fake.host_stream(d).waits for d in ("fake:0", "fake:1")}
        for d in ("fake:0", "fake:1"):
            fake.side_stream(d).hold(after_events=1)
        ck.save(1, state)
        assert all(fake.host_stream(d).waits == waits[d] + 1 for d in waits)  # fenced buffers

        def release() -> None:
            for d in ("fake:0", "fake:1"):
                fake.side_stream(d).release()

        assert blocked_for(opt.step, release) >= 0.25
        assert all(fake.host_stream(d).waits == waits[d] + 2 for d in waits)  # before the step
        opt.zero_grad()
        assert ck.wait(1, timeout=10) == 1
        assert_restores(ck, 1, expected)


def test_sources_stay_referenced_until_their_copies_land(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="refs") as ck:
        side = started(fake, state, ck)
        side.hold(after_events=1)
        ck.save(1, state)
        pending = ck._copier._pending
        assert len(pending.sources) == len(model.state_dict()) + len(opt.state)
        side.release()
        assert ck.wait(1, timeout=10) == 1
        ck._settle()
        assert pending.sources == []


def test_parameters_given_new_memory_under_their_copy_leave_the_snapshot_whole(fake):
    """The walk takes parameters as themselves; ``p.data = ...`` or ``model.to(dtype)``
    right after an overlapped ``save()`` swaps their storage out from under them, and the
    copies still in flight read what the parameters held at ``save()``."""
    for swap in ("data", "to"):
        model, opt = model_and_opt()
        state = {"model": model, "optim": opt}
        with Checkpointer(job=f"swap-{swap}") as ck:
            side = started(fake, state, ck)
            train_step(model, opt, 1)
            expected = copy_of(state)
            side.hold(after_events=1)  # the parameters' copies wait on the side stream
            ck.save(1, state)
            if swap == "data":
                for p in model.parameters():
                    p.data = torch.zeros_like(p)
            else:
                model.to(torch.float64)
            gc.collect()  # nothing but the copy in flight holds the old memory
            side.release()
            assert ck.wait(1, timeout=10) == 1
            model.to(torch.float32)
            assert_restores(ck, 1, expected)


def test_an_error_on_the_copy_stream_is_raised_and_the_step_never_published(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    ck = Checkpointer(job="broken")
    try:
        side = started(fake, state, ck)
        side.fail_next_copy = True
        ck.save(1, state)  # returns: the copies are queued
        with pytest.raises(RuntimeError, match="illegal memory access"):
            ck.save(2, state)  # the next call meets the error
        assert published(ck) == {0} and not ck._pair.writing
    finally:
        side.error = None  # a real device would be lost; the fake lets close() finish
        ck.close()


def test_a_slot_being_written_is_never_regrown_under_its_copy(fake):
    """A state that grew a little fits the slot the next snapshot goes to, but not the
    capacity the other slots are readied to: that slot is left alone while its copy runs."""
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="grow") as ck:
        side = started(fake, state, ck)
        for fut in list(ck._prep.pending.values()):
            fut.result()
        target = next(s for s in ck._pair.slots[:2] if s is not None and s.header().step != 0)
        mapping, capacity = target.buf.data_ptr(), target.capacity
        state["extra"] = torch.ones(200_000)  # 0.8 MB: within the 1 MiB headroom
        side.hold(after_events=1)
        ck.save(1, state)
        for fut in list(ck._prep.pending.values()):
            fut.result()  # the other slot grows; the one being written must not
        assert (target.buf.data_ptr(), target.capacity) == (mapping, capacity)
        side.release()
        assert ck.wait(1, timeout=10) == 1
        restored = {"model": model_and_opt(5)[0], "optim": model_and_opt(5)[1],
                    "extra": torch.zeros(200_000)}  # fmt: skip
        assert ck.restore(restored, step=1) == 1 and torch.equal(restored["extra"], state["extra"])


def test_flashckpt_threads_wait_with_the_states_device_current(fake):
    """A CUDA call on a thread with no current device makes a context on GPU 0: every
    thread of flashckpt's that waits for the device first makes the state's device current."""
    model, opt = model_and_opt()
    for t in (*model.parameters(), *model.buffers()):
        fake.place(t, 1)
    state = {"model": model, "optim": opt}
    with Checkpointer(job="device") as ck:
        train_step(model, opt, 0)
        for st in opt.state.values():
            fake.place(st["momentum_buffer"], 1)
        for step in range(3):
            ck.save(step, state)
            train_step(model, opt, step + 1)
        assert ck.wait(2, timeout=10) == 2
        restored = {"model": model_and_opt(4)[0], "optim": model_and_opt(4)[1]}
        for t in (*restored["model"].parameters(), *restored["model"].buffers()):
            fake.place(t, 1)
        ck.restore(restored)
    ours = [(name, dev) for name, dev in fake.waits if name.startswith("flashckpt")]
    assert ours and all(dev == "fake:1" for _, dev in ours), ours


def test_waiting_for_an_overlapped_copy_spins_no_core(fake):
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="idle") as ck:
        side = started(fake, state, ck)
        side.hold(after_events=1)
        ck.save(1, state)
        cpu = time.process_time()
        time.sleep(0.5)  # the publisher waits for the copies meanwhile
        used = time.process_time() - cpu
        side.release()
        assert ck.wait(1, timeout=10) == 1
    assert used < 0.15, f"{used:.2f} s of CPU while waiting 0.5 s for a copy"


def test_a_killed_trainer_never_publishes_the_step_whose_copy_was_in_flight(shm_dir):
    """SIGKILL while an overlapped copy is in flight: the step before it restores, whole."""
    from conftest import run_python

    code = f"""
import os, signal, torch
from fake_device import installed
from flashckpt import Checkpointer
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
state = {{"model": model, "optim": opt}}
with installed() as fake:
    ck = Checkpointer(job="killed")
    model(torch.ones(4, 256)).sum().backward(); opt.step()
    ck.save(1, state); ck.wait(1, timeout=10)
    torch.save(model.state_dict(), {str(shm_dir / "step1.pt")!r})
    model(torch.ones(4, 256)).sum().backward(); opt.step()
    fake.side_stream().hold(after_events=1)
    ck.save(2, state)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    with pytest.raises(AssertionError, match=r"child failed \(-9\)"):
        run_python(code)
    expected = torch.load(shm_dir / "step1.pt")
    model = torch.nn.Linear(256, 256)
    with Checkpointer(job="killed") as ck:
        assert ck.restore({"model": model, "optim": torch.optim.AdamW(model.parameters())}) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_fence_makes_the_device_wait_for_the_snapshot_in_flight(fake, caplog):
    """fence() before an in-place write outside a step keeps the snapshot whole."""
    caplog.set_level(logging.WARNING)
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="fence") as ck:
        side = started(fake, state, ck)
        expected = copy_of(state)
        side.hold(after_events=1)
        ck.save(1, state)
        assert blocked_for(ck.fence, side.release) >= 0.25  # the fake's caller stream blocks
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # ordered after the copies by the fence
        assert ck.wait(1, timeout=10) == 1 and ck.skipped == 0
        assert_restores(ck, 1, expected)
    assert "written in place" not in caplog.text
