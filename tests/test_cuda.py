"""The device path on a real GPU (``pytest -m gpu``; skipped without CUDA): both modes over
every dtype and tensor shape, mixed host and device states, the overlap fence, in-place
writes, other streams, generators, restores into GPU and CPU models, a kill mid-copy,
page-locked slots after a restart, FSDP2, DDP, torch.compile, and the error paths of
registration. The CPU suite runs the same code against a simulated device
(``test_device_path.py``, ``test_device_memory.py``)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import run_python
from states import ALL_DTYPES, tensor_of

import flashckpt
from flashckpt import Checkpointer
from flashckpt.snapshot.copy_plan import NO_COPY_KERNEL
from flashckpt.snapshot.device import CudaRuntime, _last_error_clearer
from flashckpt.snapshot.step_fence import storage_key

pytestmark = pytest.mark.gpu
MODES = [pytest.param(False, id="blocking"), pytest.param(True, id="overlapped")]


def _model(seed: int = 0, device: str = "cuda"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _forward_backward(model, seed: int) -> None:
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    model(torch.randn(64, 256, device=device, generator=g)).pow(2).mean().backward()


def _step(model, opt, seed: int) -> None:
    _forward_backward(model, seed)
    opt.step()
    opt.zero_grad()


def _host(state) -> dict:
    """Every tensor of a module/optimizer state, on the host."""
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.detach().cpu().clone() for k, v in st.items()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _host_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as bytes on the host. Sub-byte dtypes have no copy kernel (``.clone()``,
    ``.contiguous()`` of them raise): they are viewed as bytes where they are, then moved."""
    if t.dtype in NO_COPY_KERNEL:
        return t.view(torch.uint8).cpu().reshape(-1).clone()
    return _bits(t.cpu()).clone()


def _blank(v: torch.Tensor) -> torch.Tensor:
    """A tensor like ``v`` with every byte zero (some dtypes have no fill kernel)."""
    t = torch.empty_like(v)
    if t.numel():
        try:
            t.zero_()
        except (NotImplementedError, RuntimeError):
            t.view(torch.uint8).zero_()  # one-byte dtypes: their bytes
    return t


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("overlap", MODES)
def test_the_snapshot_is_the_state_at_save_time(shm_dir, overlap):
    """BatchNorm's buffers change in the next forward, the weights in the next step; the
    snapshot holds neither change."""
    model, opt = _model()
    state = {"model": model, "optim": opt}
    with Checkpointer(job=f"at-save-{overlap}", overlap=overlap) as ck:
        _step(model, opt, 0)
        ck.save(0, state)
        _step(model, opt, 1)
        expected = _host(state)
        ck.save(1, state)
        _step(model, opt, 2)
        assert ck.wait(1, timeout=30) == 1
        fresh_model, fresh_opt = _model(seed=5)
        fresh = {"model": fresh_model, "optim": fresh_opt}
        assert ck.restore(fresh) == 1
        _assert_same(_host(fresh), expected)
        assert all(t.is_cuda for t in fresh_opt.state_dict()["state"][0].values() if t.dim())


@pytest.mark.parametrize("overlap", MODES)
def test_every_dtype_and_shape_round_trips(shm_dir, overlap):
    base = torch.arange(64, dtype=torch.float32, device="cuda").view(8, 8)
    state = {str(d).removeprefix("torch."): tensor_of(d, (4, 5), seed=i).cuda()
             for i, d in enumerate(ALL_DTYPES)}  # fmt: skip
    state |= {
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3],
        "shares_a": base[:4],
        "shares_b": base[2:6],  # views of one storage
        "scalar": torch.tensor(3.5, device="cuda"),
        "empty": torch.empty(0, 7, device="cuda"),
        "conj": torch.randn(3, dtype=torch.complex64, device="cuda").conj(),
        "neg": torch._neg_view(torch.randn(3, device="cuda")),
        "host": torch.arange(10),  # a state mixing host and device tensors
    }
    expected = {k: _host_bits(v) for k, v in state.items()}
    with Checkpointer(job=f"dtypes-{overlap}", overlap=overlap) as ck:
        ck.save(0, state)
        assert ck.wait(0, timeout=30) == 0
        out = {k: _blank(v) for k, v in state.items()}
        assert ck.restore(out) == 0
    for k, v in expected.items():
        assert out[k].dtype == state[k].dtype and out[k].shape == state[k].shape, k
        assert torch.equal(_host_bits(out[k]), v), k


