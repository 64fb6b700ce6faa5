"""Shared POSIX mount tier (NFS, Lustre, GPFS): every node reads what any node wrote."""

from __future__ import annotations

from .posix import PosixTier


class ParallelFsTier(PosixTier):
    """A directory on a shared mount: plain write, fsync and rename, nothing local-only.

    Temporary names carry a random suffix, so writers on different nodes never collide, and
    the rename is atomic on the server, so readers elsewhere see whole objects or none.
    """
