"""A writer that should be gone and is not: an agent of an earlier run of a job, stopped or
cut off, that wakes up holding that run's snapshots after a newer run (on other hosts) took
the job over. Its bytes never change what the newer run committed, never count as the
newer run's steps, and never make a restore return anything but the newer run's bytes.

Real processes: the earlier run is a trainer process whose node agent (its own shared memory
and run directory: another host) is stopped with SIGSTOP, the trainer killed with SIGKILL,
and the agent woken with SIGCONT once the newer run has committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROOT, S3, wait_for

from flashckpt import Checkpointer
from flashckpt.errors import ObjectExistsError, StaleWriterError
from flashckpt.faults.agent_client import agent_pid
from flashckpt.format import fence, layout, tier_io
from flashckpt.restore.sources import run_with_tier

N = 4096
JOB = "zombie"

EARLIER_RUN = f"""
import sys, torch
from pathlib import Path
from flashckpt import Checkpointer
from flashckpt.faults.agent_client import agent_pid
url, job, shm, run, first, last = sys.argv[1:7]
ck = Checkpointer(url, job=job, shm_dir=Path(shm), run_dir=Path(run))
print("restored", ck.restore({{"t": torch.zeros({N})}}), flush=True)
if int(first) > 1:
    ck.save(0, {{"t": torch.zeros({N})}})  # a step its agent stores before it is stopped
print("ready", flush=True)
sys.stdin.readline()  # the test stops this host's agent meanwhile
for step in range(int(first), int(last) + 1):
    ck.save(step, {{"t": torch.full(({N},), 1000.0 + step)}})
print("saved", flush=True)
sys.stdin.readline()  # killed here, as a host is lost
"""


_RUN_DIRS: list[Path] = []


def host(tmp_path: Path, name: str) -> dict:
    """The shared memory and run directory of one simulated host (the same ones for the same
    test and name)."""
    run_dir = Path("/tmp") / f"fc-{abs(hash(str(tmp_path))) % 10**8}-{name}"  # a short path
    _RUN_DIRS.append(run_dir)
    return {"shm_dir": tmp_path / f"shm-{name}", "run_dir": run_dir}


@pytest.fixture(autouse=True)
def _stop_agents():
    """The agents the hosts of a test started are stopped after it."""
    yield
    import shutil

    for run_dir in set(_RUN_DIRS):
        for pidfile in run_dir.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
    _RUN_DIRS.clear()


class EarlierRun:
    """A run of the job on host ``name`` whose agent is stopped before it saves ``first`` to
    ``last``; then the trainer is killed, and the agent is left stopped until ``wake()``."""

    def __init__(self, url: str, tmp_path: Path, name: str, first: int, last: int):
        self.where = host(tmp_path, name)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", EARLIER_RUN, url, JOB, str(self.where["shm_dir"]),
             str(self.where["run_dir"]), str(first), str(last)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT / "tests",
        )  # fmt: skip
        self.agent: int | None = None

    def run_and_stop_agent(self, agent_may_persist=None) -> None:
        assert self._line().startswith("restored")
        assert self._line() == "ready"
        self.agent = wait_for(lambda: agent_pid(self.where["run_dir"], JOB), 30, what="agent")
        if agent_may_persist is not None:
            wait_for(agent_may_persist, 60, what="the earlier run's first steps stored")
        os.kill(self.agent, signal.SIGSTOP)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self._line() == "saved"
        self.proc.kill()  # the trainer dies; its READY slots stay for the stopped agent
        self.proc.wait(30)

    def wake(self) -> None:
        os.kill(self.agent, signal.SIGCONT)

    def refused(self) -> bool:
        """Whether the agent said it refused a step (its log; the event log where the
        launcher keeps one)."""
        log = self.where["run_dir"] / f"{JOB}.log"
        return log.exists() and "so this writer is a stale one" in log.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        if self.agent is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.agent, sig)
                except ProcessLookupError:
                    break

    def _line(self) -> str:
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"the earlier run's trainer stopped (rc {self.proc.poll()})")
        return line


def newer_run(url: str, tmp_path: Path, name: str, steps: range, restored: int | None) -> None:
    """A run on host ``name`` that restores (``restored`` expected), saves ``steps`` with
    values 2000 + step and waits until the last is committed in ``url``."""
    with Checkpointer(url, job=JOB, **host(tmp_path, name)) as ck:
        assert ck.restore({"t": torch.zeros(N)}) == restored
        for step in steps:
            ck.save(step, {"t": torch.full((N,), 2000.0 + step)})
        ck.wait(steps[-1], tier=url, timeout=60)


def restore_in(url: str, tmp_path: Path, name: str) -> tuple[int | None, float]:
    state = {"t": torch.zeros(N)}
    with Checkpointer(url, job=JOB, **host(tmp_path, name)) as ck:
        step = ck.restore(state)
    assert torch.all(state["t"] == state["t"][0])
    return step, float(state["t"][0])


def tier_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".tmp-")}  # fmt: skip


def test_a_stale_agent_woken_after_a_newer_run_never_lands_its_steps(tmp_path):
    """The earlier run saves 1-4 with its agent stopped; a newer run on a fresh host finds
    nothing and commits its own 1-4; the earlier run's agent wakes: refused, and a third run
    restores the newer run's step 4."""
    root = tmp_path / "pfs"
    url = f"pfs://{root}"
    earlier = EarlierRun(url, tmp_path, "a", 1, 4)
    try:
        earlier.run_and_stop_agent()
        newer_run(url, tmp_path, "b", range(1, 5), restored=None)
        before = tier_files(root)
        earlier.wake()
        wait_for(earlier.refused, 30, what="the woken agent refused")
        assert tier_files(root) == before  # nothing of the earlier run landed
        assert restore_in(url, tmp_path, "c") == (4, 2004.0)
    finally:
        earlier.close()