def test_a_gpu_snapshot_restores_into_a_cpu_model(shm_dir):
    model, opt = _model()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="to-cpu") as ck:
        _step(model, opt, 0)
        expected = _host(state)
        ck.save(0, state)
        cpu_model, cpu_opt = _model(seed=7, device="cpu")
        cpu_state = {"model": cpu_model, "optim": cpu_opt}
        assert ck.restore(cpu_state) == 0
        _assert_same(_host(cpu_state), expected)


def test_save_from_a_non_default_stream(shm_dir):
    model, opt = _model()
    state = {"model": model, "optim": opt}
    side = torch.cuda.Stream()
    with Checkpointer(job="stream") as ck:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _step(model, opt, 0)
            ck.save(0, state)
            expected = _host(state)
            _step(model, opt, 1)
        torch.cuda.current_stream().wait_stream(side)
        assert ck.wait(0, timeout=30) == 0
        fresh = dict(zip(("model", "optim"), _model(seed=3), strict=True))
        assert ck.restore(fresh) == 0
        _assert_same(_host(fresh), expected)


def test_in_place_writes_outside_the_step(shm_dir, caplog):
    """Embedding(max_norm) renormalises its weight in forward: copied before save() returns.
    A hand-written update before the step drops the snapshot (and warns); with fence() first
    it is ordered after the copies."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 512, max_norm=1.0).cuda()
    lin = torch.nn.Linear(512, 512).cuda()
    model = torch.nn.ModuleDict({"emb": emb, "lin": lin})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}

    def fwd_bwd(seed: int) -> None:
        idx = torch.randint(
            0, 1000, (256,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)
        )
        lin(emb(idx) * 10).pow(2).mean().backward()

    with Checkpointer(job="writes") as ck:
        fwd_bwd(0)
        opt.step()
        opt.zero_grad()
        expected = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        ck.save(0, state)
        fwd_bwd(1)  # renormalises rows of emb.weight in place
        opt.step()
        opt.zero_grad()
        assert ck.wait(0, timeout=30) == 0
        torch.cuda._sleep(int(1e9))  # the copies queue behind it: still in flight at the write
        ck.save(1, state)
        with torch.no_grad():
            lin.weight.mul_(0.5)  # not through the optimizer, no fence: step 1 is dropped
        fwd_bwd(2)
        opt.step()
        ck.save(2, state)
        ck.fence()
        with torch.no_grad():
            lin.weight.mul_(0.5)  # after fence(): step 2 stands
        assert ck.wait(2, timeout=30) == 2 and ck.skipped == 1
        assert "'model/lin.weight' was written in place" in caplog.text
        fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(1000, 512, max_norm=1.0),
                                     "lin": torch.nn.Linear(512, 512)}).cuda()  # fmt: skip
        ck.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)}, step=0)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.cpu(), expected[k]), k


def test_memory_freed_under_a_copy_is_not_reused_until_it_lands(shm_dir):
    model, opt = _model()
    state = {"model": model, "optim": opt}
    with Checkpointer(job="freed") as ck:
        _step(model, opt, 0)
        ck.save(0, state)
        assert ck.wait(0, timeout=30) == 0
        _step(model, opt, 1)
        expected = _host(state)
        ck.save(1, state)
        for p in model.parameters():
            p.data = torch.zeros_like(p)  # the old storages are freed by the model
        opt.state.clear()
        junk = [torch.full((256, 256), 7.0, device="cuda") for _ in range(16)]  # may reuse them
        assert ck.wait(1, timeout=30) == 1
        del junk
        fresh = dict(zip(("model", "optim"), _model(seed=3), strict=True))
        assert ck.restore(fresh, step=1) == 1
        _assert_same(_host(fresh), expected)


def test_rng_with_cuda_generators(shm_dir):
    with Checkpointer(job="rng") as ck:
        torch.cuda.manual_seed_all(5)
        torch.randn(3, device="cuda")
        ck.save(0, {"rng": flashckpt.RNG()})
        want = torch.randn(100, device="cuda").cpu()
        torch.cuda.manual_seed_all(999)
        assert ck.restore({"rng": flashckpt.RNG()}) == 0
        assert torch.equal(torch.randn(100, device="cuda").cpu(), want)


def test_torch_compiled_model(shm_dir):
    model, opt = _model()
    compiled = torch.compile(model)
    state = {"model": compiled, "optim": opt}
    with Checkpointer(job="compiled") as ck:
        for step in range(3):
            _step(compiled, opt, step)
            ck.save(step, state)
        expected = _host(state)
        _step(compiled, opt, 9)
        fresh_model, fresh_opt = _model(seed=4)
        fresh = {"model": torch.compile(fresh_model), "optim": fresh_opt}
        assert ck.restore(fresh) == 2
        _assert_same(_host(fresh), expected)


def test_kill_during_an_overlapped_copy_never_publishes_that_step(shm_dir):
    """SIGKILL right after save() of a state whose copy takes a while: the step before it
    restores, whole."""
    code = f"""
