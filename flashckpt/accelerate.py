"""Hugging Face Accelerate through the flash path: ``attach(accelerator, *tiers)``.

After ``attach``, ``accelerator.save_state(output_dir)`` snapshots this process's whole
training state as one step of its Checkpointer and returns once the snapshot is in shared
memory; the node's agent persists it to the tiers. ``accelerator.load_state(input_dir)``
restores that step in place from the freshest source (this node's memory first, then the
tiers), verified. What one step holds, as Accelerate's own ``save_state`` would write it:

- the models prepared (their state dicts, after any ``register_save_state_pre_hook`` hook),
  the optimizers, the LR schedulers and the GradScaler;
- each prepared dataloader's position: a stateful dataloader's state
  (``DataLoaderConfiguration(use_stateful_dataloader=True)``), the seedable sampler Accelerate
  keeps for iterable datasets, and the epoch (``iteration``) a seedable sampler shuffles
  with, which Accelerate itself does not keep;
- the objects given to ``register_for_checkpointing``;
- this process's random generators (torch CPU and CUDA, NumPy, Python: ``flashckpt.RNG``),
  ``accelerator.step`` and ``save_iteration``.

``attach`` replaces ``save_state`` and ``load_state`` on this one Accelerator (its class is
untouched): Accelerate's pre-hooks see only the models, and its own save writes optimizers,
schedulers, generators and registered objects to files whatever a hook does, so hooks alone
cannot make them one step. The hooks registered with ``register_save_state_pre_hook`` and
``register_load_state_pre_hook`` still run where Accelerate runs them, with the same
arguments; a hook that removes a model's weights saves and loads that model itself.

A loader resumed mid-epoch makes a new iterator, which draws its base seed from the global
torch generator: the run that saved had drawn it before saving. That one draw is undone, so
a resumed run draws the random numbers (dropout...) of a run that never stopped.

The directory keeps only a pointer, ``flashckpt.pointer`` (a ``FLASHCKPT-ACCELERATE-POINTER``
header and the job and step that hold the state), plus what pre-hooks write there. With no
tier named, the steps are kept in the ``.flashckpt`` folder of the first directory saved to,
or of ``project_dir`` with automatic checkpoint naming (``total_limit`` becomes the tier's
``keep_last``). Automatic naming works as in Accelerate (``checkpoints/checkpoint_N``, oldest
pointers removed past ``total_limit``, ``load_state()`` takes the newest), and ``load_state``
also sets ``save_iteration`` to follow the step loaded, so the next save does not collide. A
directory without a pointer but with Accelerate's files is loaded by Accelerate itself.

Not through flashckpt, or not at all: ``safe_serialization`` changes nothing (tensors are
always stored as raw bytes, never pickled; other values that are not plain scalars are
pickled, so ``allow_pickle`` defaults to True as Accelerate's ``weights_only=False`` loads
do); ``load_kwargs`` and ``map_location`` are ignored (state is restored in place, on the
devices the live objects are on); a model loads strictly (``strict=False`` is refused);
other accelerators' generators (XPU, NPU, MLU...) are not saved; DeepSpeed, FSDP,
Megatron-LM and XLA set-ups are refused at ``attach``; a step restores only at the number of
processes that saved it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpointer import Checkpointer
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
_CHECKPOINT = re.compile(r"^checkpoint_([0-9]+)$")
# Files Accelerate's own save_state writes: a directory with one of them is Accelerate's.
_ACCELERATE_FILE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|"
    r"random_states_\d+\.pkl|scheduler(_\d+)?\.bin|custom_checkpoint_\d+\.pkl)$"
)
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "use flashckpt.deepspeed.attach(engine) on the DeepSpeed engine",
    DistributedType.FSDP: "FSDP checkpoints are not supported through Accelerate",
    DistributedType.MEGATRON_LM: "Megatron-LM checkpoints are not supported",
    DistributedType.XLA: "XLA devices are not supported",
}


@dataclass(frozen=True)
class Pointer:
    """What ``flashckpt.pointer`` says: the step of which job holds a save directory's state."""

    job: str
    step: int
    world_size: int  # the processes that saved it: each restores its own snapshot
    tier: str | None  # the tier folder, relative to the pointer's directory, if none was named

    def dumps(self) -> bytes:
        return pointer_file.dumps(KIND, self.__dict__)

    @classmethod
    def read(cls, path: str) -> Pointer | None:
        def parse(d: dict) -> Pointer:
            tier = d["tier"]
            return cls(str(d["job"]), int(d["step"]), int(d["world_size"]), tier and str(tier))

        return pointer_file.read(path, KIND, parse, "load an older checkpoint directory")


