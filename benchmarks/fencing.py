"""What fencing costs the persist path, side by side with the same writes unfenced, in one run.

    python benchmarks/fencing.py [--size-mb 250] [--ranks 2] [--rounds 7] [--dir DIR]
                                 [--s3-size-mb 64] [--no-s3]

A step of ``--ranks`` ranks is stored as the node agent stores it: each rank's data, then its
manifest (crc32c checksums filled in), then the node's commit marker. Two ways, same bytes,
same tier, rounds interleaved (which goes first alternates), medians reported:

- fenced: ``tier_io.write_rank`` and ``tier_io.commit_step`` of a run that claimed its epoch
  (the claim is in the tier, as after every ``restore()``): a look at the job's fence before
  a rank and before the marker, and every object put with ``exclusive=True`` (a hard link on a
  directory tier, ``If-None-Match: *`` on S3);
- unfenced: the same three puts as plain ``tier.put`` calls (a rename; a plain PUT), as the
  agent stored steps before runs were fenced.

At three shapes of the state: 16, 4,000 and 16,000 float32 tensors over ``--size-mb`` (rows
of every tensor sharded over the ranks, as FSDP saves them), in a ``pfs://`` tier in
``--dir`` (fsynced writes) and in an ``s3://`` tier on a local moto server (as the tests use).
Also timed: a run's claim of its epoch (at ``restore()``), against listing the job's steps.
The last lines give fenced / unfenced per shape (1.00: fencing costs nothing measurable).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from restore import rank_shards

from flashckpt.format import fence, layout, tier_io
from flashckpt.restore.sources import run_with_tier

JOB = "bench-restore"  # rank_shards' job
SHAPES = (16, 4000, 16000)


async def fenced(tier, shards, step: int, run: int) -> None:
    for m, data in shards:
        await tier_io.write_rank(tier, _at(m, step, run), memoryview(data.numpy()))
    await tier_io.commit_step(tier, JOB, step, "bench", [m.rank for m, _ in shards],
                              len(shards), incarnation=run)  # fmt: skip


async def unfenced(tier, shards, step: int, run: int) -> None:
    for m, data in shards:
        view = memoryview(data.numpy())
        await tier.put(layout.data_key(JOB, step, m.rank), list(_chunks(view)), len(view))
        raw = _at(m, step, run).to_json()
        await tier.put(layout.manifest_key(JOB, step, m.rank), [memoryview(raw)], len(raw))
    marker = layout.CommitMarker("bench", tuple(m.rank for m, _ in shards), len(shards),
                                 incarnation=run).to_json()  # fmt: skip
    await tier.put(layout.commit_key(JOB, step, "bench"), [memoryview(marker)], len(marker))


def _at(m, step: int, run: int):
    return dataclasses.replace(m, step=step, incarnation=run)


def _chunks(view: memoryview, size: int = tier_io.WRITE_CHUNK):
    return (view[i : i + size] for i in range(0, len(view), size))


def compare(url: str, shards, rounds: int) -> tuple[float, float]:
    """Median seconds to store the step fenced and unfenced, rounds interleaved."""

    async def go(tier) -> tuple[list[float], list[float]]:
        run = await fence.claim([tier], JOB, 1, -1, "bench")
        times: dict[str, list[float]] = {"fenced": [], "unfenced": []}
        ways = {"fenced": fenced, "unfenced": unfenced}
        step = 0
        for i in range(rounds + 1):  # the first round warms up
            order = ("fenced", "unfenced") if i % 2 else ("unfenced", "fenced")
            for name in order:
                step += 1
                t0 = time.perf_counter()
                await ways[name](tier, shards, step, run)
                if i:
                    times[name].append(time.perf_counter() - t0)
                await tier.delete(layout.step_prefix(JOB, step))
        return times["fenced"], times["unfenced"]

    f, u = run_with_tier(url, go)
    return statistics.median(f), statistics.median(u)


def claim_cost(url: str, rounds: int) -> tuple[float, float]:
    """Median seconds of a claim and of listing the job's steps (what every restore does)."""

    async def go(tier) -> tuple[float, float]:
        claims, lists = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await fence.claim([tier], JOB, 1, -1, "bench")
            claims.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await tier_io.list_steps(tier, JOB)
            lists.append(time.perf_counter() - t0)
        return statistics.median(claims), statistics.median(lists)

    return run_with_tier(url, go)


def run_tier(name: str, url: str, nbytes: int, args: argparse.Namespace) -> list[str]:
    lines = []
    for tensors in SHAPES:
        shards = [rank_shards(r, args.ranks, nbytes, tensors) for r in range(args.ranks)]
        stored = sum(m.data_len for m, _ in shards)
        f, u = compare(url, shards, args.rounds)
        print(f"{name} {tensors:>5} tensors, {stored / 2**20:.0f} MiB: fenced {f * 1e3:8.1f} ms "
              f"({stored / f / 1e9:.2f} GB/s), unfenced {u * 1e3:8.1f} ms "
              f"({stored / u / 1e9:.2f} GB/s)", flush=True)  # fmt: skip
        lines.append(f"{name} {tensors} tensors: fenced / unfenced = {f / u:.3f}")
    c, listing = claim_cost(url, args.rounds)
    print(f"{name}: a run's claim {c * 1e3:.2f} ms, a listing of the job {listing * 1e3:.2f} ms")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=250)
    ap.add_argument("--s3-size-mb", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the pfs:// tier goes (default: /tmp)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="flashckpt-fencing-", dir=args.dir))
    lines = []
    try:
        lines += run_tier("pfs", f"pfs://{base}", args.size_mb * 2**20, args)
        if not args.no_s3:
            lines += s3(args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(lines))


def s3(args: argparse.Namespace) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from s3fixture import MotoS3

    server = MotoS3()
    server.start()
    try:
        for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                     "AWS_DEFAULT_REGION": "us-east-1",
                     "FSSPEC_S3_ENDPOINT_URL": server.endpoint_url}.items():  # fmt: skip
            os.environ[k] = v
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.client().create_bucket(Bucket=bucket)
        return run_tier("s3", f"s3://{bucket}/ckpt", args.s3_size_mb * 2**20, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
