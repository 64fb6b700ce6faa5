"""Exceptions raised by flashckpt. Each subclasses the built-in a caller would catch."""

from __future__ import annotations


class FlashCkptError(Exception):
    """Base of every flashckpt error."""


class CheckpointNotFoundError(FlashCkptError, FileNotFoundError):
    """No snapshot of the asked step (or none at all) exists where it was looked for."""


class ManifestError(FlashCkptError, ValueError):
    """A manifest is malformed, from a newer format, or does not describe its data."""


class ChecksumError(FlashCkptError, ValueError):
    """Stored bytes do not match the checksum recorded when they were written."""


class PartlyRestoredError(CheckpointNotFoundError, ChecksumError):
    """Every copy tried was found corrupt while it was being copied into the state, and no
    step was restored: the state holds part of a corrupt copy, neither its old values nor a
    step. Restore again from another source or step, or start the state afresh."""


class StateMismatchError(FlashCkptError, ValueError):
    """The snapshot and the state being restored into differ in keys, shapes or dtypes."""


class PickleNotAllowedError(FlashCkptError, ValueError):
    """A snapshot entry is pickled and restoring it was not allowed."""


class SharedMemoryError(FlashCkptError, OSError):
    """Shared memory for snapshot slots cannot be had (too small, not writable)."""


class HostMemoryCapError(SharedMemoryError):
    """What flashckpt holds on this node would pass its cap (``FLASHCKPT_HOST_MEMORY``)."""


class TierUnavailableError(FlashCkptError, OSError):
    """A storage tier cannot be reached or written (network, permission, disk full).

    Raised as ``TierUnavailableError(errno, message)`` where the system's errno is known (it
    stays in ``.errno``); its text is then the message alone, never ``[Errno N] ...``."""

    def __str__(self) -> str:
        if self.errno is not None and self.strerror:
            return str(self.strerror)
        return super().__str__()


class ObjectExistsError(FlashCkptError, FileExistsError):
    """A put that may only create found an object under its key already (``exclusive``)."""


class StaleWriterError(FlashCkptError):
    """A newer run of the job has claimed the tier: this writer's run is over there, and
    nothing it still holds may land (see "Runs of a job" in docs/FORMAT.md)."""


class ConfigError(FlashCkptError, ValueError):
    """An argument or environment variable has a value flashckpt cannot use."""


class RankBusyError(FlashCkptError, RuntimeError):
    """Another live process already saves for this job and rank."""


class CorruptSlotError(SharedMemoryError):
    """A shared-memory slot file does not hold a header flashckpt wrote: never initialised (a
    writer killed while creating it), truncated, or overwritten. Readers skip it; the rank's
    owner reinitialises it."""
