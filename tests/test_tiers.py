"""Storage tiers: one contract every tier meets, then each tier's real faults, then the registry.

The contract runs against a local directory, a "parallel FS" directory and S3 (a real moto
server over HTTP). Faults are real: a full or read-only tmpfs mounted in a user namespace,
an unwritable directory, the S3 server cut mid-upload, and a proxy answering 503 SlowDown.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import S3
from flashckpt.storage_tiers import Scope, Tier, open_tier, parse_spec
from flashckpt.storage_tiers.local import LocalTier
from flashckpt.storage_tiers.parallel_fs import ParallelFsTier

from flashckpt import Checkpointer
from flashckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    TierUnavailableError,
)

if TYPE_CHECKING:  # moto may be missing: then the S3 fixtures skip, and this goes unused
    from s3fixture import MotoS3

MiB = 1 << 20
PART = 5 * MiB
ROOT = Path(__file__).resolve().parent.parent


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def pieces(data: bytes, sizes: list[int]) -> list[memoryview]:
    """``data`` cut into views of the given sizes (the last takes the rest)."""
    view, out, pos = memoryview(data), [], 0
    for n in sizes:
        out.append(view[pos : pos + n])
        pos += n
    out.append(view[pos:])
    return out


async def stream(
    chunks: list[memoryview], fail_after: int | None = None
) -> AsyncIterator[memoryview]:
    """Chunks as an async iterator, raising after ``fail_after`` of them (a crashed producer)."""
    for i, chunk in enumerate(chunks):
        if i == fail_after:
            raise RuntimeError("producer died")
        await asyncio.sleep(0)
        yield chunk


@dataclass
class TierCase:
    """One tier under test, plus how to see its leftovers from outside the tier."""

    kind: str
    url: str
    root: Path | None = None
    server: MotoS3 | None = None
    bucket: str = ""
    planted: int = 100  # the bytes leave_temporary leaves
    temp_objects: bool = False  # S3 through fsspec with commit=rename: temporaries are objects

    def open(self, **options: object) -> Tier:
        return open_tier(self.url, **options)

    def leftovers(self) -> list[str]:
        """Temporaries (directories, S3 objects) or pending multipart uploads (S3) a failed
        put left behind."""
        if self.server is not None:
            s3 = self.server.client()
            if self.temp_objects:
                found = s3.list_objects_v2(Bucket=self.bucket).get("Contents", [])
                return sorted(o["Key"] for o in found if "/.tmp-" in o["Key"])
            uploads = s3.list_multipart_uploads(Bucket=self.bucket)
            return [u["Key"] for u in uploads.get("Uploads", [])]
        assert self.root is not None
        if not self.root.exists():
            return []
        return sorted(str(p) for p in self.root.rglob(".tmp-*"))

    def leave_temporary(self, key: str) -> None:
        """What a writer killed mid-put leaves: a temp file, or an unfinished multipart upload."""
        if self.server is not None and self.temp_objects:
            parent, _, name = f"ckpt/{key}".rpartition("/")
            self.server.client().put_object(
                Bucket=self.bucket, Key=f"{parent}/.tmp-{name}-deadbeef", Body=b"p" * self.planted
            )
            return
        if self.server is not None:
            s3 = self.server.client()
            up = s3.create_multipart_upload(Bucket=self.bucket, Key=f"ckpt/{key}")
            s3.upload_part(
                Bucket=self.bucket,
                Key=f"ckpt/{key}",
                UploadId=up["UploadId"],
                PartNumber=1,
                Body=b"x" * self.planted,
            )
            return
        assert self.root is not None
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / f".tmp-{path.name}-deadbeef").write_bytes(b"p" * self.planted)


@pytest.fixture(params=["local", "parallel_fs", "s3", "fsspec_file", "fsspec_s3"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> TierCase:
    """Every tier: the three of flashckpt's own, and the fsspec tier over fsspec's local
    filesystem and over S3 through s3fs (committing by temporary and rename, so what a crashed
    put leaves is visible to it)."""
    if request.param in ("s3", "fsspec_s3"):
        bucket = request.getfixturevalue("s3_bucket")
        server = request.getfixturevalue("s3_server")
        if request.param == "fsspec_s3":
            url = (f"fsspec+s3://{bucket}/ckpt?commit=rename&part_size={PART}"
                   f"&endpoint_url={server.endpoint_url}")  # fmt: skip
            return TierCase("fsspec_s3", url, server=server, bucket=bucket, temp_objects=True)
        return TierCase("s3", f"s3://{bucket}/ckpt?part_size={PART}", server=server, bucket=bucket)
    root = tmp_path / "tier"
    scheme = {"local": "file", "parallel_fs": "pfs", "fsspec_file": "fsspec+file"}[request.param]
    return TierCase(request.param, f"{scheme}://{root}", root=root)


class TestTierContract:
    """What every tier promises: atomic puts, exact reads, recursive sorted listings."""

    def test_small_round_trip(self, case: TierCase) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("job/step-1/rank-0/manifest.json", [memoryview(b"{}")], 2)
                await tier.put("job/empty", [], 0)
                assert await tier.get("job/step-1/rank-0/manifest.json") == b"{}"
                assert await tier.get("job/empty") == b""
                assert await tier.list("job/") == ["job/empty", "job/step-1/rank-0/manifest.json"]
            finally:
                await tier.close()

        run(go())

    def test_large_round_trip_in_parts(self, case: TierCase) -> None:
        """12 MiB in uneven chunks: S3 re-cuts them into 5 MiB parts; bytes come back equal."""
        data = os.urandom(12 * MiB)
        chunks = pieces(data, [3 * MiB, 100, 4 * MiB, 1, 2 * MiB + 7])

        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("job/step-2/rank-0/data", stream(chunks), len(data))
                assert await tier.get("job/step-2/rank-0/data") == data
                out = bytearray(len(data))
                await tier.get_into("job/step-2/rank-0/data", memoryview(out))
                assert out == data
                # ranges crossing the 5 MiB part boundaries
                assert (
                    await tier.get("job/step-2/rank-0/data", PART - 10, PART + 10)
                    == data[PART - 10 : PART + 10]
                )
                tail = bytearray(len(data) - PART - 3)
                await tier.get_into("job/step-2/rank-0/data", memoryview(tail), PART + 3)
                assert tail == data[PART + 3 :]
            finally:
                await tier.close()

        run(go())

    def test_byte_ranges(self, case: TierCase) -> None:
        data = bytes(range(256)) * 4

        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("k", pieces(data, [10, 500]), len(data))
                assert await tier.get("k", 2, 5) == data[2:5]
                assert await tier.get("k", 1000) == data[1000:]
                assert await tier.get("k", 1000, 5000) == data[1000:]  # clamped like a slice
                assert await tier.get("k", len(data)) == b""
                assert await tier.get("k", 7, 7) == b""
            finally:
                await tier.close()

        run(go())

    def test_get_into_fills_the_given_view_in_place(self, case: TierCase) -> None:
        data = os.urandom(4096)

        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("k", [memoryview(data)], len(data))
                buf = bytearray(100)
                await tier.get_into("k", memoryview(buf)[10:30], 5)
                assert buf[10:30] == data[5:25]
                assert buf[:10] == bytes(10) and buf[30:] == bytes(70)
                too_long = bytearray(200)
                with pytest.raises(ValueError, match="expected at least"):
                    await tier.get_into("k", memoryview(too_long), 4000)
            finally:
                await tier.close()

        run(go())

    def test_list_is_recursive_sorted_and_hides_temporaries(self, case: TierCase) -> None:
        keys = ["a/step-1/x", "a/step-1/y/z", "a/step-10/x", "b/q"]

        async def go() -> None:
            tier = case.open()
            try:
                for k in reversed(keys):
                    await tier.put(k, [memoryview(k.encode())], len(k))
                case.leave_temporary("a/step-1/crashed")
                assert await tier.list("") == keys
                assert await tier.list("a/step-1") == ["a/step-1/x", "a/step-1/y/z"]
                assert await tier.list("a/step-1/") == ["a/step-1/x", "a/step-1/y/z"]
                assert await tier.list("a/step-1/x") == ["a/step-1/x"]
                assert await tier.list("nothing/here") == []
            finally:
                await tier.close()

        run(go())

    def test_delete_removes_trees_and_ignores_missing(self, case: TierCase) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                for k in ["a/step-1/x", "a/step-1/y/z", "a/step-10/x", "a/keep"]:
                    await tier.put(k, [memoryview(b"v")], 1)
                await tier.delete("a/step-1")
                assert await tier.list("a") == ["a/keep", "a/step-10/x"]
                await tier.delete("a/keep")
                assert await tier.list("a") == ["a/step-10/x"]
                await tier.delete("a/step-1")  # already gone
                await tier.delete("never/was")
                with pytest.raises(ConfigError, match="non-empty prefix"):
                    await tier.delete("")
            finally:
                await tier.close()

        run(go())

    def test_missing_key(self, case: TierCase) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                for read in (
                    tier.get("job/step-9/rank-0/data"),
                    tier.get("job/step-9/rank-0/data", 3, 3),
                    tier.get_into("job/step-9/rank-0/data", memoryview(bytearray(8))),
                ):
                    with pytest.raises(CheckpointNotFoundError, match="step-9/rank-0/data"):
                        await read
            finally:
                await tier.close()

        run(go())
        assert issubclass(CheckpointNotFoundError, FileNotFoundError)

    @pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["small", "multipart"])
    def test_failed_put_leaves_nothing_and_keeps_the_old_object(
        self, case: TierCase, size: int
    ) -> None:
        """The producer dies mid-put: no new object, no temporaries or pending uploads."""
        new = os.urandom(size)
        chunk = min(size // 2, 6 * MiB)

        async def go() -> None:
            tier = case.open()
            try:
                chunks = pieces(new, [chunk, chunk])
                with pytest.raises(RuntimeError, match="producer died"):
                    await tier.put("fresh", stream(chunks, fail_after=1), size)
                assert await tier.list("") == []
                await tier.put("old", [memoryview(b"old bytes")], 9)
                with pytest.raises(RuntimeError, match="producer died"):
                    await tier.put("old", stream(chunks, fail_after=1), size)
                assert await tier.get("old") == b"old bytes"
                assert await tier.list("") == ["old"]
            finally:
                await tier.close()

        run(go())
        assert case.leftovers() == []

    def test_wrong_size_stores_nothing(self, case: TierCase) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                with pytest.raises(ValueError, match="expected 10 bytes"):
                    await tier.put("k", [memoryview(b"12345")], 10)
                with pytest.raises(ValueError, match="expected 3 bytes"):
                    await tier.put("k", [memoryview(b"12345")], 3)
                assert await tier.list("") == []
            finally:
                await tier.close()

        run(go())
        assert case.leftovers() == []

    def test_overwrite_replaces_whole_object(self, case: TierCase) -> None:
        big = os.urandom(6 * MiB)

        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("k", [memoryview(big)], len(big))
                await tier.put("k", [memoryview(b"short")], 5)
                assert await tier.get("k") == b"short"
                await tier.put("k", [memoryview(big)], len(big))
                assert await tier.get("k") == big
                assert await tier.list("") == ["k"]
            finally:
                await tier.close()

        run(go())

    def test_concurrent_puts(self, case: TierCase) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                keys = [f"job/step-3/rank-{r}/data" for r in range(8)]
                await asyncio.gather(*(tier.put(k, [memoryview(k.encode())], len(k)) for k in keys))
                assert await tier.list("job/step-3") == sorted(keys)
                assert [await tier.get(k) for k in keys] == [k.encode() for k in keys]
            finally:
                await tier.close()

        run(go())

    def test_clean_temporaries_removes_crashed_and_own_leftovers_only(self, case: TierCase) -> None:
        """What writers killed mid-put left: kept while it may be a live writer's (young and
        not claimed by ``mine``), removed once old or claimed; objects and other prefixes stay."""

        async def go() -> None:
            tier = case.open()
            try:
                await tier.put("job/step-1/rank-0/data", [memoryview(b"ok")], 2)
                for key in ("job/step-2/rank-0/data", "job/step-2/rank-1/data", "other/x/data"):
                    case.leave_temporary(key)
                young = 1e9  # every leftover here is younger (moto dates uploads 2010-11-10)
                assert await tier.clean_temporaries("job/", young) == []
                found = sorted(t.key for t in await tier.leftovers("job/"))
                assert found == ["job/step-2/rank-0/data", "job/step-2/rank-1/data"]
                assert len(case.leftovers()) == 3
                own = await tier.clean_temporaries(
                    "job/", young, mine=lambda key: key == "job/step-2/rank-1/data"
                )
                assert [t.key for t in own] == ["job/step-2/rank-1/data"]
                assert len(case.leftovers()) == 2
                would = await tier.clean_temporaries("job/", 0, dry_run=True)
                assert [t.key for t in would] == ["job/step-2/rank-0/data"]
                assert len(case.leftovers()) == 2
                gone = await tier.clean_temporaries("job/", 0)
                assert [(t.key, t.size) for t in gone] == [("job/step-2/rank-0/data", case.planted)]
                assert [p for p in case.leftovers() if "/other/" not in p] == []
                assert await tier.list("") == ["job/step-1/rank-0/data"]
                assert await tier.get("job/step-1/rank-0/data") == b"ok"
                if case.root is not None:  # the step that held only a crashed write is gone
                    assert sorted(p.name for p in (case.root / "job").iterdir()) == ["step-1"]
            finally:
                await tier.close()

        run(go())

    def test_leftovers_are_aged_on_the_stores_clock_not_the_nodes(
        self, case: TierCase, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A node whose clock runs two hours ahead takes no young leftover (another node's
        live upload) for a dead one; one the store dates two hours back goes."""
        import time

        real = time.time

        async def go(grace: float) -> list[str]:
            tier = case.open()
            try:
                return [t.key for t in await tier.clean_temporaries("job/", grace)]
            finally:
                await tier.close()

        case.leave_temporary("job/step-2/rank-0/data")
        monkeypatch.setattr(time, "time", lambda: real() + 7200)  # this node's clock, ahead
        assert run(go(3600)) == []
        assert len(case.leftovers()) == 1
        monkeypatch.setattr(time, "time", real)
        if case.root is not None:  # the store's own clock dated it two hours back
            for path in case.root.rglob(".tmp-*"):
                os.utime(path, (real() - 7200, real() - 7200))
            assert run(go(3600)) == ["job/step-2/rank-0/data"]
            assert case.leftovers() == []
        assert run(go(0)) == ([] if case.root is not None else ["job/step-2/rank-0/data"])

    @pytest.mark.parametrize("bad", ["../escape", "/abs/key", "a//b", "a/./b", ".tmp-x", ""])
    def test_keys_that_could_escape_are_refused(self, case: TierCase, bad: str) -> None:
        async def go() -> None:
            tier = case.open()
            try:
                with pytest.raises(ConfigError, match="not allowed|must be"):
                    await tier.put(bad, [memoryview(b"x")], 1)
                with pytest.raises(ConfigError):
                    await tier.get(bad)
            finally:
                await tier.close()

        run(go())


