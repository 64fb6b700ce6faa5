"""The files a directory tier writes, reached without following links: a temporary next to
its final name, committed by fsync and rename (``Temp``), and the directories on its way,
opened one at a time from the tier's root (``open_child``), made with the tier's mode and
fsynced where they are new.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flashckpt.errors import ObjectExistsError

from .base import temp_name
from .threads import in_thread

log = logging.getLogger(__name__)
T = TypeVar("T")


class Temp:
    """A temporary file being written next to its final name, both named in the directory
    ``dir_fd`` (opened link-free); removed unless committed."""

    def __init__(self, fd: int, dir_fd: int, name: str, final: Path):
        self.fd: int | None = fd
        self.dir_fd: int | None = dir_fd
        self.name = name
        self.final = final

    @classmethod
    def create(cls, dir_fd: int, final: Path, mode: int) -> Temp:
        name = temp_name(final.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)  # exactly the mode asked for, whatever the umask
        except BaseException:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            raise
        return cls(fd, dir_fd, name, final)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn`` in a thread; a cancelled caller waits for it (``in_thread``):
        a write may be reading the caller's memory, and its fd is closed only after."""
        return await in_thread(fn, *args)

    def write(self, view: memoryview) -> None:
        assert self.fd is not None
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def commit(self, exclusive: bool = False) -> None:
        """fsync the file, rename it to its final name and fsync the directory. ``exclusive``:
        only if nothing has that name yet (a hard link, which fails on an existing name, then
        the temporary's removal); ObjectExistsError otherwise, the temporary removed."""
        assert self.fd is not None and self.dir_fd is not None
        os.fsync(self.fd)
        fd, self.fd = self.fd, None
        os.close(fd)
        if exclusive:
            self._link()
        else:
            os.replace(self.name, self.final.name, src_dir_fd=self.dir_fd,
                       dst_dir_fd=self.dir_fd)  # fmt: skip
        fsync_fd(self.dir_fd, self.final.parent)
        self._close_dir()

    def _link(self) -> None:
        assert self.dir_fd is not None
        try:
            os.link(self.name, self.final.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd,
                    follow_symlinks=False)  # fmt: skip
        except FileExistsError:
            self._remove()
            raise ObjectExistsError(f"{self.final} exists already; it was left as it is") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # A file system without hard links: look, then rename (two writers racing for
            # one name may both pass the look; see Tier.exclusive_atomic).
            log.debug("no hard links on %s (%s): create-if-absent by a look", self.final, exc)
            try:
                os.stat(self.final.name, dir_fd=self.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                self._remove()
                raise ObjectExistsError(f"{self.final} exists already; it was left as it is")
            os.rename(self.name, self.final.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            return
        os.unlink(self.name, dir_fd=self.dir_fd)

    async def discard(self) -> None:
        await in_thread(self._remove)

    def _remove(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
        if self.dir_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name, dir_fd=self.dir_fd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self.dir_fd is not None:
            fd, self.dir_fd = self.dir_fd, None
            os.close(fd)


def open_child(dir_fd: int, name: str, mode: int) -> int:
    """Open directory ``name`` in ``dir_fd``, made with ``mode`` if missing, never through a
    symbolic link (O_NOFOLLOW fails on one)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:  # made by a concurrent put
        return os.open(name, flags, dir_fd=dir_fd)
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # the umask narrows mkdir's mode; a mode asked for is kept
        fsync_fd(dir_fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def make_dirs(parent: Path, mode: int) -> None:
    """Create ``parent`` and its missing ancestors with ``mode``, fsyncing each directory that
    gained one."""
    missing: list[Path] = []
    here = parent
    while not here.is_dir():
        missing.append(here)
        if here == here.parent:
            break
        here = here.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if d.is_dir():
                continue  # made by a concurrent put
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d)) from None
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)  # the umask narrows mkdir's mode; a mode asked for is kept
        finally:
            os.close(fd)
        fsync_dir(d.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def fsync_fd(fd: int, where: object) -> None:
    """fsync an open directory; some network filesystems refuse that, which is no error."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
        log.debug("directory fsync not supported on %s: %s", where, exc)
