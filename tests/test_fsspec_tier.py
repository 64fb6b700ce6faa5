"""Any fsspec store as a tier, end to end: a job persists to it through the agent with its
retention, a new process restores from it, and the flashckpt command lists, verifies and
exports from it, credentials never shown. Run against the real backends that run here:
fsspec's local filesystem and S3 through s3fs on the moto server (committing uploads, the
default for object stores). The tier contract itself runs in ``test_tiers.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import S3, run_python

from flashckpt import Checkpointer
from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier

FLASHCKPT = Path(sys.executable).parent / "flashckpt"


def committed(url: str, job: str) -> list[int]:
    return run_with_tier(url, lambda t: tier_io.committed_steps(t, job))


@pytest.fixture(params=["fsspec_file", pytest.param("fsspec_s3", marks=S3)])
def url(request, tmp_path) -> str:
    if request.param == "fsspec_file":
        return f"fsspec+file://{tmp_path / 'tier'}"
    bucket = request.getfixturevalue("s3_bucket")
    server = request.getfixturevalue("s3_server")
    # The credentials go in the URL too: nothing may ever print them.
    return (f"fsspec+s3://{bucket}/run?endpoint_url={server.endpoint_url}"
            f"&key={os.environ['AWS_ACCESS_KEY_ID']}&secret={os.environ['AWS_SECRET_ACCESS_KEY']}")  # fmt: skip


def test_a_job_persists_restores_and_is_read_by_the_cli(shm_dir, run_dir, tmp_path, url):
    tier = f"{url}{'&' if '?' in url else '?'}keep_last=2"
    state = {"w": torch.zeros(300_000), "step": 0}
    with Checkpointer(tier, job="fs") as ck:
        for step in range(1, 5):
            state["w"].fill_(step)
            state["step"] = step
            ck.save(step, state)
            ck.wait(step, tier=tier, timeout=60)  # each one committed: retention sees them all
    assert committed(url, "fs") == [3, 4]
    out = run_python(f"""
import torch
from flashckpt import Checkpointer
s = {{"w": torch.zeros(300_000), "step": -1}}
ck = Checkpointer({tier!r}, job="fs", shm_dir={str(tmp_path / "shm2")!r},
                  run_dir={str(tmp_path / "run2")!r})
print(ck.restore(s), float(s["w"][0]), s["step"])
ck.close()
""")
    assert out.stdout.split()[-3:] == ["4", "4.0", "4"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(FLASHCKPT), *args], capture_output=True, text=True,
                              env=os.environ, timeout=120)  # fmt: skip
        for secret in (
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
            os.environ.get("AWS_ACCESS_KEY_ID"),
        ):
            if secret and "key=" in url:
                assert secret not in proc.stdout + proc.stderr
        return proc

    listed = cli("ls", url, "--job", "fs", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [s["step"] for s in json.loads(listed.stdout)["steps"]] == [3, 4]
    verified = cli("verify", url, "--job", "fs")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    exported = cli("export", url, "--job", "fs", "--format", "torch", "--to",
                   str(tmp_path / "out.pt"))  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    assert float(saved["w"][0]) == 4.0 and saved["step"] == 4


def test_a_failed_put_leaves_nothing_under_its_name(url):
    """A put whose chunks fail midway is discarded: no object, no listing entry."""

    async def chunks():
        yield memoryview(b"x" * (9 << 20))
        raise RuntimeError("the producer died")

    async def go(tier) -> list[str]:
        with pytest.raises(RuntimeError, match="producer died"):
            await tier.put("job/step-1/rank-0/data", chunks(), 20 << 20)
        await tier.put("job/step-1/rank-0/manifest.json", [memoryview(b"{}")], 2)
        return await tier.list("job/")

    assert run_with_tier(url, go) == ["job/step-1/rank-0/manifest.json"]


def test_a_put_to_a_local_fsspec_tier_is_fsynced_before_and_after_its_rename(tmp_path, monkeypatch):
    """As the directory tiers do: after a power loss a marker is never durable before the
    data it commits."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    root = tmp_path / "tier"
    url = f"fsspec+file://{root}"  # commit=rename, the default there
    run_with_tier(url, lambda t: t.put("job/step-1/obj", [memoryview(b"x" * 10)], 10))
    final = root / "job" / "step-1" / "obj"
    assert final.read_bytes() == b"x" * 10
    files = [p for p in synced if Path(p).parent == final.parent and Path(p) != final.parent]
    assert files, f"the file was never fsynced: {synced}"
    assert synced.index(str(final.parent)) > synced.index(files[0]), synced  # file, then dir
