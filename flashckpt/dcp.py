"""``flashckpt.dcp``: ``torch.distributed.checkpoint``'s own calls, saving through flashckpt.

    ckpt = flashckpt.Checkpointer("file:///mnt/nvme/ckpt", job="run-7")
    dcp.save(state, checkpoint_id=step, storage_writer=flashckpt.dcp.Writer(ckpt))
    dcp.load(state, storage_reader=flashckpt.dcp.Reader(ckpt))

Code that already calls ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` (FSDP2 training
loops, TorchTitan-style trainers) keeps its calls and its state dicts; only the storage
changes. A save is a flashckpt save: each rank's state goes to its shared memory at copy
speed and the node's agent persists it to the tiers in the background, in checksummed chunks;
the step commits once every rank's snapshot is stored. A load is a flashckpt restore: every
rank agrees on the newest step all of them can get, each reads it from its fastest intact
source (its own memory, a peer's, then the tiers), every chunk verified.

The step is the ``checkpoint_id``: an int, or a name ending in one (``"step-1200"``,
``"ckpt/step_1200"``); ``Reader`` without one loads the newest step every rank can get.

``dcp.async_save`` stages through the ``Writer``: the snapshot is copied into shared memory
before ``async_save`` returns (no staging copy of DCP's own), and DCP's background save then
commits it as the ``checkpoint_id``'s step. ``dcp.save`` plans every tensor with DCP's planner
in the caller's thread first, as it does for any storage.

Each rank's snapshot holds a description of its state as DCP's default planner flattens it
(each key's tensor global size and dtype, every other value an object): ``Reader`` answers
``read_metadata`` with it, so DCP checks what it loads against what was saved as it does for
files. ``dcp.save`` saves the state flattened so; ``dcp.async_save`` saves it as given, nested,
and flattens it only to describe it where its structure changed since the last save (at
thousands of tensors flattening costs a good part of the copy); ``Reader`` loads either. The
bytes themselves move the flashckpt way: each rank saves what it holds (DCP would have one rank
write a replicated tensor for all; here every rank keeps its own copy in its own memory, so a
restart at the same size reads nothing across the network), and a load fills the target state
in place, resharding DTensor shards where the world size or the mesh changed, as
``Checkpointer.restore`` does.

Values that are not tensors or plain scalars are pickled by flashckpt's save and refused at
load unless the Checkpointer allows pickles (``allow_pickle``): what is read back is untrusted.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    Metadata,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from .checkpointer import Checkpointer, StagedSnapshot
from .errors import CheckpointNotFoundError, ConfigError, ManifestError

__all__ = ["Reader", "Writer", "describe", "flatten", "step_of"]

STATE = "dcp"  # dcp.save's: {STATE: DCP's flattened state dict, METADATA: what it holds}
TREE = "dcp_tree"  # dcp.async_save's: {TREE: the state dict as given, METADATA: the same}
METADATA = "dcp_metadata"
_CALLER_GRACE_S = 0.05
# After it, the caller's own way out: DCP's wrappers, and the state dict it passed freed (at
# thousands of tensors a few ms, which the checksums the commit starts would stretch to the
# checksums' length: each tensor freed takes the interpreter lock back from their thread).
_CALLER_LEAVES_S = 0.02
_STAGED = "flashckpt.dcp.staged"  # the stand-in ``Writer.stage`` hands DCP: which snapshot
_TRAILING_STEP = re.compile(r"(\d+)$")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}  # fmt: skip


def step_of(checkpoint_id: Any) -> int | None:
    """The step a ``checkpoint_id`` names: an int, or a name whose last characters are one."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id if checkpoint_id >= 0 else None
    found = _TRAILING_STEP.search(str(checkpoint_id).rstrip("/"))
    return int(found.group(1)) if found else None


def _step(checkpoint_id: Any, what: str) -> int | None:
    step = step_of(checkpoint_id)
    if checkpoint_id is not None and step is None:
        raise ConfigError(
            f"flashckpt.dcp.{what}: checkpoint_id {checkpoint_id!r} names no step; pass the "
            "step (an int >= 0) or a name ending in it, such as 'step-1200'"
        )
    return step