def test_a_committed_step_survives_a_stale_agent_with_keep_last_1(tmp_path):
    """One of the earlier run's steps did land, so the newer run restores it and takes the
    next run; the earlier run's agent wakes holding its later steps while the tier keeps
    only the newer run's last step: that step survives, and is what a restore returns."""
    root = tmp_path / "pfs"
    url = f"pfs://{root}?keep_last=1"

    def step_0_stored() -> bool:
        listing = run_with_tier(url, lambda t: tier_io.list_steps(t, JOB))
        return any(c is not None and c.complete for c in listing.values())

    earlier = EarlierRun(url, tmp_path, "a", 2, 3)
    try:
        earlier.run_and_stop_agent(agent_may_persist=step_0_stored)
        newer_run(url, tmp_path, "b", range(1, 4), restored=0)  # saw step 0 alone
        committed = run_with_tier(url, lambda t: tier_io.committed_steps(t, JOB))
        assert committed == [3]
        before = tier_files(root)
        earlier.wake()
        wait_for(earlier.refused, 30, what="the woken agent refused")
        assert tier_files(root) == before
        assert restore_in(url, tmp_path, "c") == (3, 2003.0)
    finally:
        earlier.close()


# -- the fence where writes land, and where they are read -------------------------------------


def stored_step(tier_url: str, tmp_path: Path, run_name: str, step: int, value: float):
    """Save ``step`` once through a Checkpointer of its own (a fresh host), committed in the
    tier; the manifest and data it stored there."""
    with Checkpointer(tier_url, job=JOB, **host(tmp_path, run_name)) as ck:
        ck.restore({"t": torch.zeros(N)})
        ck.save(step, {"t": torch.full((N,), value)})
        ck.wait(step, tier=tier_url, timeout=60)

    async def read(tier):
        return await tier_io.read_rank(tier, JOB, step, 0)

    return run_with_tier(tier_url, read)


def tier_urls(tmp_path, s3_bucket=None) -> list[str]:
    return [f"pfs://{tmp_path / 'pfs'}"] + ([f"s3://{s3_bucket}/ckpt"] if s3_bucket else [])


@pytest.fixture(params=["pfs", pytest.param("s3", marks=S3)])
def shared_url(request, tmp_path):
    if request.param == "pfs":
        return f"pfs://{tmp_path / 'pfs'}"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/ckpt"