import os, signal, torch
from flashckpt import Checkpointer
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters())
state = {{"model": model, "optim": opt}}
ck = Checkpointer(job="killed")
model(torch.ones(4, 4096, device="cuda")).sum().backward(); opt.step()
ck.save(1, state); ck.wait(1, timeout=60)
torch.save({{k: v.cpu() for k, v in model.state_dict().items()}}, {str(shm_dir / "step1.pt")!r})
model(torch.ones(4, 4096, device="cuda")).sum().backward(); opt.step()
ck.save(2, state)
os.kill(os.getpid(), signal.SIGKILL)
"""
    with pytest.raises(AssertionError, match=r"child failed \(-9\)"):
        run_python(code, timeout=300)
    expected = torch.load(shm_dir / "step1.pt")
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    with Checkpointer(job="killed") as ck:
        got = ck.restore({"model": model, "optim": torch.optim.AdamW(model.parameters())})
    assert got in (1, 2)  # 2 only if its copy landed and was published before the kill
    if got == 1:
        for k, v in model.state_dict().items():
            assert torch.equal(v.cpu(), expected[k]), k


def test_a_restarted_process_saves_into_page_locked_slots(shm_dir):
    run_python("""
import os, torch
from flashckpt import Checkpointer
m = torch.nn.Linear(1024, 1024).cuda()
ck = Checkpointer(job="restart")
for step in range(2):
    ck.save(step, {"model": m})
ck.wait(1, timeout=30)
os._exit(0)
""")
    m = torch.nn.Linear(1024, 1024).cuda()
    with Checkpointer(job="restart") as ck:
        assert ck.restore({"model": m}) == 1
        for fut in list(ck._prep.pending.values()):
            fut.result()
        slots = [s for s in ck._pair.slots if s is not None]
        assert slots and all(s.buf.is_pinned() for s in slots)
        ck.save(2, {"model": m})


def test_a_refused_registration_leaves_no_error_for_the_training_thread(shm_dir, monkeypatch):
    """Registration runs on the preparation thread, so a refusal there (an invalid address,
    here) never surfaces at the training thread's next kernel launch."""
    rt = CudaRuntime()
    error = {}
    clear = _last_error_clearer()

    def refused() -> None:
        error["e"] = rt.host_register(0, 4096)
        error["left"] = int(clear()) if clear is not None else None  # cleared already: 0

    t = threading.Thread(target=refused)
    t.start()
    t.join()
    assert error["e"] is not None
    assert error["left"] in (0, None), error
    assert (torch.ones(4, device="cuda") + 1).sum().item() == 8

    real = CudaRuntime.host_register
    monkeypatch.setattr(CudaRuntime, "host_register", lambda self, ptr, n: real(self, 0, 4096))
    model, opt = _model()
    with Checkpointer(job="refused") as ck:
        for step in range(3):
            _step(model, opt, step)
            ck.save(step, {"model": model, "optim": opt})
        assert ck.wait(2, timeout=30) == 2
        assert not any(s.buf.is_pinned() for s in ck._pair.slots if s is not None)


def test_registration_uses_the_states_device(shm_dir):
    """A rank on GPU 1 page-locks its slots without creating a context on GPU 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    pynvml = pytest.importorskip("pynvml")
    proc = run_python("""
