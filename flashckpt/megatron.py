"""Megatron-Core through the flash path: ``state(model, optimizer)`` as one Stateful.

    state = flashckpt.megatron.state(model, optimizer)
    ckpt.restore({"megatron": state})            # at start: the freshest consistent step
    ckpt.save(step, {"megatron": state})         # every step: returns once in shared memory

Megatron-Core describes what each rank holds with ``sharded_state_dict()``: every tensor is a
``ShardedTensor``, a block of a global tensor (its key, global shape and offset, and which
replica it is). The Stateful here turns that description into flashckpt's own: each block is
a tensor leaf with its shard recorded (``Sharded``: global shape and offset, as a DTensor's
shard is), named by its global key (and its layer, for the axes Megatron prepends to stack
layers), so the same tensor has the same name on every rank and at every parallel layout.
A restore into the same layout fills every block in place; into another tensor-, data- or
pipeline-parallel size, each rank's new blocks are assembled from the old ranks' blocks that
overlap them (a block its own snapshot does not hold, a layer another stage held, is found
in the old rank's that does), read from this node's memory when it holds every old rank,
else from a tier that does (``restore/reshard.py``).

The optimizer is a ``torch.optim`` optimizer over the model's parameters (what Megatron's
``FP32Optimizer`` wraps): its per-parameter state gets the sharding of its parameter, as
Megatron's ``optim_state_to_sharding_state`` gives it; step counts and hyper-parameters are
stored as they are (one step count where all agree, the usual case, so it fits any
layout). A fresh optimizer gets its state created before a restore fills it.

Replicas (the same block on several ranks: data-parallel copies, and the blocks tensor
parallelism does not split) are found once, at the first save or restore (every rank makes
it: one gather of each rank's block names and offsets). Each rank still snapshots every block
it holds into its node's memory, so it restores from there without reading another's; a tier
stores a replicated block once for its ranks (once per node in a node-local tier), and the
other ranks' copies point at it, as DDP replicas are stored. The ranks holding one block
must be evenly spaced (a range), as Megatron's parallel groups are; a block held by ranks
that are not is stored by each of them. Not supported (a clear error): blocks that are
slices of a flattened tensor (``flattened_range``, Megatron's ``DistributedOptimizer``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from . import group
from .errors import FlashCkptError
from .format.manifest import ShardInfo
from .restore import optim_state
from .snapshot.flatten import BLOCK, Sharded
from .snapshot.replicas import Replicas, as_range

try:
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
    )
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "flashckpt.megatron needs Megatron-Core: pip install 'flashckpt[megatron]'"
    ) from exc


def state(model: Any, optimizer: torch.optim.Optimizer | None = None) -> MegatronState:
    """The Stateful to save and restore: ``model`` (a Megatron-Core module, or the list of
    a virtual pipeline's model chunks) and its ``optimizer``."""
    return MegatronState(model, optimizer)


def block_name(st: Any) -> str:
    """The name of a ShardedTensor's block, the same on every rank and layout: its global
    key, and where there are prepended (layer-stacking) axes, its index on each and their
    sizes (``decoder.layers.mlp.linear_fc1.weight@1/2``: layer 1 of 2)."""
    n = getattr(st, "prepend_axis_num", 0)
    if not n:
        return st.key
    at, of = st.global_offset[:n], st.global_shape[:n]
    return f"{st.key}@{'.'.join(map(str, at))}/{'.'.join(map(str, of))}"


def _identity(st: ShardedTensor) -> int:
    """A ShardedTensor's block as a number: its key, global offset and local shape, which
    every rank holding the same block gives alike."""
    text = f"{st.key}|{tuple(st.global_offset)}|{tuple(st.local_shape)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def replica_groups(sharded: Any) -> dict[int, Replicas]:
    """The replica group of each block of this rank's ``sharded`` state held by other ranks
    too, by ``_identity``: the ranks holding it, where they are evenly spaced. Collective:
    every rank of the job calls it (nothing is gathered outside a process group)."""
    mine = sorted(
        {_identity(st) for _, st in _blocks(sharded, "") if isinstance(st, ShardedTensor)}
    )
    everyone = group.gather(mine)
    if len(everyone) < 2:
        return {}
    holders: dict[int, list[int]] = {i: [] for i in mine}
    for rank, theirs in enumerate(everyone):
        for i in theirs:  # type: ignore[union-attr]
            if i in holders:
                holders[i].append(rank)
    return {i: r for i, ranks in holders.items() if len(ranks) > 1 and (r := as_range(ranks))}


def to_leaf(st: ShardedTensor, groups: Mapping[int, Replicas] | None = None,
            of: ShardedTensor | None = None) -> Sharded:  # fmt: skip
    """The tensor leaf of a ShardedTensor: its data, and where it sits in the global tensor
    less the prepended axes (one block a layer); with ``groups``, the replica group of its
    block (or of ``of``'s: an optimizer state's block is its parameter's)."""
    if st.flattened_range is not None:
        raise FlashCkptError(
            f"{st.key}: a block that is a slice of a flattened tensor (flattened_range, as "
            "Megatron's DistributedOptimizer makes) is not supported by flashckpt.megatron; "
            "use a torch.optim optimizer over the model's parameters"
        )
    n = st.prepend_axis_num
    data = st.data
    if data is None or tuple(data.shape) != tuple(st.local_shape):
        raise FlashCkptError(
            f"{st.key}: the block holds {None if data is None else tuple(data.shape)}, its "
            f"ShardedTensor says {tuple(st.local_shape)}"
        )
    info = ShardInfo(
        global_shape=tuple(st.global_shape[n:]),
        global_offset=tuple(st.global_offset[n:]),
        placements=BLOCK,
        mesh_shape=tuple(st.axis_fragmentations[n:]) if st.axis_fragmentations else (),
    )
    return Sharded(data, info, groups.get(_identity(of or st)) if groups else None)


def _blocks(sharded: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(name, value) of every block of a sharded state dict, in its order; values of
    anything else that Megatron keeps (plain values) under their path."""
    if isinstance(sharded, Mapping):
        for k, v in sharded.items():
            yield from _blocks(v, f"{where}/{k}" if where else str(k))
    elif isinstance(sharded, list):
        for i, v in enumerate(sharded):
            yield from _blocks(v, f"{where}/{i}")
    elif isinstance(sharded, ShardedTensor):
        yield block_name(sharded), sharded
    elif isinstance(sharded, ShardedObject):
        yield f"{sharded.unique_key}", sharded
    elif isinstance(sharded, LocalNonpersistentObject):
        return  # this rank's own, never stored (Megatron keeps it out of checkpoints too)
    else:
        yield where, sharded


def leaves(
    sharded: Any, where: str, groups: Mapping[int, Replicas] | None = None
) -> dict[str, Any]:
    """A sharded state dict's tensors as flashckpt's state: every block a ``Sharded`` leaf
    under its ``block_name``, every plain value under its name (objects: ``objects()``);
    ``where`` names it in errors."""
    out: dict[str, Any] = {}
    for name, value in _blocks(sharded, ""):
        if name in out:
            raise FlashCkptError(
                f"{where}: two blocks on this rank are named {name!r}; flashckpt.megatron "
                "names a block by its key and layer, which must be unique on a rank"
            )
        if isinstance(value, ShardedTensor):
            out[name] = to_leaf(value, groups)
        elif isinstance(value, ShardedObject):
            continue  # objects() holds them
        elif isinstance(value, ShardedTensorFactory):  # pragma: no cover - applied before
            raise FlashCkptError(f"{name}: a ShardedTensorFactory left unapplied")
        else:
            out[name] = value
    return out


class _Objects(dict):
    """A rank's ShardedObjects (a layer's extra state), by their unique key. ``may_lack``:
    a snapshot taken at another pipeline layout holds other layers' objects, so a restore
    leaves those it lacks as they are (and ignores those this rank no longer holds)."""

    may_lack = True


def objects(sharded: Any) -> _Objects:
    """The ShardedObjects of a sharded state dict: unique key -> data."""
    return _Objects(
        (name, value.data)
        for name, value in _blocks(sharded, "")
        if isinstance(value, ShardedObject)
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


class MegatronState:
    """A Megatron-Core model and optimizer as one Stateful (see the module docstring)."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer | None = None):
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise FlashCkptError(
                f"flashckpt.megatron takes a torch.optim optimizer over the model's parameters, "
                f"not {type(optimizer).__name__}; pass the optimizer it wraps (.optimizer)"
            )
        self.optimizer = optimizer
        self._groups: dict[int, Replicas] | None = None

    @property
    def groups(self) -> dict[int, Replicas]:
        """The replica groups of the model's blocks, gathered on first use: the first save or
        restore, which every rank makes."""
        if self._groups is None:
            self._groups = replica_groups(self._model_sharded())
        return self._groups

    # ---- the model ----------------------------------------------------------------------
    def _model_sharded(self) -> dict:
        """Each chunk's sharded state dict with its factories applied (as Megatron-LM makes
        them: ``model0``, ``model1``... for the chunks of a virtual pipeline)."""
        if len(self.chunks) == 1:
            sharded = {"model": self.chunks[0].sharded_state_dict()}
        else:
            from megatron.core import parallel_state

            sharded = {}
            for i, chunk in enumerate(self.chunks):
                parallel_state.set_virtual_pipeline_model_parallel_rank(i)
                sharded[f"model{i}"] = chunk.sharded_state_dict()
        apply_factories(sharded)
        return sharded

    def state_dict(self) -> dict[str, Any]:
        sharded = self._model_sharded()
        out: dict[str, Any] = {
            "model": leaves(sharded, "model", self.groups),
            "objects": objects(sharded),
        }
        if self.optimizer is not None:
            out["optimizer"] = self._optimizer_dict(sharded)
        return out

    # ---- the optimizer ------------------------------------------------------------------
    def _optimizer_dict(self, model_sharded: dict) -> dict[str, Any]:
        opt = self.optimizer
        assert opt is not None
        sd = opt.state_dict()
        sd["state"] = {i: dict(st) for i, st in sd["state"].items()}  # its dicts are the live ones
        params = optim_state.params_in_order(opt)
        ids = get_param_id_to_sharded_param_map(model_sharded, params)
        steps = {i: st.pop("step") for i, st in sd["state"].items() if "step" in st}
        optim_state_to_sharding_state(sd, ids)
        state: dict[str, Any] = {}
        for i, per_key in sd["state"].items():
            for sharded in per_key.values():
                state[block_name(sharded)] = to_leaf(sharded, self.groups, ids[i])
        counts = list(steps.values())
        if counts and all(_same(c, counts[0]) for c in counts):
            step: Any = counts[0]  # one count (the usual case): the same at any layout
        else:
            step = {block_name(ids[i]): c for i, c in steps.items()}
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": len(g["params"].obj)}
            for g in sd["param_groups"]
        ]
        return {"state": state, "step": step, "param_groups": groups}

    def before_restore(self, saved: Collection[str]) -> list[torch.optim.Optimizer]:
        """Give a fresh optimizer its state (a step at learning rate 0 on zero gradients,
        which changes no parameter) for the restore to fill in place, resharded where it
        must be, if the snapshot holds one (``saved``: its keys); the optimizers given state
        (cleared again if the restore is refused)."""
        opt = self.optimizer
        if opt is None or opt.state or "optimizer" not in saved:
            return []
        n = len(optim_state.params_in_order(opt))
        return [opt] if optim_state.create_state(opt, range(n)) else []

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Put back what a restore does not fill in place: the model's objects (extra
        states), and the optimizer's step counts and hyper-parameters."""
        sharded = self._model_sharded()
        if sd.get("objects"):
            self._load_objects(sharded, sd["objects"])
        if self.optimizer is not None and "optimizer" in sd:
            self._load_optimizer(sharded, sd["optimizer"])

    def _load_objects(self, sharded: dict, objects: dict[str, Any]) -> None:
        """Each chunk's ``load_state_dict`` with the restored objects under their local keys
        (the key each has in the chunk's state dict)."""
        for i, chunk in enumerate(self.chunks):
            part = sharded["model" if len(self.chunks) == 1 else f"model{i}"]
            local = {
                k: objects[v.unique_key]
                for k, v in part.items()
                if isinstance(v, ShardedObject) and v.unique_key in objects
            }
            if local:
                chunk.load_state_dict(local, strict=False)

    def _load_optimizer(self, model_sharded: dict, saved: Mapping[str, Any]) -> None:
        opt = self.optimizer
        assert opt is not None
        params = optim_state.params_in_order(opt)
        ids = get_param_id_to_sharded_param_map(model_sharded, params)
        steps = saved.get("step", {})
        for i, sharded in ids.items():
            per_param = steps.get(block_name(sharded)) if isinstance(steps, dict) else steps
            if per_param is None or "step" not in opt.state.get(params[i], {}):
                continue
            held = opt.state[params[i]]["step"]
            if isinstance(held, torch.Tensor):
                held.copy_(torch.as_tensor(per_param, dtype=held.dtype))
            else:
                opt.state[params[i]]["step"] = per_param
        groups = saved.get("param_groups", [])
        if len(groups) != len(opt.param_groups):
            raise FlashCkptError(
                f"the snapshot's optimizer has {len(groups)} parameter groups, this one "
                f"{len(opt.param_groups)}; build the optimizer as the saving run did"
            )
        for pg, kept in zip(opt.param_groups, groups, strict=True):
            for k, v in kept.items():
                if k != "params":
                    pg[k] = v
