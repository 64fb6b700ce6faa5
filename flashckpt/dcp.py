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

What DCP's planner plans stays DCP's: the state dict is flattened by its planner as for any
storage, and ``Reader`` answers ``read_metadata`` with the saved step's tensors (global size,
dtype) and objects, so DCP checks what it loads against what was saved as it does for files.
The bytes themselves move the flashckpt way: each rank saves what it holds (DCP's plan would
have one rank write a replicated tensor for all; here every rank keeps its own copy in its own
memory, so a restart at the same size reads nothing across the network), and a load fills the
target state in place, resharding DTensor shards where the world size or the mesh changed, as
``Checkpointer.restore`` does.

Values that are not tensors or plain scalars are pickled by flashckpt's save and refused at
load unless the Checkpointer allows pickles (``allow_pickle``): what is read back is untrusted.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
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
from torch.distributed.checkpoint.storage import WriteResult

from .checkpointer import Checkpointer
from .errors import CheckpointNotFoundError, ConfigError, ManifestError

__all__ = ["Reader", "Writer", "step_of"]

STATE = "dcp"  # the saved state: {STATE: DCP's flattened state dict, METADATA: what it holds}
METADATA = "dcp_metadata"
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


class Writer(StorageWriter):
    """DCP's storage writer that saves through ``checkpointer`` (see the module doc)."""

    def __init__(self, checkpointer: Checkpointer):
        super().__init__()
        self.checkpointer = checkpointer
        self.step: int | None = None
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        self.step = _step(checkpoint_id, "Writer")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Before DCP drops replicated items from all but one rank: what this rank holds.
        return dataclasses.replace(plan, storage_data=_describe(plan.items))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        held: dict[str, dict] = {}
        for plan in plans:
            held.update(plan.storage_data or {})
        text = json.dumps(held, sort_keys=True)
        return [dataclasses.replace(plan, storage_data=text) for plan in plans]

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
        if self.step is None:
            raise ConfigError(
                "flashckpt.dcp.Writer: no step to save as; pass it as the checkpoint_id, e.g. "
                "dcp.save(state, checkpoint_id=step, storage_writer=writer)"
            )
        held = plan.storage_data if isinstance(plan.storage_data, str) else json.dumps(
            _describe(plan.items), sort_keys=True)  # fmt: skip
        self.checkpointer.save(self.step, {STATE: dict(state), METADATA: held})
        results = [WriteResult(index=item.index, size_in_bytes=_size(item), storage_data=None)
                   for item in plan.items]  # fmt: skip
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the step commits once every rank's snapshot is stored."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return step_of(checkpoint_id) is not None


class Reader(StorageReader):
    """DCP's storage reader that loads through ``checkpointer`` (see the module doc)."""

    def __init__(self, checkpointer: Checkpointer, step: int | None = None):
        super().__init__()
        self.checkpointer = checkpointer
        self.step = step
        self.loaded: int | None = None  # the step read_metadata found

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _step(checkpoint_id, "Reader")

    def read_metadata(self, *args: Any) -> Metadata:
        # No ``**kwargs``: DCP would take that as asking again, rank by rank, after a failure.
        held = {METADATA: ""}
        found = self.checkpointer.restore(held, self.step, strict=False)
        step = found[0] if isinstance(found, tuple) else found
        if step is None or not held[METADATA]:
            raise CheckpointNotFoundError(
                f"job {self.checkpointer.job!r} holds no step saved through flashckpt.dcp"
                + (f" at step {self.step}" if self.step is not None else "")
                + "; `flashckpt ls` shows what it holds"
            )
        self.loaded = step
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
                raw = io.BytesIO()
                torch.save(into[item.dest_index.fqn], raw)
                raw.seek(0)
                planner.load_bytes(item, raw)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return step_of(checkpoint_id) is not None


def _describe(items: list) -> dict[str, dict]:
    """What a rank's plan holds, by name: each tensor's global size and dtype, or an object."""
    held: dict[str, dict] = {}
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            held[fqn] = {"t": "bytes"}
        else:
            data = item.tensor_data
            held[fqn] = {"t": "tensor", "size": list(data.size),
                         "dtype": str(data.properties.dtype).removeprefix("torch.")}  # fmt: skip
    return held


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
