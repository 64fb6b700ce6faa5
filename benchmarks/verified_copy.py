"""The verified copy's kernels against a plain copy of the same bytes, in one run.

    python benchmarks/verified_copy.py [--mib 250] [--chunk-mib 4] [--rounds 7]

A data region of ``--mib`` MiB in shared memory (as a slot holds it) is copied into a target
in host memory, cut into chunks of ``--chunk-mib`` MiB with their crc32c, as a restore copies
a state of large tensors. Rows, interleaved per round (the first method moving on each round,
after one warm-up round), medians reported, ratio = the baseline's time / the row's:

- the baseline: one ``copy_`` of the whole region (torch, on its OpenMP team);
- ``copy_checked`` with every crc32c kernel this CPU runs ("fold": AVX-512 carry-less folding
  in the registers the bytes are copied through; "insn": ``memcpy`` a block, then the crc32
  instruction over it in cache), its chunks shared over torch's OpenMP team, as a restore
  runs them;
- the same "fold" kernel on a pool of Python threads, a share each (what a process without
  an OpenMP team does): each round follows a torch op, whose team threads spin for a while;
- beside them, a chunk's checksum alone (what a save's sealer and a tier's check compute):
  ``format.checksum.crc`` (the kernel where this CPU folds) against the ``crc32c`` package,
  over every chunk of the region in turn, on one thread.

Every copy is checked; the target is compared with the source at the end.
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
import torch
from snapshot_harness import timed

from flashckpt.format.checksum import crc
from flashckpt.restore import entry_copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=250)
    p.add_argument("--chunk-mib", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    native = entry_copy._native
    if native is None:
        raise SystemExit("the compiled verified copy is not built here: nothing to time")
    n, cs = args.mib << 20, args.chunk_mib << 20
    threads = entry_copy._N_WORKERS
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(n)
        region = mmap.mmap(f.fileno(), n)
        src = torch.frombuffer(region, dtype=torch.uint8)
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        dst = torch.zeros(n, dtype=torch.uint8)
        frm = np.arange(0, n, cs, dtype=np.int64)
        size = np.minimum(cs, n - frm).astype(np.int64)
        to = dst.data_ptr() + frm
        raw = memoryview(src.numpy())
        want = np.array([crc(raw[a : a + b]) for a, b in zip(frm, size, strict=True)], np.int64)
        rows = len(frm)
        pool = ThreadPoolExecutor(threads)

        def checked(kernel: str, shared: int) -> None:
            native.kernel(kernel)
            assert native.copy_checked(to, frm, size, want, 0, rows, src.data_ptr(), shared) == (
                -1,
                0,
            )

        def on_pool() -> None:
            native.kernel(native.kernels()[0])
            cuts = [rows * k // threads for k in range(threads + 1)]
            shares = [pool.submit(native.copy_checked, to, frm, size, want, a, b, src.data_ptr())
                      for a, b in itertools.pairwise(cuts)]  # fmt: skip
            assert all(s.result() == (-1, 0) for s in shares)

        def checksums(fn: Callable[[memoryview], int]) -> None:
            assert [fn(raw[a : a + b]) for a, b in zip(frm, size, strict=True)] == list(want)

        methods = {"copy_": lambda: dst.copy_(src)}
        for k in native.kernels():
            methods[f"copy_checked {k}, OpenMP team"] = lambda k=k: checked(k, threads)
        if native.team():
            methods[f"copy_checked {native.kernels()[0]}, thread pool"] = on_pool
        methods["crc32c package, chunk by chunk"] = lambda: checksums(crc32c.crc32c)
        methods["format.checksum.crc, chunk by chunk"] = lambda: checksums(crc)
        times: dict[str, list[float]] = {k: [] for k in methods}
        keys = list(methods)
        for i in range(args.rounds + 1):
            for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
                torch.ones(1 << 16).add_(1)  # a torch op just before, as a training step
                t = timed(methods[key])
                if i:
                    times[key].append(t)
        assert torch.equal(dst, src)
        native.kernel(native.kernels()[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"torch {torch.__version__}, {threads} threads, {args.mib} MiB in "
              f"{args.chunk_mib} MiB chunks (median of {args.rounds})")  # fmt: skip
        for k, v in med.items():
            print(f"  {k:40s} {v * 1e3:8.2f} ms {med['copy_'] / v:6.2f}x")
        copies = [k for k in med if k.startswith("copy_checked")]
        ratios = " ".join(f"{k.split(',')[0].split()[-1]}{'' if 'team' in k else '_pool'}"
                          f"/copy_={med['copy_'] / med[k]:.2f}" for k in copies)  # fmt: skip
        package, ours = (
            med["crc32c package, chunk by chunk"],
            med["format.checksum.crc, chunk by chunk"],
        )
        ratios += f" checksum/crc32c_package={package / ours:.2f}"
        print(f"RESULT verified_copy {ratios}")


if __name__ == "__main__":
    main()
