"""The snapshot benchmark on one GPU: ``python benchmarks/snapshot.py --device cuda``.

A stack of ``Linear(4096, 4096)`` layers with AdamW state on the GPU (``--gib``, default 4.5
GiB). Every figure is a ratio against a copy of the same bytes timed in the same run, so the
ratios hold on a shared machine; each row is printed as soon as it is measured, and the last
line holds the ratios the targets speak of:

- pinned device-to-host and host-to-device copies of the state's bytes (the baselines);
- ``save()`` in blocking mode against the pinned device-to-host copy (target >= 0.9), in this
  process and in a restarted one after ``restore()`` (a child process that restores slots a
  killed one left: the same within 10 %);
- verified ``restore()`` into the GPU tensors against the pinned host-to-device copy (target
  >= 0.8), and with ``verify=False``, of a sealed snapshot and of one saved a moment before;
- a training loop saving every step, overlapped and blocking, with a step shorter and one
  longer than the copy: the exposed cost per save against max(0, copy - forward/backward)
  + 10 % of the copy, and the training process's CPU time (cores busy) beside the loop
  without saving, with and without the sealers' checksumming (which runs off the training
  thread, on a core of its own);
- the first ``save()`` of a job against faulting in and page-locking one slot of that size
  (target <= 1.5), and the first after ``restore()`` and a step;
- beside them: DCP ``async_save`` (its default, and with a pinned ``DefaultStager``: the call
  plus staging, until the state may change again) and DLRover's flash checkpoint when it is
  installed;
- ``--integrations``: the same overlapped loop for FSDP2 (``fully_shard``, NCCL, one GPU),
  Hugging Face Accelerate and DeepSpeed ZeRO-1 (when installed), against the plain one; their
  exposed cost per save over the copy is in the RESULT line;
- the restarted process's verified ``restore()`` (the restart path: slots it did not
  page-lock, so uploads go through the staging rings) against its own host-to-device copy.

Host memory: the pinned baselines, two slots per Checkpointer and DCP's staging copies come
to about 5 times the state at the peak; every Checkpointer is closed and every file removed
before the next part.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from snapshot_harness import local_tensors, size_of

from flashckpt import Checkpointer
from flashckpt.snapshot import sealer
from flashckpt.snapshot.device import CudaRuntime

WIDTH = 4096
ROOT = Path(__file__).resolve().parent.parent


def build(layers: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def layers_for(gib: float) -> int:
    return max(1, round(gib * 2**30 / (WIDTH * WIDTH * 4 * 3)))  # weight + two AdamW moments


def sync() -> None:
    torch.cuda.current_stream().synchronize()  # what the training loop sees (not side streams)


def timed(fn: Callable[[], object]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def median_of(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(rounds))


def forward_backward(model: torch.nn.Module, batch: int) -> None:
    x = torch.randn(batch, WIDTH, device="cuda")
    model(x).pow(2).mean().backward()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int) -> None:
    forward_backward(model, batch)
    opt.step()
    opt.zero_grad(set_to_none=False)


def row(name: str, seconds: float, nbytes: int, base: float | None = None, note: str = "") -> None:
    ratio = f"{base / seconds:7.2f}" if base else "      -"
    print(f"{name:<58} {seconds * 1e3:9.1f} {nbytes / seconds / 1e9:7.2f} {ratio}  {note}",
          flush=True)  # fmt: skip


def settle(ck: Checkpointer) -> None:
    """Background work a save or restore leaves (slot preparation, page-locking, checksums)."""
    for fut in list(ck._prep.pending.values()):
        fut.result()
    ck._sealer.drain()


# ---- baselines ---------------------------------------------------------------------------
def copies(nbytes: int, rounds: int) -> tuple[float, float]:
    """Medians of a pinned device-to-host and host-to-device copy of ``nbytes``."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = median_of(lambda: host.copy_(dev, non_blocking=True), rounds)
    h2d = median_of(lambda: dev.copy_(host, non_blocking=True), rounds)
    return d2h, h2d  # both buffers are freed on return


