"""The Hugging Face ``Trainer`` through the flash path: ``attach(trainer, *tiers)``.

    flash = flashckpt.hf.attach(trainer)  # saves go to shared memory, then the tiers
    trainer.train(resume_from_checkpoint=True)  # or a checkpoint-N directory, or None

After ``attach``, every save the Trainer makes (as its ``save_strategy`` and ``save_steps``
say) snapshots this process's training state as one step of a Checkpointer and returns once
the snapshot is in shared memory; the node's agent persists it to the tiers. A resume through
``train(resume_from_checkpoint=...)`` restores that step in place from the freshest source
(this node's memory first, then the tiers), verified, where the Trainer would load its own
files, so the run goes on as one that never stopped. One step holds:

- the model (a DDP wrapper as its module; under FSDP2 this process's shards), the optimizer,
  the LR scheduler's state, the GradScaler's where there is one, and this process's random
  generators (``flashckpt.RNG``);
- under DeepSpeed, DeepSpeed's own checkpoint instead of the model and optimizer: the
  engine's ``save_checkpoint`` goes through ``flashckpt.deepspeed.attach`` (its model states,
  ZeRO partitions and scheduler), the rest riding along as its ``client_state``.

``output_dir/checkpoint-N`` keeps its name and place, so ``resume_from_checkpoint=True`` and
``save_total_limit`` work as in the Trainer. It holds the Trainer's ``trainer_state.json``
(global step, epoch, logs: what the Trainer reads to skip the samples already trained on),
``flashckpt.pointer`` (the job and step that hold the rest) and, under DeepSpeed, DeepSpeed's
layout of pointer files. It is made in a staging folder and renamed into place once every
process holds the step, so no ``checkpoint-N`` is a save cut short. Before a save, if the
step the previous directory names is not yet in the first tier, the save waits for it
(usually long done), so each directory the Trainer keeps can be loaded from a tier. A
directory the Trainer wrote itself still loads, its own way.

The tiers are those given to ``attach``; with none, ``output_dir/.flashckpt``, keeping the
last ``save_total_limit`` steps. Training's end waits (``close_timeout``) until the tiers hold
the last step saved, then frees this process's shared memory.

``attach`` replaces, on this one Trainer (its class is untouched): ``_save_checkpoint``; the
loads ``train`` makes (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler``, ``_load_rng_state``); ``train``, to read the pointer of the directory
resumed before anything is set up; and ``create_scheduler``, which runs once DeepSpeed's
engine exists, to attach flashckpt to that engine before the Trainer loads into it. ``train``
and ``create_scheduler`` still call the class's own; a subclass's own ``_save_checkpoint`` or
loads no longer run for flashckpt's directories (``attach`` logs a warning).

Refused at ``attach``: FSDP1 (FSDP2, ``fsdp_config={"version": 2}``, the default, is taken),
XLA and SageMaker model parallelism, ``save_only_model``,
``load_best_model_at_end`` (the best directory holds no weights to load) and ``push_to_hub``
(a checkpoint directory holds pointers, not a model to push). A step restores only with the
number of processes, and the DeepSpeed or plain set-up, that saved it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpointer import Checkpointer
from .door_steps import wait_named_step_stored
from .errors import CheckpointNotFoundError, ConfigError, FlashCkptError, StateMismatchError
from .format import pointer as pointer_file
from .rng import RNG

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("flashckpt.hf needs transformers: pip install 'flashckpt[hf]'") from exc

log = logging.getLogger(__name__)

KIND = "HF"
POINTER = "flashckpt.pointer"  # the file of a checkpoint directory that names the step
STATE_NAME = "trainer_state.json"  # the Trainer's own name: train() reads it
CLIENT_KEY = "flashckpt_hf"  # DeepSpeed's client_state entry: what the engine does not save
_STAGING = ".flashckpt-staging"  # "." first: no checkpoint-N pattern of the Trainer matches it
_REPLACED = (
    "train",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_rng_state",
    "create_scheduler",
)


@dataclass(frozen=True)
class Pointer:
    """What ``flashckpt.pointer`` says: the step of which job holds a directory's state."""

    job: str
    step: int
    world_size: int  # the processes that saved it: each restores its own snapshot
    deepspeed: bool  # saved through DeepSpeed's engine (its files hold the model, optimizer)

    def dumps(self) -> bytes:
        return pointer_file.dumps(KIND, self.__dict__)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Pointer | None:
        """The pointer of a checkpoint directory, or None where it has none."""
        path = Path(directory) / POINTER
        if not path.is_file():
            return None

        def parse(d: dict) -> Pointer:
            return cls(str(d["job"]), int(d["step"]), int(d["world_size"]), bool(d["deepspeed"]))

        return pointer_file.read(path, KIND, parse, "resume from another checkpoint directory")


