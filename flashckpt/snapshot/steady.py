"""The steady save: a state whose structure did not change is walked without building its tree.

A real rank's state holds thousands of tensors and almost never changes shape between saves:
the same keys, the same containers, the same tensor dtypes, shapes and devices. Building the
manifest tree again on every save (a few objects per tensor) costs more than copying small
tensors. So after a full walk (``flatten``) the walk is compiled into a program that, on the
next save, only fetches the values in the same order and checks that they still fit:

- every container has the same type and keys (key types included), every list its length;
- every tensor is a tensor again (a DTensor again, with the same shard), and the layout's
  dtypes, shapes, devices and layouts match (checked in one C-level pass over all tensors);
- the scalars (learning rates, step counts, an optimizer's parameter ids) are collected; when
  they changed, the tree's JSON is made again from a template with them filled in.

Whatever does not fit (a new key, a reshaped tensor, an ndarray or pickled leaf, which is
recomputed every save anyway) sends the save down the full walk, which compiles the program
again. Stateful objects' ``state_dict()`` is called on every save, so an optimizer's state
tensors replaced by ``load_state_dict`` are the ones copied.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from ..format.manifest import encode_scalar
from .flatten import (
    _PLAIN,
    _PLAIN_SET,
    Layout,
    Leaf,
    Sharded,
    flatten,
    is_shard_leaf,
    is_stateful,
    plan_layout,
)
from .flatten import tensor_source as _tensor_source
from .state_dicts import state_dict_of

_META = operator.attrgetter("dtype", "shape", "device", "layout")
_SCALAR_TYPES = frozenset((type(None), bool, int, float, str, torch.dtype, torch.device))
_KEY_TYPES = frozenset((str, int))
_MARK = "\x00flashckpt-scalar\x00"
_MARK_JSON = json.dumps(_MARK)


class Unfit(Exception):
    """The state no longer fits the compiled walk."""


# ---- the program: nested tuples, one per node of the tree ------------------------------
# ("T",)                        a plain tensor
# ("D", path)                   a DTensor or Sharded (its local block is what is copied)
# ("S",)                        a scalar
# ("I", n)                      a list of n ints (an optimizer's parameter ids): one scalar
# ("TD", cls, keys, key_types)  a mapping whose values are all plain tensors
# ("M", cls, keys, key_types, children)
# ("MD", cls, keys, key_types, inner_cls, inner_keys, inner_key_type)
#                               a mapping whose values are all "TD" mappings of one type with
#                               the same keys, all of one type (an optimizer's state)
# ("L", cls, children)          a list or tuple
# ("F", child, scalars)         a Stateful object: child runs on its state_dict(); scalars:
#                               whether any scalar op is under it


def _compile(node: Any, value: Any, path: str, spots: list, got: tuple[list, ...]) -> tuple:
    """The op for tree ``node`` built from ``value``; raises Unfit for what the steady walk
    does not take. ``spots`` receives (container, index) of every scalar op's tree node, and
    ``got`` (tensors, scalars, shards, statefuls) what ``_run`` would collect, both in walk
    order."""
    tensors, scalars, shards, statefuls = got
    tag = node.get("t") if isinstance(node, dict) else None
    if tag == "stateful":
        if not is_stateful(value):
            raise Unfit(path)
        sd, before = state_dict_of(value), len(scalars)
        child = _compile(node["v"], sd, path, spots, got)
        statefuls.append((value, sd, len(scalars) != before))  # after what it nests
        return ("F", child, len(scalars) != before)
    if tag == "tensor":
        if type(value) in _PLAIN:
            tensors.append(value)
            return ("T",)
        if is_shard_leaf(value):
            local, shard = _tensor_source(value, path)
            tensors.append(local)
            shards.append((shard, value.replicas) if type(value) is Sharded else shard)
            return ("D", path)
        raise Unfit(path)
    if tag in ("ndarray", "pickle"):
        raise Unfit(path)  # rebuilt from the object every save
    if tag == "dict":
        if not isinstance(value, Mapping):
            raise Unfit(path)
        keys = list(value)
        key_types = list(map(type, keys))
        if not set(key_types) <= _KEY_TYPES:
            raise Unfit(path)
        items = node["items"]
        if all(isinstance(v, dict) and v.get("t") == "tensor" for _, v in items) and (
            set(map(type, value.values())) <= _PLAIN_SET
        ):
            tensors.extend(value.values())
            return ("TD", type(value), keys, key_types)
        children = []
        for k, pair, v in zip(keys, items, value.values(), strict=True):
            children.append(_compile(pair[1], v, f"{path}/{k}", spots, got))
            _spot(pair, 1, spots, children[-1])  # in walk order, after what it nests
        if children and all(op[0] == "TD" for op in children):
            alike = {(op[1], tuple(op[2]), tuple(op[3])) for op in children}
            _, cls, inner_keys, inner_types = children[0]
            if len(alike) == 1 and len(set(inner_types)) == 1:
                return ("MD", type(value), keys, key_types, cls, inner_keys, inner_types[0])
        return ("M", type(value), keys, key_types, children)
    if tag in ("list", "tuple"):
        if type(value) is not (list if tag == "list" else tuple):
            raise Unfit(path)
        items = node["items"]
        if tag == "list" and items and set(map(type, value)) == {int}:
            scalars.append(tuple(value))
            return ("I", len(value))
        children = []
        for i, (v, x) in enumerate(zip(items, value, strict=True)):
            children.append(_compile(v, x, f"{path}/{i}", spots, got))
            _spot(items, i, spots, children[-1])
        return ("L", type(value), children)
    if type(value) in _SCALAR_TYPES:
        scalars.append(value)
        return ("S",)
    raise Unfit(path)


def _spot(container: Any, index: int, spots: list, op: tuple) -> None:
    if op[0] in ("S", "I"):
        spots.append((container, index))


def _run(op: tuple, value: Any, tensors: list, scalars: list, shards: list,
         statefuls: list) -> None:  # fmt: skip
    kind = op[0]
    if kind == "T":
        if type(value) not in _PLAIN:
            raise Unfit
        tensors.append(value)
    elif kind == "TD":
        vals = _same_mapping(op, value)
        if not set(map(type, vals)) <= _PLAIN_SET:
            raise Unfit
        tensors.extend(vals)
    elif kind == "MD":  # an optimizer's state: checked and collected in C-level passes
        inner, cls, keys = _same_mapping(op, value), op[4], op[5]
        if (set(map(type, inner)) != {cls} or not all(map(keys.__eq__, map(list, inner)))
                or set(map(type, chain.from_iterable(inner))) != {op[6]}):  # fmt: skip
            raise Unfit
        vals = list(chain.from_iterable(map(cls.values, inner)))
        if not set(map(type, vals)) <= _PLAIN_SET:
            raise Unfit
        tensors.extend(vals)
    elif kind == "M":
        for child, v in zip(op[4], _same_mapping(op, value), strict=True):
            _run(child, v, tensors, scalars, shards, statefuls)
    elif kind == "S":
        if type(value) not in _SCALAR_TYPES:
            raise Unfit
        scalars.append(value)
    elif kind == "I":
        if type(value) is not list or len(value) != op[1] or set(map(type, value)) != {int}:
            raise Unfit
        scalars.append(tuple(value))
    elif kind == "L":
        if type(value) is not op[1] or len(value) != len(op[2]):
            raise Unfit
        for child, v in zip(op[2], value, strict=True):
            _run(child, v, tensors, scalars, shards, statefuls)
    elif kind == "F":
        if not is_stateful(value):
            raise Unfit
        sd = state_dict_of(value)
        _run(op[1], sd, tensors, scalars, shards, statefuls)
        statefuls.append((value, sd, op[2]))
    else:  # "D"
        if not is_shard_leaf(value):
            raise Unfit
        local, shard = _tensor_source(value, op[1])
        tensors.append(local)
        shards.append((shard, value.replicas) if type(value) is Sharded else shard)


def _same_mapping(op: tuple, value: Any) -> list:
    """The values of mapping ``value`` if it has the type and keys (and key types) of op's."""
    if type(value) is not op[1]:
        raise Unfit
    keys = list(value)
    if keys != op[2] or list(map(type, keys)) != op[3]:
        raise Unfit
    return list(value.values())