def fault_and_pin(nbytes: int, where: str) -> float:
    """A fresh shared-memory file of ``nbytes``, faulted in and page-locked: what preparing
    one slot must cost at least."""
    path = os.path.join(where, f"pin-{uuid.uuid4().hex[:8]}")
    rt = CudaRuntime()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    error = rt.host_register(buf.data_ptr(), nbytes)
    elapsed = time.perf_counter() - t0
    if error is None:
        rt.host_unregister(buf.data_ptr())
    del buf
    mm.close()
    os.close(fd)
    os.unlink(path)
    assert error is None, error
    return elapsed


# ---- flashckpt ---------------------------------------------------------------------------
def blocking_saves(state: dict, rounds: int, job: str) -> float:
    with Checkpointer(job=job, overlap=False) as ck:
        ck.restore(state)  # finds nothing; readies and page-locks the slots in the background
        settle(ck)
        times = []
        for i in range(rounds + 1):
            t = timed(lambda i=i: ck.save(i, state))
            settle(ck)
            times.append(t)
    return statistics.median(times[1:])


def restores(state: dict, rounds: int, job: str) -> dict[str, float]:
    """Medians of restore() into ``state``'s own GPU tensors: verified and not, of a sealed
    snapshot, and verified right after save() (not sealed yet)."""
    out: dict[str, list[float]] = {"verified": [], "unverified": [], "fresh": []}
    with Checkpointer(job=job, overlap=False) as ck:
        ck.save(0, state)
        settle(ck)
        for i in range(rounds + 1):
            ck.verify = True
            out["verified"].append(timed(lambda: ck.restore(state)))
            ck.verify = False
            out["unverified"].append(timed(lambda: ck.restore(state)))
            ck.verify = True
            ck.save(i + 1, state)
            out["fresh"].append(timed(lambda: ck.restore(state)))
            settle(ck)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


Step = Callable[[int], object]  # one training step (or its forward and backward) at a batch


def loop(step: Step, batch: int, steps: int, save: Step | None) -> tuple[float, float, float]:
    """Median time of ``steps`` training steps, each followed by ``save(i)``, and the
    process's CPU time per step over them, with and without the sealers' checksumming."""

    def one(i: int) -> None:
        step(batch)
        if save is not None:
            save(i)

    for i in range(2):  # warm-up
        one(i)
    times, cpu, sealing = [], time.process_time(), sealer.cpu_seconds()
    for i in range(2, steps + 2):
        times.append(timed(lambda i=i: one(i)))
    cpu, sealing = time.process_time() - cpu, sealer.cpu_seconds() - sealing
    return statistics.median(times), cpu / steps, (cpu - sealing) / steps


def batch_for(fwd_bwd: Step, seconds: float) -> int:
    """A batch whose forward and backward take about ``seconds``."""
    probe = 256
    t = median_of(lambda: fwd_bwd(probe), 3)
    return max(8, int(probe * seconds / t))


def overlap_case(name: str, fwd_bwd: Step, step: Step, save_overlapped: Step,
                 save_blocking: Step | None, t_copy: float, batch: int,
                 steps: int) -> dict[str, float]:  # fmt: skip
    """One training loop, without saving, saving overlapped and blocking; rows and figures."""
    t_fb = median_of(lambda: fwd_bwd(batch), steps)
    plain, cpu_plain, _ = loop(step, batch, steps, None)
    over, cpu_over, cpu_unsealed = loop(step, batch, steps, save_overlapped)
    block = loop(step, batch, steps, save_blocking)[0] if save_blocking else float("nan")
    exposed, bound = max(0.0, over - plain), max(0.0, t_copy - t_fb) + 0.1 * t_copy
    print(f"{name}: forward+backward {t_fb * 1e3:.1f} ms, copy {t_copy * 1e3:.1f} ms; step "
          f"{plain * 1e3:.1f} ms plain, {over * 1e3:.1f} overlapped (exposed {exposed * 1e3:.1f},"
          f" bound {bound * 1e3:.1f}: {'ok' if exposed <= bound else 'MISSED'}), "
          f"{block * 1e3:.1f} blocking; CPU per step {cpu_plain * 1e3:.0f} ms plain, "
          f"{cpu_over * 1e3:.0f} ms overlapped ({cpu_unsealed * 1e3:.0f} ms without the "
          "sealers' checksums)", flush=True)  # fmt: skip
    return {"exposed": exposed, "bound": bound, "cpu_plain": cpu_plain, "cpu_over": cpu_over,
            "cpu_unsealed": cpu_unsealed, "step": plain}  # fmt: skip


