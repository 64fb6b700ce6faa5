"""Persistence never stops silently: across trainer restarts, job-size changes, failing tiers
and rollbacks, every step a trainer saves after a restore reaches the tiers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from conftest import run_python, wait_for

from flashckpt import Checkpointer
from flashckpt.faults.agent_client import AgentClient
from flashckpt.format import tier_io
from flashckpt.restore.sources import run_with_tier
from flashckpt.snapshot.slots import closed_marker_path, slot_path


def committed(url: str, job: str) -> list[int]:
    return run_with_tier(url, lambda t: tier_io.committed_steps(t, job))


def agent_pid(run_dir: Path, job: str) -> int:
    path = run_dir / f"{job}.pid"
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), what="agent pid"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of this test process counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][:1] != "Z"


def restore_fresh(url: str, job: str, tmp_path: Path, n: int = 1000) -> list[str]:
    """Restore ``job`` from ``url`` alone in a new process with empty shared memory."""
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        f"s = {{'t': torch.zeros({n})}}\n"
        f"ck = Checkpointer({url!r}, job={job!r}, shm_dir={str(tmp_path / 'shm-fresh')!r}, "
        f"run_dir={str(tmp_path / 'run-fresh')!r})\n"
        "print(ck.restore(s), float(s['t'][0])); ck.close()\n"
    )
    return out.stdout.split()


def test_a_restarted_trainer_keeps_its_slots_despite_an_earlier_trainer_s_closed_marker(
    shm_dir, run_dir, tmp_path
):
    url = f"file://{tmp_path / 'nvme'}"
    first = Checkpointer(url, job="marker", close_timeout=2)
    for step in range(3):
        first.save(step, {"t": torch.full((1000,), float(step))})
    first.wait(2, tier=url, timeout=60)
    os.kill(agent_pid(run_dir, "marker"), signal.SIGKILL)  # the agent is gone when it closes
    first.save(3, {"t": torch.full((1000,), 3.0)})
    first.close()
    assert closed_marker_path(shm_dir, "marker", 0).exists()  # left for an agent to act on

    second = Checkpointer(url, job="marker", close_timeout=60)
    state = {"t": torch.zeros(1000)}
    assert second.restore(state) == 3 and float(state["t"][0]) == 3.0  # from memory
    for step in range(4, 9):
        second.save(step, {"t": torch.full((1000,), float(step))})
        time.sleep(0.1)
    # The new agent commits step 3 and later: the old marker must not free the new slots.
    assert second.wait(8, tier=url, timeout=60) == 8
    assert slot_path(shm_dir, "marker", 0, 0).exists()
    started = time.monotonic()
    second.close()
    assert time.monotonic() - started < 30
    assert restore_fresh(url, "marker", tmp_path) == ["8", "8.0"]


def test_a_job_restarted_with_fewer_local_ranks_persists_and_reclaims_the_stale_rank(
    shm_dir, run_dir, tmp_path
):
    url = f"file://{tmp_path / 'nvme'}"
    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    # The earlier run: two local ranks; rank 1 dies without closing and leaves its slots.
    for rank in (0, 1):
        run_python(
            "import os, torch; from flashckpt import Checkpointer\n"
            f"ck = Checkpointer({url!r}, job='shrink', rank={rank})\n"
            f"for step in range(3): ck.save(step, {{'t': torch.full((1000,), 100.0 + {rank})}})\n"
            + ("ck.close()\n" if rank == 0 else "os._exit(0)\n"),
            env={**two, "FLASHCKPT_CLOSE_TIMEOUT": "2"},
        )
    assert slot_path(shm_dir, "shrink", 1, 0).exists()
    # The restarted job runs one rank here.
    out = run_python(
        "import time, torch; from flashckpt import Checkpointer\n"
        f"ck = Checkpointer({url!r}, job='shrink', rank=0, close_timeout=60)\n"
        "for step in range(10, 14):\n"
        "    ck.save(step, {'t': torch.full((1000,), float(step))}); time.sleep(0.05)\n"
        f"print(ck.wait(13, tier={url!r}, timeout=60))\n"
        "t0 = time.monotonic(); ck.close(); print(round(time.monotonic() - t0))\n",
        env={"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
    )
    waited, closing = out.stdout.split()
    assert waited == "13" and int(closing) < 10
    assert committed(url, "shrink")[-1] == 13
    markers = run_with_tier(url, lambda t: tier_io.list_steps(t, "shrink"))
    assert markers[0, 13].ranks == frozenset({0}) and markers[0, 13].world_size == 1
    # The stale rank's slots are reported and removed.
    wait_for(lambda: not slot_path(shm_dir, "shrink", 1, 0).exists(), what="rank 1 reclaimed")
    log = (run_dir / "shrink.log").read_text()
    assert "rank 1's slots" in log and "belong to no live trainer" in log


def test_a_failing_tier_keeps_slots_and_agent_until_it_catches_up(
    shm_dir, run_dir, tmp_path, s3_server, s3_bucket
):
    disk = f"file://{tmp_path / 'nvme'}"
    s3 = f"s3://{s3_bucket}/run?retry_attempts=1&retry_backoff_s=0.05"
    s3_server.stop()
    try:
        run_python(
            "import torch; from flashckpt import Checkpointer\n"
            f"ck = Checkpointer({disk!r}, {s3!r}, job='outage', close_timeout=3)\n"
            "import time\n"
            "for step in range(1, 4):\n"  # paced: the failing tier's round holds a slot briefly
            "    ck.save(step, {'t': torch.full((1000,), float(step))}); time.sleep(0.3)\n"
            f"ck.wait(3, tier={disk!r}, timeout=60)\n"
            "ck.close()\n",
            env={"FLASHCKPT_EXIT_WHEN_IDLE": "1"},
        )
        pid = agent_pid(run_dir, "outage")
        assert committed(disk, "outage")[-1] == 3
        time.sleep(4)  # several idle-exit periods with no trainer alive
        # S3 does not have step 3: its slots stay, and so does the agent that retries it.
        assert alive(pid), "the agent exited while a tier still lacked the last step"
        assert (
            slot_path(shm_dir, "outage", 0, 0).exists()
            or slot_path(shm_dir, "outage", 0, 1).exists()
        )
    finally:
        s3_server.restart()
    wait_for(lambda: committed(s3, "outage")[-1:] == [3], timeout=90, what="S3 to catch up")
    wait_for(lambda: not (shm_dir / "outage").exists() or not any(
        (shm_dir / "outage").glob("rank-0.slot-*")
    ), what="slots freed once every tier has the step")  # fmt: skip
    wait_for(lambda: not alive(pid), timeout=30, what="the agent to exit once idle")
    assert restore_fresh(s3, "outage", tmp_path) == ["3", "3.0"]


def test_agent_client_spawn_honours_exit_when_idle(shm_dir, run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_EXIT_WHEN_IDLE", "0.5")
    client = AgentClient.connect("quick", run_dir, shm_dir)
    pid = agent_pid(run_dir, "quick")
    client.close()
    wait_for(lambda: not alive(pid), timeout=30, what="an idle agent to exit")


def test_closing_a_checkpointer_that_only_waited_keeps_the_snapshot(shm_dir, run_dir):
    # A trainer dies without close(); another process of the job waits for its snapshot and
    # closes. The snapshot is not that process's to free: a restart still finds it in memory.
    run_python(
        "import os, torch; from flashckpt import Checkpointer\n"
        "ck = Checkpointer(job='watch')\n"
        "ck.save(3, {'t': torch.full((1000,), 3.0)}); os._exit(0)\n"
    )
    watcher = Checkpointer(job="watch")
    assert watcher.wait(timeout=10) == 3
    watcher.close()
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        "s = {'t': torch.zeros(1000)}\n"
        "ck = Checkpointer(job='watch'); print(ck.restore(s), float(s['t'][0])); ck.close()\n"
    )
    assert out.stdout.split() == ["3", "3.0"]
