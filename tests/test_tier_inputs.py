"""What a tier reads back and what a tier URL names are untrusted: a FIFO, a device or a socket
in place of an object is refused unread (never waited on) and counts as a corrupt copy; a
location that is missing, a file or out of reach is an error, not an empty tier; a file:// URL
that names a host, and a read-only filesystem where a tier is written, are refused when named;
a write the system refuses (EFBIG, EDQUOT...) says what to do, never a bare errno."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import S3
from flashckpt.storage_tiers import open_tier, parse_spec
from flashckpt.storage_tiers.os_errors import explain
from test_corruption import JOB, STEP_NEW, STEP_OLD, Template, blank, stage

from flashckpt import Checkpointer
from flashckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ManifestError,
    TierUnavailableError,
)
from flashckpt.format import layout, tier_io
from flashckpt.restore.sources import CORRUPT_COPY, TierSource

HANG_S = 20  # a read still blocked after this is a hang: the watchdog unblocks it and fails


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", *args],
        capture_output=True, text=True, env=os.environ, timeout=120, cwd=cwd,
    )  # fmt: skip


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Template:
    return Template(tmp_path_factory.mktemp("template"))


def plant(path: Path, kind: str) -> None:
    """Put a non-regular file of ``kind`` at ``path`` (whatever stood there goes)."""
    if path.is_dir():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()


class Watchdog:
    """Unblocks a reader stuck opening the FIFO at ``path`` (by opening its other end, again
    and again) once HANG_S have passed, so a test without the fix fails instead of hanging;
    ``fired`` says it had to."""

    def __init__(self, path: Path):
        self.path, self.fired = path, False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self.done.wait(HANG_S):
            return
        self.fired = True
        while not self.done.wait(0.05):
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))

    def __enter__(self) -> Watchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        assert not self.fired, f"a read of {self.path} blocked for {HANG_S} s"


# ---- 1. non-regular files in place of tier objects ----------------------------------------


async def _read_both(url: str, key: str) -> list[Exception | None]:
    tier = open_tier(url)
    found: list[Exception | None] = []
    try:
        for read in (lambda: tier.get(key), lambda: tier.get_into(key, memoryview(bytearray(8)))):
            try:
                await read()
                found.append(None)
            except Exception as exc:
                found.append(exc)
    finally:
        await tier.close()
    return found


@pytest.mark.parametrize("scheme", ["file", "pfs", "fsspec+file"])
@pytest.mark.parametrize("kind", ["fifo", "socket", "devzero", "directory"])
def test_a_non_regular_object_is_refused_unread(tmp_path: Path, scheme: str, kind: str) -> None:
    root = tmp_path / "tier"
    (root / "j").mkdir(parents=True)
    path = root / "j" / "obj"
    plant(path, kind)
    with Watchdog(path):
        errors = run(_read_both(f"{scheme}://{root}", "j/obj"))
    for err in errors:
        expected = CheckpointNotFoundError if kind == "directory" else ManifestError
        assert isinstance(err, expected), f"{scheme} {kind}: {err!r}"
        assert isinstance(err, CORRUPT_COPY)  # a restore moves on to another copy
        assert str(path) in str(err)
        word = {"fifo": "a FIFO", "socket": "a socket", "devzero": "a character device",
                "directory": "a directory"}[kind]  # fmt: skip
        assert word in str(err) and "Errno" not in str(err)


@pytest.mark.parametrize("obj", ["manifest", "data", "commit"])
def test_a_fifo_in_a_step_falls_back_to_the_older_step(template, tmp_path: Path, obj: str):
    root = tmp_path / "nvme"
    url = f"file://{root}"
    assert stage(template, url, (STEP_OLD, STEP_NEW)) is None
    key = {"manifest": layout.manifest_key(JOB, STEP_NEW, 0),
           "data": layout.data_key(JOB, STEP_NEW, 0),
           "commit": layout.commit_key(JOB, STEP_NEW, "node0")}[obj]  # fmt: skip
    plant(root / key, "fifo")
    with Watchdog(root / key):
        source = TierSource(url, JOB, 0, verify=True)
        held = source.snapshots()
        if obj == "commit":  # the unreadable marker leaves the step uncommitted
            assert sorted(held) == [(0, STEP_OLD)]
        else:
            assert not source.load(blank(), (0, STEP_NEW), allow_pickle=False)
        assert source.load(blank(), (0, STEP_OLD), allow_pickle=False)
        out = cli("verify", url, "--job", JOB, "--step", str(STEP_NEW))
    assert out.returncode == 1, out.stdout
    assert "a FIFO (named pipe), not a regular file" in out.stderr
    assert "Traceback" not in out.stderr


# ---- 2. a location that is missing, a file, or out of reach --------------------------------


def test_a_missing_or_file_location_is_an_error_not_an_empty_tier(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {
        f"fsspec+file://{tmp_path / 'nowhere'}": "there is nothing at",
        f"fsspec+file://{afile}": "is a file, not a directory",
        f"file://{afile}": "is a regular file, not a directory",
        "http://example.invalid/ckpt": "there is nothing at",
    }
    for url, said in cases.items():
        with pytest.raises(TierUnavailableError, match=said):
            run(open_tier(url).check_location())
    for url, said in list(cases.items())[:2]:
        for command in ("ls", "verify"):
            out = cli(command, url, "--job", "j")
            assert out.returncode == 1, (command, url, out.stdout)
            assert said in out.stderr and "no jobs" not in out.stdout
            assert "Errno" not in out.stderr
    # Where the tier is about to be written, a missing directory is fine; a file is not.
    run(open_tier(f"fsspec+file://{tmp_path / 'new'}").check_location(create=True))
    run(open_tier(f"file://{tmp_path / 'new' / 'deeper'}").check_location(create=True))
    with pytest.raises(TierUnavailableError, match="not a directory"):
        run(open_tier(f"file://{afile}/under").check_location(create=True))


def test_an_object_store_prefix_with_nothing_under_it_is_empty(s3_server, s3_bucket) -> None:
    url = f"fsspec+s3://{s3_bucket}/nothing-here?endpoint_url={s3_server.endpoint_url}"
    run(open_tier(url).check_location())
    out = cli("ls", url)
    assert out.returncode == 0, out.stderr
    assert "no jobs in" in out.stdout


# ---- 3. tier URLs checked when named -------------------------------------------------------


def test_a_file_url_naming_a_host_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url, meant in [("file://mnt/nvme/ckpt", "file:///mnt/nvme/ckpt"),
                       ("pfs://relative", "pfs:///relative"), ("file://host/x", "file:///host/x")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"names the host .*did you mean {meant}"):
            parse_spec(url)
        with pytest.raises(ConfigError):
            Checkpointer(url, job="u1")
    assert not (tmp_path / "mnt").exists()
    assert parse_spec("file://localhost/x").location == "/x"
    assert parse_spec("file:///mnt/x").location == "/mnt/x"
    assert parse_spec("file://./ckpt").location == str(tmp_path / "ckpt")


def test_a_read_only_filesystem_is_refused_where_a_tier_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="http:// filesystem is read-only"):
        Checkpointer("http://example.invalid/ckpt", job="u2")
    parse_spec("http://example.invalid/ckpt")  # reading from one is fine
    out = cli("restore", str(tmp_path), "--to", "http://example.invalid/x")
    assert out.returncode == 2, out.stderr
    assert "read-only" in out.stderr and "NotImplementedError" not in out.stderr
    # A tier opened anyway (an agent's --tier) says what is wrong on every put.
    with pytest.raises(TierUnavailableError, match="read-only") as refused:
        run(open_tier("http://127.0.0.1:9/ckpt").put("j/k", [memoryview(b"x")], 1))
    assert "NotImplementedError" not in str(refused.value)


# ---- 4. write errors explained in one place ------------------------------------------------

_FSIZE_CHILD = """
import asyncio, resource, sys
from flashckpt.storage_tiers import open_tier
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

