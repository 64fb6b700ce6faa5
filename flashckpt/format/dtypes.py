"""The dtypes a manifest may name, by torch's short name ("float32", "float8_e4m3fn", ...).

Reading a manifest checks each entry's dtype and size (``nbytes = numel x itemsize``). The node
agent reads every manifest it persists and never needs torch otherwise, so the names and item
sizes are a table here (the dtypes of torch 2.13; a test holds it to the installed torch's), and
torch is asked only for a name the table lacks (a newer torch's dtype).
"""

from __future__ import annotations

import functools
from typing import Any

ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
}  # fmt: skip
"""torch's dtypes and their item sizes in bytes."""

NUMPY: frozenset[str] = frozenset((
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
))  # fmt: skip
"""Those a numpy array can have (``tensor.numpy()`` takes them)."""

UNSUPPORTED: frozenset[str] = frozenset(("qint8", "quint8", "qint32", "quint4x2", "quint2x4"))
"""Quantized dtypes: their tensors carry scales a snapshot does not keep."""


def itemsize(name: str) -> int | None:
    """The item size of dtype ``name``, or None where neither the table nor torch knows it."""
    size = ITEMSIZE.get(name)
    return size if size is not None else _from_torch().get(name)


@functools.cache
def _from_torch() -> dict[str, int]:
    return {n: d.itemsize for n, d in torch_dtypes().items()}


@functools.cache
def torch_dtypes() -> dict[str, Any]:
    """Every dtype the installed torch has, by short name (imports torch)."""
    import torch

    return {
        str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
    }
