"""Heartbeat pages, the hang policy and the event report, in one process and its children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from ports import free_port

from flashckpt import Checkpointer, ConfigError
from flashckpt.faults.events import EventLog, read_events
from flashckpt.faults.hang import Hang, HangPolicy, Watchdog
from flashckpt.faults.heartbeat import (
    Beat,
    Heartbeat,
    Phase,
    heartbeat_path,
    pages,
    read,
    remove_dead,
    stacks_path,
)
from flashckpt.faults.node_watch import NodeWatch
from flashckpt.faults.proc import parent_and_state
from flashckpt.faults.report import render, summarize
from flashckpt.snapshot.slots import free_rank


def beat(phase: Phase, slowest: float = 0.0, budget_s: int = 0) -> Beat:
    return Beat(1, phase, 3, 7, time.monotonic(), slowest, 0.0, 0.0, budget_s)


def test_the_timeout_is_learned_from_step_times_and_bounded_per_phase():
    p = HangPolicy(factor=5, floor=3, ceiling=60, startup=100, save=20, restore=40)
    assert p.timeout(beat(Phase.TRAIN, 0.1)) == 3  # 0.5 s learned, raised to the floor
    assert p.timeout(beat(Phase.TRAIN, 2.0)) == 10
    assert p.timeout(beat(Phase.TRAIN, 30.0)) == 60  # capped by the ceiling
    assert p.timeout(beat(Phase.TRAIN, 0.0)) == 100  # no full step yet: the start-up budget
    assert p.timeout(beat(Phase.STARTUP)) == 100
    assert p.timeout(beat(Phase.SAVE, 2.0)) == 20
    assert p.timeout(beat(Phase.RESTORE, 2.0)) == 40
    assert p.timeout(beat(Phase.CLOSED)) is None
    assert p.timeout(beat(Phase.WAIT, 2.0, budget_s=300)) == 320  # the wait's own timeout
    assert p.timeout(beat(Phase.WAIT, 2.0)) == 80  # a wait without one: the ceiling


def test_the_policy_comes_from_the_environment_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_HANG_FLOOR", "3")
    monkeypatch.setenv("FLASHCKPT_HANG_FACTOR", "2.5")
    p = HangPolicy.from_env()
    assert (p.floor, p.factor, p.ceiling) == (3.0, 2.5, 1800.0)
    monkeypatch.setenv("FLASHCKPT_HANG_CEILING", "1")
    with pytest.raises(ConfigError, match="FLASHCKPT_HANG_CEILING"):
        HangPolicy.from_env()
    monkeypatch.setenv("FLASHCKPT_HANG_CEILING", "abc")
    with pytest.raises(ConfigError, match="FLASHCKPT_HANG_CEILING"):
        HangPolicy.from_env()


def test_a_page_round_trips_and_learns_the_slowest_step(tmp_path):
    hb = Heartbeat(tmp_path / "rank-0.heartbeat", tmp_path / "rank-0.stacks")
    first = read(hb.path)
    assert first.pid == os.getpid() and first.phase == Phase.STARTUP and first.step is None
    hb.progress(1)
    time.sleep(0.05)
    hb.progress(2)
    hb.progress(3)
    b = read(hb.path)
    assert (b.phase, b.step, b.beats) == (Phase.TRAIN, 3, 3)
    assert 0.05 <= b.slowest_step_s < 1.0 and b.updated_at >= first.updated_at
    hb.phase(Phase.SAVE, 4)
    assert read(hb.path).phase == Phase.SAVE and read(hb.path).step == 4
    hb.close()
    assert not hb.path.exists() and not (tmp_path / "rank-0.stacks").exists()


def test_a_page_carries_the_collectives_issued_and_a_new_process_starts_with_none(tmp_path):
    hb = Heartbeat(tmp_path / "rank-0.heartbeat", tmp_path / "rank-0.stacks")
    assert read(hb.path).issued == {}
    hb.issued({1: 40, 2**64 - 1: 7})
    hb.progress(5)  # a beat keeps them
    assert read(hb.path).issued == {f"{1:016x}": 40, "f" * 16: 7}
    again = Heartbeat(hb.path, tmp_path / "rank-0.stacks")  # the rank's replacement
    assert read(hb.path).issued == {}
    raw = bytearray(hb.path.read_bytes())
    raw[128:132] = (17).to_bytes(4, "little")  # more groups than a page holds: not a page
    hb.path.write_bytes(bytes(raw))
    assert read(hb.path) is None
    again.close()


SLEEPER = """
import os, sys, time, torch, torch.distributed as dist
from pathlib import Path
from flashckpt.faults.collectives import Sampler
from flashckpt.faults.heartbeat import Heartbeat, record_issued
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
hb = Heartbeat(Path(sys.argv[2]) / f"rank-{rank}.heartbeat", Path(sys.argv[2]) / f"{rank}.stacks")
Sampler(record_issued, interval=0.02).start()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
hb.progress(3)
(Path(sys.argv[2]) / f"ready-{rank}").touch()
if rank == 1:
    time.sleep(60)  # the culprit: it never issues the next collective