_REMADE = 4  # the compiled check is made at most this many times a layout


class _SameMeta:
    """Whether a walk's tensors have the dtypes, shapes, devices and layouts the compile found.

    Compared in Python, that is a tuple of four attributes a tensor, about a microsecond each:
    16 ms a walk of 16,000 tensors. From the second comparison on, torch's compiled tensor
    check (the guard ``torch.compile`` checks its inputs with) does it in C++ in a tenth of
    that. It checks more (strides, ``requires_grad``, dispatch keys and the thread's grad and
    inference modes), so what it refuses is compared in Python before the walk counts as
    changed; where this torch has no such check, Python compares every time."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.meta = list(map(_META, tensors))
        self.guard: Any = None
        self.compared = 0  # Python comparisons passed since the check was last made
        self.made = 0  # checks made (none is made again once one could not be)
        # Whether the tensors the check was made from were all plain bytes (contiguous, no
        # conjugate or negative bit): tensors it passes have their strides and dispatch keys.
        self.plain = False
        self.guarded = False  # the last comparison was the compiled check's

    def __call__(self, tensors: list[torch.Tensor]) -> bool:
        guard, self.guarded = self.guard, False
        if guard is not None:
            try:
                if guard.check(*tensors):
                    self.guarded = True
                    return True
            except Exception:  # a private check: never trusted to work
                self.guard = None
        if list(map(_META, tensors)) != self.meta:
            return False
        self.compared += 1
        # Made once the layout is steady (5 us a tensor), and again, a few times at most,
        # where two walks passed in Python that it refused: a flag it checks changed (a
        # parameter frozen or unfrozen, an optimizer's state replaced with other strides).
        if self.compared == (1 if not self.made else 2) and (
            not self.made or (self.guard is not None and self.made < _REMADE)
        ):
            self.guard, self.made, self.compared = _compiled_check(tensors), self.made + 1, 0
            self.plain = self.guard is not None and _plain(tensors)
        return True


def _plain(tensors: list[torch.Tensor]) -> bool:
    return (all(map(torch.Tensor.is_contiguous, tensors))
            and not any(map(torch.Tensor.is_conj, tensors))
            and not any(map(torch.Tensor.is_neg, tensors)))  # fmt: skip


def _compiled_check(tensors: list[torch.Tensor]) -> Any:
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors])  # fmt: skip
    except Exception:  # absent, or another signature: compared in Python
        return None


def _scalar_json(value: Any) -> str:
    if type(value) is tuple:  # an "I" block: the list node it stands for
        return json.dumps({"t": "list", "items": list(value)}, separators=(",", ":"))
    return json.dumps(encode_scalar(value), separators=(",", ":"), allow_nan=False)


@dataclass
class Walked:
    """What a save needs of its state: the layout, the tensors to copy (in entry order) and
    the tree's JSON. Nothing here outlives the save's use of the tensors: the walker keeps no
    tensor (a replaced optimizer state must be freed, on a GPU above all)."""

    layout: Layout
    tensors: list[torch.Tensor]
    tree: Any  # the tree of the last full walk (its scalars may be older than tree_json's)
    tree_json: str
    # The compiled walk's Stateful objects, innermost first: (object, the state_dict() whose
    # tensors ``tensors`` holds, whether a scalar is under it); None where the state does not
    # compile (a restore then matches it against the snapshot's tree node by node).
    statefuls: list[tuple[Any, Any, bool]] | None = None
    # Every tensor is known to be plain bytes (contiguous, no conjugate or negative bit): the
    # compiled check found them with the strides and dispatch keys of such tensors.
    plain: bool = False
    # The compiled walk took the state: it has the structure of the state walked before it
    # (the same containers, keys and tensor dtypes, shapes and shards; scalars may differ).
    steady: bool = False


class StateWalker:
    """Walks a state for a save (see the module doc); one per Checkpointer."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.full_walks = 0  # how many saves walked in full (the first, and each change)
        self._program: tuple | None = None
        self._replicated: frozenset[str] = frozenset()
        self._layout: Layout | None = None
        self._tree: Any = None
        self._meta = _SameMeta([])
        self._shards: list = []
        self._scalars: list = []
        self._scalar_types: list = []
        self._parts: list[str] | None = None  # the tree's JSON around its scalars
        self._tree_json = ""
        self._unfit: Layout | None = None  # the layout whose state the last compile refused

    def walk(self, state: Mapping[str, Any], replicated: frozenset[str],
             layout: Layout | None) -> Walked:  # fmt: skip
        """``layout``: the one the caller last used (kept while the structure is the same)."""
        if self._program is not None and replicated == self._replicated:
            tensors: list = []
            scalars: list = []
            shards: list = []
            statefuls: list = []
            try:
                _run(self._program, state, tensors, scalars, shards, statefuls)
            except (Unfit, ValueError):
                pass
            else:
                if (self._meta(tensors) and shards == self._shards
                        and self._fill(scalars)):  # fmt: skip
                    assert self._layout is not None
                    plain = self._meta.guarded and self._meta.plain
                    return Walked(self._layout, tensors, self._tree, self._tree_json, statefuls,
                                  plain, steady=True)  # fmt: skip
        return self._full(state, replicated, layout)

    def _fill(self, scalars: list) -> bool:
        """The tree's JSON for ``scalars``; False if it cannot be made from the template."""
        types = list(map(type, scalars))
        if scalars == self._scalars and types == self._scalar_types:
            return True
        if self._parts is None or len(self._parts) != len(scalars) + 1:
            return False
        try:
            filled = [self._parts[0]]
            for value, part in zip(scalars, self._parts[1:], strict=True):
                filled += (_scalar_json(value), part)
        except (TypeError, ValueError):  # a scalar JSON cannot hold as it is: walk in full
            return False
        self._tree_json = "".join(filled)
        self._scalars, self._scalar_types = scalars, types
        return True

    def _full(self, state: Mapping[str, Any], replicated: frozenset[str],
              layout: Layout | None) -> Walked:  # fmt: skip
        self.full_walks += 1
        tree, leaves = flatten(state, replicated)
        layout = plan_layout(leaves, self.chunk_size, layout)
        tree_json = json.dumps(tree, separators=(",", ":"), allow_nan=False)
        compiled = self._compile(state, tree, leaves, replicated, layout, tree_json)
        tensors = [lf.tensor for lf in leaves]
        if compiled is None or self._meta.meta != list(map(_META, tensors)):
            return Walked(layout, tensors, tree, tree_json)
        # The compile's own state_dict() calls: a restore fills these tensors and hands the
        # same dicts to load_state_dict (a state_dict() may return copies).
        return Walked(layout, compiled[0], tree, tree_json, compiled[1])

    def _compile(self, state: Mapping[str, Any], tree: Any, leaves: list[Leaf],
                 replicated: frozenset[str], layout: Layout,
                 tree_json: str) -> tuple[list, list] | None:  # fmt: skip
        """The program and template for the next saves, or none if the state does not fit
        (then not tried again while the layout stays the same: a state with an ndarray or a
        pickled leaf walks in full on every save, and pays for no compile on top). Returns
        the tensors and Stateful objects the compile collected (as ``_run`` collects them),
        or None."""
        self._program = None
        if layout is self._unfit:
            return None
        spots: list = []
        tensors: list = []
        scalars: list = []
        shards: list = []
        statefuls: list = []
        try:
            program = _compile(tree, state, "", spots, (tensors, scalars, shards, statefuls))
        except (Unfit, ValueError):
            self._unfit = layout
            return None
        if len(tensors) != len(leaves) or len(scalars) != len(spots):
            self._unfit = layout
            return None
        parts = self._template(tree, spots, len(scalars))
        self._program, self._replicated, self._layout = program, replicated, layout
        self._tree, self._tree_json = tree, tree_json
        self._meta = _SameMeta(tensors)
        self._shards, self._scalars = shards, scalars
        self._scalar_types = list(map(type, scalars))
        self._parts = parts
        return tensors, statefuls

    @staticmethod
    def _template(tree: Any, spots: list, n: int) -> list[str] | None:
        """The tree's JSON split around its scalars (None if a marker clashes with a value)."""
        if not spots:
            return None
        saved = [container[index] for container, index in spots]
        try:
            for container, index in spots:
                container[index] = _MARK
            doc = json.dumps(tree, separators=(",", ":"), allow_nan=False)
        finally:
            for (container, index), value in zip(spots, saved, strict=True):
                container[index] = value
        parts = doc.split(_MARK_JSON)
        return parts if len(parts) == n + 1 else None
