"""flashckpt: flash checkpoints and fault tolerance for PyTorch and DeepSpeed training.

ckpt = Checkpointer("file:///mnt/nvme/ckpt")
step0 = ckpt.restore({"model": model, "optim": optimizer})
...
ckpt.save(step, {"model": model, "optim": optimizer})

state = flashckpt.load("file:///mnt/nvme/ckpt")  # without the training code: plain Python

flashckpt.run_recoverable(train)  # in-process recovery under flashckpt-run (see the README)
"""

from .checkpointer import Checkpointer
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
from .inprocess import run_recoverable
from .load import load
from .manifest import FORMAT_VERSION
from .rng import RNG

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