class FlashAccelerate:
    """The ``save_state``/``load_state`` of one attached Accelerator; see the module doc."""

    def __init__(self, accelerator: Any, tiers: tuple[str, ...], checkpointer_args: dict):
        self.accelerator = accelerator
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
        """Accelerate's ``save_state``: snapshot every state as one step, write the pointer."""
        acc = self.accelerator
        config = acc.project_configuration
        if config.automatic_checkpoint_naming:
            output_dir = self._next_automatic_dir()
        elif output_dir is None:
            raise ConfigError(
                "save_state() needs output_dir unless the Accelerator's project_config sets "
                "automatic_checkpoint_naming"
            )
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, str(out))
        state = {
            "models": weights,
            "optimizers": list(acc._optimizers),
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "dataloaders": [self._dataloader_state(dl) for dl in acc._dataloaders],
            "scaler": None if acc.scaler is None else acc.scaler.state_dict(),
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "rng": RNG(),
            "step": int(acc.step),
            "iteration": int(config.iteration),
        }
        default_dir = Path(config.project_dir) if config.automatic_checkpoint_naming else out
        ckpt = self._checkpointer(default_dir / pointer_file.DIR_TIER)
        step = max(int(config.iteration), self.last + 1)
        self._named_step_stored(ckpt)
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
            pointer = Pointer(ckpt.job, step, int(acc.num_processes), tier)
            pointer_file.write(out / POINTER, pointer.dumps())
        config.iteration += 1
        return out

    def _named_step_stored(self, ckpt: Checkpointer) -> None:
        """Wait until the step the last directory names is in the first tier. The agent stores
        the newest step it finds in memory: a step saved soon after another would otherwise
        leave the other's directory naming a step no tier ever held. Usually long done."""
        if self.named is None or not ckpt.tiers:
            return
        named, self.named = self.named, None
        try:
            ckpt.wait(named, tier=ckpt.tiers[0], timeout=ckpt.close_timeout)
        except TimeoutError:
            log.warning("step %d is not in %s after %.0fs; the directory naming it loads only "
                        "while this node's memory holds it", named, ckpt._shown_tiers()[0],
                        ckpt.close_timeout)  # fmt: skip

    def _next_automatic_dir(self) -> Path:
        """``checkpoints/checkpoint_<save_iteration>``, removing the oldest past ``total_limit``
        (main process), as Accelerate names them."""
        acc = self.accelerator
        config = acc.project_configuration
        root = Path(config.project_dir) / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        limit = config.total_limit
        if limit is not None and acc.is_main_process:
            folders = _numbered(root)
            for _, folder in folders[: max(0, len(folders) + 1 - limit)]:
                shutil.rmtree(folder)
        out = root / f"checkpoint_{config.iteration}"
        if out.exists() and any(out.iterdir()):  # an empty one is a save cut short: reused
            raise ValueError(
                f"Checkpoint directory {out} ({config.iteration}) already exists. Please manually "
                "override `self.save_iteration` with what iteration to start with."
            )
        acc.wait_for_everyone()
        return out

    def _dataloader_state(self, dl: Any) -> dict[str, Any]:
        state = None
        if getattr(dl, "use_stateful_dataloader", False):
            state = dl.state_dict()
        sampler = None
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        if isinstance(dl.dataset, IterableDatasetShard):
            candidate = dl.get_sampler()
            if isinstance(candidate, SeedableRandomSampler):
                sampler = candidate
        iteration = getattr(dl, "iteration", None)
        iterating, finished = _iterating(dl), bool(getattr(dl, "end_of_dataloader", False))
        mid_epoch = iterating and not finished
        if iteration is not None and iterating and finished:
            # Saved at the last batch of an epoch: the loop that resumes starts the next one.
            iteration += 1
        return {"state": state, "sampler": sampler, "iteration": iteration, "mid_epoch": mid_epoch}

    # ---- loading ------------------------------------------------------------------------
    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        **load_model_func_kwargs,
    ) -> None:
        """Accelerate's ``load_state``: restore the step the directory's pointer names."""
        acc = self.accelerator
        config = acc.project_configuration
        if input_dir is not None:
            directory = Path(os.path.expanduser(input_dir))
            if not directory.is_dir():
                raise CheckpointNotFoundError(
                    f"{directory} is not a directory; pass one save_state() wrote"
                )
        elif config.automatic_checkpoint_naming:
            directory = self._newest_automatic_dir()
        else:
            raise ConfigError(
                "load_state() needs input_dir unless the Accelerator's project_config sets "
                "automatic_checkpoint_naming"
            )
        path = directory / POINTER
        pointer = Pointer.read(str(path)) if path.is_file() else None
        if pointer is None:
            if _written_by_accelerate(directory):
                log.info("%s holds no flashckpt pointer: Accelerate loads it", directory)
                self.accelerate_load_state(str(directory), load_kwargs, **load_model_func_kwargs)
                return
            raise CheckpointNotFoundError(
                f"{directory} holds neither a flashckpt pointer ({POINTER}) nor a checkpoint "
                "Accelerate wrote; pass the directory save_state() wrote (with automatic "
                "naming: project_dir/checkpoints/checkpoint_N), or call load_state() only once "
                "a save_state() has run"
            )
        _check_model_kwargs(load_model_func_kwargs)
        if pointer.world_size != acc.num_processes:
            raise StateMismatchError(
                f"{path} names step {pointer.step} of job {pointer.job}, saved by "
                f"{pointer.world_size} processes; this run has {acc.num_processes}. Each "
                "process restores its own snapshot: launch as many processes to load it"
            )
        state = self._restore(pointer, directory)
        self._apply(state)
        config.iteration = max(int(config.iteration), int(state["iteration"]) + 1)

    def _restore(self, pointer: Pointer, directory: Path) -> dict[str, Any]:
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
        models = list(acc._models)
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, str(directory))
        target: dict[str, Any] = {
            "models": [model.state_dict() for model in models],  # filled in place
            "optimizers": list(acc._optimizers),
            "schedulers": [None] * len(acc._schedulers),  # None: the snapshot's value
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
        for model, restored in zip(models, target["models"], strict=True):
            if any(not isinstance(v, torch.Tensor) for v in restored.values()):
                model.load_state_dict(restored)  # extra state: restored as a value, not in place
        return wrapped["accelerate"]

    def _apply(self, state: dict[str, Any]) -> None:
        """Hand the restored values that are not restored in place to their objects."""
        acc = self.accelerator
        for scheduler, saved in zip(acc._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for dl, saved in zip(acc._dataloaders, state["dataloaders"], strict=True):
            _load_dataloader(dl, saved)
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

    def _newest_automatic_dir(self) -> Path:
        root = Path(self.accelerator.project_configuration.project_dir) / "checkpoints"
        folders = _numbered(root) if root.is_dir() else []
        for _, folder in reversed(folders):
            if (folder / POINTER).is_file() or _written_by_accelerate(folder):
                return folder
            log.warning("%s holds no checkpoint (a save cut short); trying an older one", folder)
        raise CheckpointNotFoundError(
            f"no checkpoint under {root} (automatic checkpoint naming): nothing to load; start "
            "from scratch, or save_state() first"
        )

    def close(self) -> None:
        """Wait for the tiers to hold the last step saved and free this process's slots."""
        if self.ckpt is not None:
            self.ckpt.close()


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint_N`` folders of ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return sorted(f for f in found if f[1].is_dir())


def _written_by_accelerate(directory: Path) -> bool:
    return any(_ACCELERATE_FILE.match(p.name) for p in directory.iterdir())


def _iterating(dl: Any) -> bool:
    """Whether ``dl`` is being iterated (between Accelerate's begin() and end())."""
    refs = getattr(getattr(dl, "gradient_state", None), "dataloader_references", [])
    return any(ref is dl for ref in refs)


def _load_dataloader(dl: Any, saved: dict[str, Any]) -> None:
    if saved.get("sampler") is not None:
        dl.set_sampler(saved["sampler"])
    state = saved.get("state")
    if state is not None and getattr(dl, "use_stateful_dataloader", False):
        # A finished epoch's state is not loaded: torchdata would make an iterator only to
        # find it finished and make another (one more draw from the generator than the run
        # that saved made); a loader with no state starts the next epoch as that run did.
        finished = bool(state.get("_iterator_finished"))
        dl.load_state_dict({} if finished else state)
        dl.dl_state_dict = dict(state)  # what state_dict() gives until it iterates
        if saved.get("mid_epoch") and not finished:
            _without_draws_on_resume(dl)
    if saved.get("iteration") is not None and hasattr(dl, "set_epoch"):
        dl.set_epoch(int(saved["iteration"]))


def _without_draws_on_resume(dl: Any) -> None:
    """Let the iterator that resumes ``dl`` leave the global torch generator as it finds it.

    A DataLoader draws from the global generator as it makes each epoch's iterator (its base
    seed). The run that saved made this epoch's iterator before saving, so its draw is in the
    saved generator state; the resumed run makes one more, which would shift every random
    number after it (dropout, ...). The next ``iter()`` of this one loader undoes its draws.
    """
    base = getattr(dl, "base_dataloader", None)
    if base is None:
        return

    def first_iter() -> Any:
        del base.__iter__  # one epoch only: the next ones draw as in an uninterrupted run
        before = torch.get_rng_state()
        try:
            return type(base).__iter__(base)
        finally:
            torch.set_rng_state(before)

    base.__iter__ = first_iter  # Accelerate's DataLoaderShard calls base_dataloader.__iter__()


def _check_model_kwargs(kwargs: dict[str, Any]) -> None:
    unknown = {k: v for k, v in kwargs.items() if k != "map_location"}
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
    why = _UNSUPPORTED.get(accelerator.distributed_type)
    if why is not None:
        raise ConfigError(
            f"flashckpt.accelerate supports single-process and data-parallel (DDP) training, "
            f"not {accelerator.distributed_type}: {why}"
        )
    checkpointer_args.setdefault("allow_pickle", True)
    flash = FlashAccelerate(accelerator, tuple(tiers), checkpointer_args)
    accelerator.save_state = flash.save_state
    accelerator.load_state = flash.load_state
    return flash
