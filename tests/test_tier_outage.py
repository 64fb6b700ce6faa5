"""A tier that fails outlives the trainer: when it comes back, the agent persists the newest
step on its own, within one retry interval (``outage_retry_s``), trainer dead or alive. And
what an agent killed mid-upload leaves is removed once older than the grace period, with the
step directory that held only that, on every tier; committed steps stay untouched."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, S3, wait_for
from flashckpt.storage_tiers.registry import redact
from test_tiers import _unshare_works

from flashckpt import Checkpointer, TierUnavailableError
from flashckpt.faults import timeline
from flashckpt.faults.events import events_path, read_events
from flashckpt.faults.report import summarize
from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier

RETRY_S = 2.0  # outage_retry_s in these tests
FLASHCKPT = Path(sys.executable).parent / "flashckpt"

# A trainer that saves 1 MiB steps to TIER: 0-3 committed, then waits for a line on stdin (the
# outage begins), saves 4-6 and is SIGKILLed.
TRAINER = """
import os, signal, sys, torch
from flashckpt import Checkpointer
tier = sys.argv[1]
ck = Checkpointer(tier, job="outage")
for step in range(4):
    ck.save(step, {"t": torch.full((256 * 1024,), float(step))})
ck.wait(3, tier=tier, timeout=60)
print("committed 3", flush=True)
sys.stdin.readline()
for step in range(4, 7):
    ck.save(step, {"t": torch.full((256 * 1024,), float(step))})
ck.wait(6, timeout=30)  # in shared memory
print("saved 6", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def committed(url: str) -> list[int]:
    return run_with_tier(url, lambda t: tier_io.committed_steps(t, "outage"))


def through_outage(tier: str, cut, restore, env: dict, readable: bool = True) -> float:
    """Run the trainer; ``cut()`` the tier once 0-3 are committed; after the trainer is
    SIGKILLed and the agent has failed a few rounds (the tier, if ``readable`` meanwhile, still
    holds 0-3), ``restore()`` it; the seconds until step 6 is committed."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, tier], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT / "tests")  # fmt: skip
    try:
        assert trainer.stdout.readline().strip() == "committed 3"
        cut()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "saved 6"
        assert trainer.wait(30) == -signal.SIGKILL
        time.sleep(3 * RETRY_S)  # the agent keeps failing, with no trainer left
        if readable:
            assert committed(tier)[-1] == 3
        restore()
        back = time.monotonic()
        wait_for(lambda: committed(tier)[-1] == 6, timeout=60, interval=0.1,
                 what="step 6 to reach the tier after its return")  # fmt: skip
        return time.monotonic() - back
    finally:
        trainer.kill()


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces")
def test_a_full_disk_gets_the_dead_trainers_newest_step_once_space_returns(tmp_path):
    """The whole run is inside a user+mount namespace with a 16 MiB tmpfs as the tier."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "run.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_tier_outage import through_outage\n"
        f"disk = {str(disk)!r}\n"
        f"tier = 'file://' + disk + '/tier?outage_retry_s={RETRY_S}'\n"
        "filler = disk + '/filler'\n"
        "def cut():\n"
        "    with open(filler, 'wb') as f:\n"
        "        try:\n"
        "            while True: f.write(b'x' * (1 << 20))\n"
        "        except OSError: pass\n"
        "print(json.dumps({'caught_up_s': through_outage(tier, cut, lambda: os.unlink(filler),"
        " dict(os.environ))}))\n"
    )
    env = {**os.environ, "FLASHCKPT_SHM_DIR": f"/dev/shm/fc-outage-{os.getpid()}",
           "FLASHCKPT_RUN_DIR": str(tmp_path / "run")}  # fmt: skip
    try:
        out = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=16m tmpfs "{disk}" && '
             'exec "$0" "$1"', sys.executable, str(script)],
            capture_output=True, text=True, env=env, timeout=240, cwd=ROOT,
        )  # fmt: skip
    finally:
        for pid in (tmp_path / "run").glob("*.pid"):
            _kill(pid)
        subprocess.run(["rm", "-rf", env["FLASHCKPT_SHM_DIR"]])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    caught_up = json.loads(out.stdout.strip().splitlines()[-1])["caught_up_s"]
    assert caught_up <= RETRY_S + 2, f"step 6 reached the tier {caught_up:.1f}s after its return"


