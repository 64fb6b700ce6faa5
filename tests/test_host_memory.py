"""The node's host-memory cap (``FLASHCKPT_HOST_MEMORY``): at a cap that fits one slot a rank,
saves go on at the pace of the tier and never pass the cap; without a tier the first step is
kept and the saves after it skip, saying why; a cap too small for one slot fails the save
naming it; a replica past the cap is refused with the reason; ``flashckpt status`` shows the
use against the cap."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.errors import HostMemoryCapError
from flashckpt.snapshot import host_memory
from flashckpt.snapshot.slots import job_dir

FLASHCKPT = Path(sys.executable).parent / "flashckpt"


def state(step: int) -> dict:
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(100) + step}


def one_slot(shm_dir: Path) -> int:
    """A cap that holds one slot of ``state`` (measured with a job of its own), and not two."""
    ckpt = Checkpointer(job="probe", rank=0)
    ckpt.save(0, state(0))
    ckpt.wait(0)
    size = max(p.stat().st_blocks * 512 for p in job_dir(shm_dir, "probe").glob("rank-0.slot-*"))
    ckpt.close()
    return int(size * 1.5)


def slots(shm_dir: Path, job: str) -> list[Path]:
    return sorted(job_dir(shm_dir, job).glob("rank-0.slot-*"))


def test_at_a_cap_of_one_slot_saves_follow_the_tier_and_never_pass_the_cap(
    shm_dir, run_dir, tmp_path, monkeypatch, caplog
):
    cap = one_slot(shm_dir)
    monkeypatch.setenv("FLASHCKPT_HOST_MEMORY", str(cap))
    tier = f"file://{tmp_path / 'nvme'}"
    ckpt = Checkpointer(tier, job="capped", rank=0)
    taken = []
    with caplog.at_level(logging.WARNING):
        for step in range(30):
            skipped = ckpt.skipped
            ckpt.save(step, state(step))
            if ckpt.skipped == skipped:
                taken.append(step)
            assert host_memory.used(shm_dir) <= cap
            time.sleep(0.03)
        status = subprocess.run([str(FLASHCKPT), "status", "--job", "capped", "--json"],
                                capture_output=True, text=True, env=os.environ, timeout=60)  # fmt: skip
    ckpt.close()
    assert len(slots(shm_dir, "capped")) <= 1  # one slot, never a second
    assert "rank 0 keeps 1 slot(s)" in caplog.text and "FLASHCKPT_HOST_MEMORY" in caplog.text
    # The tier takes a step in milliseconds: most saves find the last one stored.
    assert len(taken) >= 10 and taken[0] == 0, taken
    doc = json.loads(status.stdout)
    memory = doc["host_memory"]
    assert memory["cap_bytes"] == cap and 0 < memory["used_bytes"] <= cap, memory
    newest = taken[-1]
    again = state(-1)
    assert Checkpointer(tier, job="capped", rank=0).restore(again) == newest
    assert torch.equal(again["w"], state(newest)["w"])


def test_without_a_tier_a_rank_at_one_slot_keeps_its_first_step_and_says_why(
    shm_dir, run_dir, monkeypatch, caplog
):
    cap = one_slot(shm_dir)
    monkeypatch.setenv("FLASHCKPT_HOST_MEMORY", str(cap))
    with Checkpointer(job="alone", rank=0) as ckpt, caplog.at_level(logging.WARNING):
        for step in range(3):
            ckpt.save(step, state(step))
            ckpt.wait(0)
            time.sleep(0.1)  # the second slot's preparation, refused, is over
        assert ckpt.skipped == 2
        assert "the job names no tier to store it in" in caplog.text
        again = state(-1)
        assert ckpt.restore(again) == 0 and torch.equal(again["w"], state(0)["w"])


def test_a_cap_too_small_for_one_slot_fails_the_save_naming_it(shm_dir, run_dir, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_HOST_MEMORY", "64KiB")
    ckpt = Checkpointer(job="tiny", rank=0)
    with pytest.raises(HostMemoryCapError, match=r"FLASHCKPT_HOST_MEMORY cap of 0\.1 MiB"):
        ckpt.save(0, state(0))
    ckpt.close()
    assert host_memory.used(shm_dir) <= 64 << 10


def test_a_replica_past_the_cap_is_refused_with_the_reason(nodes, monkeypatch):
    from flashckpt.storage_tiers import open_tier

    cluster = nodes(["node0", "node1"])
    cluster.as_node("node0")
    holder = cluster.stores["node1"]
    monkeypatch.setenv("FLASHCKPT_HOST_MEMORY", str(host_memory.used(holder.shm_dir) + 4096))
    tier = open_tier("peer://auto")
    with pytest.raises(OSError, match="FLASHCKPT_HOST_MEMORY cap of .*no room for") as err:
        asyncio.run(tier.put("pj/big", [memoryview(b"y" * 8192)], 8192))
    assert "node node1 holds" in str(err.value)
    assert holder.refused == 1
    asyncio.run(open_tier("peer://auto").put("pj/small", [memoryview(b"y" * 100)], 100))


RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
from flashckpt import Checkpointer
sys.path.insert(0, {tests!r})
from test_host_memory import state
ckpt = Checkpointer(job="two", rank=int(os.environ["RANK"]))
for step in range(4):
    ckpt.save(step, state(step))
    time.sleep(0.1)  # the slots after the first are made in the background meanwhile
Path(os.environ["SAVED"]).touch()
while not Path(os.environ["LEAVE"]).exists():
    time.sleep(0.05)
print("skipped", ckpt.skipped, flush=True)
ckpt.close()
"""


def test_a_ranks_second_slot_leaves_room_for_the_first_slot_of_a_rank_not_started(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    """Two ranks at a cap of two and a half slots: the rank that starts first does not take
    the other's room, and each keeps one slot."""
    cap = one_slot(shm_dir) * 5 // 3  # 1.5 slots each time: 2.5 slots
    leave = tmp_path / "leave"
    script = RANK_SCRIPT.format(tests=str(Path(__file__).parent))
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                   "FLASHCKPT_HOST_MEMORY": str(cap), "SAVED": str(tmp_path / f"saved{rank}"),
                   "LEAVE": str(leave)}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
            deadline = time.monotonic() + 60
            while not (tmp_path / f"saved{rank}").exists():
                assert procs[-1].poll() is None, procs[-1].communicate()[1][-3000:]
                assert time.monotonic() < deadline, "rank {rank} did not save"
                time.sleep(0.05)
        assert host_memory.used(shm_dir) <= cap
        assert [len(list(job_dir(shm_dir, "two").glob(f"rank-{r}.slot-*"))) for r in (0, 1)] == [
            1,
            1,
        ]
    finally:
        leave.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert all("keeps 1 slot(s)" in err for _, err in outs), [err[-2000:] for _, err in outs]
