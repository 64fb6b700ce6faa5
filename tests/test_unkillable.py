"""A kill that does not take: a worker held in the kernel (a hung file system, a wedged driver)
outlives its SIGKILL, and nothing waits for it.

Real processes, frozen with the cgroup v1 freezer (``unkillable``): a frozen task is in state D
and its SIGKILL stays pending until it is thawed. The launcher waits on a killed child for a
bounded time, reports one that outlived its SIGKILL (``kill_not_taken``) and leaves it behind;
its rank's next process takes the rank's slots over from it (it never runs again), and the
job finishes bit-identical to an undisturbed run, in-process with a standby or by restarting
every worker. Every frozen process is thawed and reaped at the end of its test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, wait_for
from test_launcher import NODES, Cluster, explain
from unkillable import Adopter, Freezer, state, unavailable

from flashckpt.faults import reap
from flashckpt.faults.events import EventLog, read_events
from flashckpt.faults.heartbeat import heartbeat_path, read
from flashckpt.pidfile import doomed

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

TRAINER = ROOT / "tests" / "inprocess_trainer.py"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def killed_frozen(freezer: Freezer, proc: subprocess.Popen) -> None:
    """Freeze ``proc`` and SIGKILL it: the kill stays pending (state D)."""
    freezer.freeze(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: doomed(proc.pid), 5, interval=0.01, what="the SIGKILL pending")


@pytest.mark.timeout(60)
def test_a_frozen_process_outlives_its_sigkill_and_dies_once_thawed():
    proc = subprocess.Popen(SLEEPER)
    try:
        with Freezer("unit") as freezer:
            killed_frozen(freezer, proc)
            time.sleep(1.0)
            assert proc.poll() is None and state(proc.pid) == "D" and doomed(proc.pid)
            freezer.thaw()
            assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(60)
def test_reaping_a_child_that_outlives_its_sigkill_is_bounded_and_reported(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    proc = subprocess.Popen(SLEEPER)
    try:
        with Freezer("reap") as freezer:
            freezer.freeze(proc.pid)
            began = time.monotonic()
            assert not reap.reap(proc, 3, events, "a test", timeout=1.0)
            assert time.monotonic() - began < 3.0
            assert proc.poll() is None and doomed(proc.pid)
            assert reap.reap(proc, 3, events, "a test", timeout=1.0) is False  # reported once
            freezer.thaw()
            assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(10)
    found = [e for e in read_events(events.path) if e["kind"] == "kill_not_taken"]
    assert [(e["rank"], e["worker_pid"], e["process_state"], e["kill_pending"]) for e in found] == [
        (3, proc.pid, "D", True)
    ], found


@pytest.mark.timeout(90)
def test_stopping_a_worker_group_does_not_wait_for_a_worker_that_outlived_its_kill(tmp_path):
    """TorchElastic's worker processes, stopped with their context's ``close()`` (what a
    restart does) once ``bound_close`` made it bounded: the healthy worker dies of SIGTERM,
    the frozen one is not waited for beyond ``KILL_TAKES_S`` and is reported."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    events = EventLog(tmp_path / "events.jsonl")
    args = {lr: ("-c", "import time; time.sleep(600)") for lr in range(2)}
    envs = {lr: {"RANK": str(lr)} for lr in range(2)}
    ctx = start_processes("uk", sys.executable, args, envs,
                          DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))  # fmt: skip
    reap.bound_close(ctx, events)
    frozen = ctx.subprocess_handlers[1].proc
    try:
        with Freezer("close") as freezer:
            killed_frozen(freezer, frozen)
            began = time.monotonic()
            ctx.close()  # SIGTERM, then SIGKILL: TorchElastic's own waits forever (torch < 2.13)
            took = time.monotonic() - began
            assert ctx.subprocess_handlers[0].proc.poll() is not None
            assert frozen.poll() is None and state(frozen.pid) == "D"
            freezer.thaw()
            assert frozen.wait(10) == -signal.SIGKILL
    finally:
        for h in ctx.subprocess_handlers.values():
            h.proc.kill()
            h.proc.wait(10)
    assert took < reap.KILL_TAKES_S + 3, took
    found = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "kill_not_taken"]
    assert [(e["rank"], e["worker_pid"]) for e in found] == [(1, frozen.pid)], found


