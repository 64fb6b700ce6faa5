"""Where settings come from: explicit arguments > ``FLASHCKPT_*`` environment > defaults.

This is the one place that rule is applied; every other module asks here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

DEFAULT_SHM_DIR = "/dev/shm/flashckpt"
DEFAULT_RUN_DIR = "/tmp/flashckpt-run"


def validate_name(kind: str, value: str) -> str:
    """Job and tier names become path components: refuse anything that could escape."""
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise ConfigError(
            f"{kind} name {value!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def setting(name: str, explicit: object = None, default: object = None) -> object:
    """``explicit`` if given, else ``FLASHCKPT_<NAME>`` if set, else ``default``."""
    if explicit is not None:
        return explicit
    env = os.environ.get(f"FLASHCKPT_{name.upper()}")
    if env is not None and env != "":
        return env
    return default


def resolve_job(job: str | None) -> str:
    if job is not None:
        return validate_name("job", job)
    value = setting("job") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    return validate_name("job", str(value))


def local_world_size() -> int:
    """Ranks of this job on this node as the launcher says (torchrun: LOCAL_WORLD_SIZE); 0 if unknown."""
    try:
        return max(0, int(os.environ.get("LOCAL_WORLD_SIZE") or 0))
    except ValueError:
        return 0


def resolve_rank(rank: int | None) -> int:
    if rank is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
        except Exception:  # a broken dist install must not stop checkpointing
            rank = None
    if rank is None:
        env = os.environ.get("RANK")
        rank = int(env) if env not in (None, "") else 0
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"rank must be a non-negative int, got {rank!r}")
    return rank


def shm_dir(explicit: str | os.PathLike | None = None) -> Path:
    return Path(str(setting("shm_dir", explicit, DEFAULT_SHM_DIR)))


def run_dir(explicit: str | os.PathLike | None = None) -> Path:
    return Path(str(setting("run_dir", explicit, DEFAULT_RUN_DIR)))
