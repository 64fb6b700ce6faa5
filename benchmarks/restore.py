"""Reading a stored step back: ``flashckpt restore``'s fetch and ``flashckpt export`` against
plain reads of the same bytes, in one run.

    python benchmarks/restore.py [--size-mb 1024] [--s3-size-mb 256] [--ranks 2] [--dir DIR]
                                 [--cache cold|warm|both] [--rounds 3]

A step of ``--ranks`` ranks is stored as the agent stores it (data, manifest with crc32c
checksums, commit marker), each rank holding a row shard (a DTensor ``Shard(0)``) of every
tensor of the model, as FSDP saves it:

1. local directory (``file://`` tier in ``--dir``):
   - fetch: what ``flashckpt restore`` does for each rank before writing anything, through
     its own code (``flashckpt.cli.restore``): read the manifest and data into new memory,
     verify every chunk, ranks in parallel; against a plain sequential read of every rank's
     manifest and data file into new memory (and, for reference, into memory allocated and
     faulted in beforehand: on a VM the page faults of new memory cost as much as the read);
   - export: ``flashckpt.restore.export(..., "safetensors")`` (full tensors assembled from every
     rank's shard, written as ``model.safetensors``, fsynced); against the plain read alone
     and a plain copy (the read, then one write + fsync of the same bytes in that directory).
   ``--cache cold`` drops the files from the page cache before every timed call (both
   sides, ``posix_fadvise(DONTNEED)``): a read from the disk; ``warm`` reads them cached.
2. S3 (a local moto server, as the tests use): the same fetch from an ``s3://`` tier against
   s3fs ``get_file`` of the same objects (all at once, into files in /dev/shm). The fetch is
   timed with the tier's default parts (8 MiB ranged GETs, 4 at a time) and with one GET per
   object: moto reads a whole object for every ranged GET, so parts cost it what they do not
   cost S3.

Rounds are interleaved (the first method moving on each round, after one warm-up round) and
medians reported; the last line gives the ratios (plain time / flashckpt time: 1.0 is as
fast as the plain read). Everything it writes (tier, exports, /dev/shm files) is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from persist import plain_write
from snapshot_harness import timed

from flashckpt.format import layout, tier_io
from flashckpt.format.checksum import chunk_checksums
from flashckpt.format.manifest import Manifest, ShardInfo
from flashckpt.restore.export import export
from flashckpt.restore.sources import run_with_tier
from flashckpt.snapshot.flatten import Leaf, plan_layout

ROOT = Path(__file__).resolve().parent.parent
JOB, STEP = "bench-restore", 100
N_TENSORS = 32
COLS = 1024


# ---- the stored step ---------------------------------------------------------------------------


def rank_shards(
    rank: int, world: int, nbytes: int, tensors: int = N_TENSORS, step: int = STEP
) -> tuple[Manifest, torch.Tensor]:
    """Rank ``rank``'s sealed manifest and data of ``step``: its rows of ``tensors`` float32
    tensors that hold ``nbytes`` over all ranks."""
    rows = max(world, nbytes // (tensors * COLS * 4) // world * world)
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    leaves = []
    for i in range(tensors):
        info = ShardInfo((rows, COLS), (rank * per, 0), ("Shard(dim=0)",), (world,))
        local = torch.empty(per, COLS).uniform_(generator=g)
        leaves.append(Leaf(f"model/layer{i}.weight", "tensor", local, info))
    lay = plan_layout(leaves, 4 * 2**20)
    data = torch.zeros(lay.data_len, dtype=torch.uint8)
    for e, lf in zip(lay.entries, leaves, strict=True):
        data[e.offset : e.offset + e.nbytes] = lf.tensor.reshape(-1).view(torch.uint8)
    tree = {"t": "dict", "items": [["model", {"t": "dict", "items": [
        [lf.path.split("/", 1)[1], {"t": "tensor", "i": i}] for i, lf in enumerate(leaves)]}]]}  # fmt: skip
    m = Manifest(JOB, rank, step, tree, lay.entries, lay.data_len, world_size=world)
    sums = chunk_checksums(memoryview(data.numpy()), m.entries, m.chunk_size)
    return m.with_checksums(sums), data


def store(url: str, world: int, nbytes: int) -> int:
    """Put the step in tier ``url`` as the agent does; returns the bytes of its data."""

    async def go(tier) -> int:
        total = 0
        for r in range(world):
            m, data = rank_shards(r, world, nbytes)
            await tier_io.write_rank(tier, m, memoryview(data.numpy()))
            total += m.data_len
        await tier_io.commit_step(tier, JOB, STEP, "bench", list(range(world)), world)
        return total

    return run_with_tier(url, go)


def objects(world: int) -> list[str]:
    """The step's keys a fetch reads: every rank's manifest and data."""
    return [k for r in range(world)
            for k in (layout.manifest_key(JOB, STEP, r), layout.data_key(JOB, STEP, r))]  # fmt: skip


# ---- flashckpt's side --------------------------------------------------------------------------


class _Discard:
    """A restore target that keeps nothing: only the fetch is timed."""

    shown = "nowhere"

    async def write(self, manifest, data) -> str:
        return "nowhere"


def fetch(url: str, world: int) -> None:
    """Every rank of the step, read and verified by ``flashckpt restore``'s own per-rank
    code, ranks in parallel as it runs them."""
    from flashckpt.cli import restore
    from flashckpt.cli.common import Progress
    from flashckpt.cli.locations import TierLocation, newest_key

    async def go() -> None:
        async with TierLocation(url) as loc:
            listing = await loc.listing(JOB)
            key = newest_key(listing, STEP)
            sources = [(loc, key, listing[key])]
            limit = asyncio.Semaphore(restore.RANKS_IN_FLIGHT)
            with Progress("fetch", enabled=False) as progress:
                done = await asyncio.gather(*(
                    restore._rank(r, sources, JOB, _Discard(), progress, limit)
                    for r in range(world)))  # fmt: skip
        bad = [d for d in done if not d["ok"]]
        if bad:
            raise SystemExit(f"fetch failed: {bad}")

    asyncio.run(go())


# ---- plain side --------------------------------------------------------------------------------


def plain_read(paths: list[Path], size: int, into: torch.Tensor | None = None,
               chunk: int = 8 * 2**20) -> torch.Tensor:  # fmt: skip
    """Read ``paths`` (``size`` bytes in all) one after another into new memory, as a fetch
    gets them, or into ``into`` (allocated and faulted in before)."""
    into = torch.empty(size, dtype=torch.uint8) if into is None else into
    view = memoryview(into.numpy())
    at = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view[at : at + chunk]):
                at += n
    return into


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def interleaved(methods: dict[str, Callable[[], object]], rounds: int,
                before: Callable[[], object] = lambda: None,
                after: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:  # fmt: skip
    """Median seconds of each method over ``rounds`` rounds after a warm-up round, the first
    method moving on by one each round; ``before`` runs untimed before every call."""
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds + 1):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            before()
            t = timed(methods[name])
            if after and name in after:
                after[name]()
            os.sync()  # the writeback of this call's files is not the next one's
            if i:
                times[name].append(t)
    return {n: statistics.median(v) for n, v in times.items()}


# ---- the cases ---------------------------------------------------------------------------------


def local(args: argparse.Namespace, cache: str) -> tuple[float, float, float]:
    base = Path(tempfile.mkdtemp(prefix="flashckpt-restore-bench-", dir=args.dir))
    try:
        url = f"file://{base / 'tier'}"
        nbytes = store(url, args.ranks, args.size_mb * 2**20)
        paths = [base / "tier" / k for k in objects(args.ranks)]
        size = sum(p.stat().st_size for p in paths)
        buf = torch.ones(size, dtype=torch.uint8)  # faulted in: the read only copies
        out = base / "exported"

        def copy() -> None:
            plain_write(base / "copy.bin", memoryview(plain_read(paths, size).numpy()))

        methods = {
            "plain read": lambda: plain_read(paths, size),
            "plain read, prefaulted": lambda: plain_read(paths, size, buf),
            "restore fetch": lambda: fetch(url, args.ranks),
            "plain read+write": copy,
            "export safetensors": lambda: export(url, out, "safetensors"),
        }
        cleanup = {"plain read+write": lambda: (base / "copy.bin").unlink(),
                   "export safetensors": lambda: shutil.rmtree(out)}  # fmt: skip
        before = (lambda: evict(paths)) if cache == "cold" else (lambda: None)
        t = interleaved(methods, args.rounds, before, cleanup)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"local directory {args.dir}, {cache} page cache: {args.ranks} ranks, "
          f"{nbytes / 2**20:.0f} MiB of data, median of {args.rounds}")  # fmt: skip
    for name, secs in t.items():
        print(f"  {name:<24} {secs * 1e3:9.1f} ms {nbytes / secs / 1e9:6.2f} GB/s")
    return (t["plain read"] / t["restore fetch"], t["plain read"] / t["export safetensors"],
            t["plain read+write"] / t["export safetensors"])  # fmt: skip


def s3(args: argparse.Namespace) -> tuple[float, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    import s3fs
    from s3fixture import MotoS3

    server = MotoS3()
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": server.endpoint_url}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server.client().create_bucket(Bucket=bucket)
    dest = Path(tempfile.mkdtemp(prefix="flashckpt-s3get-", dir="/dev/shm"))
    try:
        url = f"s3://{bucket}/ckpt"
        nbytes = store(url, args.ranks, args.s3_size_mb * 2**20)
        keys = [f"{bucket}/ckpt/{k}" for k in objects(args.ranks)]

        async def get_files() -> None:
            fs = s3fs.S3FileSystem(asynchronous=True, endpoint_url=server.endpoint_url)
            await fs.set_session()
            try:
                await asyncio.gather(*(fs._get_file(k, str(dest / k.replace("/", "_")))
                                       for k in keys))  # fmt: skip
            finally:
                await (await fs.set_session()).close()  # the client s3fs made, closed

        def clear() -> None:
            for p in dest.iterdir():
                p.unlink()

        whole = f"{url}?part_size={5 * 2**30}"  # one GET per object: moto reads the whole
        # object for every ranged GET, which real S3 does not
        t = interleaved({"s3fs get_file": lambda: asyncio.run(get_files()),
                         "restore fetch": lambda: fetch(url, args.ranks),
                         "restore fetch, 1 part": lambda: fetch(whole, args.ranks)},
                        args.rounds, after={"s3fs get_file": clear})  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(dest, ignore_errors=True)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    print(f"S3 (moto on 127.0.0.1): {args.ranks} ranks, {nbytes / 2**20:.0f} MiB of data, "
          f"median of {args.rounds}")  # fmt: skip
    for name, secs in t.items():
        print(f"  {name:<24} {secs * 1e3:9.1f} ms {nbytes / secs / 1e6:6.0f} MB/s")
    return t["s3fs get_file"] / t["restore fetch"], t["s3fs get_file"] / t["restore fetch, 1 part"]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=int, default=1024, help="the local step's data (MiB)")
    p.add_argument("--s3-size-mb", type=int, default=256, help="the S3 step's data (MiB)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="directory for the local tier, the exports and the plain copies")  # fmt: skip
    p.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    results = []
    for cache in ("cold", "warm") if args.cache == "both" else (args.cache,):
        fetch_r, export_r, copy_r = local(args, cache)
        results.append(f"{cache}: fetch/plain_read={fetch_r:.2f} (target >= 0.80) "
                       f"export/plain_read={export_r:.2f} export/plain_copy={copy_r:.2f}")  # fmt: skip
    r_s3, r_whole = s3(args)
    print(f"RESULT local {'; '.join(results)}; S3 fetch/s3fs_get_file={r_s3:.2f} (target >= "
          f"0.90), with one GET per object {r_whole:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