async def main(url):
    tier = open_tier(url)
    try:
        await tier.put("j/step/data", [memoryview(bytes(300_000))], 300_000)
        print("stored")
    except Exception as exc:
        print(type(exc).__name__, exc)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("scheme", ["file", "pfs", "fsspec+file"])
def test_a_file_too_large_says_what_to_do(tmp_path: Path, scheme: str) -> None:
    out = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, f"{scheme}://{tmp_path / 't'}"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    said = out.stdout
    assert said.startswith("TierUnavailableError "), said + out.stderr
    assert "File too large" in said and "ulimit -f" in said and "'j/step/data'" in said
    assert "[Errno" not in said


def test_every_refused_write_is_explained_the_same_way(tmp_path: Path) -> None:
    for code, words in [(errno.EDQUOT, "quota"), (errno.EROFS, "read-only"),
                        (errno.EACCES, "permission"), (errno.ENOSPC, "is full"),
                        (errno.EFBIG, "ulimit -f"), (errno.EIO, "dmesg")]:  # fmt: skip
        err = explain(OSError(code, os.strerror(code)), "file:///t", "k", 10, root=tmp_path)
        assert isinstance(err, TierUnavailableError) and err.errno == code
        assert words in str(err) and os.strerror(code) in str(err) and "'k'" in str(err)
        assert not str(err).startswith("[Errno")


