"""What in-process recovery needs of NCCL and CUDA: the launcher sets the variables a survivor
needs (or refuses settings that would tear it down), a process whose CUDA context holds a
sticky error never rejoins a round, and an NCCL too old to abort safely is named."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashckpt.errors import ConfigError
from flashckpt.faults import inprocess
from flashckpt.faults.inprocess import NCCL_ENV, cuda_healthy, nccl_environment

LAUNCHER = Path(sys.executable).parent / "flashckpt-run"


def test_the_nccl_settings_are_set_when_unset_and_refused_when_contrary():
    assert nccl_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                                    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                                    "NCCL_NVLS_ENABLE": "0"}  # fmt: skip
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) == {
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_NVLS_ENABLE": "1"})
    for name in NCCL_ENV:  # every requirement listed, with what was found
        assert name in str(err.value)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in str(err.value)


WORKER = """
import os
print("env", *(os.environ.get(k) for k in
               ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
                "NCCL_NVLS_ENABLE")))
"""


def _launch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    full = {**os.environ, "FLASHCKPT_RESTART_POLICY": "in-process", "FLASHCKPT_STANDBY": "0",
            "FLASHCKPT_SHM_DIR": str(tmp_path / "shm"), "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
            **env}  # fmt: skip
    for name in NCCL_ENV:
        if name not in env:
            full.pop(name, None)
    return subprocess.run([str(LAUNCHER), "--standalone", "--nproc-per-node", "1", str(script)],
                          env=full, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_launcher_gives_its_workers_the_settings_and_refuses_contrary_ones(tmp_path):
    ran = _launch(tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "env 0 0 0" in ran.stdout
    refused = _launch(tmp_path, TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    assert refused.returncode != 0
    assert "in-process recovery needs" in refused.stderr and "Traceback" not in refused.stderr


class Cuda:
    """Stands in for ``torch.cuda`` (no device here): a context with a sticky error."""

    def __init__(self, initialized: bool = True, error: str | None = None):
        self.initialized, self.error = initialized, error

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError(self.error)


def test_a_sticky_cuda_error_keeps_the_process_out_of_the_next_round(caplog):
    assert cuda_healthy(Cuda(initialized=False))  # no context made: nothing to check
    assert cuda_healthy(Cuda())
    with caplog.at_level(logging.ERROR):
        assert not cuda_healthy(Cuda(error="CUDA error: an illegal memory access"))
    assert "cannot rejoin in place" in caplog.text
    assert cuda_healthy()  # this machine's own torch.cuda


def test_an_nccl_older_than_in_process_recovery_needs_is_named(monkeypatch, caplog):
    import torch

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    with caplog.at_level(logging.WARNING):
        inprocess._check_nccl("nccl")
        inprocess._check_nccl("gloo")
    assert caplog.text.count("NCCL 2.21.5 is older than 2.26.2") == 1
