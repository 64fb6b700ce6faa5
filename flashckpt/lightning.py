"""Lightning through the flash path: ``CheckpointIO(*tiers)``, a Lightning checkpoint plugin.

``Trainer(..., plugins=[flashckpt.lightning.CheckpointIO(*tiers)])`` and the usual
``ModelCheckpoint`` make every checkpoint Lightning saves a step of a Checkpointer:
``save_checkpoint`` returns once the checkpoint is snapshotted in shared memory, and the node's
agent persists it to the tiers. ``trainer.fit(model, ckpt_path=...)`` (a path, ``"last"``,
``"best"``) restores that step from the freshest source (this node's memory first, then the
tiers), verified.

What one step holds: Lightning's whole checkpoint dict as it hands it over (the weights, the
optimizers' and LR schedulers' states, the loops' progress, the callbacks' states, the
hyper-parameters...), its tensors as tensors and its other values as a Checkpointer keeps
them; and this process's random generators (``flashckpt.RNG``), which Lightning's own files
do not hold. A resumed fit restores the generators too. Saved in the middle of an epoch, the
resumed run makes that epoch's data iterator again, which draws from the global generator
(its base seed) where the run that saved had drawn before saving: the generators are restored
again once that iterator is made, so the resumed run draws the numbers of a run that never
stopped. A load for ``validate``/``test``/``predict`` leaves the generators alone, as
Lightning does.

Lightning's strategies hand a checkpoint to their CheckpointIO on global rank 0 only; a
Checkpointer keeps one snapshot per rank and persists a step once every rank holds it. So for
a strategy whose plugin is this one, the ``save_checkpoint``, ``remove_checkpoint`` and
``load_checkpoint`` of Lightning's ``Strategy`` base class call it on every rank (the class is
patched once, on the first ``CheckpointIO()``; every other plugin is left to Lightning's own
code). Under DDP every rank snapshots the checkpoint (the same on every rank) with its own
generators; a tier stores the checkpoint once (it is a replica) and each rank's generators.

The path Lightning names keeps a pointer (a ``FLASHCKPT-LIGHTNING-POINTER`` header and the
job and step that hold the checkpoint), written by each node's first process, so
``ModelCheckpoint``'s ``save_top_k``, ``save_last`` (also ``"link"``) and ``"last"``/``"best"``
work on those files as on Lightning's own. A path holding a checkpoint Lightning wrote itself
is loaded by Lightning's own ``TorchCheckpointIO``. With no tier named, the steps go to the
``.flashckpt`` folder of the first directory saved to. Removing a pointer leaves its step in
the tiers, under their own retention (``keep_last=K`` in a tier URL; none by default): a
pointer knows its step, a step does not know its pointers. Before a save, a step another
live pointer of this process names is waited for until the first tier holds it, so that no
pointer is left naming a step only memory held (usually long done; ``save_last=True`` beside
``save_top_k`` saves twice at the same step, and the second save waits for the first:
``save_last="link"`` does not).

Not through flashckpt, or not at all: strategies other than single-device and DDP (FSDP,
DeepSpeed, model-parallel, XLA save their own way: a call they make to this plugin writes
Lightning's own file, with a warning); ``map_location`` (tensors come back on the CPU, and
Lightning moves them to the module's device); ``storage_options``; checkpoint paths on remote
filesystems (keep ``dirpath`` local and name the remote store as a tier). The checkpoint's
values that are neither tensors nor plain Python are pickled; restoring them is allowed
(``allow_pickle=True``, as Lightning's ``weights_only=False`` loads) unless the load asks
``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpointer import Checkpointer
from .door_steps import wait_named_step_stored
from .errors import CheckpointNotFoundError, ConfigError, FlashCkptError
from .format import pointer as pointer_file
from .rng import RNG

try:
    from pytorch_lightning.plugins.io import CheckpointIO as LightningCheckpointIO
    from pytorch_lightning.plugins.io import TorchCheckpointIO
    from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
    from pytorch_lightning.trainer.states import TrainerFn
except ImportError:
    try:
        from lightning.pytorch.plugins.io import CheckpointIO as LightningCheckpointIO
        from lightning.pytorch.plugins.io import TorchCheckpointIO
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
        from lightning.pytorch.trainer.states import TrainerFn
    except ImportError as exc:  # pragma: no cover - neither is installed
        raise ImportError(
            "flashckpt.lightning needs Lightning: pip install 'flashckpt[lightning]'"
        ) from exc

log = logging.getLogger(__name__)

KIND = "LIGHTNING"
KEY = "lightning"  # the state's key of Lightning's checkpoint dict; "rng" holds the generators


@dataclass(frozen=True)
class Pointer:
    """What a checkpoint path holds: the step of which job holds Lightning's checkpoint."""

    job: str
    step: int
    tier: str | None  # the tier folder, relative to the pointer's directory, if none was named

    def dumps(self) -> bytes:
        return pointer_file.dumps(KIND, self.__dict__)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Pointer | None:
        def parse(d: dict) -> Pointer:
            tier = d["tier"]
            return cls(str(d["job"]), int(d["step"]), tier and str(tier))

        return pointer_file.read(path, KIND, parse, "load another checkpoint")