def test_a_stale_rewrite_of_a_committed_step_is_refused_and_changes_nothing(shared_url, tmp_path):
    manifest, data = stored_step(shared_url, tmp_path, "a", 1, 1.0)  # run 1
    manifest2, _ = stored_step(shared_url, tmp_path, "b", 2, 2.0)  # run 2, after step 1
    assert (manifest.incarnation, manifest2.incarnation) == (1, 2)

    async def rewrite(tier):
        # Run 1 writes a step above what run 2 saw when it claimed the job: refused before
        # any byte of it is put.
        late = dataclasses.replace(manifest, step=2)
        with pytest.raises(StaleWriterError, match="step 2 of run 1 of job zombie is not written"):
            await tier_io.write_rank(tier, late, memoryview(data.numpy()))
        with pytest.raises(StaleWriterError):
            await tier_io.commit_step(tier, JOB, 2, "stale-node", [0], 1, incarnation=1)
        # A writer that passed its look at the fence before the claim (a stall in between)
        # still only creates: the committed objects are left as they are.
        for key in (layout.data_key(JOB, 2, 0), layout.manifest_key(JOB, 2, 0)):
            with pytest.raises(ObjectExistsError):
                await tier.put(key, [memoryview(b"stale")], 5, exclusive=True)
        return await tier_io.read_rank(tier, JOB, 2, 0, incarnation=2)

    again, got = run_with_tier(shared_url, rewrite)
    assert again == manifest2 and torch.all(got.view(torch.float32) == 2.0)
    assert restore_in(shared_url, tmp_path, "c") == (2, 2.0)


def test_markers_a_stale_writer_landed_never_count(shared_url, tmp_path):
    """A marker of an earlier run naming a step above what the newer run had seen (an agent
    of an older flashckpt, or one that raced the claim) is left out of every listing: the
    step is no step, verify says whose it is, and the restore returns the newer run's."""
    stored_step(shared_url, tmp_path, "a", 3, 3.0)  # run 1: step 3
    stored_step(shared_url, tmp_path, "b", 4, 4.0)  # run 2, which had seen step 3

    async def land(tier):
        # Run 1's step 5, put with no fence at all (as a writer before fencing would).
        m, data = await tier_io.read_rank(tier, JOB, 3, 0)
        m5 = dataclasses.replace(m, step=5, incarnation=1)
        await tier.put(layout.data_key(JOB, 5, 0), [memoryview(data.numpy())], len(data))
        raw = m5.to_json()
        await tier.put(layout.manifest_key(JOB, 5, 0), [memoryview(raw)], len(raw))
        marker = layout.CommitMarker("old-node", (0,), 1, incarnation=1).to_json()
        await tier.put(layout.commit_key(JOB, 5, "old-node"), [memoryview(marker)], len(marker))
        return await tier_io.list_steps(tier, JOB)

    listing = run_with_tier(shared_url, land)
    assert listing[0, 3].complete and listing[0, 4].complete
    five = listing[0, 5]
    assert not five.complete and not five.ranks and five.fenced
    assert "a stale writer's step" in five.fenced[0] and "run 1" in five.fenced[0]
    assert restore_in(shared_url, tmp_path, "c") == (4, 4.0)


def test_each_run_claims_an_epoch_above_every_claim_whatever_it_saw(tmp_path):
    """The epoch never comes from what a restore happens to see: a run that finds nothing
    still takes an epoch above every run that claimed the job before."""
    url = f"pfs://{tmp_path / 'pfs'}"
    for expected in (1, 2, 3):
        with Checkpointer(url, job=JOB, **host(tmp_path, f"h{expected}")) as ck:
            assert ck.restore({"t": torch.zeros(8)}) is None  # never saves: sees nothing
            assert ck._incarnation == expected
    claims = sorted(p.name for p in (tmp_path / "pfs" / JOB / "fence").iterdir())
    assert claims == [f"epoch-{e:012d}.json" for e in (1, 2, 3)]
    assert (tmp_path / "pfs" / JOB / "fence").stat().st_mode & 0o777 == 0o700


def test_claims_racing_for_one_epoch_get_one_each(shared_url):
    """Claimants racing at once (two launches of one job) never share an epoch."""
    got: list[int] = []
    barrier = threading.Barrier(6)

    def claimant() -> None:
        async def go(tier):
            return await fence.claim([tier], JOB, 1, -1, "n")

        barrier.wait()
        got.append(run_with_tier(shared_url, go))

    threads = [threading.Thread(target=claimant) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]