# -- POSIX faults ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_unwritable_directory(tmp_path: Path, scheme: str) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(TierUnavailableError, match="cannot be written.*Permission denied"):
            run(_put_once(f"{scheme}://{root}", "k", b"x"))
    finally:
        root.chmod(0o700)


async def _put_once(url: str, key: str, data: bytes) -> None:
    tier = open_tier(url)
    try:
        await tier.put(key, [memoryview(data)], len(data))
    finally:
        await tier.close()


_FAULT_CHILD = textwrap.dedent(
    """
    import asyncio, errno, json, os, sys
    from flashckpt.errors import TierUnavailableError
    from flashckpt.storage_tiers import open_tier

    full, ro, denied = sys.argv[1:4]
    report = {}

    async def attempt(url, key, data):
        tier = open_tier(url)
        try:
            await tier.put(key, [memoryview(data)], len(data))
            return None
        except TierUnavailableError as exc:
            return {"errno": exc.errno, "text": str(exc)}
        finally:
            await tier.close()

    async def main():
        for scheme in ("file", "pfs"):
            url = f"{scheme}://{full}/{scheme}"
            old = os.urandom(1 << 20)
            assert await attempt(url, "old", old) is None
            report[scheme + "_full"] = await attempt(url, "new", os.urandom(8 << 20))
            tier = open_tier(url)
            report[scheme + "_old_intact"] = await tier.get("old") == old
            report[scheme + "_listing"] = await tier.list("")
            await tier.delete("old")
            await tier.close()
        report["temporaries"] = [n for _, _, f in os.walk(full) for n in f]
        report["read_only"] = await attempt(f"file://{ro}", "k", b"x")
        if denied:
            report["denied"] = await attempt(f"pfs://{denied}", "a/k", b"x")

    asyncio.run(main())
    print(json.dumps(report))
    """
)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces")
def test_full_read_only_and_denied_directories(tmp_path: Path) -> None:
    """Real ENOSPC (4 MiB tmpfs), EROFS (read-only tmpfs) and EACCES (a dir owned by nobody)."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    denied = ""
    if os.geteuid() == 0:
        # Inside the namespace only our own uid is mapped: a nobody-owned 0555 directory is
        # then not ours to override, so writing into it fails with EACCES even as "root".
        (tmp_path / "denied").mkdir(mode=0o555)
        os.chown(tmp_path / "denied", 65534, 65534)
        denied = str(tmp_path / "denied")
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {full} && mount -t tmpfs -o ro,size=1m tmpfs {ro} && "
        'exec "$0" -c "$1" "$2" "$3" "$4"'
    )
    proc = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            sys.executable,
            _FAULT_CHILD,
            str(full),
            str(ro),
            denied,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for scheme in ("file", "pfs"):
        err = report[f"{scheme}_full"]
        assert err is not None, f"{scheme}: an 8 MiB put into a 4 MiB tmpfs succeeded"
        assert err["errno"] == errno.ENOSPC
        assert "is full" in err["text"] and str(8 << 20) in err["text"]
        assert "free space" in err["text"]
        assert report[f"{scheme}_old_intact"] is True
        assert report[f"{scheme}_listing"] == ["old"]
    assert report["temporaries"] == []
    assert report["read_only"]["errno"] == errno.EROFS
    assert "Read-only file system" in report["read_only"]["text"]
    assert str(ro) in report["read_only"]["text"]
    if denied:
        assert report["denied"]["errno"] == errno.EACCES
        assert "Permission denied" in report["denied"]["text"]


# -- S3 faults ------------------------------------------------------------------------------


def _s3(bucket: str, **options: object) -> Tier:
    defaults: dict[str, object] = {"part_size": PART, "retry_attempts": 3, "retry_backoff_s": 0.02}
    return open_tier(f"s3://{bucket}/ckpt", **{**defaults, **options})


def test_s3_server_cut_mid_upload(s3_server: MotoS3, s3_bucket: str) -> None:
    """The server dies between parts: after the retries, TierUnavailableError; nothing listed."""
    data = os.urandom(12 * MiB)

    async def producer() -> AsyncIterator[memoryview]:
        view = memoryview(data)
        yield view[:PART]
        yield view[PART : 2 * PART]
        await asyncio.to_thread(s3_server.stop)
        yield view[2 * PART :]

    async def go() -> None:
        tier = _s3(s3_bucket, max_concurrency=1)
        try:
            with pytest.raises(TierUnavailableError) as info:
                await tier.put("job/step-1/rank-0/data", producer(), len(data))
            text = str(info.value)
            assert "unreachable or failing" in text and s3_server.endpoint_url in text
            assert "failed 3 times" in text
        finally:
            await tier.close()

    run(go())
    s3_server.start()

    async def after() -> None:
        tier = _s3(s3_bucket)
        try:
            assert await tier.list("") == []
            with pytest.raises(CheckpointNotFoundError):
                await tier.get("job/step-1/rank-0/data")
            await tier.put("job/step-1/rank-0/data", [memoryview(data)], len(data))
            assert await tier.get("job/step-1/rank-0/data") == data
        finally:
            await tier.close()

    run(after())


@pytest.mark.parametrize(
    ("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (503, "RequestLimitExceeded")]
)
def test_s3_throttling_and_5xx_are_retried(
    s3_server: MotoS3, s3_bucket: str, status: int, code: str
) -> None:
    from s3fixture import FaultProxy

    data = os.urandom(11 * MiB)

    async def go(endpoint: str) -> None:
        tier = _s3(s3_bucket, endpoint_url=endpoint, retry_attempts=4)
        try:
            # CreateMultipartUpload passes; the 3 faults land on the parts sent in parallel
            await tier.put("big", [memoryview(data)], len(data))
            await tier.put("small", [memoryview(b"abc")], 3)
            assert await tier.get("big") == data
            assert await tier.get("small") == b"abc"
        finally:
            await tier.close()

    with FaultProxy(s3_server.endpoint_url, faults=3, status=status, code=code, after=1) as proxy:
        run(go(proxy.endpoint_url))
    assert proxy.faulted == 3


def test_s3_retry_policy_governs_attempts(s3_server: MotoS3, s3_bucket: str) -> None:
    """Throttled forever: exactly retry_attempts requests (no hidden s3fs/botocore retries)."""
    from s3fixture import FaultProxy

    async def go(endpoint: str) -> None:
        tier = _s3(s3_bucket, endpoint_url=endpoint, retry_attempts=3)
        try:
            await tier.put("k", [memoryview(b"abc")], 3)
        finally:
            await tier.close()

    limit = r"failed 3 times.*SlowDown \(HTTP 503\)"
    with (
        FaultProxy(s3_server.endpoint_url, faults=1000) as proxy,
        pytest.raises(TierUnavailableError, match=limit),
    ):
        run(go(proxy.endpoint_url))
    assert proxy.requests == 3


def test_s3_missing_bucket(s3_bucket: str) -> None:
    async def go() -> None:
        tier = _s3("no-such-bucket-here")
        try:
            with pytest.raises(TierUnavailableError, match="does not exist.*create it"):
                await tier.put("k", [memoryview(b"x")], 1)
            with pytest.raises(TierUnavailableError, match="no-such-bucket-here"):
                await tier.list("")
        finally:
            await tier.close()

    run(go())


@S3
def test_s3_part_size_floor() -> None:
    with pytest.raises(ConfigError, match="part_size"):
        open_tier("s3://bucket/p", part_size=4 * MiB)


# -- registry -------------------------------------------------------------------------------


def test_schemes_and_default_scopes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = parse_spec("file:///mnt/nvme/ckpt?scope=node&keep_last=3")
    assert (local.scheme, local.location, local.scope) == ("file", "/mnt/nvme/ckpt", Scope.NODE)
    assert local.options == {"keep_last": "3"}
    assert local.url == "file:///mnt/nvme/ckpt"
    assert parse_spec("pfs:///lustre/ckpt").scope is Scope.SHARED
    s3 = parse_spec("s3://bucket/some/prefix/")
    assert (s3.scheme, s3.location, s3.scope) == ("s3", "bucket/some/prefix", Scope.SHARED)
    for relative in ("file://./ckpt", "file:ckpt", "./ckpt", "ckpt"):
        spec = parse_spec(relative)
        assert (spec.scheme, spec.location) == ("file", str(tmp_path / "ckpt")), relative
    assert parse_spec("/mnt/x").location == "/mnt/x"


def test_options_merge_and_scope_override() -> None:
    spec = parse_spec(
        "file:///x?scope=shared&keep_last=3&every_steps=10", keep_last=5, every_seconds=1.5
    )
    assert spec.scope is Scope.SHARED
    assert spec.options == {"keep_last": "5", "every_steps": "10", "every_seconds": "1.5"}
    assert parse_spec("s3://b/p", scope=Scope.NODE).scope is Scope.NODE
    with pytest.raises(ConfigError, match="expected 'node' or 'shared'"):
        parse_spec("file:///x?scope=cluster")


def test_misspelt_unknown_and_bad_options_fail_when_the_tier_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="unknown option keep_lst; file:// tiers take .*keep_last"
    ):
        parse_spec("file:///x?keep_lst=3")
    with pytest.raises(ConfigError, match="unknown option part_size"):  # an S3-only option
        parse_spec("pfs:///x?part_size=8")
    with pytest.raises(ConfigError, match="keep_last='-1' must be >= 0"):
        parse_spec("s3://b/p?keep_last=-1")
    with pytest.raises(ConfigError, match="every_steps='ten' is not valid"):
        parse_spec("file:///x?every_steps=ten")
    with pytest.raises(ConfigError, match="unknown option kep_last"):  # Checkpointer checks early
        Checkpointer(f"file://{tmp_path}?kep_last=3", job="opts")
    spec = parse_spec(
        "s3://b/p?endpoint_url=http://h:1&part_size=8&keep_every=5&rank_concurrency=2"
    )
    assert spec.options["rank_concurrency"] == "2"


@S3
def test_open_tier_builds_the_registered_class(tmp_path: Path) -> None:
    assert isinstance(open_tier(f"file://{tmp_path}"), LocalTier)
    assert isinstance(open_tier(f"pfs://{tmp_path}"), ParallelFsTier)
    tier = open_tier("s3://bucket/p?max_concurrency=2")
    assert type(tier).__name__ == "S3Tier" and tier.scope is Scope.SHARED


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown tier scheme 'bogus'") as info:
        parse_spec("bogus://bucket/x")
    for scheme in ("file", "pfs", "s3"):
        assert scheme in str(info.value)


def test_every_fsspec_protocol_is_a_shared_tier_and_a_missing_backend_names_its_package() -> None:
    spec = parse_spec("gs://bucket/run1?keep_last=3&project=p1&token=SEKRET")
    assert (spec.scheme, spec.location, spec.scope) == ("gs", "bucket/run1", Scope.SHARED)
    assert spec.url == "gs://bucket/run1" and "SEKRET" not in str(spec.url)
    assert parse_spec("fsspec+file:///data/ckpt").location == "/data/ckpt"
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(ImportError, match=r"gs:// tier needs .*pip install gcsfs"):
            open_tier("gs://bucket/run1")
    with pytest.raises(ConfigError, match="no location"):
        parse_spec("gs://")


def test_fsspec_credentials_are_never_shown() -> None:
    from flashckpt.storage_tiers.registry import redact

    url = ("az://c/p?account_name=acct&account_key=K3Y&sas_token=S4S&connection_string=C0NN"
           "&client_secret=CL1&password=PW&part_size=8")  # fmt: skip
    shown = redact(url)
    for secret in ("K3Y", "S4S", "C0NN", "CL1", "PW"):
        assert secret not in shown
    assert "account_name=acct" in shown and "part_size=8" in shown


def test_fsspec_options_come_from_the_url_and_storage_options(tmp_path: Path) -> None:
    """Query values are converted (true/false, numbers); storage_options go as they are; an
    option the filesystem does not take is a clear error; storage_options are refused for
    flashckpt's own tiers."""
    tier = open_tier(f"fsspec+file://{tmp_path}/t?auto_mkdir=true&max_concurrency=2")
    assert tier.fs.auto_mkdir is True and tier.max_concurrency == 2
    tier = open_tier(f"fsspec+file://{tmp_path}/t", storage_options={"auto_mkdir": False})
    assert tier.fs.auto_mkdir is False
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class Strict(LocalFileSystem):  # most filesystems pass unknown options on; this one refuses
        protocol = "strictfs"

        def __init__(self, auto_mkdir: bool = False) -> None:
            super().__init__(auto_mkdir=auto_mkdir)

    fsspec.register_implementation("strictfs", Strict, clobber=True)
    with pytest.raises(ConfigError, match="Strict refused its options \\(no_such_option\\)"):
        open_tier(f"fsspec+strictfs://{tmp_path}/t?no_such_option=1")
    with pytest.raises(ConfigError, match="storage_options are for fsspec tiers"):
        open_tier(f"file://{tmp_path}/t", storage_options={"x": 1})
    with pytest.raises(ConfigError, match="commit=.*'upload' or 'rename'"):
        open_tier(f"fsspec+file://{tmp_path}/t?commit=maybe")


