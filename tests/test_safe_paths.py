"""Safe defaults on a shared node: private directories, files never opened through a planted
symlink, tier files 0600/0700, credentials never shown, crashed uploads' temporaries removed.

The attacks here come from this same user (planted symlinks, foreign-owned files made with
chown as root); tests/test_two_users.py runs them as another user for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import METRICS, wait_for
from flashckpt.agent.daemon import claim
from flashckpt.agent.metrics import Metrics
from flashckpt.agent.persist import TierWorker
from flashckpt.storage_tiers import open_tier, parse_spec
from flashckpt.storage_tiers.registry import redact

from flashckpt import Checkpointer, ConfigError, TierUnavailableError, config
from flashckpt.format import layout
from flashckpt.safe_paths import open_file, private_dir, write_atomic

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
SEKRET = "SEKRET-d41d8cd98f00"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file an attacker would like us to append to, truncate or grow."""
    path = tmp_path / "victim" / "precious"
    path.parent.mkdir()
    path.write_bytes(b"precious bytes\n")
    return path


def unchanged(victim: Path) -> bool:
    return victim.read_bytes() == b"precious bytes\n"


# ---- directories ------------------------------------------------------------------------------


def test_private_dir_is_created_0700_and_refuses_what_is_not_ours(tmp_path, victim):
    made = private_dir(tmp_path / "a" / "b", "FLASHCKPT_RUN_DIR")
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(victim.parent)
    with pytest.raises(
        ConfigError, match=r"FLASHCKPT_RUN_DIR '.*link' cannot be used: it is a symlink"
    ):
        private_dir(link, "FLASHCKPT_RUN_DIR")
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match=r"group or other users can write it \(mode 0777\)"):
        private_dir(loose, "FLASHCKPT_SHM_DIR")
    loose.chmod(0o1777)  # a sticky shared directory (a tmpfs mount point) may hold private ones
    assert private_dir(loose, "FLASHCKPT_SHM_DIR", shared_parent=True) == loose
    with pytest.raises(ConfigError, match="group or other users can write it"):
        private_dir(loose, "FLASHCKPT_RUN_DIR")  # but not be the run dir itself


@ROOT_ONLY
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=r"it is owned by .*uid 65534.*another user may have"):
        private_dir(theirs, "FLASHCKPT_SHM_DIR", shared_parent=True)


def test_explicit_dirs_that_are_symlinks_are_refused(shm_dir, tmp_path, victim, monkeypatch):
    planted = Path(str(shm_dir) + "-planted")
    planted.symlink_to(victim.parent)
    try:
        monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(planted))
        with pytest.raises(ConfigError, match=r"FLASHCKPT_SHM_DIR .* it is a symlink"):
            Checkpointer(job="j").save(1, {"t": torch.ones(4)})
        monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(shm_dir))
        with pytest.raises(ConfigError, match=r"argument run_dir .* it is a symlink"):
            Checkpointer(f"file://{tmp_path}/t", job="j", run_dir=str(planted))
    finally:
        planted.unlink()
    assert os.listdir(victim.parent) == ["precious"] and unchanged(victim)


