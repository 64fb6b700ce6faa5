"""The random number generators of a process as one Stateful leaf: ``flashckpt.RNG()``.

Put it in the saved state (``{"model": m, "optim": o, "rng": RNG()}``) and a resumed run draws
the same numbers as one that never stopped: torch's CPU generator and every CUDA device's,
NumPy's global generator and Python's ``random``. Each rank saves and restores its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import StateMismatchError


class RNG:
    """Snapshot and restore this process's global random generators."""

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return {
            "torch": torch.get_rng_state(),
            "cuda": cuda,
            "numpy": np.random.get_state(legacy=True),
            "python": random.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cuda = list(state.get("cuda") or [])
        if cuda and len(cuda) != torch.cuda.device_count():
            raise StateMismatchError(
                f"the snapshot holds the RNG states of {len(cuda)} CUDA devices, this process "
                f"sees {torch.cuda.device_count()}; restore with as many visible devices"
            )
        torch.set_rng_state(state["torch"])
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(tuple(state["numpy"]))
        random.setstate(_tuples(state["python"]))


def _tuples(value: Any) -> Any:
    """Python's generator state is tuples all the way down; a snapshot may give lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