dist.all_reduce(t)  # rank 0 waits here
"""


def test_the_sampler_shows_a_rank_blocked_behind_a_sleeping_one(tmp_path):
    """Both ranks' last progress is step 3; the one waiting in a collective has issued one
    more than the sleeper, read from its page while its training thread is blocked."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER, str(r), str(tmp_path)], env=env)
             for r in (0, 1)]  # fmt: skip
    try:
        path = {r: tmp_path / f"rank-{r}.heartbeat" for r in (0, 1)}
        deadline = time.monotonic() + 60
        while True:
            beats = {r: read(p) for r, p in path.items()}
            counts = {r: sum(b.issued.values()) for r, b in beats.items() if b is not None}
            if counts.get(0) == 4 and counts.get(1) == 3:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.05)
        assert beats[0].step == beats[1].step == 3
        hangs = [Hang(r, p.pid, "train", 3, 5.0, 3.0, time.time() - 5, b.issued, False)
                 for r, b in beats.items() for p in [procs[r]]]  # fmt: skip
        watch = NodeWatch(tmp_path, "j", EventLog(tmp_path / "e.jsonl"), HangPolicy(floor=3.0),
                          one_at_a_time=True)  # fmt: skip
        assert [h.rank for h in watch._culprit(hangs)] == [1]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "raw",
    [b"", b"garbage", b"\x00" * 4096, b"FCHBEAT2" + b"\xff" * 100],
    ids=["empty", "short", "zeros", "junk"],
)
def test_a_page_that_does_not_parse_is_no_page(tmp_path, raw):
    path = tmp_path / "rank-0.heartbeat"
    path.write_bytes(raw)
    assert read(path) is None
    assert Watchdog(tmp_path.parent, tmp_path.name, HangPolicy()).check({0: os.getpid()}) == []


def test_save_restore_and_optimizer_steps_beat(shm_dir):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with Checkpointer(job="hb") as ck:
        ck.restore(state)
        path = heartbeat_path(shm_dir, "hb", 0)
        assert read(path).phase == Phase.STARTUP
        ck.save(5, state)
        b = read(path)
        assert (b.phase, b.step) == (Phase.TRAIN, 5)
        for _ in range(3):  # steps between saves still beat, through the optimizer hook
            model(torch.ones(4)).sum().backward()
            opt.step()
        assert read(path).beats == b.beats + 3
    assert not path.exists()  # close() removes the page: the rank is no longer watched


def test_a_rank_waiting_for_its_snapshot_or_closing_is_not_hung(shm_dir):
    state = {"t": torch.ones(4)}
    dog = Watchdog(shm_dir, "hbwait", HangPolicy(floor=0.2, startup=0.2, save=0.2))
    with Checkpointer(job="hbwait", close_timeout=45) as ck:
        ck.save(1, state)
        path = heartbeat_path(shm_dir, "hbwait", 0)
        seen = []

        def look() -> None:
            time.sleep(0.6)  # silent past the floor, the start-up and the save budgets
            seen.append((read(path), dog.check({0: os.getpid()})))

        watcher = threading.Thread(target=look)
        watcher.start()
        with pytest.raises(TimeoutError, match="step 9"):
            ck.wait(9, timeout=1.5)  # a step never saved
        watcher.join()
        (during, hangs), after = seen[0], read(path)
        assert (during.phase, during.budget_s, hangs) == (Phase.WAIT, 2, [])
        assert (after.phase, after.budget_s) == (Phase.TRAIN, 0)  # back to what it was
        persisted = ck._persisted_everywhere
        ck._persisted_everywhere = lambda: seen.append(read(path)) or persisted()
    assert (seen[1].phase, seen[1].budget_s) == (Phase.WAIT, 45)  # close() waits for tiers
    assert not path.exists()