def test_taken_default_dirs_fall_back_to_per_user_ones(tmp_path, victim, monkeypatch, caplog):
    """The defaults are predictable names; taken ones are replaced by ``<default>-<uid>``."""
    base = tmp_path / "public"  # like /tmp and /dev/shm
    base.mkdir()
    base.chmod(0o1777)
    monkeypatch.setattr(config, "DEFAULT_SHM_DIR", str(base / "flashckpt"))
    monkeypatch.setattr(config, "DEFAULT_RUN_DIR", str(base / "flashckpt-run"))
    for name in ("FLASHCKPT_SHM_DIR", "FLASHCKPT_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    (base / "flashckpt").symlink_to(victim.parent)
    (base / "flashckpt-run").mkdir(mode=0o777)
    (base / "flashckpt-run").chmod(0o777)
    caplog.set_level(logging.WARNING, logger="flashckpt.config")
    uid = os.geteuid()
    pidfile = base / f"flashckpt-run-{uid}" / "fb.pid"
    try:
        with Checkpointer(f"file://{tmp_path / 'tier'}", job="fb") as ck:
            assert ck.shm_dir == base / f"flashckpt-{uid}"
            assert ck.run_dir == pidfile.parent
            ck.save(1, {"t": torch.ones(4)})
            assert ck.wait(1, tier=f"file://{tmp_path / 'tier'}", timeout=60) == 1
            assert pidfile.exists()  # the agent got the same run dir
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert f"using {base / f'flashckpt-{uid}'} instead" in caplog.text
    assert "it is a symlink" in caplog.text and "mode 0777" in caplog.text
    assert os.listdir(victim.parent) == ["precious"] and unchanged(victim)
    assert os.listdir(base / "flashckpt-run") == []


def test_default_dirs_are_used_when_free(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.delenv("FLASHCKPT_SHM_DIR", raising=False)
    assert config.shm_dir() == tmp_path / "shm"
    assert stat.S_IMODE(os.stat(tmp_path / "shm").st_mode) == 0o700


# ---- files in them ------------------------------------------------------------------------------


def test_planted_pid_log_and_owner_files_are_refused_and_victims_untouched(
    shm_dir, run_dir, tmp_path, victim
):
    (run_dir / "pj.pid").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"refusing to open .*pj.pid: it is a symlink"):
        claim(run_dir, "pj")
    (run_dir / "lj.log").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"refusing to open .*lj.log: it is a symlink"):
        Checkpointer(f"file://{tmp_path}/t", job="lj").save(1, {"t": torch.ones(2)})
    (shm_dir / "oj").mkdir(parents=True, mode=0o700)
    (shm_dir / "oj" / "rank-0.owner").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"refusing to open .*rank-0.owner: it is a symlink"):
        Checkpointer(job="oj").save(1, {"t": torch.ones(2)})
    assert unchanged(victim)


@ROOT_ONLY
def test_a_socket_of_another_user_is_never_handed_the_tier_urls(shm_dir, run_dir, tmp_path):
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run_dir / "sj.sock"))
    listener.listen()
    os.chown(run_dir / "sj.sock", 65534, 65534)
    try:
        with pytest.raises(ConfigError, match=r"sj.sock is not the socket of an agent of this"):
            Checkpointer(f"file://{tmp_path}/t", job="sj").save(1, {"t": torch.ones(2)})
    finally:
        listener.close()


def test_hard_links_and_fifos_are_refused(tmp_path, victim):
    os.link(victim, tmp_path / "hard")
    with pytest.raises(ConfigError, match="it has 2 hard links"):
        open_file(tmp_path / "hard", os.O_RDWR | os.O_CREAT)
    os.mkfifo(tmp_path / "fifo")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="it is not a regular file"):
        open_file(tmp_path / "fifo", os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never blocks
    assert time.monotonic() - t0 < 5 and unchanged(victim)


@ROOT_ONLY
def test_a_file_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs.pid"
    theirs.write_text("1")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=r"it is owned by .*uid 65534"):
        open_file(theirs, os.O_RDWR | os.O_CREAT)


def test_write_atomic_replaces_a_symlink_instead_of_following_it(tmp_path, victim):
    marker = tmp_path / "rank-0.closed"
    marker.symlink_to(victim)
    write_atomic(marker, b"12")
    assert not marker.is_symlink() and marker.read_bytes() == b"12" and unchanged(victim)
    assert sorted(os.listdir(tmp_path)) == ["rank-0.closed", "victim"]


# ---- tier files -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_tier_files_are_0600_and_directories_0700_unless_told(tmp_path, scheme):
    async def put(url: str) -> None:
        tier = open_tier(url)
        try:
            await tier.put("job/step-1/rank-0/data", [memoryview(b"abc")], 3)
        finally:
            await tier.close()

    old = os.umask(0o022)
    try:
        asyncio.run(put(f"{scheme}://{tmp_path}/private"))
        asyncio.run(put(f"{scheme}://{tmp_path}/group?mode=0640&dir_mode=0750"))
        os.umask(0o077)  # a umask does not narrow a mode asked for
        asyncio.run(put(f"{scheme}://{tmp_path}/umask?mode=0o640&dir_mode=750"))
    finally:
        os.umask(old)

    def modes(root: str) -> tuple[int, int, int]:
        data = tmp_path / root / "job/step-1/rank-0/data"
        return tuple(stat.S_IMODE(os.stat(p).st_mode) for p in (data, data.parent, tmp_path / root))

    assert modes("private") == (0o600, 0o700, 0o700)
    assert modes("group") == (0o640, 0o750, 0o750)
    assert modes("umask") == (0o640, 0o750, 0o750)


