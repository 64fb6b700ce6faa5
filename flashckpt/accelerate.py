"""Hugging Face Accelerate through the flash path: ``attach(accelerator, *tiers)``.

After ``attach``, ``accelerator.save_state(output_dir)`` snapshots this process's whole
training state as one step of its Checkpointer and returns once the snapshot is in shared
memory; the node's agent persists it to the tiers. ``accelerator.load_state(input_dir)``
restores that step in place from the freshest source (this node's memory first, then the
tiers), verified. What one step holds, as Accelerate's own ``save_state`` would write it:

- the models prepared and their optimizers, by set-up: one process or DDP, each model's state
  dict (after any ``register_save_state_pre_hook`` hook) and each optimizer's state; FSDP2
  (``FullyShardedDataParallelPlugin(fsdp_version=2)``), the sharded modules and optimizers
  themselves, each process its own shards (DTensors, with their global shape and offset);
  DeepSpeed (ZeRO 1-3), the files each engine's ``save_checkpoint`` writes, kept in the step
  (``flashckpt.accelerate_deepspeed``);
- the LR schedulers and the GradScaler;
- each prepared dataloader's position (``flashckpt.accelerate_data``);
- the objects given to ``register_for_checkpointing``;
- this process's random generators (torch CPU and CUDA, NumPy, Python: ``flashckpt.RNG``),
  ``accelerator.step`` and ``save_iteration``.

``attach`` replaces ``save_state`` and ``load_state`` on this one Accelerator (its class is
untouched): Accelerate's pre-hooks see only the models, and its own save writes optimizers,
schedulers, generators and registered objects to files whatever a hook does, so hooks alone
cannot make them one step. The hooks registered with ``register_save_state_pre_hook`` and
``register_load_state_pre_hook`` still run where Accelerate runs them, with the same
arguments (under FSDP and DeepSpeed, as in Accelerate, an empty list of weights and of models
to load); a hook that removes a model's weights saves and loads that model itself.

The directory keeps a pointer, ``flashckpt.pointer`` (a ``FLASHCKPT-ACCELERATE-POINTER``
header and the job, step, number of processes and set-up that hold the state), plus what
pre-hooks write there (and under DeepSpeed, its layout with a pointer in each file). With no
tier named, the steps are kept in the ``.flashckpt`` folder of the first directory saved to,
or of ``project_dir`` with automatic checkpoint naming (``total_limit`` becomes the tier's
``keep_last``). Automatic naming works as in Accelerate (``checkpoints/checkpoint_N``, oldest
pointers removed past ``total_limit``, ``load_state()`` takes the newest), and ``load_state``
also sets ``save_iteration`` to follow the step loaded, so the next save does not collide. A
directory without a pointer but with Accelerate's files is loaded by Accelerate itself.

A step loads at the number of processes that saved it, or at fewer where the state allows:
one process or DDP (the models and optimizers are the same in every process) and FSDP2 (the
shards are resharded). Each process then restores the rest from the process with its index;
the dataloaders keep their epoch but start it again from its first batch, as the batches of
each process are others. DeepSpeed ZeRO partitions are not resharded: a DeepSpeed step loads
only at the number of processes that saved it. No step loads at more processes than saved it.

Not through flashckpt, or not at all: ``safe_serialization`` changes nothing (tensors are
always stored as raw bytes, never pickled; other values that are not plain scalars are
pickled, so ``allow_pickle`` defaults to True as Accelerate's ``weights_only=False`` loads
do); ``load_kwargs`` and ``map_location`` are ignored (state is restored in place, on the
devices the live objects are on); outside DeepSpeed a model loads strictly (``strict=False`` is
refused); other accelerators' generators (XPU, NPU, MLU...) are not saved; FSDP1,
Megatron-LM and XLA set-ups are refused at ``attach``.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import accelerate_data, accelerate_dirs
from .checkpointer import Checkpointer
from .door_steps import wait_named_step_stored
from .errors import CheckpointNotFoundError, ConfigError, FlashCkptError, StateMismatchError
from .format import pointer as pointer_file
from .rng import RNG

try:
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - accelerate is not installed
    raise ImportError("flashckpt.accelerate needs Accelerate: pip install accelerate") from exc

log = logging.getLogger(__name__)

KIND = "ACCELERATE"
POINTER = "flashckpt.pointer"  # the file of a save directory that names the step
_UNSUPPORTED = {
    DistributedType.MEGATRON_LM: "Megatron-LM checkpoints are not supported",
    DistributedType.XLA: "XLA devices are not supported",
}


class Setup(enum.Enum):
    """How the prepared models and optimizers are held, which decides how they are saved."""

    REPLICATED = "ddp"  # one process, or DDP: every process holds the whole model
    FSDP2 = "fsdp2"  # each process holds its shards (DTensors)
    DEEPSPEED = "deepspeed"  # DeepSpeed engines: their own checkpoint files

    @classmethod
    def of(cls, accelerator: Any) -> Setup:
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            return cls.DEEPSPEED
        if accelerator.distributed_type == DistributedType.FSDP:
            return cls.FSDP2
        return cls.REPLICATED


@dataclass(frozen=True)
class Pointer:
    """What ``flashckpt.pointer`` says: the step of which job holds a save directory's state."""

    job: str
    step: int
    world_size: int  # the processes that saved it: each restores its own snapshot
    tier: str | None  # the tier folder, relative to the pointer's directory, if none was named
    setup: str = Setup.REPLICATED.value  # a Setup's value; pointers that predate it: "ddp"

    def dumps(self) -> bytes:
        return pointer_file.dumps(KIND, self.__dict__)

    @classmethod
    def read(cls, path: str) -> Pointer | None:
        def parse(d: dict) -> Pointer:
            tier, setup = d["tier"], Setup(d.get("setup", Setup.REPLICATED.value))
            return cls(str(d["job"]), int(d["step"]), int(d["world_size"]), tier and str(tier),
                       setup.value)  # fmt: skip

        return pointer_file.read(path, KIND, parse, "load an older checkpoint directory")


