"""The node agent for real: its own process, its unix socket, real tiers, real faults."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import METRICS, ROOT, run_python, wait_for

from flashckpt import Checkpointer
from flashckpt.format import layout, tier_io
from flashckpt.pidfile import holder
from flashckpt.restore.sources import TierSource, run_with_tier


def committed(url: str, job: str) -> list[int]:
    return run_with_tier(url, lambda t: tier_io.committed_steps(t, job))


def agent_pid(run_dir: Path, job: str) -> int:
    return int(
        wait_for(
            lambda: (
                (run_dir / f"{job}.pid").exists() and (run_dir / f"{job}.pid").read_text().strip()
            ),
            what="agent pid",
        )
    )


def test_two_lines_persist_to_disk_and_restore_after_memory_is_lost(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 0}
    with Checkpointer(url, job="e2e") as ck:
        assert ck.restore(state) is None
        for step in range(5):
            state["w"].add_(1)
            state["step"] = step
            ck.save(step, state)
        assert ck.wait(tier=url, timeout=60) == 4
    # close() returned after the tier committed step 4 and freed the shared memory
    assert not (shm_dir / "e2e").exists()
    assert committed(url, "e2e")[-1] == 4
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        f"s = {{'w': torch.zeros(1000), 'step': None}}\n"
        f"print(Checkpointer({url!r}, job='e2e').restore(s), s['step'], float(s['w'][0]))\n"
    )
    assert out.stdout.split() == ["4", "4", "5.0"]


def test_trainer_sigkilled_right_after_save_still_gets_persisted(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    code = (
        "import os, signal, torch; from flashckpt import Checkpointer\n"
        f"ck = Checkpointer({url!r}, job='kill')\n"
        "t = torch.ones(256, 1024)\n"
        "for step in range(8):\n    ck.save(step, {'t': t * step})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    wait_for(lambda: committed(url, "kill")[-1:] == [7], what="step 7 committed by the agent")


def test_agent_sigkilled_mid_upload_commits_nothing_partial_and_a_new_agent_catches_up(
    shm_dir, run_dir, tmp_path
):
    root = tmp_path / "pfs"
    url = f"pfs://{root}"
    job = "agentkill"
    # A trainer that keeps saving ~192 MiB snapshots; the agent needs a while for each.
    code = (
        "import sys, time, torch; from flashckpt import Checkpointer\n"
        f"ck = Checkpointer({url!r}, job={job!r})\n"
        "t = torch.zeros(48 * 2**20)\n"
        "step = 0\n"
        "while True:\n"
        "    t.fill_(step); ck.save(step, {'t': t}); print(step, flush=True); step += 1; time.sleep(0.05)\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", code], env=os.environ, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = agent_pid(run_dir, job)
        wait_for(
            lambda: list(root.rglob(".tmp-*")),
            timeout=60,
            interval=0.01,
            what="an upload in flight",
        )
        os.kill(pid, signal.SIGKILL)
        before = committed(url, job)
        # Nothing partial is listed: every committed step has every rank's manifest and data.
        for step in before:
            assert (root / layout.manifest_key(job, step, 0)).exists()
        # Training goes on without its agent.
        progress = int(trainer.stdout.readline())
        wait_for(lambda: int(trainer.stdout.readline()) > progress + 3, what="training to go on")
        assert trainer.poll() is None
        # A restarted agent persists what is in shared memory.
        agent = subprocess.Popen(
            [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", job, "--tier", url],
            env=os.environ, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            newest_before = max(before, default=-1)
            wait_for(
                lambda: max(committed(url, job), default=-1) > newest_before,
                what="the new agent to commit",
            )
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=120)
    finally:
        trainer.kill()
        trainer.wait()
        # Whichever agent holds the job now (the test's, or one the trainer started) finishes
        # what it holds before the tier is read.
        if (last := holder(run_dir / f"{job}.pid")) is not None:
            os.kill(last, signal.SIGTERM)
            wait_for(lambda: holder(run_dir / f"{job}.pid") is None, what="the agent to exit")
    steps = committed(url, job)
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        f"s = {{'t': torch.empty(48 * 2**20)}}\n"
        f"ck = Checkpointer({url!r}, job={job!r}, shm_dir={str(tmp_path / 'shm2')!r})\n"
        f"step = ck.restore(s); print(step, bool((s['t'] == step).all()))\n",
        env={"FLASHCKPT_RUN_DIR": str(run_dir / "second")},
    )
    assert out.stdout.split() == [str(steps[-1]), "True"]


def test_corrupt_chunk_in_one_tier_falls_back_to_the_next(shm_dir, run_dir, tmp_path):
    fast, slow = f"file://{tmp_path / 'nvme'}", f"pfs://{tmp_path / 'pfs'}"
    with Checkpointer(fast, slow, job="crc") as ck:
        ck.save(3, {"t": torch.arange(100_000, dtype=torch.int64)})
        ck.wait(3, tier=fast, timeout=60)
        ck.wait(3, tier=slow, timeout=60)
    data = tmp_path / "nvme" / layout.data_key("crc", 3, 0)
    raw = bytearray(data.read_bytes())
    raw[12345] ^= 0x40
    data.write_bytes(bytes(raw))
    out = run_python(
        "import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
        "from flashckpt import Checkpointer\n"
        "s = {'t': torch.zeros(100_000, dtype=torch.int64)}\n"
        f"print(Checkpointer({fast!r}, {slow!r}, job='crc').restore(s), bool((s['t'] == torch.arange(100_000)).all()))\n"
    )
    assert out.stdout.split() == ["3", "True"]
    assert "crc32c" in out.stderr and "nvme" in out.stderr


def test_ranks_saving_faster_than_the_tier_writes_still_get_steps_committed(
    shm_dir, run_dir, s3_bucket, monkeypatch
):
    # Two local ranks overwrite their older slot every few milliseconds while one rank's upload
    # takes far longer: the agent must hold every rank's copy of its step for the whole round,
    # or the later ranks' copies are gone before it reaches them and nothing ever commits.
    monkeypatch.setenv("WORLD_SIZE", "2")  # a step commits only with both ranks in
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    url = f"s3://{s3_bucket}/fast"  # tenths of a second per rank, against 10 ms per save
    states = [{"t": torch.full((4 * 2**20,), r, dtype=torch.float32)} for r in range(2)]  # 16 MiB
    cks = [Checkpointer(url, job="fast", rank=r, close_timeout=120) for r in range(2)]
    try:
        step, deadline = 0, time.monotonic() + 60
        while time.monotonic() < deadline:
            for ck, state in zip(cks, states, strict=True):
                ck.save(step, state)
            step += 1
            if step % 10 == 0 and cks[0]._agent.tier_status()[0].last_committed_step >= 0:
                break  # (asked of the agent: listing the bucket would pause the savers)
            time.sleep(0.005)
        done = committed(url, "fast")
        assert done, f"no step committed while the ranks saved {step} steps in 60 s"
    finally:
        for ck in cks:
            ck.close()
    out = {"t": torch.zeros(4 * 2**20)}
    assert TierSource(url, "fast", 1, verify=True).load(out, (0, done[-1]), allow_pickle=False)
    assert bool((out["t"] == 1).all())


def test_a_rank_closing_before_the_others_registered_waits_for_their_copies(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    """Rank 1 saves and closes before rank 0 has even registered (a slow start): the step
    is stored once rank 0's copy is there, with both ranks, not with rank 1 alone (after
    which rank 0's copy would count as stored and never go out)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    url = f"file://{tmp_path / 'nvme'}"
    ck1 = Checkpointer(url, job="slow-start", rank=1, close_timeout=60)
    ck1.save(1, {"t": torch.full((1000,), 11)})
    first = threading.Thread(target=ck1.close)
    first.start()
    time.sleep(1.5)  # several agent rounds: rank 1 is closing, rank 0 not registered
    assert first.is_alive() and committed(url, "slow-start") == []
    with Checkpointer(url, job="slow-start", rank=0, close_timeout=60) as ck0:
        ck0.save(1, {"t": torch.full((1000,), 10)})
    first.join(timeout=60)
    assert not first.is_alive() and committed(url, "slow-start") == [1]
    for r in range(2):
        out = {"t": torch.zeros(1000, dtype=torch.int64)}
        assert TierSource(url, "slow-start", r, verify=True).load(out, (0, 1), allow_pickle=False)
        assert bool((out["t"] == 10 + r).all())


