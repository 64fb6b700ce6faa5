"""States of thousands of tensors: ``python benchmarks/snapshot.py --case many-tensors``.

A real rank holds thousands of tensors (a Llama-70B rank under FSDP2 about 720 parameter
shards and twice that in AdamW moments; MoE models tens of thousands), so what a save or a
restore costs per tensor matters as much as its bandwidth. Each state here is a
``ParameterList`` with AdamW (four tensors a parameter: the parameter, two moments and the
step) of about ``--mib`` MiB in all, at 16, 4,000 and 16,000 tensors (``--sizes``); the
restores go into states of the same shapes (the targets). Per size, in interleaved rounds
(median of ``--rounds``; ratio = the baseline's time / the row's):

- the baseline: the plainest restore, ``for d, s in zip(dst, src): d.copy_(s)`` from the
  live state's tensors into the target's; beside it, for information, one ``memcpy`` of the
  same total bytes;
- restores, each into a target: flashckpt ``restore()`` from shared memory, verified; DCP
  ``load`` of a checkpoint of the state saved once beforehand, into the target's state
  dicts, then ``load_state_dict``; and, when DLRover is installed (``pip install --no-deps
  dlrover==0.6.1``), its ``DdpCheckpointer.load_checkpoint()`` of a step saved to memory,
  then every tensor it returns copied into the target's own (an optimizer's
  ``load_state_dict`` would keep the views into DLRover's memory it is given, and restore
  two thirds of the bytes without copying them: no like-for-like restore);
- saves: flashckpt ``save()`` (blocking; the checksums it leaves run untimed between calls),
  DCP ``async_save``, the blocking part (its ``state_dict()`` calls included, as a training
  loop makes them), DCP's ``save`` through ``flashckpt.dcp`` (blocking, its ``state_dict()``
  calls included), its ``async_save`` through ``flashckpt.dcp`` (the blocking part: the copy
  into shared memory), and DLRover's flash checkpoint to memory; DCP's ``load`` through
  ``flashckpt.dcp`` is a restore row;
- from a node tier: flashckpt ``restore()`` from a ``file://`` tier (a step the agent stored
  once beforehand; the reading Checkpointer's shared memory holds nothing), verified, its
  files in the page cache, against its own baseline: a plain ``readinto`` of each of the
  step's files into buffers allocated beforehand;
- the device row: the training thread's time in an overlapped ``save()`` of the 4,000-tensor
  state, on the simulated device of ``tests/fake_device.py`` here (``--device cuda``: the
  GPU); the copies themselves run on the device's side stream meanwhile.

The RESULT line holds the ratios the targets speak of.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from snapshot_harness import local_tensors, size_of, stop_agents, timed

from flashckpt import Checkpointer

ROOT = Path(__file__).resolve().parent.parent


def build(tensors: int, mib: float, device: str = "cpu", seed: int = 0):
    """A ParameterList of ``tensors / 4`` parameters and its AdamW state (stepped once)."""
    torch.manual_seed(seed)
    params = max(1, tensors // 4)
    numel = max(1, int(mib * 2**20) // 4 // 3 // params)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(params)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def state_of(tensors: int, mib: float, seed: int) -> dict:
    model, opt = build(tensors, mib, seed=seed)
    return {"model": model, "optim": opt}


def state_dicts(state: dict) -> dict:
    return {k: v.state_dict() for k, v in state.items()}


def load_state_dicts(state: dict, sd: dict) -> None:
    for k, v in state.items():
        v.load_state_dict(sd[k])


def copy_loop(state: dict, target: dict):
    """The baseline: the plainest restore, each of the state's tensors copied into the
    target's with ``copy_``."""
    src = [t.detach() for t in local_tensors(state)]
    dst = [t.detach() for t in local_tensors(target)]
    assert [t.shape for t in src] == [t.shape for t in dst]

    def run(i: int) -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    return run


def dcp_async(state: dict, where: str):
    import torch.distributed.checkpoint as dcp

    pending = []

    def run(i: int) -> None:
        pending.append(dcp.async_save(state_dicts(state), checkpoint_id=f"{where}/dcp-{i}"))

    def after(i: int) -> None:
        pending.pop().result()
        shutil.rmtree(f"{where}/dcp-{i}", ignore_errors=True)

    return run, after


