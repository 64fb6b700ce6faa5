"""flashckpt as a Megatron-Core ``dist_checkpointing`` strategy: ``register()``, then the
backend name ``"flashckpt"``.

    import flashckpt.megatron_dist
    flashckpt.megatron_dist.register()
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=("flashckpt", 1))
    dist_checkpointing.load(sharded_sd, ckpt_dir)      # the backend is read from ckpt_dir

Megatron writes the checkpoint directory as it always does (``metadata.json``, ``common.pt``
and its sharded objects, from its common strategy); the sharded tensors, the bulk, go through
a Checkpointer: ``save`` returns once they are in shared memory, the node's agent persists
them, and the directory keeps a pointer (``flashckpt.json``) to the step. ``metadata.json``
names the backend ``flashckpt``, so ``load`` picks the load strategy registered here by
itself (checkpoints of other backends load as before), and restores the step from the
freshest source, verified, resharded where the parallel layout changed.

How a directory maps to flashckpt:

- job: ``FLASHCKPT_JOB`` (or ``register(job=...)``), as for every door;
- step: the last number in the directory's name (Megatron-LM's ``iter_0000100``); a name
  without one takes the step after the last this process saved;
- tiers: those given to ``register()``, else the directory's parent keeps the steps in its
  ``.flashckpt`` folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .checkpointer import Checkpointer
from .errors import FlashCkptError
from .format import pointer as pointer_file
from .megatron import leaves, replica_groups

try:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.base import (
        LoadShardedStrategy,
        SaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "flashckpt.megatron_dist needs Megatron-Core: pip install 'flashckpt[megatron]'"
    ) from exc

BACKEND, VERSION = "flashckpt", 1
POINTER = "flashckpt.json"  # in the checkpoint directory: the job and step that hold it
KIND = "megatron"


class _Door:
    """The Checkpointer the strategies share (one per process), made on first use."""

    def __init__(self, tiers: tuple[str, ...], args: dict[str, Any]) -> None:
        self.tiers, self.args = tiers, args
        self.ckpt: Checkpointer | None = None
        self.last = -1
        self.groups: tuple[frozenset, dict] = (frozenset(), {})

    def replica_groups(self, sharded_state_dict: Any) -> dict:
        """The replica groups of the blocks of ``sharded_state_dict``, gathered again only
        when the blocks change (every rank's do together: its model and optimizer)."""
        keys = frozenset(_block_keys(sharded_state_dict))
        if keys != self.groups[0]:
            self.groups = (keys, replica_groups(sharded_state_dict))
        return self.groups[1]

    def checkpointer(self, checkpoint_dir: Path) -> Checkpointer:
        if self.ckpt is None:
            tiers = self.tiers or (pointer_file.dir_tier(checkpoint_dir.resolve().parent),)
            self.ckpt = Checkpointer(*tiers, **self.args)
        return self.ckpt

    def step_of(self, checkpoint_dir: Path) -> int:
        numbers = re.findall(r"\d+", checkpoint_dir.name)
        return int(numbers[-1]) if numbers else self.last + 1


def _block_keys(sharded: Any) -> list[tuple]:
    found: list[tuple] = []

    def note(v: Any) -> Any:
        if isinstance(v, ShardedTensor):
            found.append((v.key, tuple(v.global_offset), tuple(v.local_shape)))
        return v

    dict_list_map_inplace(note, sharded)
    return found


class FlashSave(SaveShardedStrategy):
    """Snapshots the sharded tensors; returns once they are in shared memory."""

    def __init__(self, door: _Door) -> None:
        super().__init__(BACKEND, VERSION)
        self.door = door

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        where = Path(checkpoint_dir)
        ck = self.door.checkpointer(where)
        step = self.door.step_of(where)
        groups = self.door.replica_groups(sharded_state_dict)
        ck.save(step, {"megatron": leaves(sharded_state_dict, str(where), groups)})
        self.door.last = step
        if int(os.environ.get("LOCAL_RANK", ck.rank)) == 0:  # one writer a node
            where.mkdir(parents=True, exist_ok=True)
            fields = {"job": ck.job, "step": step}
            pointer_file.write(where / POINTER, pointer_file.dumps(KIND, fields))


class FlashLoad(LoadShardedStrategy):
    """Restores the step the directory points at into the sharded tensors, in place."""

    def __init__(self, door: _Door) -> None:
        self.door = door

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        where = Path(checkpoint_dir)
        if not (where / POINTER).is_file():
            raise FlashCkptError(f"{where} has no {POINTER}: it was not saved with the "
                                 "flashckpt backend, or was copied without it")  # fmt: skip
        fields = pointer_file.read(where / POINTER, KIND, lambda d: (str(d["job"]), int(d["step"])),
                                   "save the checkpoint again")  # fmt: skip
        if fields is None:
            raise FlashCkptError(f"{where / POINTER} is not a flashckpt pointer; the directory "
                                 "was not saved with the flashckpt backend")  # fmt: skip
        job, step = fields
        ck = self.door.checkpointer(where)
        if ck.job != job:
            raise FlashCkptError(f"{where} holds step {step} of job {job!r}, this run is job "
                                 f"{ck.job!r}; set FLASHCKPT_JOB={job} to load it")  # fmt: skip
        got = ck.restore({"megatron": leaves(sharded_state_dict, str(where))}, step=step)
        if got != step:
            raise FlashCkptError(f"step {step} of job {job} is in no tier and not in memory; "
                                 "load an older checkpoint")  # fmt: skip
        self.door.last = max(self.door.last, step)
        return dict_list_map_inplace(
            lambda v: v.data if isinstance(v, ShardedTensor) else v, sharded_state_dict
        )

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> Any:
        raise NotImplementedError(
            f"{checkpoint_dir}: the flashckpt backend does not list tensor metadata without "
            "loading; load the checkpoint, or list its step with 'flashckpt ls'"
        )

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise FlashCkptError(f"a checkpoint of backend {loaded_backend!r}, not {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise FlashCkptError(f"a {BACKEND} checkpoint of version {loaded_version}, this "
                                 f"flashckpt reads version {VERSION}; upgrade flashckpt")  # fmt: skip


def register(*tiers: str, **checkpointer_args: Any) -> tuple[FlashSave, FlashLoad]:
    """Register the ``flashckpt`` backend with Megatron-Core's ``dist_checkpointing``.
    ``tiers`` and ``checkpointer_args`` (``job=``...) go to the Checkpointer both use."""
    door = _Door(tiers, checkpointer_args)
    save, load = FlashSave(door), FlashLoad(door)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save)
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load)
    return save, load


def close() -> None:
    """Close the Checkpointer the registered strategies use (waits for the tiers to hold the
    last step, as ``Checkpointer.close`` does): call it when training ends."""
    from megatron.core.dist_checkpointing.strategies.base import default_strategies

    strategy = default_strategies[StrategyAction.SAVE_SHARDED.value].get((BACKEND, VERSION))
    if isinstance(strategy, FlashSave) and strategy.door.ckpt is not None:
        strategy.door.ckpt.close()
        strategy.door.ckpt = None