@S3
def test_an_s3_outage_gets_the_dead_trainers_newest_step_once_s3_returns(
    shm_dir, run_dir, s3_server, s3_bucket
):
    tier = f"s3://{s3_bucket}/run?retry_attempts=1&outage_retry_s={RETRY_S}"
    log = events_path(run_dir, "outage")
    log.touch()  # as flashckpt-run makes it: the agent adds its tiers' commits and failures
    caught_up = through_outage(tier, s3_server.stop, s3_server.restart, dict(os.environ), False)
    assert caught_up <= RETRY_S + 2, f"step 6 reached the tier {caught_up:.1f}s after its return"
    url = redact(tier.partition("?")[0])  # the tier's name in the log: no options
    told = [(e["kind"], e.get("step")) for e in read_events(log) if e["tier"] == url]
    assert told[-2:] == [("tier_failed", None), ("tier_committed", 6)], told
    assert told.count(("tier_failed", None)) == 1  # once an outage, not once a retry
    assert ("tier_committed", 3) in told[:-2], told  # the newest step before the cut
    (lane,) = timeline.build(read_events(log), summarize(read_events(log))).tiers
    assert len(lane.outages) == 1 and lane.commits[-1].step == 6
    restored = {"t": torch.zeros(256 * 1024)}
    with Checkpointer(
        tier, job="outage", shm_dir=shm_dir / "fresh", run_dir=run_dir / "fresh"
    ) as ck:
        assert ck.restore(restored) == 6 and float(restored["t"][0]) == 6.0


def _kill(pidfile: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)


@pytest.fixture(params=["local", "parallel_fs", pytest.param("s3", marks=S3), "fsspec_file",
                        pytest.param("fsspec_s3", marks=S3)])  # fmt: skip
def crashing(request, tmp_path):
    """A tier of each kind, with how to see from outside what a crashed put left there."""
    from test_tiers import TierCase

    if request.param in ("s3", "fsspec_s3"):
        bucket = request.getfixturevalue("s3_bucket")
        server = request.getfixturevalue("s3_server")
        if request.param == "s3":
            return TierCase("s3", f"s3://{bucket}/ckpt", server=server, bucket=bucket)
        url = f"fsspec+s3://{bucket}/ckpt?commit=rename&endpoint_url={server.endpoint_url}"
        return TierCase("fsspec_s3", url, server=server, bucket=bucket, temp_objects=True)
    root = tmp_path / "tier"
    scheme = {"local": "file", "parallel_fs": "pfs", "fsspec_file": "fsspec+file"}[request.param]
    return TierCase(request.param, f"{scheme}://{root}", root=root)


