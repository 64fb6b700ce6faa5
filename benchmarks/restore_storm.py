"""Restore storm: every rank of a job asks for the restore plan at once, after a failure.

    python benchmarks/restore_storm.py [--nodes 256,1024,4096] [--workers 8] [--steps 2]
                                       [--s3-nodes 16]

A restore plan starts by listing each tier's steps for the job and reading every commit
marker of them (one per node and step): that is what ``TierSource.snapshots`` does.

1. For each N: a shared directory tier (``pfs://``) holding ``--steps`` committed steps of a
   job of N nodes x ``--workers`` ranks (a commit marker per node, a manifest and a data
   object per rank, as the agents write them). One plan is timed, and its requests counted as
   S3 bills them: a LIST per 1,000 keys, a GET per marker. The storm: every rank planning for
   itself (the restore before: N x W plans at once) against rank 0 planning and sending the
   listing to the others (now). Printed: time to a plan, requests per plan, requests of the
   storm, and how long the storm takes at S3's documented 5,500 GET/s per prefix.
2. A real storm against S3 (moto's server on 127.0.0.1, as the tests use): ``--s3-nodes``
   nodes x W ranks, every rank planning at once from its own thread, then rank 0 alone; time
   to the last plan and the requests sent.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = "storm"
S3_GETS_PER_S = 5500  # per prefix: AWS's S3 performance guidelines


class Counter:
    """Requests of the tiers of this process, as S3 would count them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lists = self.gets = 0

    def install(self) -> None:
        from flashckpt.storage_tiers.posix import PosixTier
        from flashckpt.storage_tiers.s3 import S3Tier

        counter = self
        for cls in (PosixTier, S3Tier):
            real_list, real_get = cls.list, cls.get

            async def listed(self, prefix, _real=real_list):
                keys = await _real(self, prefix)
                with counter.lock:
                    counter.lists += max(1, math.ceil(len(keys) / 1000))
                return keys

            async def got(self, key, start=0, end=None, _real=real_get):
                with counter.lock:
                    counter.gets += 1
                return await _real(self, key, start, end)

            cls.list, cls.get = listed, got

    def take(self) -> int:
        with self.lock:
            n, self.lists, self.gets = self.lists + self.gets, 0, 0
        return n


def objects(nodes: int, workers: int, steps: int) -> dict[str, bytes]:
    """The keys a job of ``nodes`` x ``workers`` ranks has after ``steps`` commits."""
    from flashckpt.format import layout

    world = nodes * workers
    out = {}
    for k in range(steps):
        step = 100 * (k + 1)
        for n in range(nodes):
            ranks = tuple(range(n * workers, (n + 1) * workers))
            out[layout.commit_key(JOB, step, f"n{n}")] = layout.CommitMarker(
                f"n{n}", ranks, world
            ).to_json()
            for r in ranks:
                out[layout.manifest_key(JOB, step, r)] = b"{}"
                out[layout.data_key(JOB, step, r)] = b""
    return out


def write_dir(root: Path, objs: dict[str, bytes]) -> None:
    made = set()
    for key, raw in objs.items():
        path = root / key
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        path.write_bytes(raw)


def plan(url: str, rank: int) -> int:
    from flashckpt.restore.sources import TierSource

    return len(TierSource(url, JOB, rank, verify=True).snapshots())


def sweep(args, counter: Counter) -> None:
    print(f"1. shared directory tier, {args.workers} ranks a node, {args.steps} steps held")
    print(f"{'N':>5} {'keys':>8} {'plan s':>7} {'requests':>9} | {'storm before: requests':>23} "
          f"{'at 5,500/s':>11} | {'now: requests':>13} {'to a plan':>10}")  # fmt: skip
    for n in [int(x) for x in args.nodes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="flashckpt-storm-") as tmp:
            objs = objects(n, args.workers, args.steps)
            write_dir(Path(tmp), objs)
            url = f"pfs://{tmp}"
            counter.take()
            t = time.perf_counter()
            held = plan(url, 0)
            took = time.perf_counter() - t
            per = counter.take()
            assert held == args.steps, held
            ranks = n * args.workers
            print(f"{n:>5} {len(objs):>8} {took:>7.2f} {per:>9} | {per * ranks:>23,} "
                  f"{per * ranks / S3_GETS_PER_S:>9.0f} s | {per:>13} {took:>9.2f}s")  # fmt: skip


def s3_storm(args, counter: Counter) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from s3fixture import MotoS3

    server = MotoS3()
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
    bucket = f"storm-{uuid.uuid4().hex[:8]}"
    client = server.client()
    client.create_bucket(Bucket=bucket)
    objs = objects(args.s3_nodes, args.workers, args.steps)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=f"ckpt/{kv[0]}",
                                                   Body=kv[1]), objs.items()))  # fmt: skip
    url = f"s3://{bucket}/ckpt?endpoint_url={server.endpoint_url}"
    ranks = args.s3_nodes * args.workers
    print(f"\n2. S3 (moto on 127.0.0.1): {args.s3_nodes} nodes x {args.workers} ranks, "
          f"{len(objs)} objects")  # fmt: skip
    counter.take()
    t = time.perf_counter()
    with ThreadPoolExecutor(ranks) as pool:
        held = list(pool.map(lambda r: plan(url, r), range(ranks)))
    every = time.perf_counter() - t
    storm = counter.take()
    t = time.perf_counter()
    one = plan(url, 0)
    alone = time.perf_counter() - t
    single = counter.take()
    assert set(held) == {args.steps} and one == args.steps, (held, one)
    print(f"   every rank plans at once (before): last plan after {every:.2f}s, "
          f"{storm} requests ({storm / every:.0f}/s)")  # fmt: skip
    print(f"   rank 0 plans, the others receive it (now): {alone:.2f}s, {single} requests "
          f"({every / alone:.1f}x sooner, {storm / single:.0f}x fewer requests)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="256,1024,4096")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="committed steps the tier holds")
    ap.add_argument("--s3-nodes", type=int, default=16, help="nodes of the real S3 storm (0: none)")
    args = ap.parse_args()
    counter = Counter()
    counter.install()
    sweep(args, counter)
    if args.s3_nodes:
        s3_storm(args, counter)


if __name__ == "__main__":
    main()
