"""Load a snapshot into a live state, in place.

Two phases: ``plan`` walks the snapshot's tree next to the target state and records every
mismatch (keys, shapes, dtypes, pickled entries not allowed) without touching anything; only
if there is none does ``run`` copy the bytes, verifying each entry's checksums first.
"""

from __future__ import annotations

import operator
import pickle
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain, compress, repeat
from typing import Any

import numpy as np
import torch

from ..errors import ManifestError, PickleNotAllowedError, StateMismatchError
from ..format.manifest import Entry, Manifest, ShardInfo, decode_scalar, dtype_from_name, dtype_name
from ..snapshot import device
from ..snapshot.flatten import (
    BLOCK,
    Sharded,
    copy_into,
    is_dtensor,
    is_stateful,
    join,
    tensor_source,
)
from ..snapshot.state_dicts import state_dict_of, unwrapped, wrapper_free
from ..snapshot.steady import Walked
from . import optim_state
from .entry_copy import Source
from .reshard import Resharder

Producer = Callable[["Source"], Any]
_GRAD = operator.attrgetter("grad")
_NOT_NONE = partial(operator.is_not, None)
MAX_LISTED = 10


@dataclass(frozen=True)
class Mismatch:
    path: str
    kind: str  # missing | unexpected | shape | dtype | type | length | shard
    detail: str


def _decode_key(node: Any) -> Any:
    if isinstance(node, dict):
        if node.get("t") == "tuple":
            return tuple(_decode_key(k) for k in node["items"])
        return decode_scalar(node)
    return node


