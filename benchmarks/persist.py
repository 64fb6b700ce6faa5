"""Agent persistence throughput against plain writes of the same bytes, in one run.

    python benchmarks/persist.py [--size-mb 1024] [--s3-size-mb 256] [--dir /mnt/nvme/x]

1. local directory: the agent streaming a snapshot from shared memory into a file tier,
   against a plain sequential write + fsync of the same bytes into the same directory;
2. S3 (a local moto server, as the tests use): the agent's S3 tier against s3fs ``put_file``
   of the same bytes to the same server;
3. a CPU training loop saving every step while the agent persists, against the same loop
   without saving.

The agent reports its own time from reading the slot to writing the commit marker
(``GetTierStatus.last_persist_seconds``). Rounds are interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from flashckpt import Checkpointer

ROOT = Path(__file__).resolve().parent.parent


def plain_write(path: Path, buf: memoryview, chunk: int = 8 * 2**20) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i in range(0, len(buf), chunk):
            os.write(fd, buf[i : i + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def agent_persist(ck: Checkpointer, step: int, state: dict, url_prefix: str) -> float:
    """Save ``step``; return the agent's own read-to-commit time for it in ``url_prefix``."""
    ck.save(step, state)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        tier = next(t for t in ck._agent.tier_status() if t.url.startswith(url_prefix))
        if tier.last_error:
            raise SystemExit(f"tier failed: {tier.last_error}")
        if tier.last_committed_step >= step:
            return tier.last_persist_seconds
        time.sleep(0.01)
    raise SystemExit("the agent did not commit in time")


def local(args: argparse.Namespace, nbytes: int) -> float:
    base = Path(tempfile.mkdtemp(prefix="flashckpt-persist-", dir=args.dir))
    state = {"t": torch.empty(nbytes, dtype=torch.uint8).fill_(7)}
    buf = memoryview(state["t"].numpy())
    url = f"file://{base / 'agent'}?keep_last=1"
    plain, agent = [], []
    with Checkpointer(url, job=f"bench-local-{uuid.uuid4().hex[:6]}") as ck:
        ck.restore(state)
        for i in range(args.rounds):
            plain.append(plain_write(base / "plain.bin", buf))
            (base / "plain.bin").unlink()
            agent.append(agent_persist(ck, i, state, "file://"))
    shutil.rmtree(base, ignore_errors=True)
    p, a = statistics.median(plain), statistics.median(agent)
    print(
        f"local dir {args.dir}: plain write+fsync {nbytes / p / 1e9:.2f} GB/s, agent {nbytes / a / 1e9:.2f} GB/s"
    )
    return p / a


def s3(args: argparse.Namespace, nbytes: int) -> float:
    sys.path.insert(0, str(ROOT / "tests"))
    import s3fs
    from s3fixture import MotoS3

    server = MotoS3()
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    os.environ["FSSPEC_S3_ENDPOINT_URL"] = server.endpoint_url
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server.client().create_bucket(Bucket=bucket)
    src = Path(tempfile.mkdtemp(prefix="flashckpt-s3src-", dir="/dev/shm")) / "blob"
    state = {"t": torch.empty(nbytes, dtype=torch.uint8).fill_(3)}
    src.write_bytes(memoryview(state["t"].numpy()))

    async def put_file(i: int) -> float:
        fs = s3fs.S3FileSystem(asynchronous=True, endpoint_url=server.endpoint_url)
        await fs.set_session()
        t0 = time.perf_counter()
        await fs._put_file(str(src), f"{bucket}/plain/{i}")
        dt = time.perf_counter() - t0
        await fs._rm(f"{bucket}/plain/{i}")
        await (await fs.set_session()).close()  # the client s3fs made, closed
        return dt

    url = f"s3://{bucket}/agent?keep_last=1"
    plain, agent = [], []
    try:
        with Checkpointer(url, job=f"bench-s3-{uuid.uuid4().hex[:6]}") as ck:
            ck.restore(state)
            for i in range(args.rounds):
                plain.append(asyncio.run(put_file(i)))
                agent.append(agent_persist(ck, i, state, "s3://"))
    finally:
        server.stop()
        shutil.rmtree(src.parent, ignore_errors=True)
    p, a = statistics.median(plain), statistics.median(agent)
    print(
        f"S3 (moto on 127.0.0.1): s3fs put_file {nbytes / p / 1e6:.0f} MB/s, agent {nbytes / a / 1e6:.0f} MB/s"
    )
    return p / a


def training(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt}

    def loop(ck: Checkpointer | None, steps: int) -> float:
        t0 = time.perf_counter()
        for step in range(steps):
            x = torch.randn(64, 1024)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if ck is not None:
                ck.save(step, state)
        return time.perf_counter() - t0

    base = Path(tempfile.mkdtemp(prefix="flashckpt-train-", dir=args.dir))
    loop(None, 3)  # warm-up: optimizer state exists
    with Checkpointer(
        f"file://{base}?keep_last=2", job=f"bench-train-{uuid.uuid4().hex[:6]}"
    ) as ck:
        ck.restore(state)
        plain, saving = [], []
        for _ in range(args.rounds):
            plain.append(loop(None, args.steps))
            saving.append(loop(ck, args.steps))
        committed = ck._agent.tier_status()[0].snapshots_persisted
    shutil.rmtree(base, ignore_errors=True)
    p, s = statistics.median(plain), statistics.median(saving)
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    print(f"training loop ({mb:.0f} MiB state, {args.steps} steps): {p / args.steps * 1e3:.1f} ms/step without saving, "
          f"{s / args.steps * 1e3:.1f} ms/step saving every step ({committed} steps committed to disk meanwhile)")  # fmt: skip
    return s / p


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--s3-size-mb", type=int, default=256)
    p.add_argument(
        "--dir",
        default=tempfile.gettempdir(),
        help="directory for the local tier and the plain writes",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    os.environ.setdefault("FLASHCKPT_SHM_DIR", f"/dev/shm/flashckpt-bench-{uuid.uuid4().hex[:8]}")
    os.environ.setdefault("FLASHCKPT_RUN_DIR", tempfile.mkdtemp(prefix="fc-bench-run-"))
    r_local = local(args, args.size_mb * 2**20)
    r_s3 = s3(args, args.s3_size_mb * 2**20)
    r_train = training(args)
    print(
        f"RESULT agent/plain_write={r_local:.2f} (target >= 0.80) agent/s3fs_put_file={r_s3:.2f} "
        f"(target >= 0.90) training_with_saving/without={r_train:.2f}"
    )


if __name__ == "__main__":
    main()