class FlashAccelerate:
    """The ``save_state``/``load_state`` of one attached Accelerator; see the module doc."""

    def __init__(self, accelerator: Any, tiers: tuple[str, ...], checkpointer_args: dict):
        self.accelerator = accelerator
        self.setup = Setup.of(accelerator)
        self.tiers = tiers
        self.args = checkpointer_args
        self.ckpt: Checkpointer | None = None
        self.tier_dir: Path | None = None  # the .flashckpt folder, when no tier is named
        self._warned = False
        self.last = -1  # the newest step saved or restored: steps only go forward
        self.named: int | None = None  # the step the last save_state's directory names
        # Accelerate's own methods, for directories flashckpt did not write.
        self.accelerate_load_state = accelerator.load_state

    # ---- the Checkpointer, made once the first save or load names its tier ------------
    def _checkpointer(self, tier_dir: Path | None, job: str | None = None) -> Checkpointer:
        if self.ckpt is None:
            args = dict(self.args)
            if job is not None and "job" not in args and not os.environ.get("FLASHCKPT_JOB"):
                args["job"] = job  # resume the job the directory names
            tiers: tuple[str, ...] = self.tiers
            if not tiers:
                if tier_dir is None:
                    raise ConfigError("no tier to keep the steps in")  # callers pass one
                self.tier_dir = tier_dir.resolve()
                tiers = (self._dir_tier(self.tier_dir),)
            self.ckpt = Checkpointer(*tiers, **args)
            if self.setup is Setup.DEEPSPEED:
                from . import accelerate_deepspeed

                accelerate_deepspeed.overlap_with_step(self.ckpt, self.accelerator._models)
        return self.ckpt

    def _dir_tier(self, tier_dir: Path) -> str:
        url = f"file://{tier_dir}"
        config = self.accelerator.project_configuration
        if config.automatic_checkpoint_naming and config.total_limit:
            url += f"?keep_last={int(config.total_limit)}"
        return url

    # ---- saving -------------------------------------------------------------------------
    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs,
    ) -> Path:
        """Accelerate's ``save_state``: snapshot every state as one step, write the pointer.
        ``save_model_func_kwargs`` go to DeepSpeed's ``save_checkpoint``, as in Accelerate."""
        acc = self.accelerator
        config = acc.project_configuration
        if config.automatic_checkpoint_naming:
            output_dir = accelerate_dirs.next_dir(acc)
        elif output_dir is None:
            raise ConfigError(
                "save_state() needs output_dir unless the Accelerator's project_config sets "
                "automatic_checkpoint_naming"
            )
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        default_dir = Path(config.project_dir) if config.automatic_checkpoint_naming else out
        ckpt = self._checkpointer(default_dir / pointer_file.DIR_TIER)
        step = max(int(config.iteration), self.last + 1)
        self._named_step_stored(ckpt)
        models, weights = self._models_to_save(out, ckpt, step, save_model_func_kwargs)
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, str(out))
        state = {
            "models": models,
            "optimizers": [] if self.setup is Setup.DEEPSPEED else list(acc._optimizers),
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "dataloaders": [accelerate_data.state_of(dl) for dl in acc._dataloaders],
            "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "rng": RNG(),
            "step": int(acc.step),
            "iteration": int(config.iteration),
        }
        ckpt.save(step, {"accelerate": state})
        self.last = self.named = step
        tier = None
        if self.tier_dir is not None:
            tier = os.path.relpath(self.tier_dir, out.resolve())
            elsewhere = default_dir.resolve() / pointer_file.DIR_TIER != self.tier_dir
            if elsewhere and not self._warned:
                self._warned = True
                log.warning(
                    "step %d (saved to %s) is kept in %s, the first directory saved to; name a "
                    "tier in attach() to keep steps apart from directories you may delete",
                    step, out, self.tier_dir.parent,
                )  # fmt: skip
        if acc.is_local_main_process:  # each node's: a node-local directory gets one too
            pointer = Pointer(ckpt.job, step, int(acc.num_processes), tier, self.setup.value)
            pointer_file.write(out / POINTER, pointer.dumps())
        config.iteration += 1
        return out

    def _models_to_save(self, out: Path, ckpt: Checkpointer, step: int,
                        kwargs: dict[str, Any]) -> tuple[list, list]:  # fmt: skip
        """What the step holds of the models, and the weights the save hooks get."""
        acc = self.accelerator
        if self.setup is Setup.DEEPSPEED:
            from . import accelerate_deepspeed

            return accelerate_deepspeed.save(acc._models, out, ckpt, step, kwargs), []
        if self.setup is Setup.FSDP2:
            return list(acc._models), []  # the modules: each process's shards
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        return weights, weights  # a hook may remove a model's weights from the list

    def _named_step_stored(self, ckpt: Checkpointer) -> None:
        named, self.named = self.named, None
        wait_named_step_stored(ckpt, named)

    # ---- loading ------------------------------------------------------------------------
    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs,
    ) -> None:
        """Accelerate's ``load_state``: restore the step the directory's pointer names.
        ``load_model_func_kwargs`` go to DeepSpeed's ``load_checkpoint``, as in Accelerate."""
        acc = self.accelerator
        config = acc.project_configuration
        if input_dir is not None:
            directory = Path(os.path.expanduser(input_dir))
            if not directory.is_dir():
                raise CheckpointNotFoundError(
                    f"{directory} is not a directory; pass one save_state() wrote"
                )
        elif config.automatic_checkpoint_naming:
            directory = accelerate_dirs.newest_dir(acc, lambda d: (d / POINTER).is_file())
        else:
            raise ConfigError(
                "load_state() needs input_dir unless the Accelerator's project_config sets "
                "automatic_checkpoint_naming"
            )
        path = directory / POINTER
        pointer = Pointer.read(str(path)) if path.is_file() else None
        if pointer is None:
            if accelerate_dirs.written_by_accelerate(directory):
                log.info("%s holds no flashckpt pointer: Accelerate loads it", directory)
                self.accelerate_load_state(str(directory), load_kwargs, **load_model_func_kwargs)
                return
            raise CheckpointNotFoundError(
                f"{directory} holds neither a flashckpt pointer ({POINTER}) nor a checkpoint "
                "Accelerate wrote; pass the directory save_state() wrote (with automatic "
                "naming: project_dir/checkpoints/checkpoint_N), or call load_state() only once "
                "a save_state() has run"
            )
        load_model_func_kwargs.pop("map_location", None)
        if self.setup is not Setup.DEEPSPEED:
            _check_model_kwargs(load_model_func_kwargs)
        resized = self._check_shape(pointer, path)
        state = self._restore(pointer, directory, load_model_func_kwargs)
        self._apply(state, position=not resized)
        config.iteration = max(int(config.iteration), int(state["iteration"]) + 1)

    def _check_shape(self, pointer: Pointer, path: Path) -> bool:
        """Refuse a step this run cannot load (another set-up, more processes, DeepSpeed at
        another number); True where it loads at fewer processes than saved it."""
        saved, now = pointer.world_size, int(self.accelerator.num_processes)
        what = f"{path} names step {pointer.step} of job {pointer.job}, saved by {saved} processes"
        if pointer.setup != self.setup.value:
            raise StateMismatchError(
                f"{what} under {_SHOWN[pointer.setup]}; this run uses {_SHOWN[self.setup.value]}. "
                f"Load it with the set-up that saved it ({_SHOWN[pointer.setup]})"
            )
        if now == saved:
            return False
        if now > saved:
            raise StateMismatchError(
                f"{what}; this run has {now}. A step loads at the number of processes that "
                f"saved it or fewer: launch at most {saved} processes to load it"
            )
        if self.setup is Setup.DEEPSPEED:
            raise StateMismatchError(
                f"{what}; this run has {now}. DeepSpeed ZeRO keeps each process's partition "
                "of the optimizer state (and at stage 3 of the weights) in that process's own "
                f"files, which flashckpt does not reshard: launch {saved} processes to load it "
                "(to go on at another number, load it there and save the weights with "
                "accelerator.save_model(), then start the new run from them)"
            )
        log.warning(
            "%s; this run has %d. Each process restores the models, optimizers, schedulers and "
            "registered objects, its random generators from the process with its index, and "
            "each dataloader's epoch, started again from its first batch",
            what, now,
        )  # fmt: skip
        return True

    def _restore(self, pointer: Pointer, directory: Path,
                 model_kwargs: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        acc = self.accelerator
        tier_dir = None
        if pointer.tier is not None:
            tier_dir = (directory / pointer.tier).resolve()
        elif not self.tiers:
            raise ConfigError(
                f"the steps of {directory} are kept in the tiers the saving run named in "
                "attach(); name the same tiers in this run's attach() to load it"
            )
        ckpt = self._checkpointer(tier_dir, job=pointer.job)
        if ckpt.job != pointer.job:
            raise FlashCkptError(
                f"the checkpoint in {directory} belongs to job {pointer.job!r}, this run is job "
                f"{ckpt.job!r}; set FLASHCKPT_JOB={pointer.job} (or job=) to load it"
            )
        replicated = self.setup is Setup.REPLICATED
        models = list(acc._models) if replicated else []  # FSDP, DeepSpeed: none, as Accelerate
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, str(directory))
        if self.setup is Setup.FSDP2:
            models_target: list = list(acc._models)  # the shards, filled in place
        elif self.setup is Setup.DEEPSPEED:
            models_target = [None] * len(acc._models)  # None: the snapshot's value
        else:
            models_target = [model.state_dict() for model in models]  # filled in place
        # The optimizers inside Accelerate's wrappers: a fresh one's state is made by a step
        # (FSDP2, a GPU), which the wrapper would hand to a GradScaler not yet scaling.
        optimizers = [getattr(opt, "optimizer", opt) for opt in acc._optimizers]
        target: dict[str, Any] = {
            "models": models_target,
            "optimizers": [] if self.setup is Setup.DEEPSPEED else optimizers,
            "schedulers": [None] * len(acc._schedulers),
            "dataloaders": [None] * len(acc._dataloaders),
            "scaler": None,
            "custom": [None] * len(acc._custom_objects),
            "rng": RNG(),
            "step": None,
            "iteration": None,
        }
        wrapped = {"accelerate": target}
        try:
            ckpt.restore(wrapped, step=pointer.step)
        except CheckpointNotFoundError:
            where = ", ".join(ckpt._shown_tiers()) or "no tier (none was named)"
            raise CheckpointNotFoundError(
                f"{directory / POINTER} names step {pointer.step} of job {pointer.job}, which "
                f"is neither in this node's shared memory nor committed in {where} for every "
                "process; load an older checkpoint directory"
            ) from None
        self.last = max(self.last, pointer.step)
        state = wrapped["accelerate"]
        if self.setup is Setup.DEEPSPEED:
            from . import accelerate_deepspeed

            accelerate_deepspeed.load(acc._models, state["models"], directory, ckpt,
                                      pointer.step, model_kwargs)  # fmt: skip
        elif replicated:
            for model, restored in zip(models, target["models"], strict=True):
                if any(not isinstance(v, torch.Tensor) for v in restored.values()):
                    model.load_state_dict(restored)  # extra state: a value, not in place
        return state

    def _apply(self, state: dict[str, Any], position: bool) -> None:
        """Hand the restored values that are not restored in place to their objects."""
        acc = self.accelerator
        for scheduler, saved in zip(acc._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for dl, saved in zip(acc._dataloaders, state["dataloaders"], strict=True):
            accelerate_data.load(dl, saved, position)
        if acc.scaler is not None:
            if state["scaler"] is None:
                raise StateMismatchError(
                    "the checkpoint was saved without a GradScaler, this run has one; load it "
                    "with the mixed precision it was saved with"
                )
            acc.scaler.load_state_dict(state["scaler"])
        for obj, saved in zip(acc._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(saved)
        acc.step = int(state["step"])

    def close(self) -> None:
        """Wait for the tiers to hold the last step saved and free this process's slots."""
        if self.ckpt is not None:
            self.ckpt.close()


_SHOWN = {Setup.REPLICATED.value: "one process or DDP", Setup.FSDP2.value: "FSDP2",
          Setup.DEEPSPEED.value: "DeepSpeed"}  # fmt: skip


def _check_model_kwargs(kwargs: dict[str, Any]) -> None:
    unknown = dict(kwargs)
    if unknown.pop("strict", True) is not True or unknown:
        raise ConfigError(
            f"load_state() got {', '.join(sorted(kwargs))}: flashckpt restores every model "
            "strictly and in place; only map_location (ignored) and strict=True are accepted"
        )


def attach(accelerator: Any, *tiers: str, **checkpointer_args: Any) -> FlashAccelerate:
    """Make ``accelerator.save_state``/``load_state`` go through flashckpt.

    ``tiers`` are where the agent persists each step; with none, a save directory keeps them
    (see the module doc). ``checkpointer_args`` go to the Checkpointer (``job=``,
    ``close_timeout=``...); ``allow_pickle`` defaults to True. The methods are replaced on
    this one Accelerator only. Call ``close()`` on the result when training ends.
    """
    if "save_state" in vars(accelerator) or "load_state" in vars(accelerator):
        raise ConfigError("this Accelerator is already attached to flashckpt")
    kind = accelerator.distributed_type
    why = _UNSUPPORTED.get(kind)
    if why is not None:
        raise ConfigError(
            f"flashckpt.accelerate supports one process, DDP, FSDP2 and DeepSpeed, not {kind}: "
            f"{why}"
        )
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError(
            "flashckpt.accelerate supports FSDP2 only, this Accelerator uses FSDP1; pass "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (or fsdp_version: 2 in the "
            "Accelerate config)"
        )
    if kind == DistributedType.DEEPSPEED:
        from . import accelerate_deepspeed  # noqa: F401 - fails now if DeepSpeed is missing
    checkpointer_args.setdefault("allow_pickle", True)
    flash = FlashAccelerate(accelerator, tuple(tiers), checkpointer_args)
    accelerator.save_state = flash.save_state
    accelerator.load_state = flash.load_state
    return flash
