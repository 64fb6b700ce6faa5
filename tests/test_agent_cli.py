"""The installed ``flashckpt-agent`` console script: ``--version``, help on every option, bad
inputs refused in one line (exit 2) with no pid file left behind, credentials kept out of its
log; and ``flashckpt status`` reading a running agent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import METRICS, S3, wait_for
from flashckpt.agent.cli import build_parser

from flashckpt.faults import control

AGENT = Path(sys.executable).parent / "flashckpt-agent"
FLASHCKPT = Path(sys.executable).parent / "flashckpt"
KEY_ID, SEKRET = "AKIAAGENTKEYID000042", "agent-sEkReT-never-shown-77"


def run(script: Path, *args: object) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(script), *map(str, args)], capture_output=True, text=True,
                          env=os.environ, timeout=120)  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_every_option_has_help_text():
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"serve", "controller"}
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"flashckpt-agent {name} {action.option_strings}"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--job", "bad/name"], "flashckpt-agent: --job: job name 'bad/name' (from argument job) is not allowed"),
        (["--tier", "bogus:///x"], "flashckpt-agent: --tier: unknown tier scheme 'bogus'"),
        pytest.param(["--tier", f"s3://b/p?part_size=1&key={KEY_ID}&secret={SEKRET}"],
                     "flashckpt-agent: --tier: tier s3://b/p: part_size=1 is out of range",
                     marks=S3),
        (["--tier", "file:///tmp/x?keep_lats=3"], "tier file:///tmp/x: unknown option keep_lats"),
        (["--log-level", "LOUD"], "argument --log-level: 'LOUD' is not a log level: use one of DEBUG"),
    ],
)  # fmt: skip
def test_a_bad_input_is_one_line_exit_2_and_leaves_no_pid_file(run_dir, args, says):
    out = run(AGENT, "serve", "--job", "j", *args)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr.strip().splitlines()[-1]
    assert KEY_ID not in out.stderr and SEKRET not in out.stderr
    assert list(run_dir.iterdir()) == []  # no pid file, no socket


@METRICS
def test_no_command_version_and_a_failed_start_after_the_claim(run_dir):
    bare = run(AGENT)
    assert (
        bare.returncode == 2 and "usage: flashckpt-agent" in bare.stderr and "serve" in bare.stderr
    )
    from importlib.metadata import version

    assert run(AGENT, "--version").stdout.strip() == f"flashckpt-agent {version('flashckpt')}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run(AGENT, "serve", "--job", "j", "--metrics-port", taken.getsockname()[1])
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("flashckpt-agent: cannot serve: ")
    assert "pick another port" in out.stderr
    assert not (run_dir / "j.pid").exists()  # it had claimed the job: the claim went with it


def test_status_shows_the_agents_tiers_and_the_agent_logs_no_credentials(
    run_dir, shm_dir, s3_bucket, s3_server, tmp_path
):
    s3 = f"s3://{s3_bucket}/p?key={KEY_ID}&secret={SEKRET}&endpoint_url={s3_server.endpoint_url}"
    nvme = f"file://{tmp_path / 'nvme'}"
    log = tmp_path / "agent.log"
    with open(log, "w") as f:
        agent = subprocess.Popen([str(AGENT), "serve", "--job", "st", "--tier", nvme, "--tier", s3],
                                 stderr=f, env=os.environ)  # fmt: skip
    try:
        wait_for(lambda: (run_dir / "st.sock").exists(), 60, what="the agent's socket")
        control.Endpoint("127.0.0.1:9", "t" * 32).save(run_dir, "st")  # a controller gone
        shown = run(FLASHCKPT, "status")  # the only job with a live agent
        as_json = run(FLASHCKPT, "status", "--job", "st", "--json")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
    assert shown.returncode == 0, shown.stderr
    assert f"agent of job st on this node ({run_dir / 'st.sock'}): 2 tier(s)" in shown.stdout
    assert f"  s3://{s3_bucket}/p (shared): ok, last committed step none" in shown.stdout
    assert "controller 127.0.0.1:9: does not answer" in shown.stdout
    doc = json.loads(as_json.stdout)
    assert doc["ok"] and doc["job"] == "st" and doc["controller"]["answered"] is False
    assert [(t["url"], t["scope"], t["health"]) for t in doc["agent"]["tiers"]] == [
        (f"file://{tmp_path / 'nvme'}", "node", "ok"), (f"s3://{s3_bucket}/p", "shared", "ok")]  # fmt: skip
    written = log.read_text()
    assert "persisting to s3://" in written and "secret=***" in written
    for text in (written, shown.stdout + shown.stderr, as_json.stdout + as_json.stderr):
        assert KEY_ID not in text and SEKRET not in text
    gone = run(FLASHCKPT, "status", "--job", "st")
    assert gone.returncode == 1 and "no flashckpt agent runs for job st" in gone.stderr
    cleaned = run(FLASHCKPT, "gc", "shm")  # the stopped agent's pid and controller files
    assert cleaned.returncode == 0 and "removed job st:" in cleaned.stdout
    assert not (run_dir / "st.pid").exists() and not (run_dir / "st.controller").exists()