class FlashTrainer:
    """The save and loads of one attached Trainer; see the module doc."""

    def __init__(self, trainer: Any, tiers: tuple[str, ...], checkpointer_args: dict) -> None:
        self.trainer = trainer
        self.tiers = tiers
        self.args = checkpointer_args
        self.ckpt: Checkpointer | None = None  # made at the first save or restore
        self.ds: Any = None  # flashckpt.deepspeed's engine, under DeepSpeed
        self.last = -1  # the newest step saved or restored: steps only go forward
        self.named: int | None = None  # the step the newest directory names
        self.restored_step: int | None = None  # the step the last resume restored
        self.restored_from: str | None = None  # where from: "shared memory", or a tier's URL
        self._pointer: Pointer | None = None  # of the directory train() resumes from
        self._engine: Any = None  # the DeepSpeed engine flashckpt is attached to
        self._client: dict | None = None  # what DeepSpeed's load handed back of ours
        self._rng: dict | None = None  # restored, set where the Trainer sets its own
        self.original = {name: getattr(trainer, name) for name in _REPLACED}
        self.original["_load_scaler"] = getattr(trainer, "_load_scaler", None)

    # ---- the Checkpointer ---------------------------------------------------------------
    def _tiers(self) -> tuple[str, ...]:
        if self.tiers:
            return self.tiers
        args = self.trainer.args
        url = pointer_file.dir_tier(args.output_dir)
        if args.save_total_limit and not args.metric_for_best_model:
            url += f"?keep_last={int(args.save_total_limit)}"  # the directories rotation keeps
        return (url,)

    def _checkpointer_args(self) -> dict[str, Any]:
        args = dict(self.args)
        job = self._pointer.job if self._pointer is not None else None
        if job is not None and "job" not in args and not os.environ.get("FLASHCKPT_JOB"):
            args["job"] = job  # resume the job the directory names
        return args

    def checkpointer(self) -> Checkpointer:
        """This process's Checkpointer (DeepSpeed's engine has its own)."""
        if self.ckpt is None:
            self.ckpt = Checkpointer(*self._tiers(), **self._checkpointer_args())
        return self.ckpt

    # ---- train(): which directory it resumes from ---------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs) -> Any:
        self._pointer, self._client, self._rng = None, None, None
        directory = resume_from_checkpoint
        if directory is True and os.path.isdir(self.trainer.args.output_dir):
            directory = get_last_checkpoint(self.trainer.args.output_dir)
        if isinstance(directory, (str, os.PathLike)):
            self._pointer = Pointer.read(directory)
            if self._pointer is not None:
                self._check_fits(self._pointer, directory)
        return self.original["train"](resume_from_checkpoint, *args, **kwargs)

    def _check_fits(self, pointer: Pointer, directory: str | os.PathLike) -> None:
        tr = self.trainer
        where = Path(directory) / POINTER
        if pointer.deepspeed != bool(tr.is_deepspeed_enabled):
            saved = "under DeepSpeed" if pointer.deepspeed else "without DeepSpeed"
            now = "is" if tr.is_deepspeed_enabled else "is not"
            raise StateMismatchError(
                f"{where} names step {pointer.step} of job {pointer.job}, saved {saved}; this "
                f"Trainer {now} a DeepSpeed one. Resume with the set-up that saved it"
            )
        if pointer.world_size != tr.args.world_size:
            raise StateMismatchError(
                f"{where} names step {pointer.step} of job {pointer.job}, saved by "
                f"{pointer.world_size} processes; this run has {tr.args.world_size}. Each "
                "process restores its own snapshot: launch as many processes to resume it"
            )

    # ---- saving ---------------------------------------------------------------------------
    def save_checkpoint(self, model: Any, trial: Any = None) -> None:
        """The Trainer's ``_save_checkpoint``: the state snapshotted as one step, then the
        directory ``checkpoint-<global_step>`` naming it."""
        tr, args = self.trainer, self.trainer.args
        if tr.hp_search_backend is None and trial is None:
            tr.store_flos()  # a collective under DDP: every process, as the Trainer does
        run_dir = Path(tr._get_output_dir(trial=trial))
        final = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{tr.state.global_step}"
        staging = run_dir / f".{final.name}{_STAGING}"
        self._note_best(run_dir)
        if args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save cut short
        if tr.is_deepspeed_enabled:
            _barrier()  # every process writes into the staging folder: it is clean first
            step = self._save_deepspeed(staging)
        else:
            step = self._save_state()
        _barrier()  # every process holds the step before a directory names it
        if args.should_save:
            self._write_directory(staging, final, step)
            _rotate(tr, run_dir)

    def _save_state(self) -> int:
        tr = self.trainer
        ckpt = self.checkpointer()
        self._named_step_stored(ckpt)
        step = max(int(tr.state.global_step), self.last + 1)
        scaler = getattr(tr.accelerator, "scaler", None)
        ckpt.save(
            step,
            {
                "model": tr.model_wrapped,  # a DDP wrapper: stored once per replica group
                "optimizer": _optimizer(tr),
                "scheduler": tr.lr_scheduler.state_dict(),
                "scaler": None if scaler is None else scaler.state_dict(),
                "rng": RNG().state_dict(),  # a value: set where the Trainer sets its own
            },
        )
        self.last = self.named = step
        return step

    def _save_deepspeed(self, staging: Path) -> int:
        tr = self.trainer
        flash = self._attach_deepspeed()
        if flash.ckpt is not None:
            self._named_step_stored(flash.ckpt)
        extras = {"scheduler": _own_scheduler_state(tr), "scaler": None, "rng": RNG().state_dict()}
        tr.model_wrapped.save_checkpoint(str(staging), client_state={CLIENT_KEY: extras})
        self.last = self.named = int(flash.last)
        return self.last

    def _note_best(self, run_dir: Path) -> None:
        """The Trainer's record of the best checkpoint, which rotation never removes."""
        tr = self.trainer
        state = tr.state
        best_step = getattr(state, "best_global_step", None)
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if tr.args.save_strategy in strategies and best_step:
            best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{best_step}"
            if best_step == state.global_step or best.is_dir():
                state.best_model_checkpoint = str(best)

    def _write_directory(self, staging: Path, final: Path, step: int) -> None:
        tr = self.trainer
        staging.mkdir(parents=True, exist_ok=True)
        for cb in tr.callback_handler.callbacks + [tr.control]:
            if isinstance(cb, ExportableState):  # their state goes in trainer_state.json
                name, saved = type(cb).__name__, cb.state()
                if isinstance(tr.state.stateful_callbacks.get(name), list):
                    tr.state.stateful_callbacks[name].append(saved)
                else:
                    tr.state.stateful_callbacks[name] = saved
        tr.state.save_to_json(str(staging / STATE_NAME))
        job = (self.ds.ckpt if self.ds is not None else self.ckpt).job
        pointer = Pointer(job, step, int(tr.args.world_size), bool(tr.is_deepspeed_enabled))
        pointer_file.write(staging / POINTER, pointer.dumps())
        replaced = None
        if final.exists():  # the same step saved again (a resume from an older directory)
            replaced = final.with_name(f".{final.name}.replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(staging, final)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    def _named_step_stored(self, ckpt: Checkpointer) -> None:
        named, self.named = self.named, None
        wait_named_step_stored(ckpt, named)

    # ---- DeepSpeed: flashckpt.deepspeed on the engine, once it exists --------------------
    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = self.original["create_scheduler"](num_training_steps, optimizer)
        if self.trainer.is_deepspeed_enabled:
            self._attach_deepspeed()
        return scheduler

    def _attach_deepspeed(self) -> Any:
        wrapped = getattr(self.trainer.accelerator, "deepspeed_engine_wrapped", None)
        engine = getattr(wrapped, "engine", None)
        if engine is None:
            raise FlashCkptError(
                "the Trainer uses DeepSpeed but Accelerate holds no DeepSpeed engine yet; "
                "flashckpt.hf saves and loads only within train()"
            )
        if engine is self._engine:
            return self.ds
        from . import deepspeed as flash_deepspeed

        if self.ds is not None:  # the engine of an earlier train()
            self.ds.close()
        self.ds = flash_deepspeed.attach(engine, *self._tiers(), **self._checkpointer_args())
        self._engine = engine
        load = engine.load_checkpoint

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            path, client = load(*args, **kwargs)
            self._client = (client or {}).get(CLIENT_KEY)
            return path, client

        engine.load_checkpoint = load_checkpoint  # the Trainer drops the client state it returns
        return self.ds

    # ---- loading --------------------------------------------------------------------------
    def load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if Pointer.read(resume_from_checkpoint) is None:
            self.original["_load_from_checkpoint"](resume_from_checkpoint, model)
        # else: the weights come back with the optimizer, once both exist

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        pointer = None if checkpoint is None else Pointer.read(checkpoint)
        if pointer is None:
            self.original["_load_optimizer_and_scheduler"](checkpoint)
            return
        if self.trainer.is_deepspeed_enabled:
            if self._client is None:
                raise FlashCkptError(
                    f"{checkpoint} names step {pointer.step} of job {pointer.job}, but "
                    "DeepSpeed's load_checkpoint did not hand back what flashckpt saved with "
                    "it; resume from a directory this Trainer saved through flashckpt"
                )
            extras, ckpt = self._client, self.ds.ckpt
        else:
            extras, ckpt = self._restore(pointer, Path(checkpoint)), self.ckpt
        self.restored_step, self.restored_from = pointer.step, ckpt._restored_from
        self._apply(extras)

    def _restore(self, pointer: Pointer, directory: Path) -> dict[str, Any]:
        tr = self.trainer
        ckpt = self.checkpointer()
        if ckpt.job != pointer.job:
            raise FlashCkptError(
                f"the checkpoint in {directory} belongs to job {pointer.job!r}, this run is job "
                f"{ckpt.job!r}; set FLASHCKPT_JOB={pointer.job} (or job=) to resume it"
            )
        state: dict[str, Any] = {
            "model": tr.model_wrapped,  # filled in place
            "optimizer": _optimizer(tr),
            "scheduler": None,  # None: the snapshot's value
            "scaler": None,
            "rng": None,
        }
        try:
            ckpt.restore(state, step=pointer.step)
        except CheckpointNotFoundError:
            where = ", ".join(ckpt._shown_tiers()) or "no tier"
            raise CheckpointNotFoundError(
                f"{directory / POINTER} names step {pointer.step} of job {pointer.job}, which "
                f"is neither in this node's shared memory nor committed in {where} for every "
                "process; resume from an older checkpoint directory, or name in attach() the "
                "tier that holds it"
            ) from None
        self.last = max(self.last, pointer.step)
        return state

    def _apply(self, extras: dict[str, Any]) -> None:
        """Hand the restored values that are not restored in place to their objects."""
        tr = self.trainer
        if extras.get("scheduler") is not None:
            tr.lr_scheduler.load_state_dict(extras["scheduler"])
        scaler = getattr(tr.accelerator, "scaler", None)
        if scaler is not None and extras.get("scaler") is not None:
            scaler.load_state_dict(extras["scaler"])
        elif scaler is not None:
            log.warning("the checkpoint holds no GradScaler state; this run's starts afresh")
        self._rng = extras.get("rng")

    def load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and Pointer.read(checkpoint) is not None:
            return  # restored with the optimizer
        if self.original["_load_scaler"] is not None:
            self.original["_load_scaler"](checkpoint)

    def load_rng_state(self, checkpoint: str | None) -> None:
        """Where the Trainer sets its generators on resume (after skipping the batches
        already trained on, whose skipping draws from them), set the restored ones."""
        if checkpoint is None or Pointer.read(checkpoint) is None:
            self.original["_load_rng_state"](checkpoint)
            return
        if self._rng is None:
            raise FlashCkptError(
                f"{checkpoint}: the random generators of its step were not restored; resume "
                "through trainer.train(resume_from_checkpoint=...)"
            )
        RNG().load_state_dict(self._rng)

    def close(self) -> None:
        """Wait for the tiers to hold the last step saved and free this process's slots."""
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        if self.ds is not None:
            self.ds.close()
            self.ds, self._engine = None, None


class _CloseAtTrainEnd(TrainerCallback):
    """Closes the attached Checkpointer when training ends: its last step reaches the tiers."""

    def __init__(self, flash: FlashTrainer) -> None:
        self.flash = flash

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.flash.close()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _optimizer(trainer: Any) -> Any:
    """The optimizer a step holds. Under FSDP2 the one inside Accelerate's wrapper: a fresh
    one holds no state until its first step, and the wrapper's own step would hand the
    restored state to a GradScaler before the restore."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return trainer.optimizer


def _own_scheduler_state(trainer: Any) -> dict | None:
    """The Trainer's LR scheduler's state, unless DeepSpeed's engine keeps it (a scheduler of
    the DeepSpeed config)."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    if trainer.lr_scheduler is None or isinstance(trainer.lr_scheduler, DeepSpeedSchedulerWrapper):
        return None
    return trainer.lr_scheduler.state_dict()


