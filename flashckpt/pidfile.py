"""An exclusive, crash-safe claim: a flock on a file holding the owner's pid.

The kernel drops a dead process's flock, so a crashed owner never wedges the claim. An owner
may unlink the file when it gives the claim up (while still holding the lock); a contender
that opened the old file just before then would lock an orphan, so after locking it checks
that the path still names the file it locked, and starts over if not. A flock belongs to an
open file description: a second claim from the same process is refused like any other.

A holder whose SIGKILL has not taken (in uninterruptible sleep, frozen: ``doomed``) keeps its
lock for as long as the kernel holds it, which may be forever, yet never runs its own code
again: ``release_doomed`` frees the claim from it for the next claimant.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from pathlib import Path

from .safe_paths import open_file

_ATTEMPTS = 100
_PID_WAIT_S = 0.5  # how long a contender waits for a new holder to write its pid


class PidFileBusy(Exception):
    """Another open claim holds the file; ``pid`` is the holder's, None if it is not known."""

    def __init__(self, pid: int | None):
        super().__init__(pid)
        self.pid = pid

    def holder(self) -> str:
        """The holder in words, for error messages."""
        if self.pid is None:
            return "another process, whose pid is not recorded yet"
        if self.pid == os.getpid():
            return f"this process (pid {self.pid}), through another claim that is still open"
        return f"pid {self.pid}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def holder(path: Path) -> int | None:
    """The pid of the process holding the claim on ``path`` now (the kernel's lock table
    says, not the pid written in the file, which may be a dead owner's), None if nobody
    holds it. Looking never takes the lock, so it never turns a claimant away."""
    try:
        return _lock_holder(os.stat(path))
    except OSError:
        return None


def _lock_holder(st: os.stat_result) -> int | None:
    """The pid holding a flock on the file ``st`` describes, from the kernel's lock table."""
    with open("/proc/locks") as f:
        table = f.read().splitlines()
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table:
        fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:inode> 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
            with contextlib.suppress(ValueError):
                return int(fields[4])
    return None


def doomed(pid: int) -> bool:
    """Whether live process ``pid`` has a SIGKILL pending: sent and not taken yet, the process
    held in the kernel (uninterruptible sleep, frozen). The kernel puts one there too for a
    fatal signal the process does not handle (a SIGTERM by default). It never runs its own
    code again: the kill is the first thing it meets on its way back to user space, whenever
    the kernel lets it go. False for a process that is gone, a zombie, or one that cannot be
    read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if fields.get("State", "").strip()[:1] in ("", "Z", "X"):
        return False
    bit = 1 << (signal.SIGKILL - 1)
    for name in ("ShdPnd", "SigPnd"):  # the process's pending set, its main thread's
        with contextlib.suppress(ValueError):
            if int(fields.get(name, "0").strip(), 16) & bit:
                return True
    return False


def release_doomed(path: Path, wait_s: float = 1.0) -> int | None:
    """Free the claim on ``path`` from a holder that can never use it again (``doomed``):
    the path is unlinked, the holder keeps its lock on a file nothing names any more, and the
    next ``lock_pidfile`` claims a new file there. The holder's pid where it was freed, else
    None. Contenders take turns on a lock of the directory (for up to ``wait_s``), so that
    none unlinks the file another has just claimed in its place."""
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.01)
        try:
            st = os.lstat(path)
            pid = _lock_holder(st)
            if pid is None or pid == os.getpid() or not doomed(pid):
                return None
            if os.lstat(path).st_ino != st.st_ino:
                return None
            path.unlink()
        except OSError:
            return None
        return pid
    finally:
        os.close(dir_fd)


def lock_pidfile(path: Path) -> int:
    """Lock ``path`` and write our pid in it; the fd holds the claim until it is closed (or
    the process dies). Raises PidFileBusy with the holder's pid if another claim has it, and
    FileNotFoundError if the directory is gone."""
    for _ in range(_ATTEMPTS):
        fd = open_file(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = _holder(fd, path)
            except _Replaced:
                continue
            finally:
                os.close(fd)
            raise PidFileBusy(pid) from None
        if not _names(path, fd):  # unlinked (or replaced) between our open and flock
            os.close(fd)
            continue
        pid = str(os.getpid()).encode()
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))  # after the write: a reader never sees an empty file
        return fd
    raise PidFileBusy(None)


class _Replaced(Exception):
    """The path was unlinked or replaced while we looked at the file it named."""


def _names(path: Path, fd: int) -> bool:
    """True if ``path`` is still the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int, path: Path) -> int | None:
    """The pid the holder of ``fd``'s lock recorded: waits briefly for a holder that has
    locked but not yet written it. _Replaced if the path no longer names that file."""
    deadline = time.monotonic() + _PID_WAIT_S
    pid = None
    while True:
        if not _names(path, fd):
            raise _Replaced
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        pid = int(text) if text.isdigit() else pid
        if (pid is not None and pid_alive(pid)) or time.monotonic() > deadline:
            return pid
        time.sleep(0.01)
