"""Any fsspec filesystem as a tier: ``gs://``, ``az://``, ``oss://``, ``hdfs://``, ``sftp://``...

URLs of protocols flashckpt has no tier of its own for come here, and ``fsspec+<protocol>://``
sends one it has here too (``fsspec+s3://``, ``fsspec+file://``). Everything goes through
fsspec's public synchronous API, run in worker threads so the agent's loop keeps serving:
``open``, ``cat_file``, ``find``, ``info``, ``mv``, ``rm``, ``rmdir``. A ``put`` is atomic either
way the tier commits (``commit=`` option):

* ``upload`` (the default for object stores: s3, gs, az, oss...): the file is opened with
  ``autocommit=False`` and committed once every byte is written, so the object appears whole
  or never; a failure discards the upload. What a killed writer's upload left is the store's
  to expire (an S3 lifecycle rule; GCS and Azure drop unfinished uploads after a week).
* ``rename`` (the default elsewhere: local, hdfs, sftp...): the bytes go to a temporary next
  to the final name, renamed in when complete; a killed writer's temporaries are leftovers
  that retention removes after the grace period.

The filesystem's own options come from the URL query (``true``/``false`` and numbers are
converted; credential options are never shown), from fsspec's configuration
(``FSSPEC_<PROTOCOL>_<OPTION>`` variables, its config files) and, in-process, from
``open_tier(url, storage_options={...})``. Tier options: ``commit``, ``part_size`` (the upload
block size, default 8 MiB), ``max_concurrency`` (ranged reads in flight, default 4).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import posixpath
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from fsspec.core import strip_protocol
from fsspec.implementations.local import LocalFileSystem

from flashckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    FlashCkptError,
    ObjectExistsError,
    TierUnavailableError,
)

from .base import (
    TEMP_PREFIX,
    Leftover,
    Tier,
    TierSpec,
    check_delete_prefix,
    check_key,
    iter_chunks,
    size_error,
    temp_name,
    temp_target,
)
from .os_errors import ADVICE, explain, kind_of, not_a_file
from .posix_files import fsync_dir
from .registry import POLICY_OPTIONS, is_secret, option
from .threads import in_thread

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "fsspec+"
OWN_OPTIONS = frozenset(["commit", "part_size", "max_concurrency"])
OBJECT_STORES = frozenset(["s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "tos"])
PAGES = frozenset(["http", "https"])
"""Protocols that call every path a file, directories too (a page listing links)."""
MiB = 1 << 20
_DONE = {"put": "written", "get": "read", "list": "read", "delete": "deleted", "clean": "cleaned"}


def protocol_of(scheme: str) -> str:
    return scheme.removeprefix(PREFIX)


def filesystem_class(protocol: str) -> type:
    """fsspec's class for ``protocol``; ImportError naming what to install if it is missing."""
    import fsspec
    from fsspec.registry import known_implementations

    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        cls = known_implementations.get(protocol, {}).get("class", "")
        package = cls.split(".")[0] if cls and not cls.startswith("fsspec.") else None
        hint = f"pip install {package}" if package else "install what it names"
        raise ImportError(
            f"the {protocol}:// tier needs a package fsspec loads for it ({exc}); {hint}"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"fsspec knows no protocol {protocol!r} ({exc})") from exc


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls(name=...)`` is accepted: named, or passed on through ``**kwargs``."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _coerce(name: str, text: str) -> Any:
    """A URL query value as the filesystem's keyword argument wants it."""
    if is_secret(name):
        return text  # a credential stays the string it is
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _modified(info: dict[str, Any]) -> float:
    """When an object was last written, from whichever field its filesystem reports."""
    for field in ("mtime", "LastModified", "last_modified", "updated", "created", "timeCreated"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return time.time()  # unknown: as young as can be, so a grace period keeps it


class FsspecTier(Tier):
    """Objects under ``<protocol>://<location>`` through an fsspec filesystem.

    fsspec has no create-if-absent common to its filesystems, so an exclusive put looks
    first: two writers racing for one key may both pass the look (``exclusive_atomic``)."""

    exclusive_atomic = False

    def __init__(self, spec: TierSpec, storage_options: dict[str, Any] | None = None):
        self.spec = spec
        self.protocol = protocol_of(spec.scheme)
        own = {"scope", *POLICY_OPTIONS, *OWN_OPTIONS}
        given = {k: _coerce(k, v) for k, v in spec.options.items() if k not in own}
        given.update(storage_options or {})
        cls = filesystem_class(self.protocol)
        # A tier must see the store as it is now: no instance shared with other users of
        # fsspec (fsspec's own keyword), no cached listing taken before another writer's rename.
        kwargs: dict[str, Any] = {"skip_instance_cache": True}
        if _takes(cls, "use_listings_cache"):
            kwargs["use_listings_cache"] = False
        kwargs.update(given)
        try:
            self.fs = cls(**kwargs)
        except TypeError as exc:  # an option the filesystem does not take
            shown = ", ".join(sorted(given)) or "none"
            raise ConfigError(
                f"tier {spec.url}: {cls.__name__} refused its options ({shown}): {exc}; fix the "
                "URL query or storage_options"
            ) from None
        self.root = strip_protocol(f"{self.protocol}://{spec.location}").rstrip("/")
        default = "upload" if self.protocol in OBJECT_STORES else "rename"
        self.commit = option(spec, "commit", default, _commit_mode, "'upload' or 'rename'")
        self.part_size = option(spec, "part_size", 8 * MiB, int)
        self.max_concurrency = max(1, option(spec, "max_concurrency", 4, int))
        # On this machine's own filesystem a commit is made durable as the directory tiers
        # make it: the file fsynced before its rename, its directory after. Other backends
        # give what their store gives (see the README).
        self.local = isinstance(self.fs, LocalFileSystem)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _key(self, path: str) -> str:
        return path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path

    async def _run(self, what: str, key: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """A blocking fsspec call in a worker thread, its errors in the tier's terms; a
        cancelled caller waits for the call (a write reads the caller's memory)."""
        try:
            return await in_thread(fn, *args, **kw)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"tier {self.spec.url} has no object {key!r} ({exc}); check the key, or "
                "whether this snapshot was deleted"
            ) from None
        except NotImplementedError:
            raise TierUnavailableError(
                f"tier {self.spec.url}: its filesystem ({type(self.fs).__name__}) cannot do the "
                f"{what} of {key!r}: it is read-only or lacks the operation; read from it only, "
                "and save to a writable store (file:///dir, s3://bucket/prefix...)"
            ) from None
        except OSError as exc:
            known = exc.errno in ADVICE and not isinstance(exc, (ConnectionError, TimeoutError))
            if known:
                raise explain(exc, self.spec.url, key, action=_DONE.get(what, what)) from exc
            raise TierUnavailableError(
                f"tier {self.spec.url}: {what} of {key!r} failed: {type(exc).__name__}: {exc}; "
                "check that the store is reachable, its credentials and its free space"
            ) from exc

    async def check_location(self, create: bool = False) -> None:
        try:
            info = await self._run("list", "", self.fs.info, self.root)
        except CheckpointNotFoundError:
            if create or self.protocol in OBJECT_STORES:
                return  # a prefix nothing is stored under yet: empty
            raise TierUnavailableError(
                errno.ENOENT,
                f"{self.spec.url}: there is nothing at {self.root} (no such directory, or a "
                "store that cannot be reached); check the URL and that the store is up",
            ) from None
        kind = info.get("type")
        if kind != "directory" and self.protocol not in OBJECT_STORES | PAGES:
            raise TierUnavailableError(
                errno.ENOTDIR,
                f"{self.spec.url}: {self.root} is {_kind(info)}, not a directory; point the tier "
                "at a directory",
            )

    async def _info(self, key: str, path: str) -> dict[str, Any]:
        """``path``'s details, which must be those of a regular file (a FIFO or a device read
        as an object could block forever)."""
        info = await self._run("get", key, self.fs.info, path)
        if info.get("type", "file") != "file":
            raise not_a_file(self.spec.url, key, path, _kind(info))
        return info

    # -- put ---------------------------------------------------------------------------------

    async def put(
        self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview], size: int,
        exclusive: bool = False,
    ) -> None:  # fmt: skip
        final = self._path(check_key(key))
        if exclusive and await self._run("put", key, self.fs.exists, final):
            raise ObjectExistsError(
                f"{self.protocol}://{final} exists already; it was left as it is"
            )
        target = final
        if self.commit == "rename":
            parent, name = posixpath.split(final)
            target = f"{parent}/{temp_name(name)}"
            await self._run("put", key, self.fs.makedirs, parent, exist_ok=True)
            opened = await self._run("put", key, self.fs.open, target, "wb",
                                     block_size=self.part_size)  # fmt: skip
        else:
            opened = await self._run("put", key, self.fs.open, target, "wb",
                                     block_size=self.part_size, autocommit=False)  # fmt: skip
        try:
            written = 0
            async for view in iter_chunks(chunks):
                if written + len(view) > size:
                    raise size_error(key, size, written + len(view), more=True)
                await self._run("put", key, opened.write, view)
                written += len(view)
            if written != size:
                raise size_error(key, size, written)
            if self.local:
                await self._run("put", key, _fsync_file, opened)
            await self._run("put", key, opened.close)
            if self.commit == "rename":
                await self._run("put", key, self.fs.mv, target, final)
            else:
                await self._run("put", key, opened.commit)
            if self.local:
                await self._run("put", key, fsync_dir, Path(posixpath.dirname(final)))
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._discard, opened, target))
            raise
        found = await self._run("put", key, self.fs.size, final)
        if found != size:  # a filesystem whose commit does not do what it should
            raise TierUnavailableError(
                f"tier {self.spec.url}: {key!r} holds {found} bytes after its put of {size}; "
                f"its filesystem ({type(self.fs).__name__}) does not commit uploads as flashckpt "
                "needs: add commit=rename to the URL"
            )

    def _discard(self, opened: Any, target: str) -> None:
        """Throw away a put that failed: nothing appears under its name."""
        try:
            if self.commit == "rename":
                opened.close()
                self.fs.rm(target)
            else:
                opened.discard()
                opened.closed = True  # nothing left to flush when it is collected
        except Exception as exc:  # what stays is a leftover that retention removes
            log.debug("discarding %s: %s", target, exc)

    # -- get ---------------------------------------------------------------------------------

    async def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(check_key(key))
        # Clamped like a slice: filesystems differ at the ends (S3 refuses a range past them).
        size = (await self._info(key, path)).get("size")
        if size is not None:
            end = size if end is None else min(end, size)
        if end is not None and end <= start:
            return b""
        return await self._run("get", key, self.fs.cat_file, path, start=start, end=end)

    async def get_into(self, key: str, out: memoryview, start: int = 0) -> None:
        path = self._path(check_key(key))
        view = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        await self._info(key, path)
        if not len(view):
            return
        slots = asyncio.Semaphore(self.max_concurrency)

        async def piece(offset: int) -> None:
            dest = view[offset : offset + self.part_size]
            async with slots:
                data = await self._run("get", key, self.fs.cat_file, path,
                                       start=start + offset, end=start + offset + len(dest))  # fmt: skip
            if len(data) != len(dest):
                raise ValueError(
                    f"tier {self.spec.url}: object {key!r} ends at byte {start + offset + len(data)}"
                    f", expected at least {start + offset + len(dest)} bytes; it is truncated or "
                    "the caller's size is wrong"
                )
            dest[:] = data

        await asyncio.gather(*(piece(off) for off in range(0, len(view), self.part_size)))

    # -- list / delete -----------------------------------------------------------------------

    async def _find(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every file under ``prefix`` (or ``prefix`` itself), temporaries included."""
        rel = check_key(prefix, prefix=True)
        try:
            return await self._run("list", prefix, self.fs.find, self._path(rel), detail=True)
        except CheckpointNotFoundError:
            return {}

    async def list(self, prefix: str) -> list[str]:
        found = await self._find(prefix)
        keys = (self._key(path) for path in found)
        return sorted(k for k in keys if not any(p.startswith(TEMP_PREFIX) for p in k.split("/")))

    async def delete(self, prefix: str) -> None:
        path = self._path(check_delete_prefix(prefix, self.spec.url))
        try:
            await self._run("delete", prefix, self.fs.rm, path, recursive=True)
        except CheckpointNotFoundError:
            return

    async def leftovers(self, prefix: str) -> list[Leftover]:
        found = []
        for path, info in (await self._find(prefix)).items():
            parent, name = posixpath.split(self._key(path))
            target = temp_target(name)
            if target is not None:
                key = f"{parent}/{target}" if parent else target
                found.append(Leftover(key, path, info.get("size"), _modified(info)))
        return found

    async def store_now(self) -> float:
        """When a probe written now in the root was modified, as the store dates it: the
        clock its leftovers' times are on. This node's clock where none can be written."""
        path = f"{self.root}/{temp_name('clock')}"
        try:
            await self._run("put", "", self.fs.pipe_file, path, b"\0")
            try:
                return _modified(await self._run("list", "", self.fs.info, path))
            finally:
                await self._run("delete", "", self.fs.rm, path)
        except (OSError, FlashCkptError) as exc:
            log.info("%s: the store's clock cannot be read (%s); leftovers' ages are taken on "
                     "this node's clock", self.spec.url, exc)  # fmt: skip
            return time.time()

    async def remove_leftover(self, leftover: Leftover) -> None:
        try:
            await self._run("clean", leftover.key, self.fs.rm, leftover.name)
        except CheckpointNotFoundError:
            return  # committed or discarded meanwhile
        await asyncio.to_thread(self._prune, posixpath.dirname(leftover.name), leftover.key)

    def _prune(self, here: str, key: str) -> None:
        """Remove the directories a leftover leaves empty, up to the job's (exclusive)."""
        job_dir = self._path(key.split("/")[0])
        while here.startswith(job_dir + "/"):
            try:
                if self.fs.ls(here, detail=False):
                    return
                self.fs.rmdir(here)
            except Exception:  # no directories (an object store), or not empty any more
                return
            here = posixpath.dirname(here)

    async def close(self) -> None:
        """Nothing to release: the filesystem object is dropped with the tier."""


def _kind(info: dict[str, Any]) -> str:
    """What a path whose details are ``info`` is, in words."""
    mode = info.get("mode")
    if isinstance(mode, int) and (kind := kind_of(mode)):
        return kind
    kind = info.get("type")
    words = {"directory": "a directory", "file": "a file"}
    return words.get(kind, f"not a regular file (type {kind!r})")


def _fsync_file(opened: Any) -> None:
    """Flush a local file written through fsspec and fsync it."""
    opened.flush()
    raw = getattr(opened, "f", opened)  # LocalFileOpener keeps the open file as ``f``
    raw.flush()
    os.fsync(raw.fileno())


def _commit_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("upload", "rename"):
        raise ValueError(text)
    return mode