@S3
def test_s3_exclusive_puts_are_conditional_writes_single_and_multipart(s3_bucket):
    url = f"s3://{s3_bucket}/x?part_size={5 * 2**20}"

    async def go(tier):
        big = memoryview(bytes(6 * 2**20))  # a multipart upload
        await tier.put("j/a", [memoryview(b"first")], 5, exclusive=True)
        await tier.put("j/b", [big], len(big), exclusive=True)
        for key, body in (("j/a", memoryview(b"again")), ("j/b", big)):
            with pytest.raises(ObjectExistsError, match="exists already"):
                await tier.put(key, [body], len(body), exclusive=True)
        await tier.put("j/a", [memoryview(b"later")], 5)  # a plain put replaces
        return await tier.get("j/a"), await tier.list("j/")

    assert run_with_tier(url, go) == (b"later", ["j/a", "j/b"])


def test_limits_take_the_least_seen_of_every_newer_claim():
    limits = fence.Limits({2: fence.Claim(2, 10), 3: fence.Claim(3, 4), 5: fence.Claim(5, 20)})
    assert limits.limit(5) == float("inf") and limits.limit(6) == float("inf")
    assert limits.limit(4) == 20 and limits.limit(3) == 20
    assert limits.limit(2) == 4 and limits.limit(1) == 4 and limits.limit(0) == 4
    assert limits.fenced(2, 5) and not limits.fenced(2, 4) and not limits.fenced(3, 20)


def test_a_corrupt_claim_is_untrusted_input_that_fences_nothing(tmp_path, caplog):
    url = f"pfs://{tmp_path / 'pfs'}"

    async def go(tier):
        await tier.put(layout.claim_key(JOB, 7), [memoryview(b'{"epoch": 8}')], 12)
        return await fence.read_claims(tier, JOB, [7]), await fence.newest_epoch(tier, JOB)

    claims, newest = run_with_tier(url, go)
    assert claims == {} and newest == 7
    assert any("the claim is corrupt and fences nothing" in r.getMessage() for r in caplog.records)


def test_claim_names_are_canonical_and_nothing_else_in_the_fence_is_a_claim():
    assert layout.parse_claim("epoch-000000000007.json") == 7
    for name in ("epoch-7.json", "epoch-0000000000007.json", "epoch-00000000000a.json", "x"):
        assert layout.parse_claim(name) is None
    keys = [f"{JOB}/fence/epoch-000000000002.json", f"{JOB}/fence/stray.json"]
    assert layout.claims(JOB, keys) == [2]
    assert layout.strays(JOB, keys) == [f"{JOB}/fence"]


def test_a_tier_where_the_run_cannot_claim_stops_the_restore_saying_what_to_do(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FLASHCKPT_LIST_RETRY_S", "0")
    root = tmp_path / "pfs"
    (root / JOB).mkdir(parents=True)
    (root / JOB / "fence").write_bytes(b"")  # a file where the claims' directory goes
    with (
        Checkpointer(f"pfs://{root}", job=JOB, **host(tmp_path, "a")) as ck,
        pytest.raises(Exception, match="could not claim its epoch") as info,
    ):
        ck.restore({"t": torch.zeros(8)})
    assert "make the tier reachable and writable" in str(info.value)


@S3
def test_a_store_without_conditional_writes_is_told_once_and_looked_at_first(s3_bucket, s3_server,
                                                                            caplog):  # fmt: skip
    """A store that answers If-None-Match with 501 NotImplemented: the put is made again
    after a HEAD, once, and from then on (a warning says how to set it); an object there is
    still never replaced by an exclusive put."""
    from s3fixture import FaultProxy

    with FaultProxy(s3_server.endpoint_url, faults=1, status=501, code="NotImplemented") as proxy:
        url = f"s3://{s3_bucket}/x?endpoint_url={proxy.endpoint_url}&retry_attempts=2"

        async def go(tier):
            await tier.put("j/a", [memoryview(b"first")], 5, exclusive=True)
            assert not tier.conditional
            with pytest.raises(ObjectExistsError):
                await tier.put("j/a", [memoryview(b"again")], 5, exclusive=True)
            return await tier.get("j/a")

        assert run_with_tier(url, go) == b"first"
    assert proxy.faulted == 1
    assert any("has no conditional writes" in r.getMessage() for r in caplog.records)
