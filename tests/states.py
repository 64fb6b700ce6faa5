"""Deterministic states shared by the tests (imported by child processes too)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch


def _storable(d: torch.dtype) -> bool:
    """Dtypes a tensor can exist in and be viewed as bytes (sub-byte placeholders cannot)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.empty(2, dtype=d).view(torch.uint8)
        return not str(d).startswith("torch.q")
    except (RuntimeError, TypeError):
        return False


ALL_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype) and _storable(v)}, key=str
)


def tensor_of(dtype: torch.dtype, shape=(3, 5), seed=0) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern, NaNs included."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rng_state() -> dict:
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    return {
        "python": random.getstate(),
        "numpy_legacy": np.random.get_state(),
        "numpy": np.random.default_rng(7).bit_generator.state,
        "torch": torch.get_rng_state(),
    }


def same(a, b) -> bool:
    """Bit-exact, type-exact equality of nested values."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        )  # fmt: skip
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b
