"""Node-local NVMe directory tier: the fastest persistent copy, readable only on its node."""

from __future__ import annotations

import errno
import os

from .posix import PosixTier


class LocalTier(PosixTier):
    """A directory on a local disk; preallocates each object so a full disk fails up front."""

    def _reserve(self, fd: int, size: int) -> None:
        if size <= 0:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise  # ENOSPC/EDQUOT become the tier's "directory is full" error
