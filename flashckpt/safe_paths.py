"""Directories and files that only this user can touch, on a node shared with other users.

The shared-memory and run directories default to predictable names in world-writable places
(``/dev/shm``, ``/tmp``). Another local user can create them first, or plant symlinks in
them, so that a trainer or agent running as root appends to, truncates or grows a file it
should not, or loads a snapshot it did not write. Every directory flashckpt keeps state in
goes through :func:`private_dir`, every file in one through :func:`open_file` (or
:func:`write_atomic`): a directory is used only if it is a real directory owned by this user
that no one else can write, a file only if it is a regular file of ours with a single link,
opened without following a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import uuid
from pathlib import Path

from .errors import ConfigError

_ATTEMPTS = 20


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


_GONE = "it does not exist"
_PLANTED = ("it is a symlink", "it is not a directory", "it is owned by", "group or other")


def why_not_private(path: Path, shared_parent: bool = False) -> str | None:
    """Why ``path`` is not a directory only this user can write, or None if it is one.

    ``shared_parent`` also accepts a sticky directory owned by this user or root (a tmpfs
    mount point, ``/dev/shm`` itself): others may add entries there but never rename or remove
    ours, so it can hold the private directories flashckpt makes inside it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return _GONE
    except OSError as exc:
        return f"it cannot be inspected ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    me = os.geteuid()
    sticky = shared_parent and st.st_mode & stat.S_ISVTX and st.st_uid in (me, 0)
    if st.st_uid != me and not sticky:
        return f"it is owned by {_user(st.st_uid)}, not by {_user(me)}"
    if st.st_mode & 0o022 and not sticky:
        return f"group or other users can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        if not os.path.lexists(path):
            return _GONE
        return f"it is not writable (mode {stat.S_IMODE(st.st_mode):04o}, or a read-only mount)"
    return None


def make_private_dir(path: Path, shared_parent: bool = False) -> str | None:
    """Create ``path`` (mode 0700) if missing, with its parents; None if it is then private,
    else why not (see :func:`why_not_private`)."""
    for _ in range(_ATTEMPTS):  # an owner closing its last rank may remove it meanwhile
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"its parent directory cannot be created ({exc.strerror})"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"it cannot be created ({exc.strerror})"
        reason = why_not_private(path, shared_parent)
        if reason != _GONE:
            return reason
    return reason


def private_dir(path: Path, what: str, shared_parent: bool = False, fix: str = "") -> Path:
    """``path``, created 0700 if missing; ConfigError naming ``what`` (the setting it came
    from) if it is not a directory only this user can write. ``fix`` says what to do instead
    of pointing ``what`` elsewhere."""
    reason = make_private_dir(path, shared_parent)
    if reason is None:
        return path
    fix = fix or f"point {what} at a directory of your own"
    if reason.startswith(_PLANTED):
        fix = f"If you did not make it, another user may have: remove it, or {fix}"
    raise ConfigError(
        f"{what} {str(path)!r} cannot be used: {reason}. Expected a directory owned by "
        f"{_user(os.geteuid())} that no other user can write (flashckpt creates it 0700). "
        f"{fix[0].upper()}{fix[1:]}"
    )


def open_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` for a file in a private directory: never through a symlink, close-on-exec,
    and only a regular file owned by this user with no other link (ConfigError otherwise)."""
    try:
        # O_NONBLOCK: a FIFO planted under the name must not hang the open.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "it is a symlink") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, or a socket
            raise _refuse(path, "it is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "it is not a regular file")
        if st.st_uid != os.geteuid():
            raise _refuse(path, f"it is owned by {_user(st.st_uid)}")
        if st.st_nlink > 1:  # 0 is fine: unlinked since the open by whoever may remove it
            raise _refuse(path, f"it has {st.st_nlink} hard links")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse(path: Path, reason: str) -> ConfigError:
    return ConfigError(
        f"refusing to open {path}: {reason}; expected a regular file of "
        f"{_user(os.geteuid())} in a directory only that user can write. Another user may have "
        "planted it: remove it and check who can write its directory"
    )


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step: readers see the old content or the new,
    never an empty or partial file; the temporary is a new file (O_EXCL) next to it."""
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = open_file(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.replace(temp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
