"""DeepSpeed engines prepared by Accelerate, kept in the step of ``flashckpt.accelerate``.

Under Accelerate's DeepSpeed set-up each prepared model is a DeepSpeed engine, whose weights
and ZeRO optimizer partitions only DeepSpeed writes and reads back. At ``save_state`` each
engine writes its checkpoint as Accelerate has it do (``save_checkpoint(dir, "pytorch_model")``,
``pytorch_model_1`` for a second model) through the flash checkpoint engine of
``flashckpt.deepspeed``, changed in one way: the files it is handed are not saved as a step of
their own but returned, to go into the one step that holds every other state of the
Accelerator. The directory gets DeepSpeed's layout with a pointer in each file. At
``load_state`` that step is restored first; each engine then ``load_checkpoint``s the same
tag, its checkpoint engine handing back the restored files.

The engine's own checkpoint engine is put back after each call, so an
``engine.save_checkpoint`` called directly is DeepSpeed's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .checkpointer import Checkpointer
from .deepspeed import FlashCheckpointEngine, Pointer
from .errors import CheckpointNotFoundError, FlashCkptError

MODEL_NAME = "pytorch_model"  # the tag Accelerate's save_state gives the first engine


def tag(index: int) -> str:
    """The tag of the ``index``-th prepared engine, as Accelerate names it."""
    return MODEL_NAME if index == 0 else f"{MODEL_NAME}_{index}"


class StepFiles(FlashCheckpointEngine):
    """The flash checkpoint engine for one call: keeps the files of ``save_checkpoint`` in
    ``files`` for the caller's step, and hands ``load_checkpoint`` the files ``restored``."""

    def __init__(self, engine: Any, ckpt: Checkpointer, step: int, restored: dict | None = None):
        super().__init__(engine, (), {})
        self.ckpt = ckpt
        self.step = step
        self.restored = restored

    def create(self, info: Any) -> None:
        self.save_dir, self.files = str(info.save_dir), {}

    def commit(self, info: Any) -> bool:
        return True  # the caller saves self.files in its step

    def files_of(self, pointer: Pointer, save_dir: str) -> dict[str, Any]:
        if self.restored is None or (pointer.job, pointer.step) != (self.ckpt.job, self.step):
            raise FlashCkptError(
                f"{save_dir} holds DeepSpeed files of step {pointer.step} of job {pointer.job}, "
                f"but its flashckpt.pointer names step {self.step} of job {self.ckpt.job}; the "
                "directory was changed after save_state() wrote it: save it again"
            )
        return self.restored


@contextlib.contextmanager
def _through(engine: Any, flash: StepFiles) -> Iterator[None]:
    """``engine`` checkpoints through ``flash`` for the block, every rank writing the model
    states it restores (DeepSpeed writes them from the first data-parallel rank only)."""
    before = engine.checkpoint_engine, engine.save_non_zero_checkpoint
    engine.checkpoint_engine, engine.save_non_zero_checkpoint = flash, True
    try:
        yield
    finally:
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = before


def save(engines: Sequence[Any], out: Path, ckpt: Checkpointer, step: int,
         kwargs: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Each engine's ``save_checkpoint`` into ``out``; the files, for ``step`` to hold."""
    files = []
    for i, engine in enumerate(engines):
        flash = StepFiles(engine, ckpt, step)
        with _through(engine, flash):
            engine.save_checkpoint(str(out), tag(i), **kwargs)
        files.append(flash.files)
    return files


def load(engines: Sequence[Any], files: Sequence[dict[str, Any]], directory: Path,
         ckpt: Checkpointer, step: int, kwargs: dict[str, Any]) -> None:  # fmt: skip
    """Each engine's ``load_checkpoint`` from ``directory``, of the ``files`` restored."""
    for i, (engine, restored) in enumerate(zip(engines, files, strict=True)):
        with _through(engine, StepFiles(engine, ckpt, step, restored)):
            path, _ = engine.load_checkpoint(str(directory), tag(i), **kwargs)
        if path is None:
            raise CheckpointNotFoundError(
                f"DeepSpeed found no checkpoint {tag(i)!r} in {directory}; pass the directory "
                "save_state() wrote"
            )


def overlap_with_step(ckpt: Checkpointer, engines: Sequence[Any]) -> None:
    """The engines' modules hold DeepSpeed's own copies of the parameters, written only after
    its optimizer steps: their copies may overlap forward and backward like the optimizer's."""
    ckpt.overlap_with_step(*(engine.module for engine in engines))
