"""Bad configuration fails when the Checkpointer is built (or at the call that first knows it),
as a ConfigError naming the setting, the value and what is expected; never a raw Python error
or a silent misreading."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_python

from flashckpt import Checkpointer, ConfigError, RankBusyError, StateMismatchError, config
from flashckpt.faults.agent_client import SOCKET_PATH_MAX
from flashckpt.format import layout
from flashckpt.snapshot.slots import ranks_in


@pytest.mark.parametrize(
    ("kwargs", "env", "needle"),
    [
        ({"rank": True}, {}, "argument rank=True is not valid: expected an integer from 0 to"),
        ({"rank": 2**40}, {}, f"argument rank={2**40} is not valid"),
        ({"rank": "3"}, {}, "argument rank='3' is not valid"),
        ({}, {"RANK": "abc"}, "RANK='abc' is not valid: expected an integer"),
        ({}, {"RANK": "-1"}, "RANK='-1' is not valid"),
        ({}, {"FLASHCKPT_CLOSE_TIMEOUT": "abc"}, "FLASHCKPT_CLOSE_TIMEOUT='abc' is not valid"),
        ({}, {"FLASHCKPT_CLOSE_TIMEOUT": "nan"}, "FLASHCKPT_CLOSE_TIMEOUT='nan' is not valid"),
        ({"close_timeout": -1}, {}, "argument close_timeout=-1 is not valid: expected a number"),
        ({}, {"FLASHCKPT_OVERLAP": "maybe"}, "FLASHCKPT_OVERLAP='maybe' is not valid: expected"),
        ({"overlap": "no"}, {}, "argument overlap='no' is not valid"),
        ({"allow_pickle": "no"}, {}, "argument allow_pickle='no' is not valid: expected True"),
        ({"verify": 0}, {}, "argument verify=0 is not valid"),
        ({"chunk_size": True}, {}, "chunk_size must be a positive multiple of 64, got True"),
        ({}, {"FLASHCKPT_LIST_RETRY_S": "-1"}, "FLASHCKPT_LIST_RETRY_S='-1' is not valid"),
    ],
)
def test_bad_settings_fail_when_built_naming_setting_and_value(
    shm_dir, monkeypatch, kwargs, env, needle
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        Checkpointer(job="cfg", **kwargs)
    assert needle in str(err.value)
    if env:
        assert f"fix or unset {next(iter(env))}" in str(err.value)


def test_good_settings_from_the_environment(shm_dir, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_CLOSE_TIMEOUT", " 12.5")
    monkeypatch.setenv("FLASHCKPT_OVERLAP", "Off")
    monkeypatch.setenv("RANK", "7")
    ck = Checkpointer(job="cfg")
    assert (ck.close_timeout, ck.overlap, ck.rank) == (12.5, False, 7)
    ck.close()
    assert Checkpointer(job="cfg", rank=config.MAX_RANK, overlap=True).rank == 2**31 - 1


def test_typed_getters_range_and_source(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_X_TEST", "5")
    assert config.setting_int("x_test", None, 0, lo=1, hi=9) == 5
    assert config.setting_int("x_test", 7, 0, lo=1, hi=9) == 7  # the argument wins
    with pytest.raises(ConfigError, match=r"argument x_test=10 is not valid: .* from 1 to 9"):
        config.setting_int("x_test", 10, 0, lo=1, hi=9)
    with pytest.raises(ConfigError, match=r"argument x_test='5' is not valid"):
        config.setting_int("x_test", "5", 0)  # text is parsed from the environment only
    monkeypatch.setenv("FLASHCKPT_X_TEST", "12")
    with pytest.raises(ConfigError, match=r"FLASHCKPT_X_TEST='12' is not valid: .* from 1 to 9"):
        config.setting_int("x_test", None, 0, lo=1, hi=9)
    monkeypatch.delenv("FLASHCKPT_X_TEST")
    assert config.setting_float("x_test", None, 2.5) == 2.5
    monkeypatch.setenv("FLASHCKPT_X_TEST", "YES")
    assert config.setting_bool("x_test") is True


def test_step_past_int64_is_a_config_error_before_anything_is_written(shm_dir):
    with Checkpointer(job="big") as ck:
        ck.save(2**63 - 1, {"t": torch.ones(2)})  # the largest step the header holds
        with pytest.raises(
            ConfigError, match=r"at most 2\*\*63-1 .* signed 64-bit.*got 9223372036854775808"
        ):
            ck.save(2**63, {"t": torch.ones(2)})
        out = {"t": torch.zeros(2)}
        assert ck.restore(out) == 2**63 - 1 and torch.equal(out["t"], torch.ones(2))


@pytest.mark.parametrize("bad", ["abc\n", "run1\n", "a\nb"])
def test_job_name_with_a_newline_is_refused(shm_dir, monkeypatch, bad):
    with pytest.raises(ConfigError, match="job name"):
        Checkpointer(job=bad)
    monkeypatch.setenv("FLASHCKPT_JOB", bad)
    with pytest.raises(ConfigError, match=r"job name .* \(from FLASHCKPT_JOB\) is not allowed"):
        Checkpointer()


def test_tier_and_slot_names_with_a_newline_are_not_read_as_steps_or_ranks(shm_dir):
    s5, s6 = layout.step_dir(5), layout.step_dir(6)
    assert layout.parse_keys("j", [f"j/{s5}\n/commit-n.json", f"j/{s6}/commit-n.json\n"]) == {
        (0, 6): []
    }
    assert layout.parse_keys("j", [f"j/{s6}/commit-n.json"]) == {(0, 6): [f"j/{s6}/commit-n.json"]}
    (shm_dir / "j").mkdir(parents=True)
    (shm_dir / "j" / "rank-3.slot-0\n").write_bytes(b"")
    (shm_dir / "j" / "rank-4.slot-1").write_bytes(b"")
    assert ranks_in(shm_dir, "j") == [4]


# ---- the agent's unix socket ------------------------------------------------------------------


def test_a_long_valid_job_name_still_gets_a_socket_and_persists(shm_dir, run_dir, tmp_path):
    job = "j" * 128  # the longest valid name: <run_dir>/<job>.sock would pass the unix limit
    assert len(os.fsencode(run_dir / f"{job}.sock")) > SOCKET_PATH_MAX
    url = f"file://{tmp_path / 'nvme'}"
    t0 = time.monotonic()
    with Checkpointer(url, job=job) as ck:
        ck.save(3, {"t": torch.arange(10.0)})
        assert ck.wait(3, tier=url, timeout=30) == 3
    assert time.monotonic() - t0 < 25
    (sock,) = [p for p in run_dir.iterdir() if p.suffix == ".sock"]
    assert len(os.fsencode(sock)) <= SOCKET_PATH_MAX and sock.name.startswith("j" * 16 + "-")


def test_a_run_dir_too_long_for_any_socket_fails_when_built(shm_dir, tmp_path):
    deep = Path(tempfile.mkdtemp(prefix="fc-", dir="/tmp")) / ("d" * 90)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            Checkpointer(f"file://{tmp_path}", job="j", run_dir=str(deep))
        assert time.monotonic() - t0 < 5
        text = str(err.value)
        assert f"holds at most {SOCKET_PATH_MAX}" in text and "FLASHCKPT_RUN_DIR" in text
        Checkpointer(job="j", run_dir=str(deep)).close()  # no tier: no agent, no socket
        agent = subprocess.run(
            [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", "j", "--run-dir",
             str(deep), "--shm-dir", str(shm_dir)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert agent.returncode == 1
        assert f"flashckpt-agent: the agent's socket {deep}" in agent.stderr
        assert "Traceback" not in agent.stderr
    finally:
        shutil.rmtree(deep.parent, ignore_errors=True)


# ---- run and shm directories that cannot be written ---------------------------------------------


def test_run_dir_that_cannot_be_created_is_a_config_error(shm_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(
        ConfigError,
        match=r"argument run_dir '.*file/run' cannot be used: its parent directory cannot be created",
    ):
        Checkpointer(f"file://{tmp_path}", job="j", run_dir=str(blocker / "run"))
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(blocker / "shm"))
    with pytest.raises(ConfigError, match=r"FLASHCKPT_SHM_DIR '.*file/shm' cannot be used"):
        Checkpointer(job="j")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces")
def test_read_only_run_dir_is_a_config_error_when_built(shm_dir, tmp_path):
    """A real read-only mount (even root cannot write it), owned by us and mode 0700."""
    ro = tmp_path / "ro"
    ro.mkdir()
    code = (
        "from flashckpt import Checkpointer, ConfigError\n"
        "try:\n"
        f"    Checkpointer('file://{tmp_path}/t', job='j', run_dir={str(ro)!r})\n"
        "except ConfigError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro,mode=0700 tmpfs "{ro}" && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"refused: argument run_dir {str(ro)!r} cannot be used: it is not writable" in out.stdout


# ---- a failed restore and a second Checkpointer in the same process -----------------------------


def test_failed_restore_releases_the_rank(shm_dir):
    # A trainer that dies without close() leaves its snapshot in shared memory.
    run_python(
        "import os, torch; from flashckpt import Checkpointer\n"
        "ck = Checkpointer(job='rel'); ck.save(4, {'t': torch.ones(4)}); os._exit(0)\n"
    )
    first = Checkpointer(job="rel")
    with pytest.raises(StateMismatchError):
        first.restore({"t": torch.zeros(5)})  # the wrong shape: restore fails
    second = Checkpointer(job="rel")
    out = {"t": torch.zeros(4)}
    assert second.restore(out) == 4 and torch.equal(out["t"], torch.ones(4))
    second.save(5, {"t": torch.ones(4) * 5})
    # The first one, used again, is told clearly that this process's other one has the rank.
    with pytest.raises(RankBusyError) as err:
        first.save(5, {"t": torch.ones(4)})
    assert f"this process (pid {os.getpid()})" in str(err.value) and "close()" in str(err.value)
    first.close()  # not the owner: must leave the second one's slots alone
    assert second.restore({"t": torch.zeros(4)}) == 5
    second.close()
    assert not (shm_dir / "rel").exists()


def test_second_open_checkpointer_in_one_process_is_told_to_close_the_first(shm_dir):
    a = Checkpointer(job="two")
    a.save(1, {"t": torch.ones(1)})
    with pytest.raises(RankBusyError) as err:
        Checkpointer(job="two").save(1, {"t": torch.ones(1)})
    text = str(err.value)
    assert f"already saving from this process (pid {os.getpid()})" in text
    assert "close() the other Checkpointer" in text and "?" not in text
    a.close()
    with Checkpointer(job="two") as b:
        b.save(2, {"t": torch.ones(1)})


# ---- claims: racing owners, and the holder's pid -------------------------------------------------

RACER = """
import fcntl, os, random, sys, time
from pathlib import Path
from flashckpt.errors import RankBusyError
from flashckpt.snapshot.slots import SlotPair