def test_what_a_killed_agent_was_uploading_is_removed_after_the_grace_period(
    shm_dir, run_dir, crashing
):
    url = f"{crashing.url}{'&' if '?' in crashing.url else '?'}temp_grace_s=60"  # the floor
    ck = Checkpointer(url, job="crash", close_timeout=1)
    try:
        ck.save(1, {"t": torch.ones(1024)})
        assert ck.wait(1, tier=url, timeout=60) == 1
        pid = int((run_dir / "crash.pid").read_text())
        # Stopped before the step exists, the agent then runs in short slices and is looked at
        # stopped: killed once its upload holds bytes, never after it ended, however loaded
        # the machine is.
        os.kill(pid, signal.SIGSTOP)
        ck.save(2, {"t": torch.ones(64 << 20)})  # 256 MiB: the agent is killed while it uploads
        stopped_once_it_holds(pid, lambda: any(t.size for t in leftovers_of(url)))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=30,
                 what="the agent to die")  # fmt: skip
        left = crashing.leftovers()
        assert left and tier_io_committed(url) == [1]
        if crashing.root is not None:  # the store dates what the killed agent left 2 h back
            for path in crashing.root.rglob(".tmp-*"):
                os.utime(path, (time.time() - 7200, time.time() - 7200))
        else:  # the store's own records dated back (moto runs in this process)
            crashing.server.date_back(crashing.bucket, 7200)
        gc = subprocess.run([str(FLASHCKPT), "gc", url, "--job", "crash", "--keep-last", "3",
                             "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert gc.returncode == 0, gc.stderr
        doc = json.loads(gc.stdout)
        assert [t["key"] for t in doc["leftovers_removed"]] == [
            "crash/step-000000000002/rank-0/data"
        ]
        assert doc["leftovers_removed"][0]["bytes"] > 0 and doc["removed"] == []
        assert crashing.leftovers() == []  # the space is back
        if crashing.root is not None:  # the step directory that held only the crashed write too
            assert sorted(p.name for p in (crashing.root / "crash").iterdir()) == [
                "step-000000000001"
            ]
        assert tier_io_committed(url) == [1]
        restored = {"t": torch.zeros(1024)}
        with Checkpointer(url, job="crash", shm_dir=shm_dir / "fresh",
                          run_dir=run_dir / "fresh") as fresh:  # fmt: skip
            assert fresh.restore(restored) == 1 and bool((restored["t"] == 1).all())
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(int((run_dir / "crash.pid").read_text()), signal.SIGKILL)  # never left stopped
        ck._agent = None  # its agent is dead: close() has nothing to wait for
        ck.close()


def stopped_once_it_holds(pid: int, holds, timeout: float = 120.0) -> None:
    """Let process ``pid`` run in slices as long as a look at it takes (at least 2 ms),
    stopped (SIGSTOP) between them, until ``holds()`` is true; it is left stopped."""
    deadline = time.monotonic() + timeout
    os.kill(pid, signal.SIGSTOP)
    while True:
        began = time.monotonic()
        if holds():
            return
        assert time.monotonic() < deadline, "the upload held no bytes"
        os.kill(pid, signal.SIGCONT)
        time.sleep(max(0.002, time.monotonic() - began))
        os.kill(pid, signal.SIGSTOP)


def leftovers_of(url: str) -> list:
    return run_with_tier(url, lambda t: t.leftovers("crash/"))


def tier_io_committed(url: str) -> list[int]:
    return run_with_tier(url, lambda t: tier_io.committed_steps(t, "crash"))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


@S3
def test_a_restore_with_nothing_found_refuses_to_start_over_while_a_tier_cannot_be_listed(
    shm_dir, run_dir, s3_server, s3_bucket, monkeypatch
):
    monkeypatch.setenv("FLASHCKPT_LIST_RETRY_S", "1")  # tried again once (0.5 s), then refused
    tier = f"s3://{s3_bucket}/run?retry_attempts=1"
    with Checkpointer(tier, job="blind") as ck:
        ck.save(3, {"t": torch.full((1024,), 3.0)})
        ck.wait(3, tier=tier, timeout=60)
    s3_server.stop()
    restored = {"t": torch.zeros(1024)}
    fresh = {"shm_dir": shm_dir / "fresh", "run_dir": run_dir / "fresh"}
    try:
        # Starting over would train from step 0 and let retention delete step 3 later.
        refused = pytest.raises(TierUnavailableError, match=r"could not be listed .*reachable")
        with Checkpointer(tier, job="blind", **fresh) as ck, refused:
            ck.restore(restored)
    finally:
        s3_server.start()
    with Checkpointer(tier, job="blind", **fresh) as ck:
        assert ck.restore(restored) == 3 and float(restored["t"][0]) == 3.0


@S3
def test_a_tier_that_cannot_be_listed_fails_the_restore_even_when_another_holds_an_older_step(
    shm_dir, run_dir, tmp_path, s3_server, s3_bucket, monkeypatch
):
    monkeypatch.setenv("FLASHCKPT_LIST_RETRY_S", "1")
    nvme, s3 = tmp_path / "nvme", f"s3://{s3_bucket}/run?retry_attempts=1"
    with Checkpointer(f"file://{nvme}", s3, job="older") as ck:
        for step in range(1, 6):
            ck.save(step, {"t": torch.full((1024,), float(step))})
            for tier in ck.tiers:
                ck.wait(step, tier=tier, timeout=60)
    for step in (4, 5):  # the node tier is behind the shared one (lost its disk, or lagging)
        run_with_tier(f"file://{nvme}", lambda t, s=step: t.delete(f"older/step-{s:012d}"))
    s3_server.stop()
    restored = {"t": torch.zeros(1024)}
    fresh = {"shm_dir": shm_dir / "fresh", "run_dir": run_dir / "fresh"}
    try:
        # Restoring step 3 would continue from behind what S3 holds, and a later restore
        # that can list S3 would jump back to step 5, dropping what was trained since.
        refused = pytest.raises(TierUnavailableError, match=r"could not be listed .*reachable")
        with Checkpointer(f"file://{nvme}", s3, job="older", **fresh) as ck, refused:
            ck.restore(restored)
        assert float(restored["t"][0]) == 0.0  # nothing was loaded
        with Checkpointer(f"file://{nvme}", s3, job="older", **fresh) as ck:
            assert ck.restore(restored, step=3) == 3  # a step named is restored as asked
    finally:
        s3_server.start()
    with Checkpointer(f"file://{nvme}", s3, job="older", **fresh) as ck:
        assert ck.restore(restored) == 5 and float(restored["t"][0]) == 5.0


def test_a_commit_marker_gone_after_the_listing_makes_its_step_unavailable_not_the_tier(tmp_path):
    url = f"pfs://{tmp_path / 'pfs'}"
    with Checkpointer(url, job="gone", shm_dir=tmp_path / "shm", run_dir=tmp_path / "run") as ck:
        for step in (1, 2):
            ck.save(step, {"t": torch.full((64,), float(step))})
            ck.wait(step, tier=url, timeout=60)
    (marker,) = (tmp_path / "pfs" / "gone" / "step-000000000002").glob("commit-*.json")

    class DeletedAfterListing:
        """The tier, with step 2's marker removed between the listing and its read (as
        retention on another node, or a store's lagging listing, does)."""

        def __init__(self, tier):
            self.tier = tier

        async def list(self, prefix):
            keys = await self.tier.list(prefix)
            marker.unlink(missing_ok=True)
            return keys

        def __getattr__(self, name):
            return getattr(self.tier, name)

    listing = run_with_tier(url, lambda t: tier_io.list_steps(DeletedAfterListing(t), "gone"))
    assert listing[0, 1].complete
    assert not listing[0, 2].complete and "went away" in listing[0, 2].problems[0]


def test_a_missing_directory_is_an_error_with_create_0_and_named_when_a_job_starts_over(
    tmp_path, caplog
):
    mount = tmp_path / "mnt" / "pfs"  # the mount point's directory is missing: not mounted
    dirs = {"shm_dir": tmp_path / "shm", "run_dir": tmp_path / "run"}
    unmounted = f"pfs://{mount}?create=0"
    refused = pytest.raises(TierUnavailableError, match=r"no directory .*create=0")
    with Checkpointer(unmounted, job="long", **dirs) as ck, refused:
        ck.restore({"t": torch.zeros(4)})
    with pytest.raises(TierUnavailableError, match="create=0"):
        run_with_tier(unmounted, lambda t: t.put("long/x", [memoryview(b"x")], 1))
    assert not mount.exists()  # never made on the node's own disk
    caplog.set_level(logging.WARNING, logger="flashckpt.restore.agreement")
    with Checkpointer(f"pfs://{mount}", job="long", **dirs) as ck:  # create=1, the default
        assert ck.restore({"t": torch.zeros(4)}) is None
    (warning,) = [r.getMessage() for r in caplog.records if "starting over" in r.getMessage()]
    assert f"pfs://{mount}" in warning and "create=0" in warning, warning
