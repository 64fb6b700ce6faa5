"""An exclusive, crash-safe claim: a flock on a file holding the owner's pid."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class PidFileBusy(Exception):
    def __init__(self, pid: str):
        super().__init__(pid)
        self.pid = pid


def lock_pidfile(path: Path) -> int:
    """Lock ``path`` and write our pid in it; the fd holds the claim until it is closed (or
    the process dies). Raises PidFileBusy with the holder's pid if another process has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise PidFileBusy(pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