class Planner:
    """Matches a snapshot's tree to a target, collecting every mismatch, and builds the loader.

    ``strict=False`` leaves whatever does not match as it is (the mismatches say what) instead
    of refusing; ``key_map`` renames the snapshot's string dict keys (None drops one);
    ``assemble`` builds a DTensor entry with no target as the full tensor, from every
    rank's shard (through ``resharder``).
    """

    def __init__(
        self, manifest: Manifest, allow_pickle: bool, resharder: Resharder | None = None,
        strict: bool = True, key_map: Callable[[str], str | None] | None = None,
        assemble: bool = False,
    ) -> None:  # fmt: skip
        self.m = manifest
        self.allow_pickle = allow_pickle
        self.resharder = resharder  # DTensors laid out otherwise than saved are asked of it
        self.strict, self.key_map, self.assemble = strict, key_map, assemble
        self.mismatches: list[Mismatch] = []
        self.pickled: list[str] = []
        self.replaced = 0  # leaves that are not in-place tensor copies
        self.created: list[Any] = []  # fresh optimizers given state to load into
        self._canon: dict[int, tuple[Mapping, dict[str, str]]] = {}  # id -> (dict, key index)

    def entry(self, node: dict) -> Entry:
        try:
            return self.m.entries[node["i"]]
        except (KeyError, IndexError, TypeError):
            raise ManifestError(f"tree node {node!r} names no entry of the manifest") from None

    # ---- values with no target: build them from the snapshot -------------------------
    def fresh(self, node: Any, path: str) -> Producer:
        self.replaced += 1
        if not isinstance(node, dict):
            return lambda src: node
        tag = node.get("t")
        cs = self.m.chunk_size
        if tag == "tensor":
            e = self.entry(node)
            if self.assemble and e.shard is not None and self.resharder is not None:
                return self._full(e)
            return lambda src: src.view(e, cs).clone()
        if tag == "ndarray":
            e = self.entry(node)
            return lambda src: src.view(e, cs).numpy().copy()
        if tag == "pickle":
            e = self.entry(node)
            if not self.allow_pickle:
                self.pickled.append(e.path)
            return lambda src: pickle.loads(src.view(e, cs).numpy().tobytes())  # noqa: S301
        if tag == "dict":
            items = [
                (_decode_key(k), self.fresh(v, join(path, _decode_key(k))))
                for k, v in node["items"]
            ]
            return lambda src: {k: p(src) for k, p in items}
        if tag in ("list", "tuple"):
            kids = [self.fresh(v, join(path, i)) for i, v in enumerate(node["items"])]
            kind = list if tag == "list" else tuple
            return lambda src: kind(p(src) for p in kids)
        if tag == "stateful":
            return self.fresh(node["v"], path)
        value = decode_scalar(node)
        return lambda src: value

    def _full(self, e: Entry) -> Producer:
        """The whole tensor of DTensor entry ``e``, from every rank's shard."""
        assert e.shard is not None and self.resharder is not None
        resharder, shape = self.resharder, tuple(e.shard.global_shape)
        problem = resharder.want(e.path, e, _whole(e.shard), shape)
        if problem:
            self.mismatches.append(Mismatch(e.path, "shard", problem))
        return lambda src: resharder.block(e.path)

    def _leave(self, path: str, kind: str, detail: str, target: Any) -> Producer | None:
        """Record a mismatch; outside strict mode, a loader that leaves ``target`` as it is."""
        self.mismatches.append(Mismatch(path, kind, detail))
        return None if self.strict else (lambda src: target)

    # ---- values with a target: match and fill in place -------------------------------
    def match(self, node: Any, target: Any, path: str, lenient: bool) -> Producer:
        tag = node.get("t") if isinstance(node, dict) else None
        if tag == "stateful" or is_stateful(target):
            return self._stateful(node, target, path, lenient)
        if tag == "tensor" and (isinstance(target, torch.Tensor) or type(target) is Sharded):
            return self._tensor(self.entry(node), target, path)
        if tag == "ndarray" and isinstance(target, np.ndarray):
            return self._ndarray(self.entry(node), target, path, lenient)
        if tag == "dict" and isinstance(target, Mapping):
            return self._dict(node, target, path, lenient)
        if tag in ("list", "tuple") and isinstance(target, (list, tuple)):
            return self._sequence(node, target, path, lenient)
        # A scalar in the state is a value the snapshot replaces; tensors and containers are
        # structure the snapshot must match.
        if not lenient and isinstance(target, (torch.Tensor, np.ndarray, Mapping, list, tuple)):
            detail = f"{_kind(node)} in snapshot, {type(target).__name__} in state"
            return self._leave(path, "type", detail, target) or self.fresh(node, path)
        return self.fresh(node, path)

    def _stateful(self, node: Any, target: Any, path: str, lenient: bool) -> Producer:
        if not (isinstance(node, dict) and node.get("t") == "stateful") or not is_stateful(target):
            self.mismatches.append(
                Mismatch(
                    path, "type", f"{_kind(node)} in snapshot, {type(target).__name__} in state"
                )
            )
            return lambda src: target
        given, target = target, unwrapped(target)  # a wrapper's state is its module's
        ready = getattr(target, "before_restore", None)
        if callable(ready):  # a door's Stateful readies what is filled (an optimizer's state)
            self.created.extend(ready(_saved_keys(node["v"])))
        indices = _state_indices(node["v"])
        fresh = optim_state.needs_state(target, indices, device.runtime().is_device_tensor)
        if fresh and optim_state.create_state(target, indices):
            self.created.append(target)
        template = state_dict_of(target)
        # A module's keys are its contract; an optimizer fills its state lazily, so a fresh one
        # has none of the keys the snapshot holds and its own load_state_dict judges them.
        strict = isinstance(target, torch.nn.Module)
        before = self.replaced
        inner = self.match(node["v"], template, path, lenient=not strict)
        needs_load = not strict or self.replaced != before

        def produce(src: Source) -> Any:
            finish_stateful(target, inner(src), needs_load, src)
            return given

        return produce

    def _tensor(self, e: Entry, target: torch.Tensor, path: str) -> Producer:
        local, shard = tensor_source(target, path)
        if type(target) is Sharded:
            dst = target.local
        else:
            dst = target.to_local() if is_dtensor(target) else target
        if shard is not None and e.shard is not None and shard != e.shard:
            return self._resharded(e, target, dst, shard, path)
        if (shard is None) != (e.shard is None) and tuple(e.shape) != tuple(local.shape):
            # Sharded on one side only (FSDP2 saved and a module that is not sharded restored,
            # or the reverse), where the whole tensor is what the other side holds.
            if shard is None and tuple(e.shard.global_shape) == tuple(local.shape):
                return self._resharded(e, target, dst, _whole(e.shard), path)
            if (shard is not None and tuple(e.shape) == tuple(shard.global_shape)
                    and e.kind == "tensor" and e.dtype == dtype_name(dst.dtype)):  # fmt: skip
                return self._block_of_whole(e, target, dst, shard)
        before = len(self.mismatches)
        if e.kind != "tensor":
            self.mismatches.append(Mismatch(path, "type", f"{e.kind} in snapshot, tensor in state"))
        if e.dtype != str(local.dtype).removeprefix("torch."):
            self.mismatches.append(
                Mismatch(path, "dtype", f"{e.dtype} in snapshot, {local.dtype} in state")
            )
        if tuple(e.shape) != tuple(local.shape):
            self.mismatches.append(
                Mismatch(
                    path, "shape", f"{tuple(e.shape)} in snapshot, {tuple(local.shape)} in state"
                )
            )
        if len(self.mismatches) > before and not self.strict:
            return lambda src: target
        cs = self.m.chunk_size

        def produce(src: Source) -> Any:
            src.copy_to(dst, e, cs)
            return target

        return produce

    def _block_of_whole(self, e: Entry, target: torch.Tensor, dst: torch.Tensor,
                        shard: ShardInfo) -> Producer:  # fmt: skip
        """A DTensor's block of a tensor saved whole (a module that is not sharded saved,
        FSDP2 restored): the block copied out of the whole, verified."""
        cs = self.m.chunk_size
        box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset, dst.shape, strict=True))

        def produce(src: Source) -> Any:
            src.copy_block_to(dst, e, cs, box)
            return target

        return produce

    def _resharded(self, e: Entry, target: torch.Tensor, dst: torch.Tensor, shard: ShardInfo,
                   path: str) -> Producer:  # fmt: skip
        """A DTensor whose block differs from the one saved: assembled from the old shards."""
        if e.dtype != dtype_name(dst.dtype):
            problem = f"{e.dtype} in snapshot, {dst.dtype} in state"
        elif self.resharder is None:
            problem = (f"saved as {e.shard}, restoring as {shard}; resharding reads every rank's "
                       "shard from a tier that holds them all (a shared tier)")  # fmt: skip
        else:
            problem = self.resharder.want(path, e, shard, tuple(dst.shape))
        if problem:
            self.mismatches.append(Mismatch(path, "shard", problem))
            return lambda src: target

        def produce(src: Source) -> Any:
            assert self.resharder is not None
            copy_into(dst, self.resharder.block(path))
            return target

        return produce

    def _a_block(self, node: Any) -> bool:
        """Whether ``node`` is a ``Sharded`` block (named by its global tensor)."""
        if not (isinstance(node, dict) and node.get("t") == "tensor"):
            return False
        shard = self.entry(node).shard
        return shard is not None and tuple(shard.placements) == BLOCK

    def _from_others(self, target: Sharded, path: str) -> Producer:
        """A block this rank's snapshot does not hold (at another pipeline layout, another
        rank held it): assembled from the old ranks' snapshots that do."""
        assert self.resharder is not None
        dst = target.local
        self.resharder.want_block(path, dtype_name(dst.dtype), target.shard, tuple(dst.shape))

        def produce(src: Source) -> Any:
            assert self.resharder is not None
            copy_into(dst, self.resharder.block(path))
            return target

        return produce

    def _ndarray(self, e: Entry, target: np.ndarray, path: str, lenient: bool) -> Producer:
        if tuple(target.shape) != tuple(e.shape) or not target.flags.writeable:
            return self.fresh({"t": "ndarray", "i": self.m.entries.index(e)}, path)
        cs = self.m.chunk_size

        def produce(src: Source) -> Any:
            np.copyto(target, src.view(e, cs).numpy(), casting="no")
            return target

        if torch.from_numpy(target[:0].copy()).dtype != dtype_from_name(e.dtype):
            detail = f"{e.dtype} in snapshot, {target.dtype} in state"
            return self._leave(path, "dtype", detail, target) or produce
        return produce

    def _unprefixed(self, key: str, target: Mapping) -> str:
        """``target``'s key for a snapshot's ``key`` that it lacks as written: the same key
        but for the wrappers' prefixes (``wrapper_free``), either way round (a state dict of a
        wrapped module given as a plain dict, or a snapshot saved so); else ``key``."""
        index = self._canon.get(id(target))
        if index is None or index[0] is not target:
            keys = {wrapper_free(k): k for k in target if isinstance(k, str)}
            index = self._canon[id(target)] = (target, keys)
        return index[1].get(wrapper_free(key), key)

    def _dict(self, node: dict, target: Mapping, path: str, lenient: bool) -> Producer:
        items = []
        seen = set()
        for knode, vnode in node["items"]:
            key = _decode_key(knode)
            if self.key_map is not None and isinstance(key, str):
                key = self.key_map(key)
                if key is None:
                    continue
            hit = key in target
            if not hit and isinstance(key, str):  # only a miss looks further
                key = self._unprefixed(key, target)
                hit = key in target
            seen.add(key)
            sub = join(path, key)
            if hit:
                items.append((key, self.match(vnode, target[key], sub, lenient)))
            elif self._a_block(vnode):
                continue  # a block another rank holds at this layout: not this rank's to load
            elif lenient:
                items.append((key, self.fresh(vnode, sub)))
            else:
                self.mismatches.append(Mismatch(sub, "unexpected", "in snapshot, not in state"))
        for key in target:
            if key in seen or getattr(target, "may_lack", False):  # a door's: left as is
                continue
            value = target[key]
            if type(value) is Sharded and value.shard.placements == BLOCK and self.resharder:
                items.append((key, self._from_others(value, join(path, key))))
            else:
                self.mismatches.append(
                    Mismatch(join(path, key), "missing", "in state, not in snapshot")
                )

        def produce(src: Source) -> Any:
            values = {k: p(src) for k, p in items}
            if isinstance(target, dict):
                target.update(values)
                return target
            return type(target)(values)

        return produce

    def _sequence(self, node: dict, target: list | tuple, path: str, lenient: bool) -> Producer:
        snap = node["items"]
        if len(snap) != len(target):
            if not lenient:
                detail = f"{len(snap)} items in snapshot, {len(target)} in state"
                return self._leave(path, "length", detail, target) or self.fresh(node, path)
            return self.fresh(node, path)
        kids = [
            self.match(v, t, join(path, i), lenient)
            for i, (v, t) in enumerate(zip(snap, target, strict=True))
        ]
        as_tuple = node["t"] == "tuple"

        def produce(src: Source) -> Any:
            values = [p(src) for p in kids]
            if as_tuple:
                return tuple(values)
            if isinstance(target, list):
                target[:] = values
                return target
            return values

        return produce