import os, pynvml, torch
from flashckpt import Checkpointer
torch.cuda.set_device(1)
m = torch.nn.Linear(1024, 1024).cuda()
with Checkpointer(job="dev1") as ck:
    for step in range(3):
        ck.save(step, {"model": m})
    for fut in list(ck._prep.pending.values()):
        fut.result()
    assert all(s.buf.is_pinned() for s in ck._pair.slots if s is not None)
    pynvml.nvmlInit()
    gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu0)}
    print("on-gpu0", os.getpid() in pids)
""")
    assert pynvml and "on-gpu0 False" in proc.stdout


def test_tensors_on_two_devices_are_fenced_on_each(shm_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")

    def build(seed):
        torch.manual_seed(seed)
        a = torch.nn.Linear(2048, 2048).to("cuda:0")
        b = torch.nn.Linear(2048, 2048).to("cuda:1")
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, momentum=0.9)
        return {"a": a, "b": b, "optim": opt}

    def step(state) -> None:
        x = torch.randn(8, 2048, device="cuda:0")
        state["b"](state["a"](x).to("cuda:1")).sum().backward()
        state["optim"].step()
        state["optim"].zero_grad()

    def host(state) -> dict:
        return {f"{n}.{k}": v.cpu().clone() for n in "ab" for k, v in state[n].state_dict().items()}

    state = build(0)
    with Checkpointer(job="two") as ck:
        for i in range(3):
            step(state)
            expected = host(state)
            ck.save(i, state)
        step(state)  # writes both devices' parameters after the last save
        assert ck.wait(2, timeout=30) == 2
        fresh = build(1)
        assert ck.restore(fresh) == 2
        _assert_same(host(fresh), expected)


@pytest.fixture
def nccl_group():
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(),
                            device_id=torch.device("cuda", 0))  # fmt: skip
    yield
    dist.destroy_process_group()


def test_fsdp2_into_a_fresh_optimizer_overlaps(shm_dir, nccl_group):
    from torch.distributed.fsdp import fully_shard

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)
    state = {"model": model, "optim": opt}
    with Checkpointer(job="fsdp2") as ck:
        _step(model, opt, 0)
        deferred = ck._copier.deferrable(state.values())
        assert {storage_key(p) for p in model.parameters()} <= deferred
        assert 0 not in deferred
        ck.save(0, state)
        expected = {k: v.to_local().cpu().clone() for k, v in model.state_dict().items()}
        _step(model, opt, 1)
        fresh_model, fresh_opt = build(3)
        assert ck.restore({"model": fresh_model, "optim": fresh_opt}) == 0
        for k, v in fresh_model.state_dict().items():
            assert torch.equal(v.to_local().cpu(), expected[k]), k
        moment = next(iter(fresh_opt.state.values()))["exp_avg"]
        assert type(moment).__name__ == "DTensor" and moment.to_local().is_cuda


def test_ddp_with_nccl(shm_dir, nccl_group):
    model, opt = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    state = {"model": ddp, "optim": opt}
    with Checkpointer(job="ddp") as ck:
        for step in range(3):
            _step(ddp, opt, step)
            ck.save(step, state)
        expected = {k: v.cpu().clone() for k, v in ddp.state_dict().items()}
        fresh_model, fresh_opt = _model(seed=2)
        fresh = torch.nn.parallel.DistributedDataParallel(fresh_model, device_ids=[0])
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 2
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.cpu(), expected[k]), k


def test_waiting_for_the_copy_spins_no_core(shm_dir):
    """The publisher waits on a blocking-sync event: the process's CPU time during a long
    overlapped copy stays far below the wall time."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": opt}
    with Checkpointer(job="idle") as ck:
        model(torch.ones(4, 4096, device="cuda")).sum().backward()
        opt.step()
        ck.save(0, state)
        ck.wait(0, timeout=60)
        for fut in list(ck._prep.pending.values()):
            fut.result()
        ck._sealer.drain()
        publisher = [t for t in threading.enumerate() if t.name.startswith("flashckpt_")]
        assert publisher, "no publisher thread"
        clocks = [time.pthread_getcpuclockid(t.ident) for t in publisher]

        def cpu_now() -> float:  # the threads that wait: this one and the publisher
            return time.thread_time() + sum(time.clock_gettime(c) for c in clocks)

        wall, cpu = time.monotonic(), cpu_now()
        torch.cuda._sleep(int(2e9))  # about a second: the copies queue behind it
        ck.save(1, state)
        ck.wait(1, timeout=60)
        wall, cpu = time.monotonic() - wall, cpu_now() - cpu
    # The slot preparation thread's page-locking and the sealer's checksums are work, not a
    # wait: they are not counted.
    assert wall > 0.5 and cpu < 0.3 * wall, f"{cpu:.2f} s of CPU over {wall:.2f} s"


