"""flashckpt: flash checkpoints and fault tolerance for PyTorch and DeepSpeed training.

ckpt = Checkpointer("file:///mnt/nvme/ckpt")
step0 = ckpt.restore({"model": model, "optim": optimizer})
...
ckpt.save(step, {"model": model, "optim": optimizer})

state = flashckpt.load("file:///mnt/nvme/ckpt")  # without the training code: plain Python
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
]
