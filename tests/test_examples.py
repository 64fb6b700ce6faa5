"""The runnable examples (``examples/train_ddp.py``, ``train_fsdp2.py``, ``train_deepspeed.py``)
run for real on 2 gloo ranks: one rank SIGKILLs itself mid-way, the job resumes from its flash
checkpoints, and the final parameters equal those of an undisturbed run, bit for bit.

DDP and FSDP2 run under ``flashckpt-run --max-restarts=1``, which restarts the workers after
the kill; DeepSpeed runs under DeepSpeed's own launcher on CPU, whose run fails with the
killed rank, and the same command run again resumes through ``load_checkpoint``.

The Kubernetes controller example is read, and its ports checked against its settings.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, descendants
from ports import free_port

EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
FINAL = re.compile(r"^final: steps=(\d+) resumed_after_step=(\w+) sha256=([0-9a-f]{64})$", re.M)


def launch(cmd: list[str], env: dict, timeout: float = 240) -> tuple[int, str]:
    """Run a launcher to its end; (exit code, stdout and stderr). Whatever it leaves behind
    (workers in their own sessions included) is killed, also when it runs out of time."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd[:4]}... ran past {timeout}s:\n{out[-4000:]}") from None
    finally:
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, out


def final(out: str) -> tuple[str, str]:
    """(the step the run resumed after, or "none"; the parameters' sha256) from rank 0's last
    line."""
    found = FINAL.findall(out)
    assert len(found) == 1, f"expected one final line:\n{out[-4000:]}"
    return found[0][1], found[0][2]


@pytest.fixture
def example_env(shm_dir, run_dir):
    """The environment of one example run: this test's shared-memory and run directories."""

    def env(job: str, **extra: str) -> dict:
        return {**os.environ, "FLASHCKPT_SHM_DIR": str(shm_dir), "FLASHCKPT_RUN_DIR": str(run_dir),
                "FLASHCKPT_JOB": job, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **extra}  # fmt: skip

    return env


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "example,steps,kill_at", [("train_ddp.py", 30, 14), ("train_fsdp2.py", 20, 9)]
)
def test_a_killed_rank_is_restarted_by_flashckpt_run_and_resumes_bit_exact(
    example_env, tmp_path, example, steps, kill_at
):
    """Undisturbed under torchrun, then under flashckpt-run with rank 1 SIGKILLed after step
    ``kill_at``: the restarted workers restore that step (not an older one, not a fresh
    start) and end with the undisturbed run's parameters."""
    script = EXAMPLES / example
    ref_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(script), "--steps", str(steps),
               "--tier", f"file://{tmp_path / 'ref'}"]  # fmt: skip
    code, out = launch(ref_cmd, example_env("ex-ref"))
    assert code == 0, out[-4000:]
    resumed, ref_sha = final(out)
    assert resumed == "none" and "SIGKILL" not in out

    cmd = [str(BIN / "flashckpt-run"), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(script), "--steps", str(steps), "--tier", f"file://{tmp_path / 'tier'}"]  # fmt: skip
    code, out = launch(cmd, example_env("ex-killed", KILL_AT_STEP=str(kill_at)))
    assert code == 0, out[-4000:]
    assert f"[rank 1] SIGKILL after step {kill_at}" in out, out[-4000:]
    assert f"resuming after step {kill_at}: steps {kill_at + 1}.." in out, out[-4000:]
    resumed, sha = final(out)
    assert resumed == str(kill_at)
    assert sha == ref_sha, "the resumed run's parameters differ from the undisturbed run's"
    # The agent persisted the steps to the tier as they were saved.
    assert any((tmp_path / "tier").rglob("*")), "nothing was persisted to the tier"


@pytest.fixture
def ds_ports():
    """Master ports for DeepSpeed launcher runs; DeepSpeed's CPU all-reduce buffers that its
    ranks leave in /dev/shm (named after the port) are removed afterwards."""
    ports: list[int] = []

    def port() -> int:
        ports.append(free_port())
        return ports[-1]

    yield port
    for port in ports:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(420)  # the first DeepSpeed run on a machine builds its CPU comm op
