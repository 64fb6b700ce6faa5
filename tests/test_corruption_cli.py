"""``flashckpt verify`` and ``list`` on corrupt copies: every problem reported, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_corruption import (
    JOB,
    MANIFESTS,
    SLOTS,
    STEP_NEW,
    STEP_OLD,
    Template,
    edit,
    flip,
    in_chunk,
    stage,
)

from flashckpt.format import layout


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", *args],
        capture_output=True, text=True, env=os.environ, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Template:
    return Template(tmp_path_factory.mktemp("template"))


@pytest.fixture
def nvme(template, tmp_path) -> tuple[str, object]:
    """A file tier holding steps 1 and 2, and the path of its root."""
    root = tmp_path / "nvme"
    url = f"file://{root}"
    stage(template, url, (STEP_OLD, STEP_NEW))
    return url, root


def rewrite(path, corrupt) -> None:
    path.write_bytes(corrupt(path.read_bytes()))


def test_verify_reports_every_bad_chunk_with_its_location(template, nvme):
    url, root = nvme
    manifest = template.copies[STEP_NEW][0]
    data = root / layout.data_key(JOB, STEP_NEW, 0)
    rewrite(data, lambda raw: flip(raw, in_chunk(manifest, "w", 1)))
    rewrite(data, lambda raw: flip(raw, in_chunk(manifest, "w", 4)))
    out = cli("verify", "--job", JOB, "--tier", url)
    assert out.returncode == 1, out.stderr
    w = next(e for e in manifest.entries if e.path == "w")
    for chunk in (1, 4):
        start = w.offset + chunk * manifest.chunk_size
        assert f"chunk {chunk} of 'w' (bytes {start}-{start + manifest.chunk_size})" in out.stderr
    assert f"step {STEP_NEW} in {url}: 2 problem(s) found" in out.stderr
    assert "Traceback" not in out.stderr
    older = cli("verify", "--job", JOB, "--tier", url, "--step", str(STEP_OLD))
    assert older.returncode == 0, older.stderr
    assert f"step {STEP_OLD} rank 0: 3 entries, 9 chunks OK" in older.stdout


def test_verify_refuses_a_manifest_without_checksums(nvme):
    url, root = nvme
    rewrite(
        root / layout.manifest_key(JOB, STEP_NEW, 0),
        edit(lambda d: [e.update(checksums=None) for e in d["entries"]]),
    )
    out = cli("verify", "--job", JOB, "--tier", url)
    assert out.returncode == 1, out.stdout
    assert "checksums are null; a stored copy must carry one crc32c per chunk" in out.stderr
    assert "OK" not in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("case", ["deep_tree_100000", "chunk_size_zero"])
def test_verify_reports_a_corrupt_manifest_without_a_traceback(nvme, case):
    url, root = nvme
    rewrite(root / layout.manifest_key(JOB, STEP_NEW, 0), MANIFESTS[case])
    out = cli("verify", "--job", JOB, "--tier", url)
    assert out.returncode == 1
    assert layout.manifest_key(JOB, STEP_NEW, 0) in out.stderr
    assert "Traceback" not in out.stderr


def test_verify_reports_truncated_data(nvme):
    url, root = nvme
    rewrite(root / layout.data_key(JOB, STEP_NEW, 0), lambda raw: raw[:1000])
    out = cli("verify", "--job", JOB, "--tier", url)
    assert out.returncode == 1
    assert "holds fewer than the 424064 bytes its manifest's data_len says" in out.stderr


def test_list_and_verify_show_a_corrupt_commit_marker_as_corrupt(nvme):
    url, root = nvme
    marker = layout.commit_key(JOB, STEP_NEW, "node0")
    (root / marker).write_bytes(b'{"node": "node0", "ranks": [0')
    listed = cli("list", "--job", JOB, "--tier", url)
    assert listed.returncode == 0, listed.stderr
    assert f"step {STEP_OLD}: ranks [0] of 1 committed" in listed.stdout
    assert f"step {STEP_NEW}: ranks [] of 0 partial, corrupt: 1 problem(s)" in listed.stdout
    assert marker in listed.stdout
    out = cli("verify", "--job", JOB, "--tier", url, "--step", str(STEP_NEW))
    assert out.returncode == 1 and marker in out.stderr and "Traceback" not in out.stderr
    newest_good = cli("verify", "--job", JOB, "--tier", url)  # the newest committed step
    assert newest_good.returncode == 0 and f"step {STEP_OLD} rank 0" in newest_good.stdout


def test_list_shows_a_corrupt_slot_as_corrupt(template, shm_dir):
    files = template.put_memory(shm_dir, (STEP_OLD, STEP_NEW))
    SLOTS["state_invalid"](files[STEP_NEW])
    out = cli("list", "--job", JOB)
    assert out.returncode == 0, out.stderr
    assert f"READY step {STEP_OLD} sealed" in out.stdout
    assert f"corrupt ({files[STEP_NEW]} is not a valid flashckpt slot: layout 1, state 7" in (
        out.stdout
    )