real_flock = fcntl.flock


def preempted_flock(fd, op):  # the scheduler may pause a claimer between open() and flock()
    time.sleep(random.random() / 1000)
    return real_flock(fd, op)


fcntl.flock = preempted_flock

shm, flag, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
owned = 0
for _ in range(rounds):
    pair = SlotPair(shm, "race", 0)
    try:
        pair.claim()
    except RankBusyError:
        continue
    try:  # while we hold the claim, no one else may
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        print("two owners at once", flush=True)
        sys.exit(3)
    owned += 1
    os.unlink(flag)
    pair.close(remove=True)  # unlinks the owner file (and the emptied job dir)
print(owned)
"""


def test_racing_owners_never_both_hold_a_rank(shm_dir, tmp_path):
    """Owners that close (unlinking the owner file) while others open and lock it."""
    flag = tmp_path / "held"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(shm_dir), str(flag), "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(4)
    ]
    results = [r.communicate(timeout=240) for r in racers]
    for racer, (out, err) in zip(racers, results, strict=True):
        assert racer.returncode == 0, out + err[-3000:]
    assert sum(int(out) for out, _ in results) >= 400  # they did take turns


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))  # locked but its pid not written yet
if sys.argv[3] == "write":
    os.pwrite(fd, str(os.getpid()).encode(), 0)
sys.stdin.read()
"""


