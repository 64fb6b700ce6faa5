"""A node agent's lease from the job's controller, for real: a controller process, an agent
process, trainers saving into shared memory. An agent whose controller stops answering (stopped
with SIGSTOP, or killed) drops its lease within the lease time and writes nothing to a shared
tier while it lasts, node-local tiers going on; it writes again once the controller answers.
An agent with no controller writes as it always did; one cut off whose launcher is gone does
not wait on the shared tiers it can no longer write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_python, wait_for
from test_agent import agent_pid, committed

from flashckpt import Checkpointer
from flashckpt.faults import control
from flashckpt.faults.events import events_path, read_events

JOB = "leased"
TOKEN = "lease-tests-" + uuid.uuid4().hex
NODE_TIMEOUT = 1.0  # the agents' lease: half of it


class ControllerProcess:
    """``flashckpt-agent controller`` in its own process, on ``bind``."""

    def __init__(self, tmp_path: Path, bind: str = "127.0.0.1:0"):
        self.log = tmp_path / f"controller-{uuid.uuid4().hex[:6]}.log"
        env = {**os.environ, "FLASHCKPT_CONTROLLER_TOKEN": TOKEN,
               "FLASHCKPT_HEARTBEAT_INTERVAL": "0.2"}  # fmt: skip
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flashckpt.agent.cli", "controller", "--bind", bind,
                 "--events", str(tmp_path / "controller.events.jsonl"), "--node-timeout", "30"],
                env=env, stderr=err, cwd=ROOT,
            )  # fmt: skip
        line = wait_for(lambda: "serving on" in self.log.read_text() and self.log.read_text(),
                        30, what="the controller serving")  # fmt: skip
        self.address = line.split("serving on ")[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


def start_agent(shm_dir: Path, run_dir: Path, logs: Path, *args: str):
    """The node's agent in its own process, once it serves and its lease holds where a
    controller is known; the process and its log (in ``logs``)."""
    log = logs / "agent.log"
    with open(log, "w") as err:
        agent = subprocess.Popen(
            [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", JOB, "--shm-dir",
             str(shm_dir), "--run-dir", str(run_dir), *args], cwd=ROOT, stderr=err,
        )  # fmt: skip
    wait_for(lambda: "serving job" in log.read_text(), 30, what="the agent serving")
    if control.Endpoint.load(run_dir, JOB) is not None:
        wait_for(lambda: "lease holds" in log.read_text(), 30, what="the lease granted")
    return agent, log


def kinds(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(events_path(run_dir, JOB)) if e["kind"] == kind]


def steps_in(root: Path) -> list[str]:
    """Every step directory of the job a tier holds, complete or not."""
    return sorted(p.name for p in (root / JOB).glob("step-*"))


@pytest.fixture
def leased(shm_dir, run_dir, tmp_path, monkeypatch):
    """A job launched with a controller (its file and event log in the run directory); its
    node's agent not started yet."""
    monkeypatch.setenv("FLASHCKPT_NODE", "here")
    monkeypatch.setenv("FLASHCKPT_NODE_TIMEOUT", str(NODE_TIMEOUT))
    events_path(run_dir, JOB).touch(mode=0o600)
    made = []

    def controller(bind: str = "127.0.0.1:0") -> ControllerProcess:
        made.append(ControllerProcess(tmp_path, bind))
        control.Endpoint(made[-1].address, TOKEN).save(run_dir, JOB)
        return made[-1]

    yield controller
    for c in made:
        c.stop()


