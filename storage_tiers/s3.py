"""S3 (or any S3-compatible store) tier over the aiobotocore client s3fs configures.

s3fs resolves the endpoint, credentials and options (its documented ``set_session()`` returns
the client); every request is a documented aiobotocore S3 call. Small objects go up in one
PutObject; large ones as a multipart upload whose parts are sent a few at a time and which is
aborted on failure, so S3 never shows a partial object. Transient errors (throttling, 5xx,
dropped connections, also while a body streams) are retried under this tier's RetryPolicy;
botocore's own retries are configured off so the policy alone decides.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

import botocore.exceptions
import s3fs

from flashckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ObjectExistsError,
    TierUnavailableError,
)

from .base import (
    Leftover,
    RetryPolicy,
    Tier,
    TierSpec,
    check_delete_prefix,
    check_key,
    iter_chunks,
    size_error,
    temp_name,
)
from .registry import as_bool, option
from .s3_errors import DENIED_CODES, UNSUPPORTED_CODES, describe, error_code, transient

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's floor for every part but the last
MAX_PART = 5 * 1024 * MiB


class S3Tier(Tier):
    """Objects under ``s3://bucket/prefix``.

    Options: ``part_size`` (bytes, default 8 MiB, at least 5 MiB), ``max_concurrency`` (parts
    in flight, default 4), ``retry_attempts`` / ``retry_backoff_s`` / ``retry_max_backoff_s``,
    ``endpoint_url``, ``region``, ``key`` / ``secret`` / ``token``, ``anon``,
    ``conditional_writes`` (default 1: an exclusive put is a write with ``If-None-Match: *``;
    0, or a store that answers it NotImplemented: a HEAD first, which two writers racing for
    one key may both pass). Use one tier per event loop: its HTTP session belongs to the loop
    that first used it.
    """

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.bucket, _, prefix = spec.location.partition("/")
        self.prefix = prefix.strip("/")
        self.part_size = option(spec, "part_size", 8 * MiB, int)
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise ConfigError(
                f"tier {spec.url}: part_size={self.part_size} is out of range: S3 needs parts "
                f"of {MIN_PART} to {MAX_PART} bytes; pick a value in that range"
            )
        self.conditional = option(spec, "conditional_writes", True, as_bool)
        self.exclusive_atomic = self.conditional
        self.max_concurrency = option(spec, "max_concurrency", 4, int)
        if self.max_concurrency < 1:
            raise ConfigError(
                f"tier {spec.url}: max_concurrency must be >= 1, got {self.max_concurrency}"
            )
        default = RetryPolicy()
        self.retry = RetryPolicy(
            attempts=max(1, option(spec, "retry_attempts", default.attempts, int)),
            backoff_s=option(spec, "retry_backoff_s", default.backoff_s, float),
            max_backoff_s=option(spec, "retry_max_backoff_s", default.max_backoff_s, float),
        )
        kwargs = self._fs_kwargs(spec)
        self.fs = s3fs.S3FileSystem(**kwargs)
        self.endpoint = kwargs.get("endpoint_url") or "the default AWS endpoint"
        self._client: Any = None  # the aiobotocore client, made on first use in the loop

    @staticmethod
    def _fs_kwargs(spec: TierSpec) -> dict[str, Any]:
        opts = spec.options
        kwargs: dict[str, Any] = {
            "asynchronous": True,
            "skip_instance_cache": True,  # each tier owns its client and may close it
            "use_listings_cache": False,
            "config_kwargs": {"retries": {"total_max_attempts": 1}},  # this tier's policy alone
        }
        # fsspec reads FSSPEC_S3_* once at import; read the endpoint again at open time.
        endpoint = opts.get("endpoint_url") or os.environ.get("FSSPEC_S3_ENDPOINT_URL")
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        for name in ("key", "secret", "token"):
            if opts.get(name):
                kwargs[name] = opts[name]
        if opts.get("anon"):
            kwargs["anon"] = option(spec, "anon", False, as_bool)
        if opts.get("region"):
            kwargs["client_kwargs"] = {"region_name": opts["region"]}
        return kwargs

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix and key else (key or self.prefix)

    # -- errors and retries ------------------------------------------------------------------

    def _fatal(self, exc: BaseException, what: str, key: str) -> BaseException | None:
        """The error to raise at once for a permanent S3 failure, or None to re-raise ``exc``."""
        code, status = error_code(exc)
        where = f"s3://{self.bucket}/{self._key(key)}"
        if code in ("NoSuchKey", "NotFound") or (code == "404" and what != "list"):
            return CheckpointNotFoundError(
                f"tier {self.spec.url} has no object {key!r}: expected {where} at "
                f"{self.endpoint}, found nothing; check the key, or whether it was deleted"
            )
        if code == "404":  # a listing of the bucket itself found nothing there
            return TierUnavailableError(
                f"tier {self.spec.url}: the S3 endpoint {self.endpoint} answered 404 Not Found "
                f"to a {what} of bucket {self.bucket!r}; check endpoint_url (it must point at an "
                "S3 service) and the bucket name"
            )
        if code == "NoSuchBucket":
            return TierUnavailableError(
                f"tier {self.spec.url}: bucket {self.bucket!r} does not exist at {self.endpoint}; "
                f"create it (e.g. `aws s3 mb s3://{self.bucket}`) or fix the bucket in the URL"
            )
        if code in DENIED_CODES or status == 403:
            return TierUnavailableError(
                f"tier {self.spec.url}: S3 refused {what} of {where} ({describe(exc)}); "
                "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or "
                "the key/secret options) and the bucket policy"
            )
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return TierUnavailableError(
                f"tier {self.spec.url}: no AWS credentials were found for {what} of {where}; "
                "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or pass anon=true"
            )
        return None

    async def _retrying(self, what: str, key: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``, retried with backoff on transient errors under ``self.retry``."""
        last: BaseException | None = None
        for attempt in range(self.retry.attempts):
            try:
                return await fn()
            except Exception as exc:
                fatal = self._fatal(exc, what, key)
                if fatal is not None:
                    raise fatal from exc
                if not transient(exc):
                    raise
                last = exc
                if attempt + 1 < self.retry.attempts:
                    delay = self.retry.delay(attempt)
                    log.warning(
                        "S3 %s of %r at %s failed (%s); retry %d/%d in %.2fs",
                        what,
                        key,
                        self.endpoint,
                        describe(exc),
                        attempt + 1,
                        self.retry.attempts - 1,
                        delay,
                    )
                    await asyncio.sleep(delay)
        raise TierUnavailableError(
            f"tier {self.spec.url}: S3 endpoint {self.endpoint} (bucket {self.bucket!r}) is "
            f"unreachable or failing: {what} of {key!r} failed {self.retry.attempts} times, last "
            f"error: {describe(last) if last else None}; check that the endpoint is up and "
            "reachable, or raise retry_attempts / retry_backoff_s"
        ) from last

    async def _s3(self) -> Any:
        """The S3 client (made once, in the event loop that first uses the tier)."""
        if self._client is None:
            self._client = await self.fs.set_session()
        return self._client

    async def _request(self, method: str, **kwargs: Any) -> dict[str, Any]:
        """One S3 request, not retried."""
        return await getattr(await self._s3(), method)(**kwargs)

    async def _call(self, what: str, key: str, method: str, **kwargs: Any) -> dict[str, Any]:
        return await self._retrying(what, key, lambda: self._request(method, **kwargs))

    # -- put ---------------------------------------------------------------------------------

    async def put(
        self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview], size: int,
        exclusive: bool = False,
    ) -> None:  # fmt: skip
        full = self._key(check_key(key))
        if exclusive and not self.conditional and await self._present(key, full):
            raise self._exists_error(full)
        only_new = {"IfNoneMatch": "*"} if exclusive and self.conditional else {}
        try:
            if size <= self.part_size:
                body = await _collect(chunks, size, key)
                await self._call("put", key, "put_object", Bucket=self.bucket, Key=full,
                                 Body=body, **only_new)  # fmt: skip
            else:
                await self._put_multipart(key, full, chunks, size, only_new)
        except Exception as exc:
            code, status = error_code(exc)
            if only_new and (code == "PreconditionFailed" or status == 412):
                raise self._exists_error(full) from None
            if only_new and (code in UNSUPPORTED_CODES or status == 501):
                log.warning("tier %s: the store has no conditional writes (%s): an exclusive "
                            "put looks first from now on (set conditional_writes=0 to say so)",
                            self.spec.url, describe(exc))  # fmt: skip
                self.conditional = self.exclusive_atomic = False
                return await self.put(key, chunks, size, exclusive)
            raise
        log.debug("put s3://%s/%s (%d bytes)", self.bucket, full, size)

    async def _present(self, key: str, full: str) -> bool:
        try:
            await self._call("put", key, "head_object", Bucket=self.bucket, Key=full)
        except CheckpointNotFoundError:
            return False
        return True

    def _exists_error(self, full: str) -> ObjectExistsError:
        return ObjectExistsError(f"s3://{self.bucket}/{full} exists already; it was left as it is")

    async def _put_multipart(
        self, key: str, full: str, chunks: AsyncIterator[memoryview] | list[memoryview], size: int,
        only_new: dict[str, str],
    ) -> None:  # fmt: skip
        where = {"Bucket": self.bucket, "Key": full}
        started = await self._call("start upload", key, "create_multipart_upload", **where)
        upload_id = started["UploadId"]
        etags: dict[int, str] = {}
        slots = asyncio.Semaphore(self.max_concurrency)
        running: set[asyncio.Task[None]] = set()

        async def send(number: int, body: bytearray) -> None:
            try:
                reply = await self._call(
                    "upload part",
                    key,
                    "upload_part",
                    **where,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                )
                etags[number] = reply["ETag"]
            finally:
                slots.release()

        try:
            total = 0
            async for number, body in _parts(chunks, self.part_size):
                total += len(body)
                if total > size:
                    raise size_error(key, size, total, more=True)
                await slots.acquire()  # bounds parts in flight (and buffers in memory)
                _reap(running)
                running.add(asyncio.create_task(send(number, body)))
            if total != size:
                raise size_error(key, size, total)
            await asyncio.gather(*running)
            parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
            await self._call(
                "complete upload",
                key,
                "complete_multipart_upload",
                **where,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **only_new,
            )
        except BaseException:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.shield(self._abort(key, full, upload_id))
            raise

    async def _abort(self, key: str, full: str, upload_id: str) -> None:
        """Abort a failed upload so no parts linger; a lifecycle rule catches what this misses."""
        try:
            await self._call(
                "abort upload",
                key,
                "abort_multipart_upload",
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
            )
        except Exception as exc:
            log.warning(
                "could not abort multipart upload %s of s3://%s/%s (%s); its parts stay until "
                "an AbortIncompleteMultipartUpload lifecycle rule removes them",
                upload_id,
                self.bucket,
                full,
                exc,
            )

    # -- get ---------------------------------------------------------------------------------

    async def _exists(self, key: str) -> None:
        """Raise CheckpointNotFoundError unless ``key`` exists (for empty reads)."""
        await self._call("get", key, "head_object", Bucket=self.bucket, Key=self._key(key))

    async def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        full = self._key(check_key(key))
        if end is not None and end <= start:
            await self._exists(key)
            return b""
        ranged = (
            {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end else {}
        )

        async def read() -> bytes:
            try:
                reply = await self._request("get_object", Bucket=self.bucket, Key=full, **ranged)
            except Exception as exc:
                if error_code(exc)[0] == "InvalidRange":  # start at or past the end
                    return b""
                raise
            body = reply["Body"]
            try:
                return await body.read()
            finally:
                body.close()

        return await self._retrying("get", key, read)

    async def get_into(self, key: str, out: memoryview, start: int = 0) -> None:
        full = self._key(check_key(key))
        view = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        if not len(view):
            await self._exists(key)
            return
        slots = asyncio.Semaphore(self.max_concurrency)

        async def piece(offset: int) -> None:
            dest = view[offset : offset + self.part_size]
            async with slots:
                await self._retrying(
                    "get", key, lambda: self._read_range(key, full, dest, start + offset)
                )

        await _all_or_nothing([piece(off) for off in range(0, len(view), self.part_size)])

    async def _read_range(self, key: str, full: str, dest: memoryview, pos: int) -> None:
        """One ranged GET streamed straight into ``dest``."""
        try:
            reply = await self._request(
                "get_object",
                Bucket=self.bucket,
                Key=full,
                Range=f"bytes={pos}-{pos + len(dest) - 1}",
            )
        except Exception as exc:
            if error_code(exc)[0] == "InvalidRange":
                raise self._short(key, pos, pos + len(dest)) from None
            raise
        body = reply["Body"]
        try:
            filled = 0
            while filled < len(dest):
                if hasattr(body, "readinto"):
                    got = await body.readinto(dest[filled:])
                else:  # a checksum-validating wrapper has only read()
                    data = await body.read(len(dest) - filled)
                    got = len(data)
                    dest[filled : filled + got] = data
                if not got:
                    raise self._short(key, pos + filled, pos + len(dest))
                filled += got
        finally:
            body.close()

    def _short(self, key: str, at: int, wanted: int) -> ValueError:
        return ValueError(
            f"tier {self.spec.url}: object {key!r} ends at byte {at}, expected at least "
            f"{wanted} bytes; it is truncated or the caller's size is wrong"
        )

    # -- list / delete -----------------------------------------------------------------------

    def _under(self, prefix: str) -> tuple[str, Callable[[str], bool]]:
        """The S3 ``Prefix`` to list the tree ``prefix`` with (a tier key, possibly ``""``), and
        a test that keeps the full names in it. The prefix ends in ``/``: without it, listing
        ``step-1`` (or a tier at ``run1``) would page through ``step-10...`` (``run10/...``)."""
        rel = check_key(prefix, prefix=True)
        full = self._key(rel)
        if not full:
            return "", lambda name: True
        return full + "/", lambda name: name.startswith(full + "/")

    async def list(self, prefix: str) -> list[str]:
        s3_prefix, inside = self._under(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": s3_prefix}
        while True:
            page = await self._call("list", prefix, "list_objects_v2", **kwargs)
            for obj in page.get("Contents", []):
                name = obj["Key"]
                if name.endswith("/"):
                    continue  # a console's "folder" marker, not an object
                if inside(name):
                    keys.append(name[strip:])
            if not page.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
        if not keys and s3_prefix:  # ``prefix`` may name one object: the first key from it
            full = s3_prefix[:-1]
            page = await self._call("list", prefix, "list_objects_v2", Bucket=self.bucket,
                                    Prefix=full, MaxKeys=1)  # fmt: skip
            if [obj["Key"] for obj in page.get("Contents", [])] == [full]:
                keys.append(full[strip:])
        return sorted(keys)

    async def leftovers(self, prefix: str) -> list[Leftover]:
        """The multipart uploads under ``prefix`` never completed (a live writer's, or a dead
        one's), with the bytes their parts hold. An upload's age runs from its newest part:
        its ``Initiated`` time does not move while parts arrive, so an upload longer than the
        grace period would look dead to every other node while its writer is still at it."""
        s3_prefix, inside = self._under(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": s3_prefix}
        found = []
        while True:
            page = await self._call("list uploads", prefix, "list_multipart_uploads", **kwargs)
            for upload in page.get("Uploads", []):
                name = upload["Key"]
                if inside(name):
                    size, newest = await self._parts(prefix, name, upload["UploadId"])
                    modified = max(upload["Initiated"].timestamp(), newest)
                    found.append(Leftover(name[strip:], upload["UploadId"], size, modified))
            if not page.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = page["NextKeyMarker"]
            kwargs["UploadIdMarker"] = page["NextUploadIdMarker"]

    async def _parts(self, prefix: str, full: str, upload_id: str) -> tuple[int | None, float]:
        """The bytes an upload's parts hold (None: completed or aborted meanwhile) and when
        its newest part was written (0.0: no part yet)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id}
        total, newest = 0, 0.0
        while True:
            try:
                page = await self._call("list parts", prefix, "list_parts", **kwargs)
            except Exception as exc:
                if error_code(exc)[0] == "NoSuchUpload":  # completed or aborted meanwhile
                    return None, newest
                raise
            for part in page.get("Parts", []):
                total += part["Size"]
                if isinstance(part.get("LastModified"), datetime):
                    newest = max(newest, part["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return total, newest
            kwargs["PartNumberMarker"] = page["NextPartNumberMarker"]

    async def store_now(self) -> float:
        """The LastModified S3 gives a probe object put now: the clock that dates uploads and
        their parts. This node's clock where none can be put (a read-only bucket)."""
        where = {"Bucket": self.bucket, "Key": self._key(temp_name("clock"))}
        try:
            await self._call("probe clock", "", "put_object", **where, Body=b"")
            try:
                head = await self._call("probe clock", "", "head_object", **where)
            finally:
                await self._call("probe clock", "", "delete_object", **where)
            return head["LastModified"].timestamp()
        except Exception as exc:  # any failure: the fallback below says so
            log.info("%s: the store's clock cannot be read (%s); leftovers' ages are taken on "
                     "this node's clock", self.spec.url, exc)  # fmt: skip
            return time.time()

    async def remove_leftover(self, leftover: Leftover) -> None:
        await self._abort(leftover.key, self._key(leftover.key), leftover.name)

    async def delete(self, prefix: str) -> None:
        check_delete_prefix(prefix, self.spec.url)
        keys = await self.list(prefix)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            reply = await self._call(
                "delete",
                prefix,
                "delete_objects",
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise TierUnavailableError(
                    f"tier {self.spec.url}: S3 kept {len(reply['Errors'])} of {len(batch)} "
                    f"objects under {prefix!r} (first: {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message')}); check delete permissions and retry"
                )
        log.debug("deleted %d objects under s3://%s/%s", len(keys), self.bucket, self._key(prefix))

    async def close(self) -> None:
        """Close the client's HTTP session (the tier is not used after this)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


async def _collect(
    chunks: AsyncIterator[memoryview] | list[memoryview], size: int, key: str
) -> bytearray:
    """A small object's chunks in one buffer, for a single PutObject."""
    body = bytearray(size)
    filled = 0
    async for view in iter_chunks(chunks):
        if filled + len(view) > size:
            raise size_error(key, size, filled + len(view), more=True)
        body[filled : filled + len(view)] = view
        filled += len(view)
    if filled != size:
        raise size_error(key, size, filled)
    return body


async def _parts(
    chunks: AsyncIterator[memoryview] | list[memoryview], part_size: int
) -> AsyncIterator[tuple[int, bytearray]]:
    """Re-cut the caller's chunks into numbered parts of exactly ``part_size`` (last shorter)."""
    number, buf, fill = 1, bytearray(part_size), 0
    async for view in iter_chunks(chunks):
        while view:
            take = min(len(view), part_size - fill)
            buf[fill : fill + take] = view[:take]
            fill, view = fill + take, view[take:]
            if fill == part_size:
                yield number, buf
                number, buf, fill = number + 1, bytearray(part_size), 0
    if fill:
        del buf[fill:]
        yield number, buf


def _reap(running: set[asyncio.Task[None]]) -> None:
    """Drop finished part uploads, raising the first failure."""
    for task in [t for t in running if t.done()]:
        running.discard(task)
        task.result()


async def _all_or_nothing(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` together; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