def test_missing_s3_extra_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry imports the tier module named in its entry; block just that import.
    monkeypatch.setitem(sys.modules, "flashckpt.storage_tiers.s3", None)
    with pytest.raises(ImportError, match=r"pip install 'flashckpt\[s3\]'"):
        open_tier("s3://bucket/p")


def test_third_party_tier_from_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed distribution that declares a ``flashckpt.tiers`` entry point is found."""
    (tmp_path / "memtier.py").write_text(
        textwrap.dedent(
            """
            from flashckpt.storage_tiers import Scope
            from flashckpt.storage_tiers.parallel_fs import ParallelFsTier

            class MemTier(ParallelFsTier):
                default_scope = Scope.SHARED
            """
        )
    )
    dist = tmp_path / "memtier-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: memtier\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[flashckpt.tiers]\nmem = memtier:MemTier\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tier = open_tier("mem://anything?keep_last=2")
    assert type(tier).__name__ == "MemTier"
    assert tier.scope is Scope.SHARED and tier.spec.options == {"keep_last": "2"}
    with pytest.raises(ConfigError, match="mem"):
        parse_spec("nosuch://x")


def test_importing_tiers_does_not_import_s3fs() -> None:
    code = (
        "import sys, flashckpt.storage_tiers as t; t.parse_spec('s3://b/p'); "
        "assert 's3fs' not in sys.modules and 'fsspec' not in sys.modules, 'imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_checkpointer_names_a_missing_backend_package_when_it_is_made(monkeypatch) -> None:
    """Before any agent opens the tier, without importing the package in the trainer."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("s3fs", "gcsfs") else real(name, *a))  # fmt: skip
    with pytest.raises(
        ImportError, match=r"needs s3fs, which is not installed; run: pip install 'flashckpt\[s3\]'"
    ):
        Checkpointer("s3://bucket/run1", job="x")
    with pytest.raises(
        ImportError, match="needs gcsfs, which is not installed; run: pip install gcsfs"
    ):
        Checkpointer("gs://bucket/run1", job="x")
