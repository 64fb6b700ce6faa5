"""Pointer files: what a framework's checkpoint directory holds once flashckpt keeps the state.

The framework integrations (``flashckpt.deepspeed``, ``flashckpt.accelerate``) leave the
checkpoint directory a framework expects where it expects it, but instead of the state they
write small pointer files naming the step of this job's Checkpointer that holds it. A pointer
is one header line, ``FLASHCKPT-<KIND>-POINTER 1`` (KIND names the integration), then a JSON
object. A file without the header is not flashckpt's: a checkpoint the framework wrote
itself, which the integration reads the framework's way.

When no tier is named, a save directory keeps the steps the agent persists in its own
``.flashckpt`` folder (:func:`dir_tier`).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..errors import FlashCkptError

T = TypeVar("T")

DIR_TIER = ".flashckpt"  # where a save directory keeps its snapshots when no tier is named
MAX_BYTES = 64 << 10  # a pointer is small: anything longer is not one


def magic(kind: str) -> bytes:
    """The header line of a pointer written by the integration ``kind``."""
    return f"FLASHCKPT-{kind.upper()}-POINTER 1\n".encode()


def dumps(kind: str, fields: Mapping[str, Any]) -> bytes:
    return magic(kind) + json.dumps(dict(fields), sort_keys=True).encode()


def read(path: str | os.PathLike, kind: str, parse: Callable[[dict], T], hint: str) -> T | None:
    """``parse`` of the pointer in ``path``, or None if the file is not a ``kind`` pointer.

    A file with the header whose body ``parse`` cannot take (KeyError, TypeError, ValueError)
    is a damaged pointer: FlashCkptError, ending with ``hint`` (what the caller can do).
    """
    with open(path, "rb") as f:
        head = f.read(MAX_BYTES + 1)
    header = magic(kind)
    if not head.startswith(header):
        return None
    try:
        return parse(json.loads(head[len(header) :]))
    except (ValueError, KeyError, TypeError):
        raise FlashCkptError(f"{path} is a damaged flashckpt pointer; {hint}") from None


def write(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step: readers see the old pointer or the new one.
    Ranks of other nodes may write the same pointer to a shared directory at once: each
    writes its own temporary."""
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dir_tier(directory: str | os.PathLike) -> str:
    """The tier URL of the ``.flashckpt`` folder of ``directory``."""
    return f"file://{Path(directory).resolve() / DIR_TIER}"
