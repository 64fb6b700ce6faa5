"""DeepSpeed through the flash path: ``attach(engine, *tiers)``.

DeepSpeed writes a checkpoint through its engine's checkpoint engine: ``create`` for a tag,
``save`` once per file, ``commit`` when every file is handed over. The engine attached here
keeps the state of every file of one ``save_checkpoint`` call and snapshots them together at
commit, as one step of this rank's Checkpointer; ``save_checkpoint`` returns once the
snapshot is in shared memory and the agent persists it to the tiers.

The checkpoint directory keeps DeepSpeed's layout (``latest``, one folder per tag, the file
names DeepSpeed picks), but each file holds a pointer to the step that has its state, not the
state. ``load_checkpoint(dir)`` reads the pointers and restores that step from the freshest
source (this node's memory first, then the tiers), verified. A file that is not a pointer (a
checkpoint written without flashckpt) is read with ``torch.load`` as DeepSpeed would.

Every data-parallel rank keeps the model-states file in its own snapshot (DeepSpeed writes it
from one rank only), so each rank restores from its own node without reading another's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpointer import Checkpointer
from .errors import FlashCkptError
from .format import pointer as pointer_file

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "flashckpt.deepspeed needs DeepSpeed: pip install 'flashckpt[deepspeed]'"
    ) from exc

KIND = "DEEPSPEED"
MAGIC = pointer_file.magic(KIND)  # b"FLASHCKPT-DEEPSPEED-POINTER 1\n"
DIR_TIER = pointer_file.DIR_TIER  # where a save directory keeps its snapshots when no tier is named


@dataclass(frozen=True)
class Pointer:
    """What a file of the checkpoint directory says: which step of which job holds it."""

    job: str
    step: int
    tag: str
    name: str  # the file's path below the save directory, as DeepSpeed named it

    def dumps(self) -> bytes:
        return pointer_file.dumps(KIND, self.__dict__)

    @classmethod
    def read(cls, path: str) -> Pointer | None:
        """The pointer in ``path``, or None if the file is something else."""
        return pointer_file.read(
            path,
            KIND,
            lambda d: cls(str(d["job"]), int(d["step"]), str(d["tag"]), str(d["name"])),
            "load an older tag, or restore the step with the flashckpt CLI",
        )


class FlashCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that snapshots to shared memory; see the module doc."""

    def __init__(self, engine: Any, tiers: tuple[str, ...], checkpointer_args: dict[str, Any]):
        super().__init__()
        self.name = "FlashCheckpointEngine"
        self.engine = engine
        self.tiers = tiers
        self.args = checkpointer_args
        self.ckpt: Checkpointer | None = None
        self.save_dir: str | None = None
        self.files: dict[str, Any] = {}
        self.step = 0
        self.last = -1  # the newest step saved or restored: steps only go forward
        self._restored: tuple[int, dict[str, Any]] | None = None

    # ---- the Checkpointer, made once the first save or load names a directory ---------
    def checkpointer(self, directory: str) -> Checkpointer:
        if self.ckpt is None:
            tiers = self.tiers or (pointer_file.dir_tier(directory),)
            self.ckpt = Checkpointer(*tiers, **self.args)
            # The module's parameters are DeepSpeed's own copies (bf16/fp16, or the flat
            # buffers ZeRO partitions from): the engine writes them only after its optimizer
            # steps, so their copies overlap forward and backward like the optimizer's.
            self.ckpt.overlap_with_step(self.engine.module)
        return self.ckpt

    # ---- saving -----------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self.checkpointer(info.save_dir)
        self.save_dir, self.files = str(info.save_dir), {}
        self.step = max(int(getattr(self.engine, "global_steps", 0)), self.last + 1)
        self._restored = None

    def save(self, state_dict: Any, path: str) -> None:
        if self.save_dir is None:
            raise FlashCkptError("DeepSpeed saved a file outside save_checkpoint()")
        name = os.path.relpath(path, self.save_dir)
        self.files[name] = state_dict
        tag = Path(name).parts[0] if len(Path(name).parts) > 1 else ""
        pointer = Pointer(self.ckpt.job, self.step, tag, name)  # type: ignore[union-attr]
        pointer_file.write(path, pointer.dumps())

    def commit(self, info: CheckpointCommitInfo) -> bool:
        assert self.ckpt is not None
        self.ckpt.save(self.step, {"deepspeed": {"tag": str(info.tag), "files": self.files}})
        self.files, self.last = {}, self.step
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # a snapshot copies a view's bytes only: no clone needed first

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return True

    # ---- loading ----------------------------------------------------------------------
    def load(self, path: str, map_location: Any = None) -> Any:
        pointer = Pointer.read(path)
        if pointer is None:
            return torch.load(path, map_location=map_location, weights_only=False)
        files = self.files_of(pointer, os.path.dirname(os.path.dirname(os.path.abspath(path))))
        try:
            return files[pointer.name]
        except KeyError:
            raise FlashCkptError(
                f"{path}: step {pointer.step} of job {pointer.job} holds no {pointer.name!r} for "
                f"this rank (it holds {sorted(files)}); it was saved with another number of "
                "ranks, which DeepSpeed checkpoints through flashckpt cannot be resharded to"
            ) from None

    def files_of(self, pointer: Pointer, save_dir: str) -> dict[str, Any]:
        """The files of the step ``pointer`` names (a subclass that keeps a step's files
        elsewhere hands them back here)."""
        if self._restored is not None and self._restored[0] == pointer.step:
            return self._restored[1]
        ck = self.checkpointer(save_dir)
        if ck.job != pointer.job:
            raise FlashCkptError(
                f"the checkpoint in {save_dir} belongs to job {pointer.job!r}, this run is job "
                f"{ck.job!r}; set FLASHCKPT_JOB={pointer.job} (or job=) to load it"
            )
        state: dict[str, Any] = {"deepspeed": None}
        got = ck.restore(state, step=pointer.step)
        if got != pointer.step:
            raise FlashCkptError(
                f"step {pointer.step} of job {pointer.job} (tag {pointer.tag!r}) is in no tier "
                "and not in memory; load an older tag"
            )
        files = state["deepspeed"]["files"]
        self._restored, self.last = (pointer.step, files), max(self.last, pointer.step)
        return files

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


def attach(engine: Any, *tiers: str, **checkpointer_args: Any) -> FlashCheckpointEngine:
    """Make ``engine.save_checkpoint``/``load_checkpoint`` go through flashckpt.

    ``tiers`` are where the agent persists each step; with none, the directory given to
    ``save_checkpoint`` keeps them (in its ``.flashckpt`` folder). ``checkpointer_args`` go
    to the Checkpointer (``job=``, ``close_timeout=``...). DeepSpeed's files hold pickled
    objects (its config, scheduler, shapes), so ``allow_pickle`` defaults to True, as
    DeepSpeed's own ``torch.load(weights_only=False)`` does. Call ``close()`` on the result
    when training ends.
    """
    checkpointer_args.setdefault("allow_pickle", True)
    flash = FlashCheckpointEngine(engine, tuple(tiers), checkpointer_args)
    engine.checkpoint_engine = flash
    engine.save_non_zero_checkpoint = True  # every rank keeps the model states it restores
    return flash
