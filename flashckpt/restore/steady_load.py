"""The steady restore: a live state that holds what the snapshot holds but for tensor values.

A restore into the state being trained (a rollback after a fault, in-process recovery, a
restore the same process made before) finds it shaped as the snapshot: the same keys and
containers, the same tensor dtypes and shapes, the same scalars. Matching the snapshot's tree
against it node by node costs microseconds a tensor, more than copying a small tensor. So
when the state's compiled walk (``snapshot/steady.py``) yields the snapshot's entries in
order (path, kind, dtype, shape, shard, replica mark) and the tree's JSON is the snapshot's,
the tensors are filled in one batched, verified pass (``Source.copy_many``) and each Stateful
object is finished as the node-by-node restore finishes it: ``load_state_dict`` with the
dict its tensors were filled in (an optimizer's param groups set in place), gradients
dropped. Anything else (another structure, a scalar that differs, shards to reassemble,
renamed keys) goes through the node-by-node ``into_state.plan``.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable

import torch

from ..format.kept import Kept
from ..format.manifest import Manifest
from ..format.sealed import bare_entries
from ..snapshot import device
from ..snapshot.flatten import Layout
from ..snapshot.steady import Walked
from .entry_copy import Source
from .into_state import Producer, drop_grads, finish_stateful

_IS_CPU = operator.attrgetter("is_cpu")
_KEY = operator.attrgetter(
    "path", "kind", "dtype", "shape", "shard", "replicated", "stored_at", "replicas"
)
# A few layouts' results, as several Checkpointers (memory, a tier's reader) restore in turn.
# (layout, runtime) -> keys, host, device
_KEYS: Kept[tuple[list, bool, Hashable | None]] = Kept(4, identity=True)
_MATCHED: Kept[bool] = Kept(4, identity=True)  # (keys, entries) found equal (held: ids stay)


def _keys(layout: Layout, tensors: list[torch.Tensor]) -> tuple[list, bool, Hashable | None]:
    """The layout's entry keys, whether every tensor of it is a host tensor, and the device
    every tensor of it is on where they are all on one device of the runtime (the same for
    every state of the layout: its signature holds each tensor's device)."""
    rt = device.runtime()
    found = _KEYS.get((layout, rt))
    if found is None:
        keys = list(map(_KEY, layout.entries))
        on_device = list(map(rt.is_device_tensor, tensors))
        host = all(map(_IS_CPU, tensors)) and not any(on_device)
        devices = set(map(rt.device_of, tensors)) if tensors and all(on_device) else set()
        found = (keys, host, devices.pop() if len(devices) == 1 else None)
        _KEYS.put((layout, rt), found)
    return found


def producer(manifest: Manifest, walked: Walked | None) -> Producer | None:
    """The loader of ``manifest`` into the state ``walked`` was walked from, if the state
    holds exactly what the snapshot holds but for tensor values; None otherwise."""
    if walked is None or walked.statefuls is None:
        return None
    entries = manifest.entries
    bare = bare_entries(entries)  # a step's entries are its layout's: parsed once, kept
    keys, host, on_device = _keys(walked.layout, walked.tensors)
    if len(bare) != len(walked.tensors):
        return None
    if _MATCHED.get((keys, bare)) is None:
        if list(map(_KEY, bare)) != keys:
            return None
        _MATCHED.put((keys, bare), True)
    if not walked.tree_json or manifest.tree_json != walked.tree_json:
        return None
    tensors, statefuls, cs = walked.tensors, walked.statefuls, manifest.chunk_size
    plain = walked.plain

    def produce(src: Source) -> None:
        drop_grads(*(target for target, _, _ in statefuls))  # the walk's reads still in cache
        # The walk checked each tensor's dtype, shape and device against the layout's.
        src.copy_many(tensors, entries, cs, host_sized=host, plain=plain, on_device=on_device)
        for target, sd, has_scalars in statefuls:  # innermost first, as node by node
            needs_load = has_scalars or not isinstance(target, torch.nn.Module)
            finish_stateful(target, sd, needs_load, src, grads_dropped=True)

    return produce