def _rotate(trainer: Any, run_dir: Path) -> None:
    """Remove the oldest directories past ``save_total_limit``, as the Trainer does."""
    args = trainer.args
    try:
        from transformers.trainer_utils import rotate_checkpoints
    except ImportError:  # transformers 4: a method of the Trainer
        trainer._rotate_checkpoints(use_mtime=True, output_dir=str(run_dir))
        return
    rotate_checkpoints(
        output_dir=str(run_dir),
        save_total_limit=args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _check_supported(trainer: Any) -> None:
    missing = [name for name in _REPLACED if not callable(getattr(trainer, name, None))]
    if missing:
        raise ConfigError(
            f"this Trainer has no {', '.join(missing)}: flashckpt.hf hooks the Trainer of "
            f"transformers 5 (tested with 5.23), this is transformers {transformers.__version__}"
        )
    args = trainer.args
    fsdp = None
    if getattr(trainer, "is_fsdp_enabled", False):
        fsdp = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) != 2:
        raise ConfigError(
            "flashckpt.hf supports FSDP2, not FSDP1, whose flat parameters no other set-up can "
            'read: give TrainingArguments fsdp_config={"version": 2} (its default)'
        )
    refused = {
        "XLA devices": bool(getattr(trainer, "is_fsdp_xla_enabled", False))
        or str(getattr(args, "device", "")).startswith("xla"),
        "SageMaker model parallelism": _sagemaker_mp(),
    }
    for what, used in refused.items():
        if used:
            raise ConfigError(
                f"flashckpt.hf supports the Trainer on one process, under DDP, FSDP2 and "
                f"DeepSpeed, not with {what}: unset it, or keep the Trainer's own checkpoints"
            )
    options = {
        "save_only_model": "a flash step holds the whole training state at the cost of a "
        "memory copy; unset save_only_model",
        "load_best_model_at_end": "a checkpoint directory holds no weights to load the best "
        "model from; unset it, and save the model you keep with trainer.save_model()",
        "push_to_hub": "a checkpoint directory holds pointers, not a model to push; unset it, "
        "and push the model after training with trainer.push_to_hub()",
    }
    for option, why in options.items():
        if getattr(args, option, False):
            raise ConfigError(f"flashckpt.hf cannot save with {option}=True: {why}")