@pytest.mark.parametrize(
    "bad", ["mode=0400", "mode=0666", "dir_mode=0600", "mode=rw", "dir_mode=0777"]
)
def test_bad_tier_modes_fail_when_the_checkpointer_is_built(shm_dir, tmp_path, bad):
    name = bad.split("=")[0]
    with pytest.raises(ConfigError, match=rf"option {name}='.*' is not valid: expected an octal"):
        Checkpointer(f"file://{tmp_path}?{bad}", job="m")


# ---- credentials --------------------------------------------------------------------------------


def test_redact_hides_credential_options_and_userinfo():
    url = f"s3://b/p?key=AKIA&secret={SEKRET}&token=T0K&endpoint_url=http://h:1&keep_last=2"
    assert (
        redact(url) == "s3://b/p?key=***&secret=***&token=***&endpoint_url=http://h:1&keep_last=2"
    )
    assert redact(f"s3://me:{SEKRET}@b/p") == "s3://***@b/p"
    assert redact("file:///mnt/x?mode=0640") == "file:///mnt/x?mode=0640"
    assert parse_spec(f"s3://me:{SEKRET}@b/p").url == "s3://***@b/p"
    for bad in (
        f"s3://b/p?secret={SEKRET}&bogus=1",
        f"s3://b/p?secret={SEKRET}&x",
        f"s3:///?secret={SEKRET}",
    ):
        with pytest.raises(ConfigError) as err:
            parse_spec(bad)
        assert SEKRET not in str(err.value)


@METRICS
def test_metric_labels_hide_credentials():
    metrics = Metrics(0)
    try:
        metrics.persisted(f"s3://me:{SEKRET}@b/p", 10)
        metrics.lag(f"s3://me:{SEKRET}@b/p", 1, 0.5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10).read()
    finally:
        metrics.close()
    assert SEKRET.encode() not in body and b'tier="s3://***@b/p"' in body


