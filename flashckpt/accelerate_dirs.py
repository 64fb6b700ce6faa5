"""Accelerate's checkpoint directories, as ``flashckpt.accelerate`` names and recognises them.

With automatic checkpoint naming Accelerate saves into ``project_dir/checkpoints/checkpoint_N``
(N the ``save_iteration``), removes the oldest past ``total_limit`` and loads the newest;
``next_dir`` and ``newest_dir`` do the same for flashckpt's directories, which hold a pointer.
A directory that holds one of the files Accelerate's own ``save_state`` writes is
Accelerate's: ``written_by_accelerate``.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import CheckpointNotFoundError

log = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint_([0-9]+)$")
_ACCELERATE_FILE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|"
    r"random_states_\d+\.pkl|scheduler(_\d+)?\.bin|custom_checkpoint_\d+\.pkl)$"
)


def written_by_accelerate(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint Accelerate's own ``save_state`` wrote."""
    return any(_ACCELERATE_FILE.match(p.name) for p in directory.iterdir())


def next_dir(accelerator: Any) -> Path:
    """``checkpoints/checkpoint_<save_iteration>``, removing the oldest past ``total_limit``
    (main process), as Accelerate names them."""
    config = accelerator.project_configuration
    root = Path(config.project_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    limit = config.total_limit
    if limit is not None and accelerator.is_main_process:
        folders = _numbered(root)
        for _, folder in folders[: max(0, len(folders) + 1 - limit)]:
            shutil.rmtree(folder)
    out = root / f"checkpoint_{config.iteration}"
    if out.exists() and any(out.iterdir()):  # an empty one is a save cut short: reused
        raise ValueError(
            f"Checkpoint directory {out} ({config.iteration}) already exists. Please manually "
            "override `self.save_iteration` with what iteration to start with."
        )
    accelerator.wait_for_everyone()
    return out


def newest_dir(accelerator: Any, holds_pointer: Callable[[Path], bool]) -> Path:
    """The newest ``checkpoint_N`` that holds a checkpoint (a pointer, or Accelerate's)."""
    root = Path(accelerator.project_configuration.project_dir) / "checkpoints"
    folders = _numbered(root) if root.is_dir() else []
    for _, folder in reversed(folders):
        if holds_pointer(folder) or written_by_accelerate(folder):
            return folder
        log.warning("%s holds no checkpoint (a save cut short); trying an older one", folder)
    raise CheckpointNotFoundError(
        f"no checkpoint under {root} (automatic checkpoint naming): nothing to load; start "
        "from scratch, or save_state() first"
    )


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint_N`` folders of ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return sorted(f for f in found if f[1].is_dir())