def dcp_load(state: dict, target: dict, where: str):
    """DCP ``load`` into the target's state dicts and ``load_state_dict``, as a user restores,
    of a checkpoint of ``state`` saved once beforehand."""
    import torch.distributed.checkpoint as dcp

    path = tempfile.mkdtemp(prefix="dcp-load-", dir=where)
    dcp.save(state_dicts(state), checkpoint_id=path)

    def run(i: int) -> None:
        sd = state_dicts(target)
        dcp.load(sd, checkpoint_id=path)
        load_state_dicts(target, sd)

    return run


def dcp_flash(state: dict, target: dict):
    """DCP's own calls with flashckpt's storage (``flashckpt.dcp``): ``dcp.save`` of the
    state dicts (their ``state_dict()`` calls included) through a ``Writer``, blocking (the
    checksums it leaves run untimed between calls), and ``dcp.load`` through a ``Reader`` of
    the newest such save into the target's state dicts, then ``load_state_dict``."""
    import torch.distributed.checkpoint as dcp

    import flashckpt.dcp

    ck = Checkpointer(job=f"many-dcp-{uuid.uuid4().hex[:6]}")
    with warnings.catch_warnings():  # DCP says once per call that no process group is set up
        warnings.simplefilter("ignore")
        for step in (0, 1):  # the slots readied, as for save()
            dcp.save(
                state_dicts(state), checkpoint_id=step, storage_writer=flashckpt.dcp.Writer(ck)
            )

    def save(i: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state_dicts(state), checkpoint_id=i + 2,
                     storage_writer=flashckpt.dcp.Writer(ck))  # fmt: skip

    def load(i: int) -> None:
        sd = state_dicts(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=flashckpt.dcp.Reader(ck))
        load_state_dicts(target, sd)

    return save, lambda i: ck._sealer.drain(), load, ck


