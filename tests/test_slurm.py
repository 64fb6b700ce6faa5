"""Slurm: compressed node lists expanded as Slurm expands them, the job named after the Slurm
job (not its id, which a requeue does not keep), and ``examples/slurm/launch.sh``, the line
``train.sbatch`` runs on every node through srun, run by hand on two simulated nodes of this
machine with the allocation's variables set as Slurm sets them: a killed rank is brought
back and the job ends bit-identical to an undisturbed run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from ports import free_port_pair
from test_launcher import NODES, PER_NODE, TOKEN, TRAINER, restores

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


@pytest.mark.slow
def test_the_sbatch_launch_line_runs_a_fault_tolerant_job_on_two_nodes(tmp_path, reference):
    # The controller takes the rendezvous port + 1 (FLASHCKPT_CONTROLLER unset): both free.
    port, job_name = free_port_pair(), "slurm-test/requeued"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    procs, logs = [], []
    for node in range(NODES):
        env = {**os.environ, "PATH": path, "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
               "SLURM_JOB_NUM_NODES": str(NODES), "SLURM_JOB_NAME": job_name,
               "SLURM_JOB_ID": str(1000 + node), "SLURMD_NODENAME": f"sn{node}",
               "NPROC_PER_NODE": str(PER_NODE), "RDZV_PORT": str(port),
               "FLASHCKPT_CONTROLLER_TOKEN": TOKEN, "FLASHCKPT_SHM_DIR": f"/dev/shm/fc-slurm-{port}-{node}",
               "FLASHCKPT_RUN_DIR": str(tmp_path / f"run{node}"), "FT_MARKS": str(tmp_path),
               "FT_DIGEST": str(tmp_path / "digest"), "FT_FAULT": "kill", "FT_RANK": "3",
               "FT_STEP": "12", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        for inherited in ("FLASHCKPT_CONTROLLER", "FLASHCKPT_JOB"):
            env.pop(inherited, None)
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115
        logs.append(log)
        procs.append(subprocess.Popen(["bash", str(LAUNCH), str(TRAINER)], env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    try:
        codes = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for log in logs:
            log.close()
        for node in range(NODES):
            subprocess.run(["rm", "-rf", f"/dev/shm/fc-slurm-{port}-{node}"], check=False)
    text = "".join((tmp_path / f"node{n}.log").read_text() for n in range(NODES))
    assert codes == [0] * NODES, text[-4000:]
    job = "slurm-test-requeued"  # the Slurm job's name, not its id
    events = [read_events(events_path(tmp_path / f"run{n}", job)) for n in range(NODES)]
    resumed = {**restores(events[0]), **restores(events[1])}
    assert sorted(resumed) == list(range(NODES * PER_NODE)), text[-4000:]
    assert {e["step"] for e in resumed.values()} == {12}, resumed
    assert {e["node"] for e in events[1]} <= {"sn1"}
    assert (tmp_path / "digest").read_text() == reference