def test_credentials_never_reach_logs_errors_status_or_cli(shm_dir, run_dir, s3_bucket, s3_server):
    """A tier URL carrying key/secret: the agent's log and status, the trainer's errors and the
    CLI show ``***``; the credentials still work."""
    url = f"s3://{s3_bucket}/ck?key=testing&secret={SEKRET}&endpoint_url={s3_server.endpoint_url}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", "cred", "--tier", url],
        env=os.environ, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: (run_dir / "cred.sock").exists(), what="agent socket")
        with Checkpointer(url, job="cred") as ck:
            ck.save(1, {"t": torch.ones(64)})
            assert ck.wait(1, tier=url, timeout=60) == 1
            status = ck._agent.tier_status()
            assert [t.url for t in status] == [f"s3://{s3_bucket}/ck"]
            with pytest.raises(ConfigError) as err:
                ck.wait(1, tier=url.replace("/ck?", "/other?"), timeout=1)
            assert SEKRET not in str(err.value) and "secret=***" in str(err.value)
        bad = url + "&part_size=1"  # parses, but the agent cannot open it
        with pytest.raises(TierUnavailableError) as refused:
            Checkpointer(bad, job="cred").save(2, {"t": torch.ones(64)})
        assert SEKRET not in str(refused.value) and "secret=***" in str(refused.value)
        listed = subprocess.run(
            [sys.executable, "-m", "flashckpt.cli", "list", "--job", "cred", "--tier", url],
            capture_output=True, text=True, env=os.environ, timeout=120,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert "step 1: ranks [0] of 1 committed" in listed.stdout
        assert SEKRET not in listed.stdout + listed.stderr and "secret=***" in listed.stdout
    finally:
        agent.send_signal(signal.SIGTERM)
        log = agent.communicate(timeout=60)[1]
    assert "persisting to s3://" in log and "secret=***" in log
    assert SEKRET not in log


# ---- temporaries of crashed uploads ------------------------------------------------------------


def _leave_temp(root: Path, key: str, age_s: float = 0) -> Path:
    """What an agent killed mid-put leaves in a directory tier."""
    final = root / key
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".tmp-{final.name}-0123456789ab"
    temp.write_bytes(b"partial")
    if age_s:
        os.utime(temp, (time.time() - age_s, time.time() - age_s))
    return temp


def _start_worker(url: str, shm: Path, node: str = "n0") -> None:
    async def go() -> None:
        worker = TierWorker("tj", open_tier(url), shm, node)
        try:
            await worker.start()
        finally:
            await worker.close()

    asyncio.run(go())


@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_agent_start_removes_crashed_uploads_but_not_another_nodes_live_ones(
    shm_dir, tmp_path, scheme
):
    """A node-local tier is all this node's; in a shared one a young temporary of a rank that
    runs elsewhere may be another agent's live upload, and stays."""
    root = tmp_path / "tier"
    with Checkpointer(job="tj", rank=0) as ck:  # rank 0 has slots on this node
        ck.save(1, {"t": torch.ones(2)})
        mine = _leave_temp(root, layout.data_key("tj", 5, 0))
        marker = _leave_temp(root, layout.commit_key("tj", 5, "n0"))
        foreign_young = _leave_temp(root, layout.data_key("tj", 5, 1))
        foreign_old = _leave_temp(root, layout.data_key("tj", 4, 1), age_s=7200)
        other_job = _leave_temp(root, layout.data_key("tk", 5, 0))
        _start_worker(f"{scheme}://{root}", shm_dir)
    assert not mine.exists() and not marker.exists() and not foreign_old.exists()
    assert foreign_young.exists() is (scheme == "pfs")
    assert other_job.exists()


def test_agent_start_aborts_own_s3_uploads_and_spares_young_foreign_ones(
    shm_dir, s3_bucket, s3_server
):
    """moto dates every upload's start 2010-11-10 (its parts: when they were written): a grace
    of 10**9 s (32 years) makes every upload young. An upload's age runs from its newest part,
    so a live one that started long ago is spared; one with no part since is a dead writer's."""
    s3 = s3_server.client()

    def upload(key: str, part: bool = True) -> None:
        full = f"ck/{key}"
        up = s3.create_multipart_upload(Bucket=s3_bucket, Key=full)
        if part:
            s3.upload_part(Bucket=s3_bucket, Key=full, UploadId=up["UploadId"], PartNumber=1,
                           Body=b"x")  # fmt: skip

    def pending() -> list[str]:
        return [u["Key"] for u in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]

    upload(layout.data_key("tj", 5, 0))
    upload(layout.data_key("tj", 5, 1))  # another node's, started 2010, a part just now: live
    upload(layout.data_key("tj", 4, 1), part=False)  # another node's, nothing since 2010: dead
    upload(layout.data_key("tk", 5, 1))
    with Checkpointer(job="tj", rank=0) as ck:
        ck.save(1, {"t": torch.ones(2)})
        _start_worker(f"s3://{s3_bucket}/ck?temp_grace_s=1000000000", shm_dir)
        assert sorted(pending()) == [
            f"ck/{layout.data_key('tj', 4, 1)}",
            f"ck/{layout.data_key('tj', 5, 1)}",
            f"ck/{layout.data_key('tk', 5, 1)}",
        ]
        _start_worker(f"s3://{s3_bucket}/ck", shm_dir)  # the default grace: one hour
    # Judged by its start (2010), the live upload would be aborted here and retried forever.
    assert sorted(pending()) == [f"ck/{layout.data_key('tj', 5, 1)}",
                                 f"ck/{layout.data_key('tk', 5, 1)}"]  # fmt: skip


def test_retention_removes_crashed_temporaries_older_than_the_grace(tmp_path):
    from flashckpt.format import tier_io

    root = tmp_path / "tier"
    old = _leave_temp(root, layout.data_key("rj", 9, 3), age_s=7200)
    young = _leave_temp(root, layout.data_key("rj", 9, 4))

    async def go() -> tier_io.Retired:
        tier = open_tier(f"pfs://{root}")
        try:
            return await tier_io.apply_retention(tier, "rj", 1, None)
        finally:
            await tier.close()

    retired = asyncio.run(go())
    assert retired.steps == []
    assert [t.key for t in retired.leftovers] == [layout.data_key("rj", 9, 3)]
    assert not old.exists() and young.exists()