def test_deepspeed_launcher_run_killed_then_rerun_resumes_through_load_checkpoint(
    example_env, tmp_path, ds_ports
):
    """ZeRO stage 2 under ``deepspeed --num_gpus 2`` on CPU: an undisturbed run; then a run
    whose rank 1 SIGKILLs itself after step 11 (the launcher fails), and the same command run
    again, which loads the latest tag (step 11) and ends with the undisturbed parameters."""
    pytest.importorskip("deepspeed")
    steps, kill_at = 20, 11

    def cmd(save_dir: Path) -> list[str]:
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                "--master_port", str(ds_ports()), str(EXAMPLES / "train_deepspeed.py"),
                "--steps", str(steps), "--save-dir", str(save_dir),
                "--kill-at", str(kill_at)]  # fmt: skip

    ref_env = example_env("ex-ds-ref", DS_ACCELERATOR="cpu")
    code, out = launch(cmd(tmp_path / "ref") + ["--kill-at", "-1"], ref_env, timeout=300)
    assert code == 0, out[-4000:]
    resumed, ref_sha = final(out)
    assert resumed == "none" and "SIGKILL" not in out

    env = example_env("ex-ds", DS_ACCELERATOR="cpu")
    save_dir = tmp_path / "ckpt"
    code, out = launch(cmd(save_dir), env)
    assert code != 0, "the launcher was meant to fail with its killed rank:\n" + out[-4000:]
    assert f"[rank 1] SIGKILL after step {kill_at}" in out, out[-4000:]
    assert not FINAL.search(out)
    # DeepSpeed's layout, its files pointing at the flash snapshots (global_steps counts from 1).
    assert (save_dir / "latest").read_text() == f"global_step{kill_at + 1}"

    code, out = launch(cmd(save_dir), env)  # the same command again
    assert code == 0, out[-4000:]
    assert "SIGKILL" not in out
    resumed, sha = final(out)
    assert resumed == str(kill_at)
    assert sha == ref_sha, "the resumed run's parameters differ from the undisturbed run's"


def test_the_kubernetes_controller_service_exposes_the_controller_and_the_recovery_store():
    """Under in-process recovery the standalone controller serves the recovery store too: the
    example fixes the store's port and exposes it, in the pod and in the Service, with etcd's
    for the rendezvous."""
    import yaml

    from flashckpt.faults import control
    from flashckpt.faults.inprocess import STORE_ENV

    path = EXAMPLES / "kubernetes" / "controller.yaml"
    deployment, service = yaml.safe_load_all(path.read_text())
    container, etcd = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    store_port = control.split_address(env[STORE_ENV], STORE_ENV)[1]
    bind = container["command"][container["command"].index("--bind") + 1]
    wanted = {"controller": control.split_address(bind)[1], "recovery-store": store_port}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == wanted
    # The rendezvous beside it: etcd with the v2 API that torch's etcd-v2 backend speaks.
    assert "--enable-v2" in etcd["command"]
    wanted["etcd"] = etcd["ports"][0]["containerPort"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, port) for name, port in wanted.items()
    }
    name = service["metadata"]["name"]
    assert f"{STORE_ENV}={name}:{store_port}" in path.read_text()


def test_the_kubernetes_spare_node_runs_the_jobs_launch_line_with_spare():
    """The spare pod's flashckpt-run parses as a spare of the controller example's job: the
    launcher's own flag stripped before torchrun's arguments, in-process recovery, and the
    controller and store that controller.yaml serves."""
    import yaml

    from flashckpt.faults.spare import split_flag

    pod = yaml.safe_load((EXAMPLES / "kubernetes" / "spare-node.yaml").read_text())
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[0] == "flashckpt-run"
    argv, spare = split_flag(command[1:])
    assert spare and "--spare" not in argv and argv[-1] == "train.py"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLASHCKPT_RESTART_POLICY"] == "in-process"
    controller = (EXAMPLES / "kubernetes" / "controller.yaml").read_text()
    # The rendezvous is the control plane's etcd, on no training node.
    assert "--rdzv-backend=etcd-v2" in argv
    assert "--rdzv-endpoint=flashckpt-controller-run1:2379" in argv
    for name in ("FLASHCKPT_CONTROLLER", "FLASHCKPT_RECOVERY_STORE"):
        assert (
            env[name].split(":")[0] == "flashckpt-controller-run1"
            and env[name].split(":")[1] in controller
        )


@pytest.mark.slow
def test_lightning_example_killed_mid_run_resumes_to_the_same_weights(example_env, tmp_path):
    """examples/train_lightning.py (one process) SIGKILLs itself after step 35 (it saves every
    10 steps); the same command run again resumes from last.ckpt (step 30, from shared memory)
    and ends with the weights of a run that was never killed."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("torchdata")

    def run(directory: Path, job: str, *args: str) -> subprocess.Popen:
        cmd = [sys.executable, str(EXAMPLES / "train_lightning.py"), "--dir", str(directory), *args]
        return subprocess.Popen(cmd, env=example_env(job), cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip

    def digest(out: str) -> str:
        [line] = [ln for ln in out.splitlines() if ln.startswith("digest ")]
        return line.split()[1]

    whole = run(tmp_path / "whole", "ex-pl-ref")  # alongside: the machine has two cores
    first = run(tmp_path / "run", "ex-pl", "--kill-at", "35")
    out, _ = first.communicate(timeout=120)
    assert first.returncode == -signal.SIGKILL, out[-4000:]
    assert "killed after step 35" in out
    second = run(tmp_path / "run", "ex-pl", "--kill-at", "35")  # the same command again
    resumed, _ = second.communicate(timeout=120)
    assert second.returncode == 0 and "resumed at step 30" in resumed, resumed[-4000:]
    reference, _ = whole.communicate(timeout=120)
    assert whole.returncode == 0, reference[-4000:]
    assert digest(resumed) == digest(reference)
