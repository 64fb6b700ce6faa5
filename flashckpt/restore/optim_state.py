"""Give a fresh optimizer the state a restore loads into.

Optimizers create their per-parameter state lazily, at the first ``step()``. A snapshot's
state restored into a fresh one would arrive as plain tensors, while a sharded model's
(FSDP2, tensor parallel) optimizer state must be DTensors on the parameters' mesh and
placements, and a GPU optimizer's state belongs on the GPU. So before a restore, the
parameters the snapshot holds state for get that state created the way the optimizer's own
first step creates it: a step on zero gradients at a learning rate of zero, which changes no
parameter. The snapshot's values then overwrite it in place (uploaded once, for a device).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from itertools import chain
from typing import Any

import torch

from ..snapshot.flatten import is_dtensor


def params_in_order(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()`` order: index ``i`` is key ``i``."""
    return [p for group in opt.param_groups for p in group["params"]]


def needs_state(
    opt: Any, indices: Collection[int], on_device: Callable[[torch.Tensor], bool]
) -> bool:
    """Whether ``opt`` is a fresh optimizer whose state for ``indices`` must be created before
    a restore: it has none yet and some of those parameters are DTensors or ``on_device``
    (restored in place, the state is uploaded once instead of coming back on the host for
    ``load_state_dict`` to move)."""
    if not isinstance(opt, torch.optim.Optimizer) or opt.state or not indices:
        return False
    params = params_in_order(opt)
    return any(
        0 <= i < len(params) and (is_dtensor(params[i]) or on_device(params[i])) for i in indices
    )


def create_state(opt: torch.optim.Optimizer, indices: Collection[int]) -> bool:
    """Create ``opt``'s state for the parameters at ``indices`` without changing any
    parameter; gradients and learning rates are put back as they were. False, with nothing
    created, for an optimizer whose step needs a closure (LBFGS)."""
    params = params_in_order(opt)
    chosen = {i for i in indices if 0 <= i < len(params)}
    grads = [p.grad for p in params]
    rates = [(g, g["lr"]) for g in opt.param_groups if "lr" in g]
    try:
        for i, p in enumerate(params):
            p.grad = torch.zeros_like(p) if i in chosen and p.requires_grad else None
        for group, lr in rates:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        try:
            opt.step()
        except TypeError:  # step(closure): its state comes from load_state_dict instead
            opt.state.clear()
            return False
    finally:
        for group, lr in rates:
            group["lr"] = lr
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return True


def loaded_in_place(opt: Any, sd: dict) -> bool:
    """Finish loading ``sd`` (what a restore produced from ``opt.state_dict()``) into ``opt``
    without ``load_state_dict``, when the restore already filled every state value in place:
    only the param groups' settings are left to set. True if done; False (nothing changed)
    where ``load_state_dict`` must run: a subclass with its own, load hooks, a state entry
    the restore replaced rather than filled (a scalar, a fresh tensor), other groups.

    ``torch.optim.Optimizer.load_state_dict`` casts and re-keys every state value, about
    13 microseconds a tensor: at thousands of tensors, more than the restore's copies."""
    if not isinstance(opt, torch.optim.Optimizer):
        return False
    if type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return False
    if getattr(opt, "_optimizer_load_state_dict_pre_hooks", None) or getattr(
        opt, "_optimizer_load_state_dict_post_hooks", None
    ):
        return False
    if not isinstance(sd, dict) or set(sd) != {"state", "param_groups"}:
        return False
    params = params_in_order(opt)
    state, groups = sd["state"], sd["param_groups"]
    if not isinstance(state, dict) or len(state) != len(opt.state):
        return False
    # Each of the optimizer's states against the entry of its parameter's index, found by id:
    # a tensor hashes in Python, a microsecond each. Equal counts make it one to one.
    index = {id(p): i for i, p in enumerate(params)}
    try:
        kinds = set(map(type, chain.from_iterable(map(dict.values, opt.state.values()))))
    except TypeError:  # a state that is not a dict
        return False
    if not all(issubclass(t, torch.Tensor) for t in kinds):
        return False  # a scalar: load_state_dict sets those
    for p, now in opt.state.items():
        entry = state.get(index.get(id(p), -1))
        if entry is now:  # state_dict() hands out the state's own dicts: filled in place
            continue
        if not isinstance(entry, dict) or entry.keys() != now.keys():
            return False
        if any(entry[k] is not now[k] or not isinstance(now[k], torch.Tensor) for k in now):
            return False  # replaced, or a scalar: load_state_dict sets those
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        return False
    at = 0
    for saved, group in zip(groups, opt.param_groups, strict=True):
        n = len(group["params"])
        if not isinstance(saved, dict) or saved.get("params") != list(range(at, at + n)):
            return False
        if saved.keys() != group.keys():
            return False
        at += n
    for saved, group in zip(groups, opt.param_groups, strict=True):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                group[k] = v
    return True