def steps_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Step, Step]:
    """(forward and backward, a whole training step) of ``model`` and ``opt``."""
    return (lambda b: forward_backward(model, b)), (lambda b: train_step(model, opt, b))


def saving_every_step(state: dict, job: str, overlap: bool) -> tuple[Checkpointer, Step]:
    ck = Checkpointer(job=job, overlap=overlap)
    ck.restore(state)
    settle(ck)
    return ck, lambda i: ck.save(i, state)


def first_saves(state: dict, model, opt, nbytes: int, where: str) -> tuple[float, float, float]:
    """A fault-and-pin of one slot, a job's first save() without restore(), and the first
    save() after restore() and a training step."""
    pin = fault_and_pin(nbytes + (2 << 20), where)
    with Checkpointer(job=f"first-{uuid.uuid4().hex[:6]}") as ck:
        cold = timed(lambda: ck.save(0, state))
        settle(ck)
    with Checkpointer(job=f"first-r-{uuid.uuid4().hex[:6]}") as ck:
        ck.restore(state)
        train_step(model, opt, 64)
        warm = timed(lambda: ck.save(0, state))
        settle(ck)
    return pin, cold, warm


# ---- a restarted process -----------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """``--child save|restarted``: leave slots behind as a killed trainer would, or restore
    them in a new process and time blocking saves there; prints one JSON line."""
    model, opt = build(args.layers)
    train_step(model, opt, 64)
    state = {"model": model, "optim": opt}
    if args.child == "save":
        ck = Checkpointer(job=args.job, overlap=False)
        for step in range(2):
            ck.save(step, state)
        ck.wait(1, timeout=300)
        settle(ck)
        os._exit(0)  # no close(): the slots stay, unpinned, for the next process
    nbytes = size_of(local_tensors(state))
    d2h, h2d = copies(nbytes, args.rounds)
    with Checkpointer(job=args.job, overlap=False) as ck:
        t_restore = timed(lambda: ck.restore(state))
        settle(ck)
        pinned = all(ck._prep.pinner.pinned(s) for s in ck._pair.slots if s is not None)
        times = [timed(lambda i=i: ck.save(10 + i, state)) for i in range(args.rounds + 1)]
    print(json.dumps({"d2h": d2h, "h2d": h2d, "save": statistics.median(times[1:]),
                      "pinned": pinned, "restore": t_restore}), flush=True)  # fmt: skip


def restarted(args: argparse.Namespace) -> dict:
    job = f"restart-{uuid.uuid4().hex[:6]}"
    base = [sys.executable, __file__, "--layers", str(args.layers), "--rounds", str(args.rounds),
            "--job", job]  # fmt: skip
    subprocess.run([*base, "--child", "save"], check=True)
    out = subprocess.run([*base, "--child", "restarted"], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


# ---- others --------------------------------------------------------------------------------
def dcp_async(state: dict, where: str, rounds: int) -> tuple[float, float | None]:
    """Blocking part of DCP async_save: its default, and with a pinned DefaultStager (the
    call plus staging, until the state may change)."""
    import torch.distributed.checkpoint as dcp

    def sd() -> dict:
        return {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}

    def once(i: int, **kwargs: object) -> float:
        """The blocking part of one async_save (with staging waited for); then its upload
        is waited for and its files removed, untimed."""
        path = os.path.join(where, f"dcp-{i}")
        response: list = []

        def call() -> None:
            r = dcp.async_save(sd(), checkpoint_id=path, no_dist=True, **kwargs)
            staging = getattr(r, "staging_completion", None)
            if staging is not None:
                staging.result()  # until then the state must not change
            response.append(r)

        t = timed(call)
        getattr(response[0], "upload_completion", response[0]).result()
        shutil.rmtree(path, ignore_errors=True)
        return t

    default = [once(i) for i in range(rounds + 1)]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return statistics.median(default[1:]), None
    stager = DefaultStager(StagingOptions())
    pinned = [once(i, async_stager=stager) for i in range(rounds + 1)]
    stager.close()
    return statistics.median(default[1:]), statistics.median(pinned[1:])


def dlrover(state: dict, where: str, rounds: int) -> float | None:
    try:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    except ImportError:
        return None
    ck = DdpCheckpointer(where)
    sd = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
    times = [timed(lambda i=i: ck.save_checkpoint(i, sd, storage_type=StorageType.MEMORY))
             for i in range(rounds + 1)]  # fmt: skip
    return statistics.median(times[1:])


# ---- integrations ------------------------------------------------------------------------
def integrations(args: argparse.Namespace, t_copy: float, batch: int,
                 plain_exposed: float) -> dict[str, float]:  # fmt: skip
    """Each integration's exposed cost per save over the copy, by name."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(),
                            device_id=torch.device("cuda", 0))  # fmt: skip
    try:
        model, opt = build(args.layers)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        train_step(model, opt, batch)
        state = {"model": model, "optim": opt}
        ck, save = saving_every_step(state, "fsdp2", True)
        got = overlap_case("FSDP2 (fully_shard, NCCL, 1 GPU)", *steps_of(model, opt), save, None,
                           t_copy, batch, args.rounds)  # fmt: skip
        ck.close()
        print(
            f"  FSDP2 exposed/plain's: {got['exposed'] * 1e3:.1f} vs {plain_exposed * 1e3:.1f} ms"
        )
        out = {"fsdp2": got["exposed"] / t_copy}
        del model, opt, state, ck, save
        gc.collect()
        torch.cuda.empty_cache()
        for name, case in (("accelerate", accelerate_case), ("deepspeed", deepspeed_case)):
            got = case(args, t_copy, batch)
            if got is not None:
                out[name] = got["exposed"] / t_copy
        return out
    finally:
        dist.destroy_process_group()