@pytest.mark.parametrize("writes", [True, False], ids=["pid-written-late", "pid-never-written"])
def test_busy_rank_never_names_its_holder_as_a_question_mark(shm_dir, writes):
    owner = shm_dir / "pidj" / "rank-0.owner"
    owner.parent.mkdir(parents=True, mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(owner), "0.2", "write" if writes else "no"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RankBusyError) as err:
            Checkpointer(job="pidj").save(1, {"t": torch.ones(1)})
        text = str(err.value)
        assert "pid ?" not in text
        if writes:
            assert f"already saving from pid {holder.pid};" in text
        else:
            assert "another process, whose pid is not recorded yet" in text
    finally:
        holder.kill()
        holder.wait()


# ---- the default job name ---------------------------------------------------------------------


def test_default_job_name_is_stable_across_reruns(monkeypatch, tmp_path, caplog):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.delenv("FLASHCKPT_JOB", raising=False)
    caplog.set_level(logging.INFO, logger="flashckpt.config")

    def job(argv: list[str], run_id: str | None) -> str:
        monkeypatch.setattr(sys, "argv", argv)
        if run_id is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        return config.resolve_job(None)

    args = [str(script), "--lr", "0.1"]
    first = job(args, str(uuid.uuid4()))  # torchrun --standalone: a new uuid4 every run
    assert re.fullmatch(r"train-[0-9a-f]{8}", first)
    assert job(args, str(uuid.uuid4())) == first
    assert job(args, "none") == first  # torchrun's placeholder --rdzv-id
    assert job(args, None) == first  # plain python
    assert job([*args, "--local-rank=3"], None) == first  # added per worker by the launcher
    assert job([str(script), "--lr", "0.2"], None) != first
    assert "the same for every rerun of this command" in caplog.text and first in caplog.text
    assert job(args, "nightly-42") == "nightly-42"  # a real --rdzv-id
    monkeypatch.setenv("FLASHCKPT_JOB", "mine")
    assert job(args, "nightly-42") == "mine"
    assert "job name 'mine' (from FLASHCKPT_JOB)" in caplog.text
    monkeypatch.delenv("FLASHCKPT_JOB")
    assert job(["-c"], str(uuid.uuid4())) == "default"
    assert config.resolve_job(None, from_command=False) == "default"  # a daemon's own argv


