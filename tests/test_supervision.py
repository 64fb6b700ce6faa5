"""A node's processes kept up, for real: the launcher's keeper starts the agent and replaces
one killed (its socket left behind) or stopped (its claim held, nothing answering); a trainer
restarts a dead agent itself when no launcher does, and is told at once why one exits at start;
a second launcher of a job already running on the node is refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from flashckpt.errors import TierUnavailableError
from flashckpt.faults.agent_client import AgentClient, agent_pid
from flashckpt.faults.agent_keeper import AgentKeeper
from flashckpt.faults.control import launcher_path
from flashckpt.faults.proc import parent_and_state
from flashckpt.format import tier_io
from flashckpt.pidfile import holder, lock_pidfile
from flashckpt.restore.sources import run_with_tier


def test_the_claim_holder_is_read_from_the_lock_table_without_taking_the_lock(tmp_path):
    path = tmp_path / "job.pid"
    assert holder(path) is None  # no file
    fd = lock_pidfile(path)
    assert holder(path) == os.getpid()
    os.close(fd)
    assert path.read_text() == str(os.getpid()) and holder(path) is None  # a dead owner's pid
    os.close(lock_pidfile(path))  # looking took no lock: the claim is still free


def test_the_keeper_starts_the_agent_and_replaces_a_killed_or_stopped_one(shm_dir, run_dir):
    keeper = AgentKeeper("keep", run_dir, shm_dir, stopped_s=0.5, silent_s=60)
    assert keeper.check() == "started"
    first = agent_pid(run_dir, "keep")
    assert first is not None and keeper.check() == "ok"

    os.kill(first, signal.SIGKILL)
    wait_for(lambda: agent_pid(run_dir, "keep") is None, what="the killed agent's claim freed")
    assert (run_dir / "keep.sock").exists()  # left behind: a socket is no sign of life
    assert keeper.check() == "started"
    second = agent_pid(run_dir, "keep")
    assert second not in (None, first) and keeper.check() == "ok"

    os.kill(second, signal.SIGSTOP)
    assert keeper.check() == "waiting"  # holds the claim, answers nothing: given a while
    time.sleep(0.6)
    assert keeper.check() == "replaced"
    third = agent_pid(run_dir, "keep")
    assert third not in (None, second) and parent_and_state(second)[1] == ""
    assert keeper.check() == "ok"


def test_a_trainer_waits_for_an_agent_holding_the_claim_and_says_how_to_free_it(shm_dir, run_dir):
    AgentClient.connect("held", run_dir, shm_dir).close()
    pid = agent_pid(run_dir, "held")
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TierUnavailableError, match=rf"pid {pid}, state T.*kill -CONT {pid}"):
            AgentClient.connect("held", run_dir, shm_dir, timeout=1.5)
        assert agent_pid(run_dir, "held") == pid  # none started against its claim
    finally:
        os.kill(pid, signal.SIGCONT)
    AgentClient.connect("held", run_dir, shm_dir, timeout=10).close()  # it answers again
    assert agent_pid(run_dir, "held") == pid


@contextlib.contextmanager
def saving(tier: Path, job: str) -> Iterator[Callable[[], int]]:
    """A trainer saving a step every 0.1 s to the file tier at ``tier`` while the block runs;
    yields how to read the newest step committed there. It must still be training after."""
    url = f"file://{tier}"
    code = (
        "import time, torch; from flashckpt import Checkpointer\n"
        f"ck = Checkpointer({url!r}, job={job!r})\n"
        "t = torch.zeros(1024)\n"
        "for step in range(100000):\n"
        "    t.fill_(step); ck.save(step, {'t': t}); time.sleep(0.1)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], env=os.environ)
    try:
        yield lambda: max(run_with_tier(url, lambda t: tier_io.committed_steps(t, job)), default=-1)
        assert trainer.poll() is None
    finally:
        trainer.kill()
        trainer.wait()


def test_a_replaced_agent_gets_the_trainers_tiers_and_persistence_goes_on(
    shm_dir, run_dir, tmp_path
):
    with saving(tmp_path / "tier", "replaced") as newest:
        wait_for(lambda: newest() >= 2, what="steps committed by the first agent")
        os.kill(agent_pid(run_dir, "replaced"), signal.SIGKILL)
        wait_for(lambda: agent_pid(run_dir, "replaced") is None, what="the killed agent gone")
        before = newest()
        assert AgentKeeper("replaced", run_dir, shm_dir).check() == "started"  # no tier given
        wait_for(lambda: newest() > before + 3, what="the new agent to commit newer steps")


def test_a_trainer_restarts_a_dead_agent_when_no_launcher_does(shm_dir, run_dir, tmp_path):
    with saving(tmp_path / "tier", "revived") as newest:
        wait_for(lambda: newest() >= 2, what="steps committed by the first agent")
        first = agent_pid(run_dir, "revived")
        os.kill(first, signal.SIGKILL)
        before = newest()
        wait_for(lambda: agent_pid(run_dir, "revived") not in (None, first), what="a new agent")
        wait_for(lambda: newest() > before + 3, what="the new agent to commit newer steps")


def test_an_agent_that_exits_at_start_is_reported_at_once_with_its_reason(
    shm_dir, run_dir, monkeypatch
):
    # A setting only the agent reads (a Checkpointer checks them first; this path does not).
    monkeypatch.setenv("FLASHCKPT_GIVE_UP_AFTER", "abc")
    began = time.monotonic()
    with pytest.raises(TierUnavailableError, match=r"exited at start .*FLASHCKPT_GIVE_UP_AFTER"):
        AgentClient.connect("badstart", run_dir, shm_dir, timeout=60)
    assert time.monotonic() - began < 20  # not the whole timeout


LAUNCHER = Path(sys.executable).parent / "flashckpt-run"


def test_a_second_launcher_of_a_job_running_on_the_node_is_refused(shm_dir, run_dir, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(120)\n")
    cmd = [str(LAUNCHER), "--standalone", "--nproc-per-node=1", str(script)]
    env = {**os.environ, "FLASHCKPT_JOB": "twice"}
    first = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: holder(launcher_path(run_dir, "twice")) == first.pid,
                 what="the first launcher's claim")  # fmt: skip
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert f"job 'twice' already runs on this node under flashckpt-run (pid {first.pid})" in (
            second.stderr
        )
        assert first.poll() is None  # untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