def accelerate_case(args: argparse.Namespace, t_copy: float, batch: int) -> dict | None:
    try:
        from accelerate import Accelerator

        import flashckpt.accelerate as fa
    except ImportError:
        print("Accelerate: not installed", flush=True)
        return None
    acc = Accelerator()
    model, opt = acc.prepare(*build(args.layers))
    flash = fa.attach(acc)
    where = tempfile.mkdtemp(prefix="flashckpt-acc-")
    acc.save_state(os.path.join(where, "s"))
    train_step(model, opt, batch)
    got = overlap_case("Accelerate save_state()", *steps_of(model, opt),
                       lambda i: acc.save_state(os.path.join(where, "s")), None, t_copy, batch,
                       args.rounds)  # fmt: skip
    flash.close()
    shutil.rmtree(where, ignore_errors=True)
    return got


def deepspeed_case(args: argparse.Namespace, t_copy: float, batch: int) -> dict | None:
    try:
        import deepspeed

        import flashckpt.deepspeed as flash_ds
    except ImportError:
        print("DeepSpeed ZeRO-1: not installed", flush=True)
        return None
    model, opt = build(args.layers)
    config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    where = tempfile.mkdtemp(prefix="flashckpt-ds-")
    flash = flash_ds.attach(engine)

    def fwd_bwd(b: int) -> None:
        engine.backward(engine(torch.randn(b, WIDTH, device="cuda")).pow(2).mean())

    def step(b: int) -> None:
        fwd_bwd(b)
        engine.step()

    try:
        engine.save_checkpoint(where, tag="t")
        return overlap_case("DeepSpeed ZeRO-1 save_checkpoint()", fwd_bwd, step,
                            lambda i: engine.save_checkpoint(where, tag="t"), None, t_copy,
                            batch, args.rounds)  # fmt: skip
    finally:
        flash.close()
        shutil.rmtree(where, ignore_errors=True)


