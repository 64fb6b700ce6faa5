"""Turn a user's state into a JSON tree plus a flat list of arrays, and lay them out in bytes."""

from __future__ import annotations

import contextlib
import functools
import gc
import operator
import pickle
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..format.manifest import MAX_TREE_DEPTH, Entry, ShardInfo, dtype_name, encode_scalar
from ..format.slot import align
from .state_dicts import state_dict_of


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor. Whoever made one imported ``torch.distributed.tensor``:
    it is looked up, never imported here, for importing it costs every process of flashckpt
    (trainer, agent, command line) about a second at start."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(value: Any) -> bool:
    # What isinstance(value, Stateful) says, without the protocol machinery's cost on every
    # node of every save.
    return (
        not isinstance(value, (torch.Tensor, Mapping))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


@dataclass(slots=True)
class Leaf:
    """An array to store: its path, kind, the source tensor and DTensor shard info."""

    path: str
    kind: str  # "tensor" | "ndarray" | "pickle"
    tensor: torch.Tensor
    shard: ShardInfo | None = None
    replicated: bool = False  # the same bytes on every rank of the job's replica group
    replicas: tuple[int, int, int] | None = None  # its own replica group (``Sharded``'s)


BLOCK = ("block",)
"""The placements of a ``Sharded`` leaf's shard: a block named by its global tensor, which
any rank may hold (a restore at another layout finds it in whichever old rank's snapshot)."""


@dataclass(frozen=True, slots=True)
class Sharded:
    """A block of a global tensor that this rank holds where no DTensor says so (a
    Megatron-Core ``ShardedTensor``): ``local`` is what is copied, ``shard`` where it sits.
    Saved and restored as a DTensor's local shard is: in place, or assembled from the old
    shards when the block is another one (resharding)."""

    local: torch.Tensor
    shard: ShardInfo
    replicas: tuple[int, int, int] | None = None
    """range(start, stop, step) of the ranks holding the same bytes of this block (this one
    included), where there are others: a tier stores the block once for them all."""


def is_shard_leaf(value: object) -> bool:
    """A DTensor or a ``Sharded``: a tensor leaf whose shard info is recorded."""
    return type(value) is Sharded or is_dtensor(value)


def join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _shard_info(t: Any) -> ShardInfo:
    return _shard_info_of(tuple(t.shape), t.device_mesh, tuple(t.placements))


@functools.lru_cache(maxsize=1 << 14)
def _shard_info_of(shape: tuple[int, ...], mesh: Any, placements: tuple) -> ShardInfo:
    """Computed once per layout, not on every save (a few ms for a model's DTensors)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return ShardInfo(
        global_shape=shape,
        global_offset=tuple(int(o) for o in offset),
        placements=tuple(repr(p) for p in placements),
        mesh_shape=tuple(mesh.shape),
    )


def tensor_source(t: Any, path: str) -> tuple[torch.Tensor, ShardInfo | None]:
    """The plain tensor whose bytes represent ``t`` on this rank, and its shard info."""
    shard = None
    if type(t) is Sharded:
        shard, t = t.shard, t.local
    elif is_dtensor(t):
        shard = _shard_info(t)
        with torch.no_grad():  # a parameter's own (keep_vars): no autograd node for its block
            t = t.to_local()
    if t.layout != torch.strided:
        raise TypeError(
            f"{path}: tensors of layout {t.layout} are not supported; densify them first"
        )
    if t.is_quantized or t.is_meta:
        raise TypeError(
            f"{path}: {'quantized' if t.is_quantized else 'meta'} tensors cannot be saved"
        )
    return t.detach(), shard


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: the common leaves, checked first
_SCALARS = (type(None), bool, int, str)  # exact types whose encoding is the value itself


def _plain_leaf(t: torch.Tensor, path: str) -> torch.Tensor:
    """The tensor to copy for a plain (non-DTensor) tensor leaf, checked as tensor_source does."""
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        return tensor_source(t, path)[0]  # raises, naming what is wrong
    return t.detach() if t.requires_grad else t


class Flattener:
    """Walks a state once, producing the manifest tree and the leaves to copy.

    The walk runs on every save, over every tensor of the state (thousands on a real rank),
    so the common cases go first: plain tensors and the exact built-in containers are
    dispatched on their type before any ABC check, and a dict whose values are all plain
    tensors (a module's ``state_dict()``) is done in one tight loop."""

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []

    def _leaf(
        self, kind: str, path: str, tensor: torch.Tensor, shard: ShardInfo | None = None
    ) -> dict:
        self.leaves.append(Leaf(path, kind, tensor, shard))
        return {"t": kind, "i": len(self.leaves) - 1}

    def node(self, value: Any, path: str, depth: int = 0) -> Any:
        cls = type(value)
        if cls in _PLAIN:
            return self._leaf("tensor", path, _plain_leaf(value, path))
        if cls in _SCALARS:
            return value
        if cls is dict:
            return self._mapping(value, path, depth)
        container = isinstance(value, (Mapping, list, tuple)) or is_stateful(value)
        if container and depth >= MAX_TREE_DEPTH:  # a restore would refuse it: fail now
            _too_deep(path)
        if cls is Sharded and value.replicas is not None:
            source, shard = tensor_source(value, path)
            out = self._leaf("tensor", path, source, shard)
            self.leaves[-1].replicated, self.leaves[-1].replicas = True, value.replicas
            return out
        if isinstance(value, torch.Tensor) or cls is Sharded:
            source, shard = tensor_source(value, path)
            return self._leaf("tensor", path, source, shard)
        if isinstance(value, np.ndarray) and value.dtype.hasobject is False:
            return self._leaf("ndarray", path, torch.from_numpy(np.ascontiguousarray(value)))
        if isinstance(value, Mapping):
            return self._mapping(value, path, depth)
        if isinstance(value, list):
            return {
                "t": "list",
                "items": [self.node(v, join(path, i), depth + 1) for i, v in enumerate(value)],
            }
        if type(value) is tuple:
            return {
                "t": "tuple",
                "items": [self.node(v, join(path, i), depth + 1) for i, v in enumerate(value)],
            }
        if is_stateful(value):
            return {"t": "stateful", "v": self.node(state_dict_of(value), path, depth + 1)}
        try:
            return encode_scalar(value)
        except TypeError:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            return self._leaf("pickle", path, torch.frombuffer(bytearray(blob), dtype=torch.uint8))

    def _mapping(self, value: Mapping, path: str, depth: int) -> dict:
        if depth >= MAX_TREE_DEPTH:
            _too_deep(path)
        keys = list(value)
        values = list(value.values())
        if set(map(type, values)) <= _PLAIN_SET and set(map(type, keys)) <= _KEY_SET:
            # All plain tensors under str or int keys: no recursion, no per-value dispatch.
            leaves, first = self.leaves, len(self.leaves)
            prefix = f"{path}/" if path else ""
            items = []
            for n, (k, t) in enumerate(zip(keys, values, strict=True)):
                at = f"{prefix}{k}"
                leaves.append(Leaf(at, "tensor", _plain_leaf(t, at)))
                items.append([k, {"t": "tensor", "i": first + n}])
            return {"t": "dict", "items": items}
        return {
            "t": "dict",
            "items": [
                [self.key(k, path), self.node(v, join(path, k), depth + 1)]
                for k, v in zip(keys, values, strict=True)
            ],  # fmt: skip
        }

    def key(self, key: Any, path: str) -> Any:
        if type(key) is tuple:
            return {"t": "tuple", "items": [self.key(k, path) for k in key]}
        try:
            return encode_scalar(key)
        except TypeError:
            raise TypeError(
                f"{path}: dict key {key!r} of type {type(key).__name__} cannot be saved"
            ) from None


def _too_deep(path: str) -> None:
    raise TypeError(
        f"{path}: the state nests containers deeper than {MAX_TREE_DEPTH} levels, "
        "which no snapshot may hold; flatten that part of the state"
    )


_PLAIN_SET = frozenset(_PLAIN)
_KEY_SET = frozenset((str, int))


def flatten(
    state: Mapping[str, Any], replicated: frozenset[str] = frozenset()
) -> tuple[Any, list[Leaf]]:
    """The manifest tree of ``state`` and its leaves; the tensors under the top-level keys
    in ``replicated`` are marked as the same on every rank of the replica group."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> value, got {type(state).__name__}")
    with paused_gc():
        f = Flattener()
        items = []
        for key, value in state.items():
            first = len(f.leaves)
            items.append([f.key(key, ""), f.node(value, join("", key), 1)])
            if key in replicated:
                for leaf in f.leaves[first:]:
                    leaf.replicated = leaf.replicas is not None or (
                        leaf.kind == "tensor" and leaf.shard is None
                    )
    return {"t": "dict", "items": items}, f.leaves


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No collection in the block (nestable). A save's walk and layout check allocate a few
    objects per tensor that all live on: at thousands of tensors, the collections that set
    off cost more than the work itself."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every leaf in a slot's data region, for one state structure."""

    signature: tuple
    entries: tuple[Entry, ...]
    data_len: int
    n_chunks: int
    replicated: bool = False  # some entry is the same on every rank of the replica group


_PATH_KIND = operator.attrgetter("path", "kind", "shard", "replicated", "replicas")
_META = operator.attrgetter("dtype", "shape", "device")


def signature(leaves: list[Leaf]) -> tuple:
    """What the layout of ``leaves`` depends on: each leaf's path, kind, shard and replica
    mark, and its tensor's dtype, shape and device. Built and compared on every save, so
    from C-level maps (a tuple per leaf, no Python loop)."""
    return (
        list(map(_PATH_KIND, leaves)),
        list(map(_META, map(_TENSOR, leaves))),
    )


_TENSOR = operator.attrgetter("tensor")


def plan_layout(leaves: list[Leaf], chunk_size: int, cached: Layout | None = None) -> Layout:
    """Offsets for ``leaves``; ``cached`` is returned as is while the structure is unchanged."""
    sig = signature(leaves)
    if cached is not None and cached.signature == sig:
        return cached
    entries = []
    offset = chunk = 0
    for lf in leaves:
        t = lf.tensor
        nbytes = t.numel() * t.element_size()
        entry = Entry(
            path=lf.path, kind=lf.kind, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
            offset=offset, nbytes=nbytes, first_chunk=chunk, shard=lf.shard, device=t.device.type,
            replicated=lf.replicated, replicas=lf.replicas,
        )  # fmt: skip
        entries.append(entry)
        chunk += entry.n_chunks(chunk_size)
        offset = align(offset + nbytes)
    return Layout(sig, tuple(entries), offset, chunk, any(e.replicated for e in entries))


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype tensors, as a byte copy when it can be.

    Bytes need no per-dtype kernel (sub-byte and bit dtypes have none) and copy at memcpy
    speed; strided sources and lazily conjugated/negated views take the typed path.
    """
    if (
        src.is_contiguous() and dst.is_contiguous() and not src.is_conj() and not src.is_neg()
        and not dst.is_conj() and not dst.is_neg() and src.device.type == dst.device.type == "cpu"
    ):  # fmt: skip
        if src.numel():
            dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
    else:
        dst.copy_(src)