JOB_PRINTER = """
from flashckpt import Checkpointer
import os
if os.environ["RANK"] == "0":
    print("JOB", Checkpointer().job, flush=True)
"""


@pytest.mark.slow
def test_torchrun_standalone_reruns_get_the_same_job(shm_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(JOB_PRINTER)
    env = {k: v for k, v in os.environ.items() if k != "FLASHCKPT_JOB"}
    jobs = []
    for extra in (["--standalone"], ["--standalone"], []):
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *extra, "--nproc-per-node", "1", str(script)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=180,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        jobs.append(
            next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("JOB"))
        )
    assert jobs[0] == jobs[1] == jobs[2] and jobs[0].startswith("train-")


def test_a_bad_peer_timeout_fails_when_built(shm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_PEER_REPLICAS", "1")
    monkeypatch.setenv("FLASHCKPT_PEER_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="FLASHCKPT_PEER_TIMEOUT='0' is not valid: expected"):
        Checkpointer(f"file://{tmp_path}/tier", job="cfg", run_dir=tmp_path / "run")


@pytest.mark.parametrize("name", config.AGENT_NUMBERS)
def test_a_bad_agent_setting_fails_when_built_not_in_the_agents_log(
    shm_dir, tmp_path, monkeypatch, name
):
    monkeypatch.setenv(f"FLASHCKPT_{name.upper()}", "abc")
    with pytest.raises(ConfigError, match=f"FLASHCKPT_{name.upper()}='abc' is not valid"):
        Checkpointer(f"file://{tmp_path}/tier", job="cfg", run_dir=tmp_path / "run")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"FLASHCKPT_KILL_GRACE": "abc"}, "FLASHCKPT_KILL_GRACE='abc' is not valid"),
        ({"FLASHCKPT_EXIT_WHEN_IDLE": "x"}, "FLASHCKPT_EXIT_WHEN_IDLE='x' is not valid"),
        (
            {"FLASHCKPT_CONTROLLER": "nohost"},
            "FLASHCKPT_CONTROLLER must be host:port, got 'nohost'",
        ),
    ],
)
def test_the_launcher_refuses_bad_settings_before_starting_anything(shm_dir, tmp_path, env, needle):
    script = tmp_path / "never.py"
    script.write_text("print('worker started')\n")
    launcher = Path(sys.executable).parent / "flashckpt-run"
    full = {**os.environ, "FLASHCKPT_RUN_DIR": str(tmp_path / "run"), **env}
    proc = subprocess.run([str(launcher), "--standalone", "--nproc-per-node=1", str(script)],
                          env=full, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and f"flashckpt-run: {needle}" in proc.stderr
    assert "worker started" not in proc.stdout + proc.stderr