def _sagemaker_mp() -> bool:
    try:
        from transformers.utils import is_sagemaker_mp_enabled
    except ImportError:  # pragma: no cover - moved in a later transformers
        return False
    return bool(is_sagemaker_mp_enabled())


def attach(trainer: Any, *tiers: str, **checkpointer_args: Any) -> FlashTrainer:
    """Make ``trainer``'s saves and resumes go through flashckpt.

    ``tiers`` are where the agent persists each step; with none, ``output_dir/.flashckpt``.
    ``checkpointer_args`` go to the Checkpointer (``job=``, ``close_timeout=``...). The
    methods are replaced on this one Trainer only; training's end closes the Checkpointer
    (``close()`` on the result does it earlier). See the module doc for what is saved.
    """
    if "_save_checkpoint" in vars(trainer):
        raise ConfigError(
            "this Trainer is already attached to flashckpt, or has its own _save_checkpoint"
        )
    _check_supported(trainer)
    from transformers import Trainer

    # The others call the class's own method; these replace it (for flashckpt's directories).
    replaced = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
                "_load_rng_state")  # fmt: skip
    overridden = [n for n in replaced if getattr(type(trainer), n) is not getattr(Trainer, n)]
    if overridden:
        log.warning("%s overrides %s; flashckpt.hf replaces them on this Trainer, so that code "
                    "does not run", type(trainer).__name__, ", ".join(overridden))  # fmt: skip
    flash = FlashTrainer(trainer, tuple(tiers), checkpointer_args)
    trainer.train = flash.train
    trainer._save_checkpoint = flash.save_checkpoint
    trainer._load_from_checkpoint = flash.load_from_checkpoint
    trainer._load_optimizer_and_scheduler = flash.load_optimizer_and_scheduler
    trainer._load_scaler = flash.load_scaler
    trainer._load_rng_state = flash.load_rng_state
    trainer.create_scheduler = flash.create_scheduler
    trainer.add_callback(_CloseAtTrainEnd(flash))
    return flash


__all__ = ["FlashTrainer", "Pointer", "attach"]