def test_a_rank_closing_first_does_not_get_its_last_step_stored_without_the_others(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    # Rank 0 finishes first and closes; rank 1 saves the same last step a moment later. The
    # agent must wait for rank 1's copy rather than store the step with rank 0 alone, after
    # which rank 1's copy would never go out and the last step would never be complete.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    url = f"file://{tmp_path / 'nvme'}"
    cks = [Checkpointer(url, job="late", rank=r, close_timeout=60) for r in range(2)]
    for step in range(3):
        for r, ck in enumerate(cks):
            ck.save(step, {"t": torch.full((1000,), 10 * step + r)})
    cks[0].save(3, {"t": torch.full((1000,), 30)})
    first = threading.Thread(target=cks[0].close)
    first.start()
    time.sleep(1.5)  # rank 0 is in close(), waiting for its last step to be stored
    assert first.is_alive()
    cks[1].save(3, {"t": torch.full((1000,), 31)})
    cks[1].close()
    first.join(timeout=60)
    assert not first.is_alive()
    assert committed(url, "late")[-1] == 3
    for r in range(2):
        out = {"t": torch.zeros(1000, dtype=torch.int64)}
        assert TierSource(url, "late", r, verify=True).load(out, (0, 3), allow_pickle=False)
        assert bool((out["t"] == 30 + r).all())


def test_an_early_rank_does_not_get_a_step_stored_before_the_node_s_ranks_registered(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    url = f"file://{tmp_path / 'nvme'}"
    with Checkpointer(url, job="early", rank=0, close_timeout=60) as ck0:
        ck0.save(0, {"t": torch.zeros(10)})
        time.sleep(1.5)  # several agent rounds: rank 1 has not registered yet
        status = ck0._agent.tier_status()[0]
        assert status.last_committed_step == -1 and status.snapshots_persisted == 0
        with Checkpointer(url, job="early", rank=1, close_timeout=60) as ck1:
            ck1.save(0, {"t": torch.ones(10)})
            assert ck1.wait(0, tier=url, timeout=60) == 0
    assert committed(url, "early") == [0]


def test_retention_and_throttle(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}?keep_last=2&keep_every=4"
    with Checkpointer(url, job="keep") as ck:
        for step in range(10):
            ck.save(step, {"t": torch.full((10,), step)})
            ck.wait(step, tier=url, timeout=60)
    assert committed(url, "keep") == [0, 4, 8, 9]
    thr = f"file://{tmp_path / 'thr'}?every_steps=5"
    with Checkpointer(thr, job="thr") as ck:
        for step in range(3, 15):  # a resumed job: its first step is off the grid
            ck.save(step, {"t": torch.full((10,), step)})
            time.sleep(0.1)  # paced, so that the throttle (not the agent's speed) decides
    steps = committed(thr, "thr")
    # Steps on the grid of 5 (every node of a job picks the same ones), and the last: close()
    # flushes the final step through the throttle.
    assert steps[-1] == 14 and len(steps) >= 2, steps
    assert all(s % 5 == 0 for s in steps[:-1]), steps


@METRICS
def test_second_agent_for_a_job_refuses_and_metrics_are_served(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    cmd = [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", "dup", "--tier", url]
    first = subprocess.Popen(
        [*cmd, "--metrics-port", "0", "--log-format", "json"],
        env=os.environ,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        agent_pid(run_dir, "dup")
        second = subprocess.run(cmd, env=os.environ, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "already runs on this node" in second.stderr
        with Checkpointer(url, job="dup") as ck:
            ck.save(1, {"t": torch.ones(1000)})
            ck.wait(1, tier=url, timeout=60)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
        logs = [
            json.loads(line) for line in first.stderr.read().splitlines() if line.startswith("{")
        ]
        port = next(
            int(m["msg"].split("metrics ")[-1].rstrip(")"))
            for m in logs
            if "serving job" in m["msg"]
        )
        assert any("committed step 1" in m["msg"] for m in logs)
        assert port > 0
    finally:
        first.kill()


@METRICS
def test_metrics_endpoint(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", "met", "--tier", url, "--metrics-port", "0"],
        env=os.environ, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = wait_for(
            lambda: next((x for x in iter(agent.stderr.readline, "") if "serving job" in x), None),
            what="agent start",
        )
        port = int(line.rsplit("metrics ", 1)[1].rstrip(")\n"))
        with Checkpointer(url, job="met") as ck:
            ck.save(1, {"t": torch.ones(4096)})
            ck.wait(1, tier=url, timeout=60)
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
        assert 'flashckpt_persisted_snapshots_total{tier="' in body
        assert "flashckpt_tier_lag_steps" in body
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)


def test_disk_full_fails_that_tier_and_keeps_older_steps(tmp_path):
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-rm", "true"]).returncode != 0
    ):
        pytest.skip("needs unshare -rm to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full.py"
    script.write_text(
        "import json, os, torch\n"
        "from flashckpt import Checkpointer\n"
        f"url = 'file://{disk}'\n"
        "ck = Checkpointer(url, job='full', close_timeout=20)\n"
        "ck.save(1, {'t': torch.ones(256 * 1024)})\n"  # 1 MiB: fits
        "ck.wait(1, tier=url, timeout=60)\n"
        "ck.save(2, {'t': torch.ones(2 * 1024 * 1024)})\n"  # 8 MiB: does not
        "import time\n"
        "for _ in range(300):\n"
        "    st = ck._agent.tier_status()[0]\n"
        "    if st.last_error: break\n"
        "    time.sleep(0.1)\n"
        "print(json.dumps({'error': st.last_error, 'committed': st.last_committed_step}))\n"
        "ck.close()\n"
        "s = {'t': torch.zeros(256 * 1024)}\n"
        f"ck2 = Checkpointer(url, job='full', shm_dir='{tmp_path}/shm2', run_dir='{tmp_path}/run2')\n"
        "print(json.dumps({'restored': ck2.restore(s), 'ok': bool((s['t'] == 1).all())}))\n"
    )
    env = {
        **os.environ,
        "FLASHCKPT_SHM_DIR": f"/dev/shm/fc-full-{os.getpid()}",
        "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
        "FLASHCKPT_GIVE_UP_AFTER": "1",  # its agents stop retrying the full disk and exit
        "FLASHCKPT_EXIT_WHEN_IDLE": "1",
    }
    try:
        out = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "{disk}" && exec "$0" "$1"', sys.executable, str(script)],
            capture_output=True, text=True, env=env, timeout=240, cwd=ROOT,
        )  # fmt: skip
    finally:
        shutil.rmtree(env["FLASHCKPT_SHM_DIR"], ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{"))
    assert "full" in first["error"] and first["committed"] == 1
    assert second == {"restored": 1, "ok": True}


def test_s3_outage_fails_only_that_tier_and_it_catches_up(
    shm_dir, run_dir, tmp_path, s3_server, s3_bucket
):
    disk = f"file://{tmp_path / 'nvme'}"
    s3 = f"s3://{s3_bucket}/run?retry_attempts=2&retry_backoff_s=0.05"
    state = {"t": torch.zeros(3 * 2**20)}  # 12 MiB: a multipart upload
    with Checkpointer(disk, s3, job="s3job", close_timeout=60) as ck:
        state["t"].fill_(1)
        ck.save(1, state)
        assert ck.wait(1, tier=s3, timeout=60) == 1
        s3_server.stop()
        try:
            for step in (2, 3):
                state["t"].fill_(step)
                ck.save(step, state)
            assert ck.wait(3, tier=disk, timeout=60) == 3  # the disk tier keeps going
            failing = wait_for(
                lambda: [
                    t for t in ck._agent.tier_status() if t.url.startswith("s3://") and t.last_error
                ],
                what="the S3 tier to report failing",
            )
            assert failing[0].last_committed_step == 1
            assert "unreachable" in failing[0].last_error or "fail" in failing[0].last_error
        finally:
            s3_server.restart()
        assert (
            ck.wait(3, tier=s3, timeout=90) == 3
        )  # it catches up to the newest, skipping none needed
    assert committed(s3, "s3job")[-1] == 3
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        "s = {'t': torch.zeros(3 * 2**20)}\n"
        f"ck = Checkpointer({s3!r}, job='s3job', shm_dir={str(tmp_path / 'shm2')!r}, run_dir={str(tmp_path / 'run2')!r})\n"
        "print(ck.restore(s), float(s['t'][0]))\n"
    )
    assert out.stdout.split() == ["3", "3.0"]


def test_list_and_fetch_restore_rpcs(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    with Checkpointer(url, job="rpc") as ck:
        for step in (1, 2):
            ck.save(step, {"t": torch.ones(1000) * step})
        ck.wait(2, tier=url, timeout=60)
        pb, stub = ck._agent.pb, ck._agent.stub
        listing = stub.ListSnapshots(pb.ListSnapshotsRequest(job="rpc"), timeout=30)
        assert sorted((m.rank, m.step) for m in listing.memory) == [(0, 1), (0, 2)]
        assert [list(t.committed_steps)[-1] for t in listing.tiers] == [2]
        plan = stub.FetchRestore(pb.FetchRestoreRequest(job="rpc", rank=0), timeout=30)
        assert [(s.url, s.step) for s in plan.sources][:2] == [("memory", 2), ("memory", 1)]
        assert (url, 2) in [(s.url, s.step) for s in plan.sources]
        only = stub.FetchRestore(pb.FetchRestoreRequest(job="rpc", rank=0, step=1), timeout=30)
        assert {s.step for s in only.sources} == {1}
        import grpc

        with pytest.raises(grpc.RpcError) as err:
            stub.SnapshotReady(pb.SnapshotReadyRequest(job="../etc", rank=0, step=1), timeout=30)
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "job name" in err.value.details()
        )


def test_a_failed_round_stops_every_upload_before_the_trainers_get_their_slots_back(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    """Rank 0's upload fails at once while rank 1's is still going: the round ends only once
    rank 1's has stopped too, since its bytes are read from a slot the trainer then reuses."""
    import asyncio
    import errno

    from flashckpt.agent.persist import TierWorker
    from flashckpt.storage_tiers import open_tier

    monkeypatch.setenv("WORLD_SIZE", "2")
    running: set[str] = set()

    class Failing:
        """The directory tier, with rank 0's data failing (disk full) and rank 1's slow."""

        def __init__(self, tier):
            self.tier = tier

        async def put(self, key, chunks, size, exclusive=False):
            if "rank-0/data" in key:
                raise OSError(errno.ENOSPC, "No space left on device")
            running.add(key)
            try:
                await asyncio.sleep(5)
                await self.tier.put(key, chunks, size)
            finally:
                running.discard(key)

        def __getattr__(self, name):
            return getattr(self.tier, name)

    trainers = [Checkpointer(job="round", rank=r, run_dir=run_dir) for r in (0, 1)]
    try:
        for ck in trainers:
            ck.save(1, {"t": torch.ones(1 << 20)})

        async def go() -> bool:
            worker = TierWorker("round", Failing(open_tier(f"file://{tmp_path / 'nvme'}")),
                                shm_dir, "n0")  # fmt: skip
            try:
                with pytest.raises(OSError, match="No space"):
                    await worker.persist_newest()
                return not running  # nothing still reads a slot
            finally:
                await worker.close()

        assert asyncio.run(go()), f"still uploading after the round failed: {running}"
    finally:
        for ck in trainers:
            ck.close()


def test_a_duty_share_rests_the_tier_in_proportion_to_its_last_round(tmp_path):
    """``duty=0.25`` (what peer replicas take): after a round of t seconds the tier rests 3t,
    so storing takes at most a quarter of the agent's time, whatever the state's size; a
    closing trainer's last step goes out at once all the same."""
    from flashckpt.agent.persist import TierWorker
    from flashckpt.storage_tiers import open_tier

    from flashckpt.errors import ConfigError

    worker = TierWorker("duty", open_tier(f"file://{tmp_path / 't'}?duty=0.25"), tmp_path, "n")
    worker.state.last_persist_seconds = 0.2
    worker._last_persist_time = time.monotonic()
    assert worker._throttled((0, 5))  # 0.6 s of rest owed
    worker._last_persist_time -= 0.7
    assert not worker._throttled((0, 5))
    worker._last_persist_time = time.monotonic()
    worker.trainers.final_step = (0, 5)
    assert not worker._throttled((0, 5))
    with pytest.raises(ConfigError, match="share of the time"):
        open_tier(f"file://{tmp_path / 't'}?duty=2")


def test_a_closing_step_waits_a_while_for_ranks_that_never_register(monkeypatch):
    """A node's rank that makes no Checkpointer never registers: the closing trainer's last
    step waits LATE_GRACE_S for it (a slow rank is still starting), then goes out with the
    ranks that registered."""
    from flashckpt.agent import trainers as trainers_module

    t = trainers_module.Trainers()
    t.register(1, os.getpid(), world_size=2, local_world_size=2)
    assert t.required({1}, lambda r: True) is None  # rank 0 may still register
    t.close(1, (0, 5))
    assert t.required({1}, lambda r: True) is None  # closing: still waits, for a while
    clock = time.monotonic() + trainers_module.LATE_GRACE_S + 1
    monkeypatch.setattr(trainers_module.time, "monotonic", lambda: clock)
    assert t.required({1}, lambda r: True) == {1}