def _whole(shard: ShardInfo) -> ShardInfo:
    """The block of all of ``shard``'s tensor, laid out as ``shard`` is."""
    return replace(shard, global_offset=(0,) * len(shard.global_shape))


def finish_stateful(target: Any, sd: Any, needs_load: bool, src: Source,
                    grads_dropped: bool = False) -> None:  # fmt: skip
    """Finish restoring Stateful ``target`` once ``sd`` (its ``state_dict()``, filled in place
    and given the snapshot's other values) is produced: load it where that is needed.
    ``grads_dropped``: the caller dropped its gradients (``drop_grads``) already."""
    target = unwrapped(target)  # the keys are its module's
    if needs_load and not optim_state.loaded_in_place(target, sd):  # reads no tensor value
        src.flush()  # the copies land before load_state_dict() sees the tensors
        target.load_state_dict(sd)
    if not grads_dropped:
        # Gradients are no part of a snapshot: none survive a rollback (a step cut short by
        # a fault would otherwise add its own to the next one's).
        drop_grads(target)


def drop_grads(*targets: Any) -> None:
    """``zero_grad(set_to_none=True)`` for each module or optimizer of ``targets`` (anything
    else keeps what it has). Where the class keeps torch's own, the parameters of all of them
    are gathered, each once (a model's and its optimizer's are the same), and walked
    directly: torch's walk (a generator of named members, a set of those seen) costs more
    than the restore's copies at thousands of parameters."""
    groups: list[Iterable[Any]] = []
    for target in targets:
        if isinstance(target, torch.nn.Module):
            if type(target).zero_grad is not torch.nn.Module.zero_grad:
                target.zero_grad(set_to_none=True)
            else:
                groups.append(chain.from_iterable(m._parameters.values() for m in target.modules()))
        elif isinstance(target, torch.optim.Optimizer):
            if type(target).zero_grad is not torch.optim.Optimizer.zero_grad:
                target.zero_grad(set_to_none=True)
            else:
                groups.append(chain.from_iterable(g["params"] for g in target.param_groups))
    # Read in C-level passes (a Python loop's read is a microsecond a parameter); a rollback
    # finds the grads of the step cut short, a restore again finds none.
    found = list(filter(_NOT_NONE, chain.from_iterable(groups)))
    params = list(dict(zip(map(id, found), found, strict=True)).values())
    for p in compress(params, map(operator.is_not, map(_GRAD, params), repeat(None))):
        p.grad = None


