"""Slurm: compressed node lists expanded as Slurm expands them, the job named after the Slurm
job (not its id, which a requeue does not keep), and ``examples/slurm/launch.sh``, the line
``train.sbatch`` runs on every node through srun, run by hand on three simulated nodes of this
machine (the control plane's node and two training nodes) with the allocation's variables set
as Slurm sets them: a killed rank is brought back and the job ends bit-identical to an
undisturbed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from faults import poll
from ports import free_port, free_port_pair
from test_launcher import NODES, PER_NODE, TOKEN
from test_spare_nodes import INPROCESS

from flashckpt.errors import ConfigError
from flashckpt.faults import slurm
from flashckpt.faults.events import events_path, read_events

LAUNCH = ROOT / "examples" / "slurm" / "launch.sh"


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-02]", ["node01", "node02"]),
    ("a[1-3,5]b,c", ["a1b", "a2b", "a3b", "a5b", "c"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("127.0.0.[1-2],login7", ["127.0.0.1", "127.0.0.2", "login7"]),
    ("single", ["single"]),
])  # fmt: skip
def test_compressed_node_lists_expand_as_slurm_expands_them(nodelist, hosts):
    assert slurm.expand(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "a[1-", "a]1", "a[x]", "a[3-1]", "a[[1]]", ","])
def test_a_node_list_that_is_not_one_says_so(bad):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        slurm.expand(bad)


def test_the_job_is_named_after_the_slurm_job_not_its_id():
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NAME": "llama 70b/pretrain",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "n2"}  # fmt: skip
    assert slurm.settings(env) == {"FLASHCKPT_RDZV_HOST": "n1", "FLASHCKPT_NNODES": "2",
                                   "FLASHCKPT_JOB": "llama-70b-pretrain", "FLASHCKPT_NODE": "n2"}  # fmt: skip
    assert slurm.settings({**env, "FLASHCKPT_JOB": "mine"})["FLASHCKPT_JOB"] == "mine"
    with pytest.raises(ConfigError, match="--job-name"):
        slurm.job_name({"SLURM_JOB_NAME": "///"})
    with pytest.raises(ConfigError, match="under srun"):
        slurm.settings({})
    out = subprocess.run([sys.executable, "-m", "flashckpt.faults.slurm", "env"],
                         env={**os.environ, **env}, capture_output=True, text=True)  # fmt: skip
    assert "export FLASHCKPT_JOB=llama-70b-pretrain" in out.stdout, out.stderr


def test_the_last_nodes_of_the_allocation_are_the_spares():
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NAME": "run", "SLURM_JOB_NUM_NODES": "3",
           "FLASHCKPT_SPARES": "1"}  # fmt: skip
    first, last = (slurm.settings({**env, "SLURM_NODEID": i}) for i in ("0", "2"))
    assert first["FLASHCKPT_NNODES"] == last["FLASHCKPT_NNODES"] == "2"
    assert "FLASHCKPT_SPARE" not in first and last["FLASHCKPT_SPARE"] == "1"
    assert first["FLASHCKPT_RDZV_HOST"] == "n1"
    for bad in ("3", "-1", "one"):
        with pytest.raises(ConfigError, match="FLASHCKPT_SPARES"):
            slurm.settings({**env, "SLURM_NODEID": "0", "FLASHCKPT_SPARES": bad})
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        slurm.settings(env)


def test_the_first_node_serves_the_control_plane_in_a_step_of_its_own():
    """``FLASHCKPT_CONTROL_NODE=1``: node n1 serves the control plane and trains nothing; a
    node's place is its name's in the list, since the two job steps each count node ids from 0
    (the training step's first node has SLURM_NODEID 0 too)."""
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NAME": "run", "SLURM_JOB_NUM_NODES": "4",
           "FLASHCKPT_CONTROL_NODE": "1", "FLASHCKPT_SPARES": "1"}  # fmt: skip
    control, n2, n4 = (slurm.settings({**env, "SLURMD_NODENAME": name, "SLURM_NODEID": "0"})
                       for name in ("n1", "n2", "n4"))  # fmt: skip
    assert control["FLASHCKPT_CONTROL"] == "1" and "FLASHCKPT_CONTROL" not in n2
    assert {s["FLASHCKPT_CONTROL_HOST"] for s in (control, n2, n4)} == {"n1"}
    assert n2["FLASHCKPT_NNODES"] == "2"  # four nodes: the control node, two trainers, a spare
    assert "FLASHCKPT_SPARE" not in n2 and n4["FLASHCKPT_SPARE"] == "1"
    for bad in ("2", "yes"):
        with pytest.raises(ConfigError, match="FLASHCKPT_CONTROL_NODE"):
            slurm.settings({**env, "SLURMD_NODENAME": "n2", "FLASHCKPT_CONTROL_NODE": bad})
    with pytest.raises(ConfigError, match="not in SLURM_JOB_NODELIST"):
        slurm.settings({**env, "FLASHCKPT_SPARES": "0", "SLURMD_NODENAME": "elsewhere"})
    # Without it, the first node trains and serves the rendezvous and the controller.
    plain = slurm.settings({**env, "FLASHCKPT_CONTROL_NODE": "0", "SLURM_NODEID": "0"})
    assert "FLASHCKPT_CONTROL_HOST" not in plain and plain["FLASHCKPT_NNODES"] == "3"


