"""flashckpt: flash checkpoints and fault tolerance for PyTorch and DeepSpeed training.

ckpt = Checkpointer("file:///mnt/nvme/ckpt")
step0 = ckpt.restore({"model": model, "optim": optimizer})
...
ckpt.save(step, {"model": model, "optim": optimizer})

state = flashckpt.load("file:///mnt/nvme/ckpt")  # without the training code: plain Python

flashckpt.run_recoverable(train)  # in-process recovery under flashckpt-run (see the README)
"""

from typing import TYPE_CHECKING

from .errors import (
    CheckpointNotFoundError,
    ChecksumError,
    ConfigError,
    FlashCkptError,
    ManifestError,
    PickleNotAllowedError,
    RankBusyError,
    SharedMemoryError,
    StateMismatchError,
    TierUnavailableError,
)

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .faults.inprocess import run_recoverable
    from .format.manifest import FORMAT_VERSION
    from .restore.loader import load
    from .rng import RNG

# What needs torch is imported when first used: the agent, the controller and the command
# line import this package too, and torch costs each of them a second or two at start.
_LAZY = {
    "FORMAT_VERSION": "format.manifest",
    "Checkpointer": "checkpointer",
    "RNG": "rng",
    "load": "restore.loader",
    "run_recoverable": "faults.inprocess",
}


_SUBMODULES = ("dcp", "hf", "lightning")  # ``flashckpt.dcp`` without importing it first


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "Checkpointer",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ConfigError",
    "FlashCkptError",
    "ManifestError",
    "PickleNotAllowedError",
    "RNG",
    "RankBusyError",
    "SharedMemoryError",
    "StateMismatchError",
    "TierUnavailableError",
    "load",
    "run_recoverable",
]