def _done(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class Writer(StorageWriter, AsyncStager):
    """DCP's storage writer that saves through ``checkpointer`` (see the module doc).

    ``dcp.async_save`` stages through it: the snapshot is copied into shared memory before
    ``async_save`` returns, and DCP's planning then runs in its background thread over a
    one-key stand-in, which commits the staged snapshot as the ``checkpoint_id``'s step.
    """

    def __init__(self, checkpointer: Checkpointer):
        super().__init__()
        self.checkpointer = checkpointer
        self.step: int | None = None
        self.is_coordinator = False
        self._staged: dict[int, StagedSnapshot] = {}  # by the token ``stage`` hands DCP
        self._tokens = itertools.count()
        self._returned = threading.Event()  # the caller of dcp.async_save is on its way back
        self._returned.set()
        self._stager: int | None = None  # the thread that called ``stage`` last

    def reset(self, checkpoint_id: Any = None) -> None:
        if not self._returned.is_set() and threading.get_ident() != self._stager:
            # DCP's background save starts while the training thread is still in async_save:
            # it lets that thread return first, instead of taking the interpreter lock from it
            # for a switch interval (5 ms) or two. At most 70 ms late, once a save.
            self._returned.wait(_CALLER_GRACE_S)
            time.sleep(_CALLER_LEAVES_S)
        self.step = _step(checkpoint_id, "Writer")

    @property
    def should_synchronize_after_execute(self) -> bool:
        """False (``stage`` returns once the copy is done). DCP asks last thing before
        ``async_save`` returns, so the background save knows its caller is leaving."""
        self._returned.set()
        return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``: snapshot ``state_dict`` now (its step is not known yet), and
        hand DCP's background save a stand-in naming the staged snapshot."""
        for token in [t for t, s in self._staged.items() if s.dropped_by is not None]:
            del self._staged[token]  # an earlier save DCP gave up before writing
        token = next(self._tokens)
        self._staged[token] = _stage(self.checkpointer, TREE, state_dict)
        self._stager = threading.get_ident()
        self._returned.clear()
        return {_STAGED: token}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is done."""

    def close(self) -> None:
        """Nothing to free: the Checkpointer owns the slots."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        state = getattr(planner, "state_dict", None)
        if not isinstance(state, dict):
            raise ConfigError(
                "flashckpt.dcp.Writer saves the state dict DCP's planner holds: use DCP's "
                f"DefaultSavePlanner or a subclass of it (this planner, {type(planner).__name__}, "
                "keeps none)"
            )
        staged = self._staged.pop(state[_STAGED], None) if len(state) == 1 and _STAGED in state \
            else None  # fmt: skip
        if staged is None and self._staged:
            for pending in self._staged.values():
                pending.drop()
            self._staged.clear()
            raise ConfigError(
                "flashckpt.dcp.Writer: the planner changed what dcp.async_save staged (the key "
                f"{_STAGED!r}); use DCP's DefaultSavePlanner with dcp.async_save, or dcp.save"
            )
        if self.step is None:
            if staged is not None:
                staged.drop()
            raise ConfigError(
                "flashckpt.dcp.Writer: no step to save as; pass it as the checkpoint_id, e.g. "
                "dcp.save(state, checkpoint_id=step, storage_writer=writer)"
            )
        step, self.step = self.step, None  # the next save names its own
        if staged is None:  # dcp.save: the state as DCP's planner flattened it
            staged = _stage(self.checkpointer, STATE, dict(state))
        staged.commit(step)
        results = [WriteResult(index=item.index, size_in_bytes=_size(item), storage_data=None)
                   for item in plan.items]  # fmt: skip
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the step commits once every rank's snapshot is stored."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return step_of(checkpoint_id) is not None

    def __reduce__(self) -> Any:
        raise ConfigError(
            "flashckpt.dcp.Writer saves into this process's Checkpointer and cannot be sent to "
            "another process: use dcp.async_save's default thread executor, not "
            "AsyncCheckpointerType.PROCESS"
        )


# What saves through DCP last described, per Checkpointer and form (STATE or TREE): kept while
# the Checkpointer's walk finds the state it stages of the same structure
# (``StagedSnapshot.steady``). Made anew every save, at thousands of tensors it would cost a
# good part of the copy.
_DESCRIBED: weakref.WeakKeyDictionary[Checkpointer, dict[str, str]] = weakref.WeakKeyDictionary()


def _stage(checkpointer: Checkpointer, form: str, state: dict[str, Any]) -> StagedSnapshot:
    """Stage ``state`` under ``form`` (STATE: flattened by DCP's planner; TREE: as given) with
    its description, made again only when its structure changed since the last save."""
    described = _DESCRIBED.setdefault(checkpointer, {})
    text = last = described.get(form)
    if last is None:
        text = _describe(form, state)
    staged = checkpointer.stage({form: state, METADATA: text})
    if last is not None and not staged.steady:  # another structure: other keys or sizes?
        text = _describe(form, state)
        if text != last:
            staged.drop()
            staged = checkpointer.stage({form: state, METADATA: text})
    described[form] = text
    return staged


def _describe(form: str, state: dict[str, Any]) -> str:
    return describe(state if form == STATE else flatten(state))


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` flattened as DCP's default planner flattens it: mappings and the lists that
    hold a tensor or a mapping are walked, their keys joined by dots; tuples and every other
    value are leaves."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, items: Any) -> None:
        for key, value in items:
            fqn = prefix + (key if type(key) is str else str(key))
            if type(value) is dict or (  # the cheap test first: most containers are dicts
                not isinstance(value, torch.Tensor) and isinstance(value, Mapping)
            ):
                walk(fqn + ".", value.items())
            elif isinstance(value, list) and not _leaf_list(value):
                walk(fqn + ".", enumerate(value))
            elif fqn in flat:
                raise ConfigError(f"flashckpt.dcp.Writer: two values flatten to the key {fqn!r}")
            else:
                flat[fqn] = value

    walk("", state.items())
    return flat


_SCALARS = frozenset((int, float, str, bool, type(None)))


def _leaf_list(values: list) -> bool:
    for v in values:
        if type(v) in _SCALARS:  # the common case (an optimizer's "params"): at once
            continue
        if isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not _leaf_list(v)):
            return False
    return True


def describe(flat: Mapping[str, Any]) -> str:
    """What a flattened state holds, as DCP's metadata tells it: each tensor's global size
    and dtype (a DTensor's whole tensor), every other value an object."""
    held: dict[str, dict] = {}
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            held[fqn] = {"t": "tensor", "size": list(value.shape),
                         "dtype": str(value.dtype).removeprefix("torch.")}  # fmt: skip
        else:
            held[fqn] = {"t": "bytes"}
    return json.dumps(held, separators=(",", ":"))


class Reader(StorageReader):
    """DCP's storage reader that loads through ``checkpointer`` (see the module doc)."""

    def __init__(self, checkpointer: Checkpointer, step: int | None = None):
        super().__init__()
        self.checkpointer = checkpointer
        self.step = step
        self.loaded: int | None = None  # the step read_metadata found
        self._nested = False  # the step holds its state as given (dcp.async_save's)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _step(checkpoint_id, "Reader")

    def read_metadata(self, *args: Any) -> Metadata:
        # No ``**kwargs``: DCP would take that as asking again, rank by rank, after a failure.
        held = {METADATA: ""}
        found = self.checkpointer.restore(held, self.step, strict=False)
        step, left = found if isinstance(found, tuple) else (found, [])
        if step is None or not held[METADATA]:
            raise CheckpointNotFoundError(
                f"job {self.checkpointer.job!r} holds no step saved through flashckpt.dcp"
                + (f" at step {self.step}" if self.step is not None else "")
                + "; `flashckpt ls` shows what it holds"
            )
        self.loaded = step
        self._nested = any(m.path == TREE and m.kind == "unexpected" for m in left)
        return Metadata(state_dict_metadata=_metadata(held[METADATA], step))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        target = getattr(planner, "state_dict", None)
        if not isinstance(target, dict):
            raise ConfigError(
                "flashckpt.dcp.Reader loads into the state dict DCP's planner holds: use DCP's "
                f"DefaultLoadPlanner or a subclass of it ({type(planner).__name__} keeps none)"
            )
        wanted = {item.dest_index.fqn for item in plan.items}
        if self._nested:  # the nested state DCP's planner flattened, cut to what it plans
            nested = getattr(planner, "original_state_dict", None)
            paths = (getattr(planner, "mappings", None) or {}) if isinstance(nested, dict) else {}
            keys = _Keys()
            into = _part(nested if paths else target, paths, wanted, keys)
            found = self.checkpointer.restore({TREE: into}, self.loaded, strict=False)
        else:
            paths, keys = {}, _Keys()
            into = {fqn: value for fqn, value in target.items() if fqn in wanted}
            found = self.checkpointer.restore({STATE: into}, self.loaded, strict=False)
        missing = [m for m in found[1] if m.kind != "unexpected"]
        if missing:
            m = missing[0]
            raise ManifestError(
                f"step {self.loaded} of job {self.checkpointer.job!r} does not fit the state "
                f"loaded into it: {m.path}: {m.kind}: {m.detail}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        for item in plan.items:  # objects: through DCP's planner, which places them
            if item.type == LoadItemType.BYTE_IO:
                fqn = item.dest_index.fqn
                raw = io.BytesIO()
                torch.save(keys.get(into, paths.get(fqn, (fqn,))), raw)
                raw.seek(0)
                planner.load_bytes(item, raw)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return step_of(checkpoint_id) is not None


class _Keys:
    """The keys DCP's planner's paths name: a mapping's key as text (``"0"`` for an optimizer
    state's ``0``), each mapping's keys indexed by their text on first need."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Mapping, dict[str, Any]]] = {}

    def __call__(self, mapping: Mapping, key: Any) -> Any:
        if key in mapping or type(key) is not str:
            return key
        known = self._known.get(id(mapping))
        if known is None or known[0] is not mapping:
            known = self._known[id(mapping)] = (mapping, {str(k): k for k in mapping})
        return known[1].get(key, key)

    def get(self, state: Any, path: tuple) -> Any:
        for key in path:
            state = state[self(state, key) if isinstance(state, Mapping) else key]
        return state


def _part(state: Mapping, paths: Mapping[str, tuple], wanted: set[str], keys: _Keys) -> dict:
    """What of nested ``state`` holds the flattened keys ``wanted`` (``paths``: each key's path
    of keys in ``state``, as DCP's planner recorded it; a key without one is a key of
    ``state``): new mappings with only the keys on the way to a wanted value, which hold the
    state's own values. A list on the way is taken whole, as the snapshot's tree holds it."""
    part: dict[Any, Any] = {}
    for fqn in wanted:
        path = paths.get(fqn, (fqn,))
        src, dst = state, part
        for key in path[:-1]:
            key = keys(src, key)
            src = src[key]
            if not isinstance(src, Mapping):
                dst[key] = src
                break
            dst = dst.setdefault(key, {})
        else:
            key = keys(src, path[-1])
            dst[key] = src[key]
    return part


def _size(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _metadata(text: str, step: int) -> dict[str, Any]:
    """DCP's metadata of a saved step, from the description its ranks saved (untrusted: read
    back from memory or a tier, so checked before DCP plans with it)."""

    def bad(why: str) -> ManifestError:
        return ManifestError(f"step {step}: the DCP description it holds is damaged ({why})")

    try:
        held = json.loads(text)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if not isinstance(held, dict):
        raise bad("not a mapping")
    out: dict[str, Any] = {}
    for fqn, entry in held.items():
        if not isinstance(entry, dict) or entry.get("t") not in ("tensor", "bytes"):
            raise bad(f"{fqn!r}: no kind")
        if entry["t"] == "bytes":
            out[fqn] = BytesStorageMetadata()
            continue
        size, dtype = entry.get("size"), _DTYPES.get(entry.get("dtype"))
        if (not isinstance(size, list) or dtype is None
                or not all(type(n) is int and n >= 0 for n in size)):  # fmt: skip
            raise bad(f"{fqn!r}: size {size!r}, dtype {entry.get('dtype')!r}")
        shape = torch.Size(size)
        chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=shape)
        out[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), shape, [chunk])
    return out