@pytest.mark.slow
def test_the_sbatch_launch_line_runs_a_fault_tolerant_job_on_two_nodes(tmp_path, reference):
    """train.sbatch's two job steps by hand: node 0 of the allocation serves the control plane
    (etcd, the controller and the recovery store; ``FLASHCKPT_CONTROL_NODE=1``), nodes 1 and 2
    train, under in-process recovery. Rank 3 killed after step 12 is replaced in-process, and
    the job ends bit-identical under the Slurm job's name."""
    import control_plane

    if why := control_plane.unavailable():
        pytest.skip(why)
    etcd, controller, peer = free_port(), free_port_pair(), free_port()
    job_name = "slurm-test/requeued"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    hosts = [f"127.0.0.{n + 1}" for n in range(NODES + 1)]
    procs, logs = [], []

    def launch(node: int, step_id: int) -> None:
        env = {**os.environ, "PATH": path, "SLURM_JOB_NODELIST": f"127.0.0.[1-{NODES + 1}]",
               "SLURM_JOB_NUM_NODES": str(NODES + 1), "SLURM_JOB_NAME": job_name,
               "SLURM_JOB_ID": "1000", "SLURMD_NODENAME": hosts[node], "SLURM_NODEID": str(step_id),
               "FLASHCKPT_CONTROL_NODE": "1", "FLASHCKPT_ETCD": str(control_plane.etcd_binary()),
               "RDZV_PORT": str(etcd), "RDZV_PEER_PORT": str(peer),
               "CONTROLLER_PORT": str(controller), "TMPDIR": str(tmp_path),
               "NPROC_PER_NODE": str(PER_NODE), "FLASHCKPT_CONTROLLER_TOKEN": TOKEN,
               "FLASHCKPT_SHM_DIR": f"/dev/shm/fc-slurm-{etcd}-{node}",
               "FLASHCKPT_RUN_DIR": str(tmp_path / f"run{node}"), "FT_MARKS": str(tmp_path),
               "FT_DIGEST": str(tmp_path / "digest"), "FT_FAULTS": "kill:3:12",
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        for inherited in ("FLASHCKPT_CONTROLLER", "FLASHCKPT_JOB", "FLASHCKPT_RESTART_POLICY"):
            env.pop(inherited, None)
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115
        logs.append(log)
        procs.append(subprocess.Popen(["bash", str(LAUNCH), str(INPROCESS)], env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip

    try:
        launch(0, 0)  # the control plane's step
        assert poll(lambda: "recovery store serving" in (tmp_path / "node0.log").read_text(), 60), (
            (tmp_path / "node0.log").read_text()[-3000:])  # fmt: skip
        for node in range(1, NODES + 1):  # the training step: its node ids count from 0
            launch(node, node - 1)
        codes = [p.wait(240) for p in procs[1:]]
        os.killpg(procs[0].pid, signal.SIGTERM)  # train.sbatch ends the control plane's step
        control_code = procs[0].wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for log in logs:
            log.close()
        for node in range(NODES + 1):
            subprocess.run(["rm", "-rf", f"/dev/shm/fc-slurm-{etcd}-{node}"], check=False)
    text = "".join((tmp_path / f"node{n}.log").read_text() for n in range(NODES + 1))
    assert codes == [0] * NODES, text[-4000:]
    assert control_code == 0, (tmp_path / "node0.log").read_text()[-3000:]
    job = "slurm-test-requeued"  # the Slurm job's name, not its id
    events = [read_events(events_path(tmp_path / f"run{n}", job)) for n in range(1, NODES + 1)]
    recovered = [e for e in events[1] if e["kind"] == "inprocess_recovered"]
    assert recovered and recovered[0]["ranks"] == [3], text[-4000:]
    assert {e["node"] for e in events[1]} <= {hosts[2]}
    assert (tmp_path / "digest").read_text() == reference