class CheckpointIO(LightningCheckpointIO):
    """Lightning's checkpoints as flashckpt steps; see the module doc.

    ``tiers`` are where the agent persists each step; with none, the first checkpoint
    directory keeps them (in its ``.flashckpt`` folder). ``checkpointer_args`` go to the
    Checkpointer (``job=``, ``close_timeout=``...); ``allow_pickle`` defaults to True.
    """

    def __init__(self, *tiers: str, **checkpointer_args: Any) -> None:
        super().__init__()
        checkpointer_args.setdefault("allow_pickle", True)
        # Lightning's checkpoint is the same on every rank (it writes rank 0's): one copy a tier.
        checkpointer_args.setdefault("replicated", [KEY])
        self.tiers = tuple(tiers)
        self.args = checkpointer_args
        self.ckpt: Checkpointer | None = None
        self.tier_dir: Path | None = None  # the .flashckpt folder, when no tier is named
        self.restored_from: str | None = None  # where the last load came from
        self.last = -1  # the newest step saved or restored: steps only go forward
        self._unstored: dict[str, int] = {}  # pointer path -> its step, until a tier holds it
        self._torch = TorchCheckpointIO()
        self._warned: set[str] = set()
        _route_strategy_calls()

    # ---- Lightning's CheckpointIO, as called directly ------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """A call that did not come through a single-device or DDP strategy (one that saves
        its own way, or the weights a spawned run hands back): Lightning's own file."""
        self._warn_once(
            "direct",
            "%s was saved by torch.save, not flashckpt: it was not handed over by a single-"
            "device or DDP strategy's save_checkpoint", path,
        )  # fmt: skip
        self._torch.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``: its step restored if it holds a pointer, else
        Lightning's own file. The random generators are left alone."""
        return self._load(None, path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self._remove(None, path)

    def teardown(self) -> None:
        """Lightning's end of a fit (or test...): wait for the tiers to hold the last step
        saved and free this process's slots. A later save makes a new Checkpointer."""
        ckpt, self.ckpt = self.ckpt, None
        self._unstored.clear()
        if ckpt is not None:
            ckpt.close()

    # ---- the Checkpointer, made once the first save or load names its tier -------------
    def _checkpointer(self, tier_dir: Path | None, job: str | None = None) -> Checkpointer:
        if self.ckpt is None:
            args = dict(self.args)
            if job is not None and "job" not in args and not os.environ.get("FLASHCKPT_JOB"):
                args["job"] = job  # resume the job the pointer names
            tiers = self.tiers
            if not tiers:
                if self.tier_dir is None:
                    if tier_dir is None:
                        raise ConfigError("no tier to keep the steps in")  # callers pass one
                    self.tier_dir = tier_dir.resolve()
                tiers = (f"file://{self.tier_dir}",)
            self.ckpt = Checkpointer(*tiers, **args)
        return self.ckpt

    # ---- saving ----------------------------------------------------------------------------
    def _save(self, strategy: Any, checkpoint: dict[str, Any], path: Any,
              storage_options: Any | None) -> None:  # fmt: skip
        """Every rank's part of Lightning's ``Strategy.save_checkpoint``."""
        _check_strategy(strategy)
        if storage_options is not None:
            raise ConfigError(
                "save_checkpoint(storage_options=...) is not supported by flashckpt's "
                f"CheckpointIO (got {storage_options!r}); leave it unset"
            )
        target = _local(path)
        ckpt = self._checkpointer(target.parent / pointer_file.DIR_TIER)
        self._wait_for_named(ckpt, str(target))
        step = max(int(checkpoint.get("global_step", 0)), self.last + 1)
        skipped = ckpt.skipped
        ckpt.save(step, {KEY: checkpoint, "rng": RNG().state_dict()})
        if ckpt.skipped != skipped:  # no room in shared memory: the older file stays as it was
            log.warning("%s not written: step %d could not be snapshotted", target, step)
            return
        self.last = step
        tier = None
        if self.tier_dir is not None:
            tier = os.path.relpath(self.tier_dir, target.parent.resolve())
            if target.parent.resolve() / pointer_file.DIR_TIER != self.tier_dir:
                self._warn_once(
                    "elsewhere",
                    "step %d (saved to %s) is kept in %s, the first directory saved to; name "
                    "a tier in CheckpointIO() to keep steps apart from directories you may "
                    "delete", step, target, self.tier_dir.parent,
                )  # fmt: skip
        if strategy.local_rank == 0:  # each node's: a node-local directory gets one too
            target.parent.mkdir(parents=True, exist_ok=True)
            pointer_file.write(target, Pointer(ckpt.job, step, tier).dumps())
        self._unstored[str(target)] = step

    def _wait_for_named(self, ckpt: Checkpointer, path: str) -> None:
        """Wait until the first tier holds every step a live pointer of ours names (but the
        one about to be replaced). The agent stores the newest step it finds in memory: a
        step saved soon after another would otherwise leave the other's pointer naming a
        step no tier ever held."""
        named, self._unstored = self._unstored, {}
        for other, step in sorted(named.items(), key=lambda item: item[1]):
            if other == path or not os.path.lexists(other):
                continue
            wait_named_step_stored(ckpt, step)

    def _remove(self, strategy: Any | None, path: Any) -> None:
        """Lightning's ``remove_checkpoint``: the pointer (or Lightning's own file) goes; the
        step stays in the tiers, under their retention."""
        target = Path(os.fspath(path))
        self._unstored.pop(str(target), None)
        if strategy is not None and strategy.local_rank != 0:
            return
        if target.is_symlink() or (target.is_file() and Pointer.read(target) is not None):
            target.unlink(missing_ok=True)
        else:
            self._torch.remove_checkpoint(path)

    # ---- loading ---------------------------------------------------------------------------
    def _load(self, strategy: Any | None, path: Any, map_location: Any | None,
              weights_only: bool | None) -> dict[str, Any]:  # fmt: skip
        """Restore the step ``path`` names, or load Lightning's own file there."""
        target = Path(os.fspath(path)) if "://" not in str(path) else None
        pointer = None
        if target is not None:
            if not target.exists():
                raise CheckpointNotFoundError(
                    f"Checkpoint file not found: {target}; pass a path ModelCheckpoint (or "
                    "trainer.save_checkpoint) wrote"
                )
            pointer = Pointer.read(target) if target.is_file() else None
        if pointer is None:
            kwargs = {} if map_location is None else {"map_location": map_location}
            return self._torch.load_checkpoint(path, weights_only=weights_only, **kwargs)
        allow = False if weights_only else None
        state = self._restore(pointer, target, allow)
        trainer = _trainer_of(strategy)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            _resume_generators(state["rng"], state[KEY], trainer)
        return state[KEY]

    def _restore(self, pointer: Pointer, path: Path, allow_pickle: bool | None) -> dict[str, Any]:
        tier_dir = None
        if pointer.tier is not None:
            tier_dir = (path.parent / pointer.tier).resolve()
        elif not self.tiers:
            raise ConfigError(
                f"the step {path} names is kept in the tiers the saving run named in "
                "CheckpointIO(); name the same tiers in this run's CheckpointIO() to load it"
            )
        ckpt = self._checkpointer(tier_dir, job=pointer.job)
        if ckpt.job != pointer.job:
            raise FlashCkptError(
                f"{path} belongs to job {pointer.job!r}, this run is job {ckpt.job!r}; set "
                f"FLASHCKPT_JOB={pointer.job} (or job=) to load it"
            )
        state: dict[str, Any] = {KEY: None, "rng": None}  # None: the snapshot's values
        try:
            ckpt.restore(state, step=pointer.step, allow_pickle=allow_pickle)
        except CheckpointNotFoundError:
            where = ", ".join(ckpt._shown_tiers()) or "no tier (none was named)"
            raise CheckpointNotFoundError(
                f"{path} names step {pointer.step} of job {pointer.job}, which is neither in "
                f"this node's shared memory nor committed in {where} for every rank; load "
                "another checkpoint"
            ) from None
        self.restored_from = ckpt._restored_from
        self.last = max(self.last, pointer.step)
        self._unstored.clear()  # steps of the branch left behind are no longer waited for
        return state

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def _local(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in str(text):
        raise ConfigError(
            f"checkpoint path {text!r} is not on a local filesystem; flashckpt keeps a small "
            "pointer file there. Give ModelCheckpoint a local dirpath and name the remote "
            "store as a tier: CheckpointIO('s3://bucket/prefix')"
        )
    return Path(text)


def _check_strategy(strategy: Any) -> None:
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise ConfigError(
            "flashckpt.lightning.CheckpointIO supports the single-device and DDP strategies, "
            f"not {type(strategy).__name__}; use strategy='ddp' (or one device), or drop the "
            "plugin"
        )


def _trainer_of(strategy: Any | None) -> Any | None:
    module = None if strategy is None else strategy.lightning_module
    try:
        return None if module is None else module.trainer
    except RuntimeError:  # a module not attached to a Trainer
        return None


def _saved_mid_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether Lightning saved ``checkpoint`` after a batch that was not its epoch's last."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_loop.batch_progress", {})
    ready = progress.get("current", {}).get("ready", 0)
    return bool(ready) and not progress.get("is_last_batch", True)


def _resume_generators(saved: dict[str, Any], checkpoint: dict[str, Any], trainer: Any) -> None:
    """Put the random generators back as the run that saved had them.

    Resumed at an epoch's start, the fit loop makes the epoch's data iterator as that run
    did after saving, with the same draws. Resumed mid-epoch, it makes again an iterator
    that run had made before saving: its draws are undone once it is made, so the batches
    and dropout that follow draw what they drew in a run that never stopped.
    """
    RNG().load_state_dict(saved)
    if not _saved_mid_epoch(checkpoint):
        return
    loop = trainer.fit_loop
    setup: Callable[[], None] = loop.setup_data

    def setup_then_rewind() -> None:
        del loop.setup_data  # once: later epochs draw as in an uninterrupted run
        setup()
        RNG().load_state_dict(saved)

    loop.setup_data = setup_then_rewind


# ---- every rank's part of a strategy's checkpoint calls --------------------------------------
_LIGHTNING: dict[str, Callable[..., Any]] = {}


def _route_strategy_calls() -> None:
    """Have ``Strategy.save_checkpoint``/``remove_checkpoint``/``load_checkpoint`` call a
    flashckpt plugin on every rank with the strategy; other plugins keep Lightning's code."""
    if _LIGHTNING:
        return
    _LIGHTNING.update(
        save=Strategy.save_checkpoint,
        remove=Strategy.remove_checkpoint,
        load=Strategy.load_checkpoint,
    )

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # noqa: ANN001
        io = self._checkpoint_io
        if isinstance(io, CheckpointIO):
            return io._save(self, checkpoint, filepath, storage_options)
        return _LIGHTNING["save"](self, checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath):  # noqa: ANN001
        io = self._checkpoint_io
        if isinstance(io, CheckpointIO):
            return io._remove(self, filepath)
        return _LIGHTNING["remove"](self, filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None):  # noqa: ANN001
        io = self._checkpoint_io
        if isinstance(io, CheckpointIO):
            return io._load(self, checkpoint_path, None, weights_only)
        return _LIGHTNING["load"](self, checkpoint_path, weights_only)

    for name, wrapper in (("save_checkpoint", save_checkpoint),
                          ("remove_checkpoint", remove_checkpoint),
                          ("load_checkpoint", load_checkpoint)):  # fmt: skip
        wrapper.__doc__ = getattr(Strategy, name).__doc__
        wrapper.__qualname__ = f"Strategy.{name}"
        setattr(Strategy, name, wrapper)