SAVER = """
import time, torch
from flashckpt import Checkpointer
ck = Checkpointer(job="uk")
w = torch.zeros(1024)
for step in range(1, 6):
    w.fill_(step)
    ck.save(step, {"w": w})
ck.wait(5, timeout=30)  # step 5 whole in shared memory
print("saved", flush=True)
time.sleep(600)
"""

TAKER = """
import sys, torch
from flashckpt import Checkpointer
from flashckpt.errors import RankBusyError
ck = Checkpointer(job="uk")
w = torch.zeros(1024)
try:
    step = ck.restore({"w": w})
except RankBusyError as exc:
    print("busy", exc, flush=True)
    sys.exit(3)
assert step == 5 and bool((w == 5).all()), (step, w[:4])
w.fill_(6)
ck.save(6, {"w": w})
ck.close()
print("taken", step, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_held_by_a_process_whose_kill_did_not_take_is_taken_over(shm_dir):
    """A rank's owner frozen is alive: its rank is refused to a second process. Once its
    SIGKILL is pending (it never runs again) the next process takes the rank over, restores
    what it saved and saves on; the old one, thawed, dies without writing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    saver = subprocess.Popen([sys.executable, "-c", SAVER], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert saver.stdout.readline().strip() == "saved"
        with Freezer("slots") as freezer:
            freezer.freeze(saver.pid)
            taker = [sys.executable, "-c", TAKER]
            busy = subprocess.run(taker, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert busy.returncode == 3 and f"pid {saver.pid}" in busy.stdout, busy
            os.kill(saver.pid, signal.SIGKILL)
            taken = subprocess.run(taker, env=env, cwd=ROOT, capture_output=True, text=True,
                                   timeout=60)  # fmt: skip
            assert taken.returncode == 0 and "taken 5" in taken.stdout, taken
            assert f"its owner (pid {saver.pid}) was killed" in taken.stderr, taken.stderr
            assert state(saver.pid) == "D"
            freezer.thaw()
            assert saver.wait(10) == -signal.SIGKILL
    finally:
        saver.kill()
        saver.wait(10)


def env(**more: str) -> dict[str, str]:
    return {"FLASHCKPT_RESTART_POLICY": "in-process", "FLASHCKPT_RECOVERY_DEADLINE": "15",
            "FLASHCKPT_HANG_FLOOR": "3", "FT_FAULTS": "sleep:3:10", **more}  # fmt: skip


def holder_of(cluster: Cluster, rank: int) -> int:
    """The pid of ``rank``'s process, from its heartbeat page on whichever node runs it."""
    for shm in cluster.shm:
        beat = read(heartbeat_path(shm, cluster.job, rank))
        if beat is not None:
            return beat.pid
    raise AssertionError(f"no heartbeat page of rank {rank}")


def run_frozen(tmp_path, name: str, **more: str):
    """The job of two nodes (in-process by default), rank 3 frozen in its sleep after step 10
    (so the watchdog finds it hung and its SIGKILL does not take). Returns the run, the frozen
    pid, its state at the job's end (still frozen) and whether it was reaped once thawed."""
    cluster = Cluster(tmp_path, name, trainer=TRAINER, **env(**more))
    with Adopter() as adopter, Freezer(name) as freezer:
        try:
            for node in range(NODES):
                cluster.start(node)
            wait_for(lambda: (cluster.marks / "sleep-3-10").exists(), 180, interval=0.02,
                     what="rank 3's sleep")  # fmt: skip
            pid = holder_of(cluster, 3)
            freezer.freeze(pid)
        except BaseException:
            cluster.close()
            raise
        run = cluster.finish()
        at_end = (state(pid), doomed(pid))
        freezer.thaw()
        reaped = adopter.reap(pid)
    return run, pid, at_end, reaped


def events(run, kind: str) -> list[dict]:
    return [e for node in run.events for e in node if e["kind"] == kind]


def check_left_behind(run, pid: int, at_end: tuple[str, bool], reaped: bool,
                      judged: bool = True) -> None:  # fmt: skip
    """The frozen rank was reported left behind (in state D, its kill pending), still held in
    the kernel when the job ended, and reaped once thawed. ``judged``: it was also found hung
    in state D and killed by its node's watchdog, and reported left behind within
    ``KILL_TAKES_S`` (and a second or two of polling) of that kill. (Under the restart policy
    each node judges its own workers: the other node's blocked ranks may be judged first, and
    the frozen rank is then killed when its group is stopped.)"""
    left = [e for e in events(run, "kill_not_taken") if e["worker_pid"] == pid]
    found = [(e["rank"], e["process_state"], e["kill_pending"]) for e in left]
    assert found == [(3, "D", True)], left
    if judged:
        hangs = [(e["rank"], e["process_state"]) for e in events(run, "hang_detected")
                 if e["worker_pid"] == pid]  # fmt: skip
        assert hangs and set(hangs) == {(3, "D")}, hangs
        killed = [e for e in events(run, "killed") if e["worker_pid"] == pid]
        assert killed, explain(run)
        assert left[0]["time"] - killed[0]["time"] < reap.KILL_TAKES_S + 2, (killed, left)
    assert at_end == ("D", True), at_end
    assert reaped


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(420)
def test_a_rank_whose_kill_does_not_take_is_replaced_by_a_standby(tmp_path, reference):
    """In-process recovery goes on without the frozen rank: it counts as lost once its SIGKILL
    has been pending ``KILL_TAKES_S``, a standby takes its rank (and its slots) and the round
    forms within the deadline; every other worker keeps its process."""
    began = time.monotonic()
    run, pid, at_end, reaped = run_frozen(tmp_path, "uk-standby")
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    check_left_behind(run, pid, at_end, reaped)
    assert [e["rank"] for e in events(run, "hang_detected")] == [3]  # the culprit alone
    started = events(run, "replacement_started")
    assert [(e["rank"], e["lost_pid"], e["lost_status"]) for e in started] == [(3, pid, -9)]
    recovered = events(run, "inprocess_recovered")
    assert recovered and not events(run, "inprocess_fallback"), explain(run)
    assert all(e["replacement_s"] < 15 for e in recovered), recovered
    assert time.monotonic() - began < 300


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(420)
def test_with_no_standby_the_restart_of_every_worker_is_not_held_by_the_frozen_one(
    tmp_path, reference
):
    """No standby: the fault falls back to restarting every worker. Stopping the node's
    worker group does not wait for the frozen one, and the restarted rank 3 takes its slots
    over and restores from them with the others."""
    began = time.monotonic()
    run, pid, at_end, reaped = run_frozen(tmp_path, "uk-restart", FLASHCKPT_STANDBY="0")
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    check_left_behind(run, pid, at_end, reaped)
    assert [e["rank"] for e in events(run, "hang_detected")] == [3]
    fallback = events(run, "inprocess_fallback")
    assert fallback and "no standby" in fallback[0]["reason"], fallback
    assert "takes the rank over" in "".join(run.logs), explain(run)
    assert time.monotonic() - began < 300


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(420)
def test_under_the_restart_policy_the_worker_group_restarts_without_the_frozen_one(
    tmp_path, reference
):
    """The restart policy: TorchElastic sees no exit of a worker whose kill did not take;
    ``BoundedAgent`` reports it failed once its SIGKILL has been pending ``KILL_TAKES_S`` (or
    its group is stopped for another's failure), the group restarts without waiting for it,
    and the new rank 3 takes its slots over."""
    began = time.monotonic()
    run, pid, at_end, reaped = run_frozen(tmp_path, "uk-policy", FLASHCKPT_RESTART_POLICY="restart")
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    check_left_behind(run, pid, at_end, reaped, judged=False)
    assert "takes the rank over" in "".join(run.logs), explain(run)
    # Restarted at once: TorchElastic's own stop waits 30 s for the SIGTERM, and then, from
    # torch 2.13, 30 s more for the SIGKILL (before it, forever).
    left = [e for e in events(run, "kill_not_taken") if e["worker_pid"] == pid][0]
    again = [e for e in events(run, "restored") if e["rank"] == 3 and e["pid"] != pid]
    assert again and again[0]["time"] - left["time"] < 30, (left, again)
    assert time.monotonic() - began < 300
