"""A node's ranks restoring together list their peer holder once, not once each.

The first rank to come takes a lock in the run directory, lists, and leaves its answer (or, if
it was slow to come, its error) in a file beside it; the ranks queued behind it take that
answer while it is fresher than LISTING_TTL_S. A process never takes its own answer: its next
call lists anew. A put or a delete drops the node's answers for the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from flashckpt.errors import TierUnavailableError

LISTING_TTL_S = 2.0  # a node's ranks share a listing this fresh (they restore together)
SHARED_FAILURE_S = 1.0  # a failed listing that took this long is shared too


async def once_per_node(path: Path, list_now: Callable[[], Awaitable[list[str]]],
                        wait: float) -> list[str]:  # fmt: skip
    """``list_now()``, or what another process of this node (a rank restoring beside this one)
    got from it less than LISTING_TTL_S ago, its error included where it was slow to come: the
    first rank to come lists while the others wait on a lock, at most twice ``wait`` (the
    longest one wait on the holder may take)."""
    fd = await _locked(f"{path}.lock", 2 * wait)
    try:
        try:
            with open(path) as f:
                doc = json.load(f)
            # Another process's answer: this one's own calls each list anew.
            fresh = time.time() - float(doc["at"]) < LISTING_TTL_S and doc["pid"] != os.getpid()
        except (OSError, ValueError, KeyError, TypeError):
            doc, fresh = None, False
        if fresh and isinstance(doc.get("keys"), list):
            return [k for k in doc["keys"] if isinstance(k, str)]
        if fresh and isinstance(doc.get("error"), str):
            raise TierUnavailableError(doc["error"])
        began = time.monotonic()
        try:
            keys = await list_now()
        except TierUnavailableError as exc:
            # A slow failure (a holder that does not answer) is shared: each rank would wait
            # as long. A quick one (refused) is not: the next rank tries for itself.
            if time.monotonic() - began >= SHARED_FAILURE_S:
                _write_listing(path, {"at": time.time(), "pid": os.getpid(), "error": str(exc)})
            raise
        _write_listing(path, {"at": time.time(), "pid": os.getpid(), "keys": keys})
        return keys
    finally:
        os.close(fd)  # the lock goes with it


def stale(run_dir: Path, key: str) -> None:
    """This node's shared listings of the key's job no longer hold: drop them."""
    for path in run_dir.glob(f"{key.split('/', 1)[0]}.peer-listing-*.json"):
        path.unlink(missing_ok=True)


async def _locked(path: str, patience: float) -> int:
    """``path`` opened and locked, waited for on this loop (a cancelled wait holds nothing).
    A holder of the lock that does not let go within ``patience`` seconds (a process stopped
    while it listed) is not waited for longer: this rank goes on without the lock and lists
    for itself."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return fd
                await asyncio.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise


def _write_listing(path: Path, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
