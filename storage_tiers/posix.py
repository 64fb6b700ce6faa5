"""Directory tiers: objects are files under a root, written to a temporary and renamed in.

The rename is what makes ``put`` atomic; the fsyncs (file, then its directory) make it
durable. Blocking calls run in worker threads so the agent's event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

from flashckpt.errors import CheckpointNotFoundError, ObjectExistsError, TierUnavailableError

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
from .os_errors import explain, kind_of, not_a_file, through_link
from .posix_files import Temp, is_link, make_dirs, open_child
from .registry import as_bool, mode_option, option
from .threads import in_thread

log = logging.getLogger(__name__)
T = TypeVar("T")

COALESCE_BYTES = 1 << 20
"""Chunks smaller than this are gathered into one write; larger ones go straight from their view."""


class PosixTier(Tier):
    """Objects as files under ``spec.location``; subclasses add what their filesystem allows."""

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.root = Path(spec.location)
        # Snapshots are the model: readable by the owner alone unless the URL says otherwise.
        self.file_mode = mode_option(spec, "mode")
        self.dir_mode = mode_option(spec, "dir_mode")
        # create=0: a missing root is an error (an unmounted file system), not made on the
        # node's own disk by the first write nor listed as empty.
        self.create = option(spec, "create", True, as_bool)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _link_on_way(self, path: Path) -> Path | None:
        """The first symbolic link on the way from the root to ``path`` (``path`` included, the
        root not: it may be one, the owner chose it); None if there is none. Nothing inside a
        tier is a link flashckpt wrote, and following one would read or delete elsewhere."""
        here = self.root
        for part in path.relative_to(self.root).parts:
            here = here / part
            try:
                if stat.S_ISLNK(os.lstat(here).st_mode):
                    return here
            except (FileNotFoundError, NotADirectoryError):
                return None
        return None

    # -- hooks -------------------------------------------------------------------------------

    def _reserve(self, fd: int, size: int) -> None:
        """Called on the temporary before writing ``size`` bytes (a local disk preallocates)."""

    # -- errors ------------------------------------------------------------------------------

    def _translate(self, exc: OSError, key: str, size: int, action: str = "written") -> OSError:
        """An OSError in words that say what it means for the tier and what to do."""
        return explain(exc, self.spec.url, key, size, action, self.root)

    async def check_location(self, create: bool = False) -> None:
        await asyncio.to_thread(self._check_root, create)

    def _check_root(self, create: bool) -> None:
        here = self.root
        while True:
            try:
                st = os.stat(here)
            except NotADirectoryError:
                here = here.parent  # a file on the way: the walk up names it
                continue
            except FileNotFoundError:
                if not create or not self.create:
                    raise TierUnavailableError(
                        errno.ENOENT,
                        f"{self.spec.url}: there is no directory {self.root}; check the path"
                        + ("" if self.create else " (create=0: is its file system mounted?)"),
                    ) from None
                here = here.parent  # made by the first put: what is above must be a directory
                continue
            except OSError as exc:
                raise self._translate(exc, "", 0, "read") from None
            kind = kind_of(st.st_mode) or "a regular file"
            if kind != "a directory":
                raise TierUnavailableError(
                    errno.ENOTDIR,
                    f"{self.spec.url}: {here} is {kind}, not a directory; point the tier at a "
                    "directory" + (" (a missing one is created)" if create else ""),
                )
            return

    # -- put ---------------------------------------------------------------------------------

    def _room_for(self, size: int) -> None:
        """ENOSPC at once when the filesystem plainly has no room for ``size`` bytes: a full
        tier is retried often, and each try then costs a statvfs, not a failed write."""
        try:
            st = os.statvfs(self.root if self.root.exists() else self.root.parent)
        except OSError:
            return  # the write itself says what is wrong
        if size > st.f_bavail * st.f_frsize:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root))

    async def put(
        self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview], size: int,
        exclusive: bool = False,
    ) -> None:  # fmt: skip
        path = self._path(key)
        if not self.create:
            await self.check_location()
        try:
            await asyncio.to_thread(self._room_for, size)
            temp = await asyncio.to_thread(self._create_temp, path, key)
        except OSError as exc:
            raise self._translate(exc, key, size) from exc
        try:
            await temp.run(self._reserve, temp.fd, size)
            written = await self._write_all(temp, chunks)
            if written != size:
                raise size_error(key, size, written)
            await temp.run(temp.commit, exclusive)
        except BaseException as exc:
            await asyncio.shield(temp.discard())
            if isinstance(exc, OSError) and not isinstance(exc, ObjectExistsError):
                raise self._translate(exc, key, size) from exc
            raise
        log.debug("put %s/%s (%d bytes)", self.root, key, size)

    def _create_temp(self, path: Path, key: str) -> Temp:
        """A new temporary next to ``path``, in its directory as reached from the root."""
        dir_fd = self._open_parent(path.parent, key)
        try:
            return Temp.create(dir_fd, path, self.file_mode)
        except BaseException:
            os.close(dir_fd)
            raise

    def _open_parent(self, parent: Path, key: str) -> int:
        """An fd of the directory ``parent`` inside the tier, made (``dir_mode``) where missing.
        It is reached from the root one directory at a time, each opened without following a
        link: a link on the way is refused, as reads refuse it, never written through (the
        root itself may be one: its owner chose it)."""
        if not self.root.is_dir():
            make_dirs(self.root, self.dir_mode)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        here = self.root
        try:
            for part in parent.relative_to(self.root).parts:
                here = here / part
                try:
                    child = open_child(fd, part, self.dir_mode)
                except OSError as exc:
                    if is_link(fd, part):
                        raise through_link(self.spec.url, key, here) from None
                    raise OSError(exc.errno, exc.strerror, str(here)) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def _write_all(
        self, temp: Temp, chunks: AsyncIterator[memoryview] | list[memoryview]
    ) -> int:
        """Write chunks in order: small ones gathered, large ones from their own memory."""
        written = 0
        pending = bytearray()
        async for view in iter_chunks(chunks):
            if len(view) < COALESCE_BYTES:
                pending += view
                if len(pending) < COALESCE_BYTES:
                    continue
                view, pending = memoryview(pending), bytearray()
            elif pending:
                await temp.run(temp.write, memoryview(pending))
                written += len(pending)
                pending = bytearray()
            await temp.run(temp.write, view)
            written += len(view)
        if pending:
            await temp.run(temp.write, memoryview(pending))
            written += len(pending)
        return written

    # -- get ---------------------------------------------------------------------------------

    def _open_read(self, key: str) -> int:
        """An fd of ``key``'s file, which must be a regular file: anything else (a FIFO, a
        device, a socket, a symbolic link anywhere inside the tier) is refused unread, never
        waited on."""
        path = self._path(key)
        if (link := self._link_on_way(path)) is not None:
            raise not_a_file(self.spec.url, key, link, _link_kind(link))
        try:
            kind = kind_of(os.stat(path).st_mode)
            # Non-blocking: what stands there may change between the stat and the open.
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = None if kind else os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"tier {self.spec.url} has no object {key!r}: expected the file {path}, found "
                "nothing there; check the key, or whether this snapshot was deleted"
            ) from None
        except OSError as exc:
            raise self._translate(exc, key, 0, "read") from exc
        if fd is not None:
            kind = kind_of(os.fstat(fd).st_mode)
            if not kind:
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
        raise not_a_file(self.spec.url, key, path, kind)

    def read_fd(self, key: str) -> int:
        """An open, blocking file descriptor of ``key``'s file, for the caller to read and
        close (a replica holder sends it with ``sendfile``); refused as ``get`` refuses."""
        return self._open_read(key)

    async def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return await asyncio.to_thread(self._get, key, start, end)

    def _get(self, key: str, start: int, end: int | None) -> bytes:
        fd = self._open_read(key)
        try:
            length = os.fstat(fd).st_size
            end = length if end is None else min(end, length)
            parts: list[bytes] = []
            pos = start
            while pos < end:
                piece = os.pread(fd, end - pos, pos)
                if not piece:
                    break
                parts.append(piece)
                pos += len(piece)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    async def get_into(self, key: str, out: memoryview, start: int = 0) -> None:
        await in_thread(self._get_into, key, out, start)

    def open_fd(self, key: str) -> int:
        """A file descriptor of ``key``'s file, open for reading (the caller closes it): a
        restore reads each chunk of a rank's data from it straight into its target."""
        return self._open_read(check_key(key))

    def _get_into(self, key: str, out: memoryview, start: int) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        with os.fdopen(self._open_read(key), "rb", buffering=0) as f:
            f.seek(start)
            filled = 0
            while filled < len(view):
                n = f.readinto(view[filled:])
                if not n:
                    raise ValueError(
                        f"tier {self.spec.url}: object {key!r} ends at byte {start + filled}, "
                        f"expected at least {start + len(view)} bytes; it is truncated or the "
                        "caller's size is wrong"
                    )
                filled += n

    # -- list / delete -----------------------------------------------------------------------

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list, check_key(prefix, prefix=True))

    def _list(self, prefix: str) -> list[str]:
        if not self.create:
            self._check_root(False)
        base = self.root / prefix if prefix else self.root
        if self._link_on_way(base) is not None:
            return []  # a link is no part of the tier: what it points at is not listed
        if base.is_file():
            return [prefix]
        try:
            found = list(_files(base))
        except PermissionError as exc:
            raise self._translate(exc, prefix, 0, "read") from exc
        keys = [os.path.relpath(p, self.root).replace(os.sep, "/") for p in found]
        return sorted(k for k in keys if not os.path.basename(k).startswith(TEMP_PREFIX))

    async def delete(self, prefix: str) -> None:
        await asyncio.to_thread(self._delete, check_delete_prefix(prefix, self.spec.url))

    def _delete(self, prefix: str) -> None:
        target = self.root / prefix
        link = self._link_on_way(target.parent) if target.parent != self.root else None
        if link is not None:
            raise through_link(self.spec.url, prefix, link, "deleted")
        try:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._translate(exc, prefix, 0) from exc
        log.debug("deleted %s", target)

    async def leftovers(self, prefix: str) -> list[Leftover]:
        rel = check_key(prefix, prefix=True)
        return await asyncio.to_thread(self._leftovers, rel)

    def _leftovers(self, prefix: str) -> list[Leftover]:
        """Temporaries under ``prefix``: a crashed writer's, or a live one's (fresh mtime)."""
        found = []
        base = self.root / prefix if prefix else self.root
        if self._link_on_way(base) is not None:
            return []
        for path in _files(base):
            target = temp_target(path.name)
            if target is not None:
                key = Path(os.path.relpath(path.with_name(target), self.root)).as_posix()
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # committed or discarded meanwhile
                found.append(Leftover(key, str(path), st.st_size, st.st_mtime))
        return found

    async def store_now(self) -> float:
        return await asyncio.to_thread(self._probe_time)

    def _probe_time(self) -> float:
        """The mtime of a byte written just now in the root: the clock that dates the tier's
        files (a network filesystem's server's). This node's clock where none can be
        written (a read-only tier removes nothing anyway)."""
        name = temp_name("clock")
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(name, flags, 0o600, dir_fd=root)
                try:
                    os.write(fd, b"\0")
                    return os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
                    os.unlink(name, dir_fd=root)
            finally:
                os.close(root)
        except OSError as exc:
            log.info("%s: the store's clock cannot be read (%s); leftovers' ages are taken on "
                     "this node's clock", self.spec.url, exc)  # fmt: skip
            return time.time()

    async def remove_leftover(self, leftover: Leftover) -> None:
        await asyncio.to_thread(self._remove_leftover, Path(leftover.name), leftover.key)

    def _remove_leftover(self, path: Path, key: str) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return  # committed or discarded meanwhile
        except OSError as exc:
            raise self._translate(exc, key, 0, "cleaned") from exc
        # A step directory that only ever held this crashed write goes too (not the job's).
        job_dir = self.root / Path(key).parts[0]
        here = path.parent
        while here != job_dir and job_dir in here.parents:
            try:
                here.rmdir()
            except OSError:  # not empty (a committed object, a live write), or gone
                return
            here = here.parent

    async def close(self) -> None:
        """Nothing to release: every call opens and closes its own file."""


def _link_kind(link: Path) -> str:
    """A symbolic link in words, with what it points at."""
    try:
        target = kind_of(os.stat(link).st_mode) or "a regular file"
    except OSError:
        target = "nothing"
    return f"a symbolic link to {target}"


def _files(base: Path) -> Iterator[Path]:
    """What is under ``base`` that is neither a directory nor a symbolic link (os.walk lists a
    link to a file as a file, and descends into none but lists links to directories). An unreadable directory fails the listing rather than shrink it; a missing
    one (nothing written yet, or removed meanwhile) holds nothing."""
    stack = [base]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif not entry.is_symlink():  # a FIFO or device too: its read refuses it
                        yield Path(entry.path)
        except (FileNotFoundError, NotADirectoryError):
            continue