def test_the_watchdog_finds_a_stopped_rank_and_dumps_its_stacks(shm_dir):
    code = (
        "import os, signal, time, torch\n"
        "from flashckpt import Checkpointer\n"
        "ck = Checkpointer(job='hbstop')\n"
        "ck.save(1, {'t': torch.ones(4)})\n"
        "def waiting_in_a_collective():\n"
        "    print('ready', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    time.sleep(60)\n"
        "waiting_in_a_collective()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        dog = Watchdog(shm_dir, "hbstop", HangPolicy(floor=0.3, startup=0.3))
        deadline = time.monotonic() + 10
        while not (hangs := dog.check({0: proc.pid})) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(h.rank, h.pid, h.phase, h.step) for h in hangs] == [(0, proc.pid, "train", 1)]
        assert 0.3 < hangs[0].silent_s < 5
        stacks = dog.stacks(0, proc.pid, stopped=True)
        assert "waiting_in_a_collective" in stacks
        assert dog.check({0: proc.pid + 1}) == []  # a page of another process is not this one's
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert stacks_path(shm_dir, "hbstop", 0).exists()  # a killed rank leaves its files,
    free_rank(shm_dir, "hbstop", 0)  # which go with the rest of its files when it is freed
    assert not stacks_path(shm_dir, "hbstop", 0).exists()
    assert not heartbeat_path(shm_dir, "hbstop", 0).exists()


def test_of_ranks_hung_together_the_stopped_one_is_the_culprit_though_judged_last(tmp_path):
    """In-process recovery kills one rank: the ranks blocked in a collective with a stopped
    one fall silent within moments of it, and may pass their timeout first."""
    watch = NodeWatch(tmp_path, "j", EventLog(tmp_path / "e.jsonl"), HangPolicy(floor=3.0),
                      one_at_a_time=True)  # fmt: skip
    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while parent_and_state(stopped.pid)[1] != "T":
            assert time.monotonic() < deadline, "sleep was never seen stopped"
            time.sleep(0.01)

        def hung(pid, silent, rank):  # as Watchdog.silences reads it
            return Hang(rank, pid, "train", 10, silent, 3.0, time.time() - silent, {},
                        parent_and_state(pid)[1] == "T")  # fmt: skip

        waiting = hung(os.getpid(), 3.1, 2)  # this process: running, past its timeout
        assert [h.rank for h in watch._culprit([waiting, hung(stopped.pid, 2.9, 3)])] == [3]
        # a stopped rank silent for less than half its timeout did not stop with this hang
        assert [h.rank for h in watch._culprit([waiting, hung(stopped.pid, 1.0, 3)])] == [2]
        # none stopped, no collective counts (see test_culprit): the one silent longest
        assert [h.rank for h in watch._culprit([waiting, hung(os.getppid(), 3.5, 1)])] == [1]
    finally:
        stopped.kill()
        stopped.wait()


def test_a_rank_hung_in_save_is_the_culprit_its_blocked_peers_are_not(tmp_path):
    """Rank 3 hangs in ``save()`` (its phase's timeout 300 s) while rank 2 waits in the next
    step's all-reduce (3 s, past it): rank 3 is a suspect once it is silent past half the
    floor, whatever its own timeout, and the evidence (rank 2 issued a collective rank 3 has
    not) makes it the culprit, not the peer blocked on it."""
    watch = NodeWatch(tmp_path, "j", EventLog(tmp_path / "e.jsonl"), HangPolicy(floor=3.0),
                      one_at_a_time=True)  # fmt: skip
    now = time.time()
    waiting = Hang(2, 12, "train", 10, 3.1, 3.0, now - 3.1, {"world": 41})
    saving = Hang(3, 13, "save", 10, 3.0, 300.0, now - 3.0, {"world": 40})
    assert watch._suspects([waiting, saving]) == [waiting, saving]
    assert watch._culprit([waiting, saving]) == [saving]
    quiet = Hang(3, 13, "save", 10, 1.0, 300.0, now - 1.0, {"world": 40})  # not half the floor
    assert watch._suspects([waiting, quiet]) == [waiting]


def test_ranks_blocked_with_a_killed_culprit_wait_for_its_replacement_to_start(tmp_path):
    """However long a loaded node takes to start the killed rank's replacement, the ranks
    waiting on it are not judged before it has a page and the floor has passed after it."""
    shm = tmp_path / "shm"
    (shm / "wait").mkdir(parents=True)
    policy = HangPolicy(floor=3, startup=60)
    watch = NodeWatch(shm, "wait", EventLog(tmp_path / "e.jsonl"), policy, one_at_a_time=True)
    killed = Hang(1, os.getpid() + 100000, "train", 10, 4.0, 3.0)
    assert not watch._awaiting_replacement()  # nothing killed yet
    watch._replacing = [killed], time.monotonic()
    assert watch._awaiting_replacement()  # no page of rank 1 yet
    hb = Heartbeat(heartbeat_path(shm, "wait", 1), stacks_path(shm, "wait", 1))  # the new one
    try:
        before = time.monotonic()
        assert watch._awaiting_replacement()  # its page is there: the floor starts now
        assert watch._replacing is None and watch._quiet_until >= before + 3
        assert not watch._awaiting_replacement()
        watch._replacing = [killed], time.monotonic() - 61  # never replaced within start-up
        hb.close()
        assert not watch._awaiting_replacement() and watch._replacing is None
    finally:
        hb.close()