def _saved_keys(node: Any) -> set[Any]:
    """The keys of a saved dict node (empty for anything else)."""
    if not isinstance(node, dict) or node.get("t") != "dict":
        return set()
    keys = set()
    for knode, _ in node.get("items", []):
        try:
            keys.add(_decode_key(knode))
        except TypeError:  # a key that does not hash (a list): not one a door asks for
            continue
    return keys


def _state_indices(node: Any) -> set[int]:
    """The parameter indices an optimizer's saved ``state`` holds state for."""
    if not isinstance(node, dict) or node.get("t") != "dict":
        return set()
    for knode, vnode in node.get("items", []):
        if _decode_key(knode) == "state" and isinstance(vnode, dict) and vnode.get("t") == "dict":
            return {k for kn, _ in vnode.get("items", []) if type(k := _decode_key(kn)) is int}
    return set()


def _kind(node: Any) -> str:
    if isinstance(node, dict):
        return node.get("t", "object")
    return type(node).__name__


def plan(
    manifest: Manifest, state: Mapping[str, Any], allow_pickle: bool,
    resharder: Resharder | None = None, unmatched: list[Mismatch] | None = None,
    key_map: Callable[[str], str | None] | None = None, walked: Walked | None = None,
) -> Producer:  # fmt: skip
    """Check ``state`` against ``manifest``; raise listing every problem, or return the loader.
    DTensors laid out otherwise than saved are asked of ``resharder`` (a mismatch without
    one), which must fetch them before the loader runs. With an ``unmatched`` list, what does
    not match is appended to it and left as it is instead (``restore(strict=False)``).
    ``walked``: the state's walk, made just before; a state that holds what the snapshot
    holds but for tensor values is then loaded without matching node by node."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> value, got {type(state).__name__}")
    if resharder is None and key_map is None:
        from .steady_load import producer as steady

        fast = steady(manifest, walked)
        if fast is not None:
            if unmatched is not None:
                unmatched.clear()
            return fast
    planner = Planner(manifest, allow_pickle, resharder, unmatched is None, key_map)
    producer = planner.match(manifest.tree, state, "", lenient=False)
    where = f"snapshot of step {manifest.step} (job {manifest.job}, rank {manifest.rank})"
    if planner.mismatches and unmatched is None:
        for opt in planner.created:  # nothing loaded: the optimizer stays as fresh as it was
            opt.state.clear()
        raise StateMismatchError(_describe(planner.mismatches, where))
    if unmatched is not None:
        unmatched[:] = planner.mismatches
    refuse_pickles(planner.pickled, where)
    return producer


def refuse_pickles(pickled: list[str], where: str) -> None:
    """PickleNotAllowedError naming the pickled entries, if there are any."""
    if pickled:
        shown = ", ".join(repr(p) for p in pickled[:MAX_LISTED])
        more = f" and {len(pickled) - MAX_LISTED} more" if len(pickled) > MAX_LISTED else ""
        raise PickleNotAllowedError(
            f"{where} holds pickled entries: {shown}{more}. Unpickling runs code from the snapshot; "
            "if you trust it, pass allow_pickle=True"
        )


def run(producer: Producer, source: Source) -> None:
    with torch.no_grad():
        producer(source)
        source.flush()


def _describe(mismatches: list[Mismatch], where: str) -> str:
    counts = Counter(m.kind for m in mismatches)
    summary = ", ".join(f"{n} {k}" for k, n in counts.most_common())
    lines = [f"  {m.path or '<root>'}: {m.kind}: {m.detail}" for m in mismatches[:MAX_LISTED]]
    if len(mismatches) > MAX_LISTED:
        lines.append(f"  ... and {len(mismatches) - MAX_LISTED} more")
    return (
        f"{where} does not match the state to restore into: {len(mismatches)} mismatches "
        f"({summary}):\n"
        + "\n".join(lines)
        + "\nNothing was loaded. Build the model and optimizer "
        "the same way as the run that saved, or restore into a matching state."
    )