def test_accelerate_overlaps(shm_dir, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    import flashckpt.accelerate as fa

    acc = Accelerator()
    model, opt = _model()
    model, opt = acc.prepare(model, opt)
    flash = fa.attach(acc)
    try:
        acc.save_state(str(tmp_path / "s0"))  # makes the Checkpointer, which watches steps
        _step(model, opt, 0)
        params = {storage_key(p) for p in model.parameters()}
        assert params <= flash.ckpt._copier.deferrable([])
        acc.save_state(str(tmp_path / "s1"))
    finally:
        flash.close()


@pytest.mark.skipif(os.environ.get("FLASHCKPT_GPU_SLOW") != "1", reason="FLASHCKPT_GPU_SLOW=1")
def test_a_large_state_round_trips_at_speed(shm_dir):
    """4.5 GiB of model and AdamW state (benchmarks/snapshot.py --device cuda times it)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(24)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": opt}
    model(torch.ones(4, 4096, device="cuda")).sum().backward()
    opt.step()
    with Checkpointer(job="large") as ck:
        ck.save(0, state)
        expected = {k: v.sum().item() for k, v in model.state_dict().items()}
        ck.wait(0, timeout=120)
        fresh = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(24)]).cuda()
        assert ck.restore({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())}) == 0
        assert {k: v.sum().item() for k, v in fresh.state_dict().items()} == expected


def _many_on_gpu(numel: int) -> dict:
    """1,000 GPU parameters of ``numel`` floats and their AdamW state, stepped once."""
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel, device="cuda"))
                                    for _ in range(1000)])  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model, "optim": opt}


def test_thousands_of_tensors_round_trip_in_batched_copies(shm_dir):
    state = _many_on_gpu(97)
    model, opt = state["model"], state["optim"]
    with Checkpointer(job="many", overlap=True) as ck:
        for step in range(3):
            ck.save(step, state)
            expected = _host(state)
            for p in model:
                p.grad = torch.randn_like(p)
            opt.step()  # waits for the copies on the device, then writes
        assert ck.wait(2, timeout=60) == 2
        fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(97, device="cuda"))
                                        for _ in range(1000)])  # fmt: skip
        fopt = torch.optim.AdamW(fresh.parameters(), foreach=False)
        assert ck.restore({"model": fresh, "optim": fopt}) == 2
        _assert_same(_host({"model": fresh, "optim": fopt}), expected)


def test_a_graph_captured_while_slots_are_page_locked_in_the_background(shm_dir):
    """Right after restore() the slots are page-locked in the background, when warm-up
    captures run: the capture (global mode) and the registration never overlap."""
    run_python("""
import os, torch
from flashckpt import Checkpointer
ck = Checkpointer(job="capture")
ck.save(0, {"w": torch.randn(64 << 20, device="cuda")})  # 256 MiB: registration takes a while
ck.wait(0, timeout=60)
os._exit(0)  # the slots stay, as a killed trainer leaves them
""")
    big = {"w": torch.zeros(64 << 20, device="cuda")}
    with Checkpointer(job="capture") as ck:
        assert ck.restore(big) == 0  # page-locks the slots it found, in the background
        x = torch.ones(1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 2  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x * 2
        x.fill_(3)
        g.replay()
        torch.cuda.synchronize()
        assert y.sum().item() == 6 * 1024
        for fut in list(ck._prep.pending.values()):
            fut.result(timeout=60)
        slots = [sl for sl in ck._pair.slots if sl is not None]
        assert slots and all(sl.buf.is_pinned() for sl in slots)


def test_training_moved_to_another_stream_calls_fence_there(shm_dir):
    """BatchNorm's running stats are copied before save() returns on the stream current at
    save(); a forward on another stream first makes it wait with ``fence()``."""
    model, opt = _model()
    state = {"model": model, "optim": opt}
    other = torch.cuda.Stream()
    with Checkpointer(job="switch", overlap=True) as ck:
        _step(model, opt, 0)
        expected = _host(state)
        torch.cuda._sleep(int(5e8))  # the copies queue behind it
        ck.save(0, state)
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            ck.fence()  # this stream waits for every copy in flight
            _forward_backward(model, 1)  # writes the running stats in place
        torch.cuda.current_stream().wait_stream(other)
        assert ck.wait(0, timeout=30) == 0
        fresh = dict(zip(("model", "optim"), _model(seed=3), strict=True))
        assert ck.restore(fresh) == 0
        _assert_same(_host(fresh), expected)


def test_a_verified_restore_into_gpu_tensors_refuses_a_flipped_byte(shm_dir):
    """Each piece staged for its upload is checked on the way: a flipped byte in the newest
    step sends the restore to the older one, which lands whole on the GPU."""
    from flashckpt.format.slot import HEADER_SIZE
    from flashckpt.snapshot.slots import read_locked

    state = {"w": torch.randn(3 << 20, device="cuda"), "b": torch.randn(1000, device="cuda")}
    with Checkpointer(job="gpu-corrupt") as ck:
        ck.save(1, state)
        older = {k: v.cpu().clone() for k, v in state.items()}
        state["w"].add_(1.0)
        ck.save(2, state)
        ck.wait(2)  # its copies have landed and it is published
        ck._sealer.drain()
        for slot in ck._pair.ready():
            with read_locked(slot) as snap:
                if snap is not None and snap.step == 2:
                    entry = next(e for e in snap.manifest.entries if e.path == "w")
                    slot.buf[HEADER_SIZE + entry.offset + (9 << 20) + 5] ^= 0xFF
        target = {"w": torch.zeros(3 << 20, device="cuda"), "b": torch.zeros(1000, device="cuda")}
        assert ck.restore(target) == 1
    torch.cuda.synchronize()
    assert all(torch.equal(target[k].cpu(), older[k]) for k in older)


@pytest.mark.parametrize("pinned", [False, True], ids=["staged", "from-the-slot"])
def test_thousands_of_gpu_tensors_restore_in_batched_uploads_and_refuse_a_flipped_byte(
    shm_dir, pinned
):
    """The steady restore into 3,000 GPU tensors: staged through the page-locked ring (a
    small buffer, so many of them) or uploaded from a page-locked slot directly. A flipped
    byte in one small tensor of the newest step sends the restore to the older one, which
    lands whole; a buffer's worth of tensors goes up in one call."""
    from flashckpt.format.slot import HEADER_SIZE
    from flashckpt.restore import device_upload
    from flashckpt.snapshot.slots import read_locked

    state = _many_on_gpu(257)
    model = state["model"]
    stage = device_upload.STAGE
    device_upload.STAGE = 64 << 10
    try:
        with Checkpointer(job=f"many-flip-{pinned}") as ck:
            ck._prep.pinner.pinned = lambda slot: pinned
            ck.save(1, state)
            ck.wait(1, timeout=60)  # landed before the writes below
            older = _host(state)
            with torch.no_grad():
                for p in model:
                    p.add_(1.0)
            ck.save(2, state)
            ck.wait(2, timeout=60)
            ck._sealer.drain()
            for slot in ck._pair.ready():
                with read_locked(slot) as snap:
                    if snap is not None and snap.step == 2:
                        entry = next(e for e in snap.manifest.entries if e.path == "model/500")
                        slot.buf[HEADER_SIZE + entry.offset + 7] ^= 0xFF
            fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(257, device="cuda"))
                                            for _ in range(1000)])  # fmt: skip
            fopt = torch.optim.AdamW(fresh.parameters(), foreach=False)
            target = {"model": fresh, "optim": fopt}
            assert ck.restore(target) == 1
            _assert_same(_host(target), older)
            assert ck.restore(target) == 1  # again, on the steady path: the same refusal
            _assert_same(_host(target), older)
    finally:
        device_upload.STAGE = stage