# ---- the run -----------------------------------------------------------------------------
def main(args: argparse.Namespace) -> None:
    if args.child:
        child(args)
        return
    model, opt = build(args.layers)
    train_step(model, opt, 64)
    state = {"model": model, "optim": opt}
    nbytes = size_of(local_tensors(state))
    where = tempfile.mkdtemp(prefix="flashckpt-bench-")
    shm = os.environ["FLASHCKPT_SHM_DIR"]
    os.makedirs(shm, exist_ok=True)
    print(f"state: {nbytes / 2**30:.2f} GiB in {len(local_tensors(state))} tensors on "
          f"{torch.cuda.get_device_name()}; torch {torch.__version__}; median of {args.rounds}")  # fmt: skip
    print(f"{'what':<58} {'ms':>9} {'GB/s':>7} {'ratio':>7}")
    d2h, h2d = copies(nbytes, args.rounds)
    row("pinned device-to-host copy (baseline)", d2h, nbytes)
    row("pinned host-to-device copy (baseline)", h2d, nbytes)
    t_block = blocking_saves(state, args.rounds, "block")
    row("save(), blocking", t_block, nbytes, d2h, "vs the D2H copy (target >= 0.9)")
    r = restores(state, args.rounds, "restore")
    row("restore() into the GPU tensors, verified", r["verified"], nbytes, h2d,
        "vs the H2D copy (target >= 0.8)")  # fmt: skip
    row("restore(), verify=False", r["unverified"], nbytes, h2d)
    row("restore() right after save() (not sealed yet)", r["fresh"], nbytes, h2d)
    pin, cold, warm = first_saves(state, model, opt, nbytes, shm)
    row("fault in + page-lock one slot (baseline for a first save)", pin, nbytes)
    row("save(), first of a job, no restore()", cold, nbytes, None,
        f"{cold / pin:.2f} x fault+pin (target <= 1.5)")  # fmt: skip
    row("save(), first after restore() and a step", warm, nbytes, None,
        f"{warm / pin:.2f} x fault+pin")  # fmt: skip
    rs = restarted(args)
    row("save(), blocking, in a restarted process after restore()", rs["save"], nbytes,
        rs["d2h"], f"vs its own D2H copy; slots page-locked: {rs['pinned']}")  # fmt: skip
    row("restore() in a restarted process, verified (staging rings)", rs["restore"], nbytes,
        rs["h2d"], "vs its own H2D copy")  # fmt: skip
    fwd_bwd, step = steps_of(model, opt)
    short, long = batch_for(fwd_bwd, 0.5 * d2h), batch_for(fwd_bwd, 2.0 * d2h)
    results = {}
    for name, batch in (("short", short), ("long", long)):
        ck_o, save_o = saving_every_step(state, f"loop-o-{name}", True)
        ck_b, save_b = saving_every_step(state, f"loop-b-{name}", False)
        results[name] = overlap_case(f"step {name}er than the copy (batch {batch})", fwd_bwd,
                                     step, save_o, save_b, d2h, batch, args.rounds)  # fmt: skip
        ck_o.close()
        ck_b.close()
    t_async, t_staged = dcp_async(state, where, args.rounds)
    row("DCP async_save, blocking part (default)", t_async, nbytes, d2h)
    if t_staged is not None:
        row("DCP async_save with a pinned DefaultStager, call + staging", t_staged, nbytes, d2h)
    t_dlrover = dlrover(state, where, args.rounds)
    if t_dlrover is None:
        print("DLRover flash checkpoint: not installed", flush=True)
    else:
        row("DLRover flash checkpoint, memory, blocking part", t_dlrover, nbytes, d2h)
    doors = {}
    if args.integrations:
        doors = integrations(args, d2h, long, results["long"]["exposed"])
    shutil.rmtree(where, ignore_errors=True)
    print(
        f"RESULT blocking_save/d2h={d2h / t_block:.2f} (>= 0.9) "
        f"restarted_blocking_save/d2h={rs['d2h'] / rs['save']:.2f} (>= 0.9) "
        f"verified_restore/h2d={h2d / r['verified']:.2f} (>= 0.8) "
        + " ".join(f"overlap_{k}_exposed/copy={v['exposed'] / d2h:.2f} "
                   f"(<= {v['bound'] / d2h:.2f})" for k, v in results.items())
        + f" first_save/fault_and_pin={cold / pin:.2f} (<= 1.5)"
        + f" restarted_verified_restore/h2d={rs['h2d'] / rs['restore']:.2f}"
        + "".join(f" {k}_overlap_long_exposed/copy={v:.2f}" for k, v in doors.items())
        + " cpu_per_step_ms(plain/overlapped/without_sealing)="
        + "/".join(f"{results['long'][k] * 1e3:.0f}"
                   for k in ("cpu_plain", "cpu_over", "cpu_unsealed"))
    )  # fmt: skip


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=4.5, help="GPU state size (cuda)")
    p.add_argument("--integrations", action="store_true",
                   help="cuda: also FSDP2, Accelerate and DeepSpeed ZeRO-1")  # fmt: skip
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["save", "restarted"], help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)


if __name__ == "__main__":  # the children of ``restarted``
    parser = argparse.ArgumentParser()
    arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    main(parser.parse_args())