def test_ranks_blocked_with_several_killed_culprits_wait_for_every_replacement(tmp_path):
    """Two culprits killed in one decision (two ranks hung at once): the ranks blocked with
    them are not judged before both replacements have their pages, then the floor."""
    shm = tmp_path / "shm"
    (shm / "two").mkdir(parents=True)
    policy = HangPolicy(floor=3, startup=60)
    watch = NodeWatch(shm, "two", EventLog(tmp_path / "e.jsonl"), policy, one_at_a_time=True)
    killed = [Hang(r, os.getpid() + 100000 + r, "train", 10, 4.0, 3.0) for r in (1, 2)]
    watch._replacing = list(killed), time.monotonic()
    first = Heartbeat(heartbeat_path(shm, "two", 1), stacks_path(shm, "two", 1))
    second = None
    try:
        assert watch._awaiting_replacement()  # rank 2 has no new process yet
        assert watch._replacing[0] == [killed[1]] and watch._quiet_until == 0.0
        second = Heartbeat(heartbeat_path(shm, "two", 2), stacks_path(shm, "two", 2))
        before = time.monotonic()
        assert watch._awaiting_replacement()  # both have their pages: the floor starts now
        assert watch._replacing is None and watch._quiet_until >= before + 3
        second.close()
        watch._replacing = list(killed), time.monotonic() - 61  # one never replaced
        assert not watch._awaiting_replacement() and watch._replacing is None
    finally:
        first.close()
        if second is not None:
            second.close()


def test_the_report_splits_lost_time_into_its_parts(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    t0 = 1000.0
    lines = [
        {"time": t0, "kind": "launcher_started"},
        {"time": t0 + 10, "kind": "hang_detected", "rank": 3, "silent_s": 3.2, "step": 10,
         "worker_pid": 11},
        {"time": t0 + 10.5, "kind": "worker_exited", "rank": 2, "worker_pid": 12, "step": 10},
        {"time": t0 + 16, "kind": "restored", "rank": 0, "step": 10, "seconds": 0.5},
        {"time": t0 + 16.2, "kind": "restored", "rank": 3, "step": 10, "seconds": 0.7},
        {"time": t0 + 30, "kind": "closed", "rank": 0, "save_stall_s": 1.5, "step_s": 0.1},
        {"time": t0 + 31, "kind": "launcher_exited"},
    ]  # fmt: skip
    with open(log.path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write('{"torn": \n')  # a torn line is skipped
    log.record("note", text="appended by the API")
    events = read_events(log.path)
    assert [e["kind"] for e in events][-1] == "note"
    report = summarize(events)
    (f,) = report.failures
    assert (f.kind, f.ranks, f.restored_step, f.mode) == ("hang", [3], 10, "restart")
    assert f.detect_s == pytest.approx(3.2)
    assert f.restart_s == pytest.approx(5.5) and f.restore_s == pytest.approx(0.7)
    assert f.recomputed_steps() == 1
    assert report.lost_s() == pytest.approx(1.5 + 3.2 + 5.5 + 0.7 + 0.1)
    text = render(report)
    assert "1 failure" in text and "restored step 10" in text and "effective training time" in text


def test_pages_left_by_dead_processes_are_removed_before_a_launcher_starts_workers(shm_dir):
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from flashckpt.faults.heartbeat import Heartbeat, heartbeat_path, stacks_path\n"
        "shm, job = Path(sys.argv[1]), 'stale'\n"
        "(shm / job).mkdir(parents=True, exist_ok=True)\n"
        "Heartbeat(heartbeat_path(shm, job, 2), stacks_path(shm, job, 2))\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # an earlier run's rank 2, killed\n"
    )
    subprocess.run([sys.executable, "-c", code, str(shm_dir)], check=False, timeout=60)
    live = Heartbeat(heartbeat_path(shm_dir, "stale", 0), stacks_path(shm_dir, "stale", 0))
    try:
        assert [rank for rank, _ in pages(shm_dir, "stale")] == [0, 2]
        assert remove_dead(shm_dir, "stale") == [2]
        assert [rank for rank, _ in pages(shm_dir, "stale")] == [0]  # a live one stays
    finally:
        live.close()