@pytest.mark.serial
@pytest.mark.parametrize("outage", ["stopped", "killed"])
def test_an_agent_cut_off_from_its_controller_writes_no_shared_tier_until_it_answers_again(
    leased, shm_dir, run_dir, tmp_path, outage
):
    c = leased()
    shared, nvme = f"file://{tmp_path / 'pfs'}?scope=shared", f"file://{tmp_path / 'nvme'}"
    agent, _ = start_agent(shm_dir, run_dir, tmp_path, "--tier", shared, "--tier", nvme)
    try:
        with Checkpointer(shared, nvme, job=JOB) as ck:
            assert ck.restore({"w": torch.zeros(256)}) is None
            ck.save(1, {"w": torch.full((256,), 1.0)})
            assert ck.wait(1, tier=shared, timeout=60) == 1
            cut = time.time()
            if outage == "stopped":
                os.kill(c.proc.pid, signal.SIGSTOP)
            else:
                c.stop()
            lapsed = wait_for(lambda: kinds(run_dir, "lease_lapsed"), 10, 0.05, "a lapse")
            # Within the lease (half the node timeout) of the last answer, plus a report's
            # interval and this machine's slack: well before the controller could find it lost.
            assert lapsed[0]["time"] - cut < NODE_TIMEOUT, lapsed
            for step in (2, 3):
                ck.save(step, {"w": torch.full((256,), float(step))})
            assert ck.wait(3, tier=nvme, timeout=60) == 3  # node-local tiers go on
            time.sleep(1.0)  # rounds of the shared tier's worker, each skipped
            assert steps_in(tmp_path / "pfs") == ["step-000000000001"]
            assert not kinds(run_dir, "lease_regained")
            if outage == "stopped":
                os.kill(c.proc.pid, signal.SIGCONT)
            else:
                leased(c.address)  # a controller again, where the job's file says
            wait_for(lambda: kinds(run_dir, "lease_regained"), 30, what="the lease regained")
            assert ck.wait(3, tier=shared, timeout=60) == 3
        assert committed(shared, JOB)[-1] == 3
        assert len(kinds(run_dir, "lease_lapsed")) == 1
    finally:
        agent.terminate()
        assert agent.wait(30) == 0


def test_an_agent_with_no_controller_is_not_leased(shm_dir, run_dir, tmp_path):
    events_path(run_dir, JOB).touch(mode=0o600)
    shared = f"file://{tmp_path / 'pfs'}?scope=shared"
    with Checkpointer(shared, job=JOB) as ck:  # its agent spawned by the trainer, as usual
        assert ck.restore({"w": torch.zeros(64)}) is None
        for step in (1, 2):
            ck.save(step, {"w": torch.full((64,), float(step))})
        assert ck.wait(2, tier=shared, timeout=60) == 2
    assert committed(shared, JOB)[-1] == 2
    assert not [e for e in read_events(events_path(run_dir, JOB)) if "lease" in e["kind"]]


@pytest.mark.serial
def test_an_agent_cut_off_whose_launcher_is_gone_drains_node_local_tiers_and_exits(
    leased, shm_dir, run_dir, tmp_path
):
    c = leased()
    shared, nvme = f"file://{tmp_path / 'pfs'}?scope=shared", f"file://{tmp_path / 'nvme'}"
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    agent, _ = start_agent(shm_dir, run_dir, tmp_path, "--tier", shared, "--tier", nvme,
                             "--exit-when-idle", "0.5", "--while-pid", str(launcher.pid))  # fmt: skip
    try:
        assert agent_pid(run_dir, JOB) == agent.pid
        os.kill(c.proc.pid, signal.SIGSTOP)
        wait_for(lambda: kinds(run_dir, "lease_lapsed"), 30, 0.05, "a lapse")
        # A trainer saves while the node is cut off, and goes (its slots left to the agent).
        run_python(
            "import torch; from flashckpt import Checkpointer\n"
            f"ck = Checkpointer({shared!r}, {nvme!r}, job={JOB!r}, close_timeout=1)\n"
            "ck.restore({'w': torch.zeros(64)})\n"
            "ck.save(5, {'w': torch.full((64,), 5.0)})\n"
            f"ck.wait(5, tier={nvme!r}, timeout=60)\n"
            "ck.close()\n"
        )  # fmt: skip
        launcher.kill()
        launcher.wait()
        # Not an hour of retries (--give-up-after): the shared tier cannot be written.
        assert agent.wait(60) == 0
        assert committed(nvme, JOB) == [5] and steps_in(tmp_path / "pfs") == []
    finally:
        launcher.kill()
        agent.kill()
        agent.wait()