def dcp_flash_async(state: dict):
    """``dcp.async_save`` of the state dicts through a ``flashckpt.dcp.Writer``: the blocking
    part (the ``state_dict()`` calls, and the copy into shared memory that ``Writer.stage``
    makes); DCP's background save and the checksums run untimed between calls."""
    import torch.distributed.checkpoint as dcp

    import flashckpt.dcp

    ck = Checkpointer(job=f"many-dcpa-{uuid.uuid4().hex[:6]}")
    pending = []

    def save(i: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pending.append(dcp.async_save(state_dicts(state), checkpoint_id=i + 2,
                                          storage_writer=flashckpt.dcp.Writer(ck)))  # fmt: skip

    def after(i: int) -> None:
        pending.pop().result()
        ck._sealer.drain()

    for step in (-2, -1):  # the slots readied, as for save()
        save(step)
        after(step)
    return save, after, ck


def dlrover(state: dict, target: dict, where: str):
    """DLRover's flash checkpoint of ``state`` to memory, and its restore from memory into
    ``target`` (``load_checkpoint()``, then each tensor copied into the target's); None if it
    is not installed."""
    try:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    except ImportError:
        return None
    import logging

    logging.getLogger("dlrover.logger").setLevel(logging.ERROR)  # its start-up retries too
    logging.getLogger("flashckpt").setLevel(logging.WARNING)  # dlrover configures the root logger
    ck = DdpCheckpointer(where)

    def save(i: int) -> None:  # step 0 is never restored: DLRover takes it for no checkpoint
        ck.save_checkpoint(i + 1, state_dicts(state), storage_type=StorageType.MEMORY)

    into = [t.detach() for t in local_tensors(state_dicts(target))]

    def restore(i: int) -> None:
        loaded = local_tensors(ck.load_checkpoint())
        for dst, src in zip(into, loaded, strict=True):
            dst.copy_(src)

    save(0)  # what the restore restores, before the rounds
    return save, restore


def node_tier(state: dict, target: dict, where: str, run_dir: Path):
    """flashckpt ``restore()`` into ``target`` from a ``file://`` tier, and its baseline: the
    step's files read with ``readinto`` into buffers allocated beforehand. The agent stores
    the step once, beforehand; the writer's ``close()`` then frees its slots, so the reader,
    whose shared memory holds nothing, restores from the tier. The files stay in the page
    cache (read once more here)."""
    url = f"file://{where}/node-tier"
    job = f"many-tier-{uuid.uuid4().hex[:6]}"
    with Checkpointer(url, job=job, run_dir=run_dir) as writer:
        writer.save(0, state)
        writer.wait(0, tier=url, timeout=600)
    reader = Checkpointer(url, job=job, run_dir=run_dir)
    files = sorted(p for p in Path(where, "node-tier", job).rglob("*") if p.is_file())
    bufs = [bytearray(p.stat().st_size) for p in files]

    def read(i: int) -> None:
        for path, buf in zip(files, bufs, strict=True):
            with open(path, "rb", buffering=0) as f:
                assert f.readinto(buf) == len(buf)

    def restore(i: int) -> None:
        assert reader.restore(target) == 0 and reader._restored_from == url

    read(0)
    return read, restore, reader


def one_size(tensors: int, args: argparse.Namespace, where: str,
             run_dir: Path) -> dict[str, float]:  # fmt: skip
    state = state_of(tensors, args.mib, seed=0)
    # The restore targets: states of the same shapes. DCP and DLRover load into their own, as
    # an optimizer's load_state_dict may keep the tensors it is given (DLRover's memory).
    target, dcp_target, dl_target, flash_target = (state_of(tensors, args.mib, seed=s)
                                                   for s in (1, 2, 3, 4))  # fmt: skip
    nbytes = size_of(local_tensors(state))
    flat_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    ck = Checkpointer(job=f"many-{tensors}-{uuid.uuid4().hex[:6]}")
    ck.save(0, state)  # the first save readies the slots; steady saves are what is timed
    ck.save(1, state)
    ck._sealer.drain()
    read, tier_restore, reader = node_tier(state, target, where, run_dir)
    methods = {
        "loop": (copy_loop(state, target), None),
        "memcpy": (lambda i: flat_dst.copy_(flat_src), None),
        "save": (lambda i: ck.save(i + 2, state), lambda i: ck._sealer.drain()),
        "restore": (lambda i: ck.restore(target), None),
        "dcp_load": (dcp_load(state, dcp_target, where), None),
        "dcp_async": dcp_async(state, where),
        "readinto": (read, None),
        "tier_restore": (tier_restore, None),
    }
    flash_save, flash_drain, flash_load, flash_ck = dcp_flash(state, flash_target)
    methods["dcp_flash_save"] = (flash_save, flash_drain)
    methods["dcp_flash_load"] = (flash_load, None)
    async_save, async_after, async_ck = dcp_flash_async(state)
    methods["dcp_flash_async"] = (async_save, async_after)
    restored = {"restore": target, "tier_restore": target, "dcp_load": dcp_target,
                "dcp_flash_load": flash_target}  # fmt: skip
    dl = dlrover(state, dl_target, f"{where}/dlrover")
    if dl is not None:
        restored["dlrover_restore"] = dl_target
        methods["dlrover"] = (dl[0], None)
        methods["dlrover_restore"] = (dl[1], None)
    if args.only:  # a few methods alone, in turn (each ratio still needs its baseline)
        wanted = set(args.only.split(",")) | {"loop", "readinto"}
        methods = {k: v for k, v in methods.items() if k in wanted}
    times: dict[str, list[float]] = {k: [] for k in methods}
    keys = list(methods)
    for i in range(args.rounds + 1):  # the first round warms up, uncounted
        k = i % len(keys)
        for key in keys[k:] + keys[:k]:
            run, after = methods[key]
            t = timed(lambda run=run, i=i: run(i))
            if after is not None:
                after(i)
            if i:
                times[key].append(t)
    ck.close()
    reader.close()
    flash_ck.close()
    async_ck.close()
    for into in (state for key, state in restored.items() if key in methods):  # each restored
        assert all(map(torch.equal, local_tensors(into), local_tensors(state)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"--- {tensors} tensors, {nbytes / 2**20:.0f} MiB (median of {args.rounds})")
    ratios = {}
    for heading, base, labels in ROWS:
        if heading:
            print(f"  {heading}")
        for key, label in labels.items():
            if key in med:
                ratios[f"{key}/{base}"] = med[base] / med[key]
                print(f"  {label:<54}{med[key] * 1e3:10.1f} ms {med[base] / med[key]:8.2f}x")
    return ratios


ROWS = [  # (heading, the baseline of the rows, {key: label}); ratio = baseline's time / row's
    ("", "loop", {
        "loop": "Python zip copy_ loop (baseline)",
        "memcpy": "one memcpy of the same bytes",
        "restore": "flashckpt restore() from memory, verified",
        "dcp_load": "DCP load + load_state_dict",
        "dcp_flash_load": "DCP load through flashckpt.dcp + load_state_dict",
        "dlrover_restore": "DLRover 0.6.1 restore from memory + copy into the state",
        "save": "flashckpt save(), blocking",
        "dcp_async": "DCP async_save, blocking part",
        "dcp_flash_save": "DCP save through flashckpt.dcp, blocking",
        "dcp_flash_async": "DCP async_save through flashckpt.dcp, blocking part",
        "dlrover": "DLRover 0.6.1 flash checkpoint to memory",
    }),
    ("from a node tier, its files in the page cache:", "readinto", {
        "readinto": "readinto of the step's files (baseline)",
        "tier_restore": "flashckpt restore() from a file:// tier, verified",
    }),
]  # fmt: skip


def device_row(tensors: int, args: argparse.Namespace) -> tuple[float, float]:
    """On the device: the training thread's median time in an overlapped save(), and a
    verified restore() into device tensors as a ratio to the baseline of a restore there:
    one host-to-device copy per tensor from page-locked memory, on a side stream."""
    import contextlib

    from flashckpt.snapshot import device

    if args.device == "cuda":
        on_device = contextlib.nullcontext()
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_device import installed

        on_device = installed()
    with on_device:
        model, opt = build(tensors, args.mib, device=args.device)
        state = {"model": model, "optim": opt}
        target_model, target_opt = build(tensors, args.mib, device=args.device, seed=1)
        target = {"model": target_model, "optim": target_opt}
        ck = Checkpointer(job=f"many-dev-{uuid.uuid4().hex[:6]}", overlap=True)
        times = []
        try:
            for i in range(args.rounds + 2):
                opt.step()  # training: what only a step writes is copied while the next runs
                t = time.perf_counter()
                ck.save(i, state)
                took = time.perf_counter() - t
                ck.wait(i)  # its copies land and it is published before the next save
                ck._sealer.drain()
                if i >= 2:
                    times.append(took)
            upload = _uploads(local_tensors(target), device.runtime())
            restore, baseline = [], []
            for i in range(args.rounds + 1):  # interleaved; the first round warms up
                for run, into in ((lambda: ck.restore(target), restore), (upload, baseline)):
                    t = timed(run)
                    if i:
                        into.append(t)
        finally:
            ck.close()
    return statistics.median(times), statistics.median(baseline) / statistics.median(restore)


def _uploads(tensors: list[torch.Tensor], rt) -> Callable[[], None]:
    """One copy per tensor from its bytes in page-locked memory, on a side stream, waited
    for: what a restore into device tensors cannot beat."""
    dsts = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    pinned = rt.pinned_empty(sum(d.numel() for d in dsts))
    srcs, at = [], 0
    for d in dsts:
        srcs.append(pinned[at : at + d.numel()])
        at += d.numel()
    dev = rt.device_of(tensors[0])
    stream = rt.new_stream(dev)

    def upload() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            rt.copy(stream, d, s)
        done = rt.new_event()
        done.record(stream)
        done.synchronize()

    return upload


def main(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, one process
    where = tempfile.mkdtemp(prefix="flashckpt-many-")
    run_dir = Path(tempfile.mkdtemp(prefix="fc-run-", dir="/tmp"))  # short: the agent's socket
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, about {args.mib:g} MiB "
          "a state")  # fmt: skip
    if importlib.util.find_spec("dlrover") is None:
        print(
            "DLRover is not installed (pip install --no-deps dlrover==0.6.1): its rows are left out"
        )
    ratios = {}
    try:
        for n in [int(s) for s in args.sizes.split(",")]:
            ratios[n] = one_size(n, args, where, run_dir)
        dev, dev_restore = device_row(4000, args)
        where_dev = "the GPU" if args.device == "cuda" else "the simulated device"
        print(f"  overlapped save() of 4000 tensors on {where_dev}, training thread: "
              f"{dev * 1e3:.1f} ms (target <= 5 ms on a GPU)")  # fmt: skip
        print(f"  verified restore() of 4000 tensors into {where_dev}: {dev_restore:.2f}x one "
              "pinned host-to-device copy per tensor (target >= 0.80 on a GPU)")  # fmt: skip
    finally:
        stop_agents(run_dir)
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    informative = {"loop/loop", "memcpy/loop", "readinto/readinto"}  # not in the RESULT line
    parts = [f"{name}@{n}={x:.2f}" for n, r in ratios.items()
             for name, x in r.items() if name not in informative]  # fmt: skip
    parts.append(f"overlapped_save_ms@4000={dev * 1e3:.1f}")
    parts.append(f"device_restore/h2d@4000={dev_restore:.2f}")
    print("RESULT case=many-tensors " + " ".join(parts) + " (targets: restore >= 0.90 at every "
          "size; restore ahead of dlrover and dcp_load at every size)")  # fmt: skip
