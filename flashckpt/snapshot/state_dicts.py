"""A Stateful object's ``state_dict()``, as every walk of a state asks for it.

Saves and restores call it on every module and optimizer of the state, every time, and at
thousands of parameters torch's own costs more than copying small tensors:

- ``Module.state_dict()`` detaches every parameter and buffer (a new tensor each, half a
  microsecond). The walks never need the detached aliases: they read a tensor's bytes, and
  write them under ``torch.no_grad()``. So where no module of the tree has a state-dict
  hook (which might expect detached values), the tensors themselves are taken
  (``keep_vars=True``, same keys, same order).
- ``Optimizer.state_dict()`` renumbers each parameter's state by the parameter's index, a
  Python step a parameter. Where an optimizer keeps torch's own (its class does not
  override it, no state-dict hook), the same dict is made here in C-level passes: the same
  keys in the same order, copies of the groups' dicts with their parameters' indices, the
  state's own per-parameter dicts. What the passes do not take (a parameter in two groups,
  a state keyed by something other than a tensor) gets torch's.

Anything else gets its own ``state_dict()``.

A module behind a wrapper that only forwards to it, ``torch.compile``'s (``_orig_mod.``) or
DDP's and DataParallel's (``module.``), is the same state as the module: its state is the
module's own (``unwrapped``), so that a snapshot saved from either restores into either.
"""

from __future__ import annotations

import operator
import re
from functools import partial
from itertools import repeat
from typing import Any

import torch

_TORCH_MODULE = torch.nn.Module.state_dict
_TORCH_OPTIMIZER = torch.optim.Optimizer.state_dict
_NOT_NONE = partial(operator.is_not, None)


def unwrapped(value: Any) -> Any:
    """The module inside ``torch.compile``'s, DDP's and DataParallel's wrappers (however
    nested), else ``value``."""
    while isinstance(value, torch.nn.Module):
        if type(value).__name__ == "OptimizedModule" and isinstance(
            getattr(value, "_orig_mod", None), torch.nn.Module
        ):
            value = value._orig_mod
        elif isinstance(value, _FORWARDING):
            value = value.module
        else:
            break
    return value


_FORWARDING = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
_ORIG_MOD = re.compile(r"(^|\.)_orig_mod\.")


def wrapper_free(key: str) -> str:
    """A state-dict key without the wrappers' prefixes: every ``_orig_mod.`` segment
    (``torch.compile``'s) and a leading ``module.`` (DDP's)."""
    key = _ORIG_MOD.sub(r"\1", key)
    return key.removeprefix("module.")


def state_dict_of(value: Any) -> Any:
    """What ``value.state_dict()`` returns, its tensors undetached where it is a module's; a
    wrapped module's own (``unwrapped``)."""
    value = unwrapped(value)
    cls = type(value)
    if cls.state_dict is _TORCH_MODULE and isinstance(value, torch.nn.Module):
        if not _hooked(value):
            return value.state_dict(keep_vars=True)
    elif cls.state_dict is _TORCH_OPTIMIZER and isinstance(value, torch.optim.Optimizer):
        sd = _optimizer_state_dict(value)
        if sd is not None:
            return sd
    return value.state_dict()


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a module of ``module``'s tree has a state-dict hook, before or after. Each
    module is looked at once (one shared in two places, or a cycle, which torch's own
    ``state_dict()`` then refuses)."""
    todo, seen = [module], {id(module)}
    while todo:
        m = todo.pop()
        if m._state_dict_hooks or m._state_dict_pre_hooks:
            return True
        for child in filter(_NOT_NONE, m._modules.values()):
            if id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return False


def _optimizer_state_dict(opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """``torch.optim.Optimizer.state_dict(opt)`` in C-level passes; None where it must run."""
    if getattr(opt, "_optimizer_state_dict_pre_hooks", None) or getattr(
        opt, "_optimizer_state_dict_post_hooks", None
    ):
        return None
    index: dict[int, int] = {}  # id(parameter) -> its index, in the groups' order
    groups = []
    for group in opt.param_groups:
        params = group["params"]
        start = len(index)
        index.update(zip(map(id, params), range(start, start + len(params)), strict=True))
        if len(index) != start + len(params):
            return None  # a parameter twice: torch's numbering skips it
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(params)))
        groups.append(packed)
    keys = list(opt.state)
    if not all(map(isinstance, keys, repeat(torch.Tensor))):
        return None
    try:
        state = dict(zip(map(index.__getitem__, map(id, keys)), opt.state.values(), strict=True))
    except KeyError:  # a state whose parameter is in no group: torch's raises the same
        return None
    return {"state": state, "param_groups": groups}
