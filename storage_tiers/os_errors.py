"""What a tier says when the filesystem under it refuses, in one place: each errno a tier's
owner can act on, what it means there and what to do (directory tiers, fsspec filesystems and
the command line all word it from here). And the refusal of a tier object that is not a
regular file: a FIFO, a device or a socket read as an object could block forever or never end.
"""

from __future__ import annotations

import errno
import os
import stat

from flashckpt.errors import (
    CheckpointNotFoundError,
    FlashCkptError,
    ManifestError,
    TierUnavailableError,
)

_FEWER = "or keep fewer snapshots (lower keep_last / keep_every)"
_ELSEWHERE = "or use another directory"

ADVICE: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the filesystem is full", f"free space there, {_FEWER}"),
    errno.EDQUOT: (
        "the disk quota is used up, it is full for this user",
        f"raise the quota or free space there, {_FEWER}",
    ),
    errno.EFBIG: (
        "a file may not grow this large: the writer's file size limit (ulimit -f) or "
        "the filesystem's largest file is below it",
        "raise the limit for the process that writes (ulimit -f unlimited, systemd "
        f"LimitFSIZE=infinity), {_ELSEWHERE} on a filesystem that holds such files",
    ),
    errno.EACCES: (
        "the user running this lacks permission there",
        f"fix its permissions or run as its owner, {_ELSEWHERE}",
    ),
    errno.EPERM: (
        "refused by permissions, file attributes or a security policy",
        f"fix its permissions or attributes (chattr) or run as its owner, {_ELSEWHERE}",
    ),
    errno.EROFS: ("the filesystem is mounted read-only", f"remount it read-write, {_ELSEWHERE}"),
    errno.ENOTDIR: (
        "a file stands where a directory must be",
        f"remove or rename that file, {_ELSEWHERE}",
    ),
    errno.EEXIST: (
        "something already stands at that path (a file where a directory must be?)",
        "remove or rename it, or use another path",
    ),
    errno.EISDIR: (
        "a directory stands where a file must be",
        f"remove or rename that directory, {_ELSEWHERE}",
    ),
    errno.ENAMETOOLONG: (
        "a path is longer than the filesystem allows",
        "use a shorter directory or job name",
    ),
    errno.ELOOP: ("symbolic links loop", f"fix the links on the path, {_ELSEWHERE}"),
    errno.EMFILE: ("this process has too many files open", "raise its limit (ulimit -n)"),
    errno.ENFILE: ("the system has too many files open", "close files, or raise fs.file-max"),
    errno.EIO: (
        "the device reported an I/O error",
        f"check the disk and the kernel log (dmesg), {_ELSEWHERE}",
    ),
    errno.ESTALE: ("the network filesystem's handle is stale", f"remount it, {_ELSEWHERE}"),
    errno.ENOTCONN: (
        "the filesystem is not connected (a dead FUSE or network mount)",
        f"remount it, {_ELSEWHERE}",
    ),
    errno.ENODEV: ("its device is gone", f"remount it, {_ELSEWHERE}"),
}


_DOING = {"written": "writing", "read": "reading", "cleaned": "cleaning", "deleted": "deleting"}


def _free(path: object) -> str:
    try:
        st = os.statvfs(str(path))
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} bytes are free"


def explain(exc: OSError, where: str, key: str, size: int | None = None,
            action: str = "written", root: object = None) -> OSError:  # fmt: skip
    """``exc`` (raised while ``key`` of the tier at ``where`` was being ``action``) as a
    TierUnavailableError that says what it means and what to do; ``exc`` itself when it is
    already a flashckpt error or carries no errno. ``size``: the bytes being written; ``root``:
    where free space is measured."""
    if isinstance(exc, FlashCkptError) or exc.errno is None:
        return exc
    code = exc.errno
    meaning, todo = ADVICE.get(code, (
        f"errno {errno.errorcode.get(code, code)}",
        f"check the filesystem and the kernel log, {_ELSEWHERE}",
    ))  # fmt: skip
    on = exc.filename or root or where
    need = ""
    if size:
        need = f", needed {size} bytes"
        if code in (errno.ENOSPC, errno.EDQUOT):
            need += f" and {_free(root or on)}"
    doing = _DOING.get(action, action)
    return TierUnavailableError(
        code,
        f"tier {where} cannot be {action}: {os.strerror(code)} on {on} ({meaning}; "
        f"{doing} {key!r}{need}); {todo}",
    )


def advice(exc: OSError) -> str | None:
    """One line for an OSError outside any tier (``strerror on path; what to do``), or None
    when its errno is not one in the table."""
    if exc.errno not in ADVICE:
        return None
    meaning, todo = ADVICE[exc.errno]
    on = f" on {exc.filename}" if exc.filename else ""
    return f"{os.strerror(exc.errno)}{on} ({meaning}); {todo}"


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str | None:
    """What a file of ``mode`` is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def not_a_file(url: str, key: str, path: object, kind: str) -> Exception:
    """What reading ``key`` raises when ``path`` holds ``kind`` instead of a regular file: a
    directory is no object (CheckpointNotFoundError); anything else is a corrupt copy
    (ManifestError), never read, so a restore takes another tier or an older step."""
    if kind == "a directory":
        return CheckpointNotFoundError(
            f"tier {url} has no object {key!r}: expected the file {path}, found a directory "
            "there; check the key, or whether this snapshot was deleted"
        )
    return ManifestError(
        f"tier {url}: object {key!r} at {path} is {kind}, not a regular file, so it is not "
        "read (it could block forever); the copy is corrupt: remove it, and restore from "
        "another tier or an older step"
    )


def through_link(url: str, key: str, link: object, action: str = "written") -> Exception:
    """What writing or deleting ``key`` raises when the way to it inside the tier passes the
    symbolic link ``link``: nothing flashckpt writes is a link, and following one would write
    or delete outside the tier (where reads, listings and retention never look)."""
    return TierUnavailableError(
        errno.ELOOP,
        f"tier {url}: {key!r} is not {action}: {link} is a symbolic link, and nothing is "
        f"{action} through a link inside a tier (flashckpt makes none; expected a directory); "
        "replace the link with the directory it points at, or remove it",
    )