# ---- 5. the command line never prints a raw errno ------------------------------------------


def test_restore_and_export_into_a_file_say_so(template, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'nvme'}"
    assert stage(template, url, (STEP_OLD, STEP_NEW)) is None
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = cli("restore", url, "--to", str(afile))
    assert out.returncode == 1
    assert f"{afile} is a regular file, not a directory" in out.stderr
    assert "Errno" not in out.stderr and "Traceback" not in out.stderr
    out = cli("export", url, "--format", "torch", "--to", str(afile / "x.pt"))
    assert out.returncode == 2
    assert f"{afile} is a regular file, not a directory" in out.stderr
    assert "Errno" not in out.stderr and "Traceback" not in out.stderr


def test_an_os_error_on_the_command_line_is_explained() -> None:
    from flashckpt.cli.common import describe_error

    text = describe_error(FileExistsError(errno.EEXIST, "File exists", "/x/afile"))
    assert "Errno" not in text and "/x/afile" in text
    assert "Errno" not in describe_error(OSError(errno.ENOMSG, "No message of desired type"))
    assert describe_error(NotImplementedError()) != "NotImplementedError"


# ---- 6. an empty commit marker -------------------------------------------------------------


def test_verify_of_a_step_whose_marker_is_empty_says_so(template, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    url = f"file://{root}"
    assert stage(template, url, (STEP_OLD, STEP_NEW)) is None
    (root / layout.commit_key(JOB, STEP_NEW, "node0")).write_bytes(b"")
    out = cli("verify", url, "--job", JOB, "--step", str(STEP_NEW))
    assert out.returncode == 1
    assert "the commit marker is empty (0 bytes)" in out.stderr
    assert "none of its commit markers can be read" in out.stderr
    assert "ranks [] of 0" not in out.stderr
    listing = run(_listing(url))
    assert listing[0, STEP_NEW].problems and not listing[0, STEP_NEW].complete


async def _listing(url: str) -> tier_io.Listing:
    tier = open_tier(url)
    try:
        return await tier_io.list_steps(tier, JOB)
    finally:
        await tier.close()


# ---- names and links inside a tier ---------------------------------------------------------


@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_a_directory_tier_follows_no_symbolic_link_inside_it(tmp_path: Path, scheme: str):
    """Nothing flashckpt writes is a link: one inside the tier is neither listed, read nor
    deleted through (retention once emptied what a linked job directory pointed at)."""
    root, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
    url = f"{scheme}://{root}"
    with Checkpointer(url, job="real", shm_dir=tmp_path / "shm", run_dir=tmp_path / "run") as ck:
        ck.save(1, {"t": torch.ones(8)})
        ck.wait(1, tier=url, timeout=60)
    shutil.copytree(root / "real", elsewhere / "linked")
    (root / "linked").symlink_to(elsewhere / "linked")  # a job directory that is a link
    step = root / "real" / "step-000000000001" / "rank-0"
    (step / "manifest.json").rename(tmp_path / "outside.json")
    (step / "manifest.json").symlink_to(tmp_path / "outside.json")  # a file that is a link
    listing = run(tier_io.list_steps(open_tier(url), "linked"))
    assert listing == {}  # what the link points at is not the tier's
    with pytest.raises(ManifestError, match="symbolic link to a regular file"):
        run(tier_io.read_manifest(open_tier(url), "real", 1, 0))
    with pytest.raises(TierUnavailableError, match="nothing is deleted through a link"):
        run(open_tier(url).delete("linked/step-000000000001"))
    assert (elsewhere / "linked" / "step-000000000001").is_dir()
    keys = run(open_tier(url).list("real/"))
    assert "real/step-000000000001/rank-0/manifest.json" not in keys and keys


def test_names_read_back_from_a_tier_are_ascii(tmp_path: Path, monkeypatch):
    """``\\d`` takes every script's digits and int() reads them: a stray ``step-١`` would
    commit step 1 under a name no key of step 1 has, never to be deleted."""
    two = layout.step_dir(2)
    keys = [f"j/step-{'0' * 11}\u0661/commit-n.json", f"j/{two}/commit-n.json"]
    assert list(layout.parse_keys("j", keys)) == [(0, 2)]
    assert not layout.written_by("j", f"j/{two}/rank-\u0661/data", "n", [1])
    monkeypatch.setenv("FLASHCKPT_NODE", "n\u0153ud-\u0661")
    from flashckpt import config

    node = config.node_name()
    assert node.isascii(), node
    marker = layout.CommitMarker(node, (0,), 1).to_json()
    assert layout.CommitMarker.from_json(marker).node == node  # its markers are read back


@pytest.mark.parametrize("url", ["pfs:///mnt/pfs/ckpt", "file:///nvme/ckpt", "s3://b/ckpt",
                                 "fsspec+memory://ckpt"])  # fmt: skip
def test_a_grace_below_the_floor_is_refused_saying_why(url: str):
    """A live upload pauses between writes; a grace shorter than that removes it."""
    for bad in ("0", "0.001", "59.9"):
        with pytest.raises(ConfigError) as caught:
            parse_spec(f"{url}?temp_grace_s={bad}")
        text = str(caught.value)
        assert f"temp_grace_s={bad} is below the floor of 60 seconds" in text
        assert "an upload still being written" in text and "give at least 60" in text
    assert parse_spec(f"{url}?temp_grace_s=60").options["temp_grace_s"] == "60"


@S3
def test_an_s3_listing_asks_only_for_the_tree_it_lists(s3_server, s3_bucket):
    """``run1`` without its ``/`` would page through ``run10/...`` too (and ``job`` through
    ``job10/...``): with thousands of such siblings, each listing costs pages of them."""
    tier = open_tier(f"s3://{s3_bucket}/run1?endpoint_url={s3_server.endpoint_url}")
    sibling = open_tier(f"s3://{s3_bucket}/run10?endpoint_url={s3_server.endpoint_url}")
    asked: list[str] = []
    real = tier._request

    async def spy(method, **kwargs):
        if method in ("list_objects_v2", "list_multipart_uploads"):
            asked.append(kwargs.get("Prefix", ""))
        return await real(method, **kwargs)

    tier._request = spy

    async def go():
        try:
            await tier.put("job/step-000000000001/x", [memoryview(b"x")], 1)
            await sibling.put("job/step-000000000001/y", [memoryview(b"y")], 1)
            await tier.put("job10/step-000000000001/z", [memoryview(b"z")], 1)
            return [await tier.list(""), await tier.list("job"), await tier.leftovers("job/")]
        finally:
            await tier.close()
            await sibling.close()

    everything, job, leftovers = run(go())
    assert everything == ["job/step-000000000001/x", "job10/step-000000000001/z"]
    assert job == ["job/step-000000000001/x"] and leftovers == []
    assert asked and all(p.endswith("/") for p in asked), asked
