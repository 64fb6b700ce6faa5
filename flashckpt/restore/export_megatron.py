"""``flashckpt export --format megatron``: a committed step of Megatron-Core blocks written
in Megatron's ``torch_dist`` layout, which ``dist_checkpointing.load`` reads without flashckpt.

Every block saved through ``flashckpt.megatron`` (or its ``dist_checkpointing`` backend) is
named by its ShardedTensor key, and its layer on the axes Megatron prepends (``key@1/2``).
The export assembles each block whole from every rank's copies (any parallel layout, every
pipeline stage), verified, stacks a key's layers back into the one global tensor Megatron
describes (``(layers, ...)``), and writes them as a DCP checkpoint under their keys, with
Megatron's ``metadata.json`` (backend ``torch_dist``) and an empty ``common.pt``. Loading
needs the sharded state dict of the model at any layout; ShardedObjects (a layer's extra
state) are not exported, so load with ``strict=StrictHandling.LOG_ALL`` (or any mode that
skips keys the checkpoint lacks) where the model has them. Optimizer moments are exported
under their keys (``optimizer.state.exp_avg.<key>``) with ``select="megatron/optimizer/state"``.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..format import tier_io
from ..format.manifest import ShardInfo
from ..format.sealed import bare_entries
from ..snapshot.flatten import BLOCK
from .export import ExportResult, Progress, write_checkpoint_dir
from .loader import committed, resolve_job
from .reshard import Resharder
from .sources import run_with_tier


def parse_block_name(name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(key, index on each prepended axis, their sizes) of a block's name (``key@1/2``:
    layer 1 of 2; a name without ``@`` has none)."""
    key, sep, rest = name.rpartition("@")
    if not sep or "/" not in rest:
        return name, (), ()
    at, _, of = rest.partition("/")
    try:
        index, sizes = tuple(map(int, at.split("."))), tuple(map(int, of.split(".")))
    except ValueError:
        return name, (), ()
    if len(index) != len(sizes) or not all(0 <= i < n for i, n in zip(index, sizes, strict=True)):
        return name, (), ()
    return key, index, sizes


async def megatron_tensors(tier, job: str, c: tier_io.CommittedStep,
                           select: str | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The global tensors of the blocks under ``select`` (a ``/``-path of the saved state;
    default: ``megatron/model``, what ``flashckpt.megatron.state`` saves, else ``megatron``,
    what the ``dist_checkpointing`` backend saves) of committed step ``c``, by Megatron key,
    assembled from every rank's blocks."""
    manifests = await asyncio.gather(*(
        tier_io.read_manifest(tier, job, c.step, r, c.generation, c.incarnation)
        for r in range(c.world_size)))  # fmt: skip
    blocks = [e for m in manifests for e in bare_entries(m.entries)
              if e.shard is not None and tuple(e.shard.placements) == BLOCK]  # fmt: skip
    if select is None:
        model = any(e.path.startswith("megatron/model/") for e in blocks)
        select = "megatron/model" if model else "megatron"
    prefix = select.strip("/") + "/"
    found: dict[str, tuple[str, tuple[int, ...]]] = {}  # path -> (dtype, block's global shape)
    for e in blocks:
        if e.path.startswith(prefix):
            found.setdefault(e.path, (e.dtype, tuple(e.shard.global_shape)))
    if not found:
        raise ConfigError(f"step {c.step} of job {job!r} holds no Megatron blocks under "
                          f"{select!r}; it was not saved through flashckpt.megatron")  # fmt: skip
    resharder = Resharder()
    for path, (dtype, shape) in found.items():
        whole = ShardInfo(shape, (0,) * len(shape), BLOCK, ())
        resharder.want_block(path, dtype, whole, shape)
    await resharder.fetch(tier, job, c.step, c.generation, c.world_size, c.incarnation)
    stacks: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for path in found:
        key, index, of = parse_block_name(path[len(prefix) :])
        if sizes.setdefault(key, of) != of:
            raise ConfigError(f"{key}: its blocks name {sizes[key]} and {of} layers")
        stacks.setdefault(key, {})[index] = resharder.block(path)
    out = {}
    for key, layers in stacks.items():
        of = sizes[key]
        if not of:
            out[key] = layers[()]
            continue
        if len(layers) != math.prod(of):
            raise ConfigError(f"{key}: {len(layers)} of its {math.prod(of)} layers are stored")
        first = next(iter(layers.values()))
        whole = torch.empty((*of, *first.shape), dtype=first.dtype)
        for index, block in layers.items():
            whole[index] = block
        out[key] = whole
    return out


def write_torch_dist(tensors: dict[str, torch.Tensor], tmp: Path) -> None:
    """``tensors`` as a Megatron ``torch_dist`` checkpoint in the new directory ``tmp``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    torch.save({}, tmp / "common.pt")
    meta: dict[str, Any] = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                            "common_backend": "torch", "common_backend_version": 1}  # fmt: skip
    (tmp / "metadata.json").write_text(json.dumps(meta))


def export_megatron(url: str, to: Path, job: str | None, step: int | None, select: str | None,
                    progress: Progress) -> ExportResult:  # fmt: skip
    """``export(..., format="megatron")``: see the module's documentation."""

    async def read(tier) -> tuple[str, int, dict[str, torch.Tensor]]:
        name = await resolve_job(tier, job)
        c = await committed(tier, name, step)
        return name, c.step, await megatron_tensors(tier, name, c, select)

    name, at, tensors = run_with_tier(url, read)
    result = ExportResult(name, at, "megatron", str(to))
    write_checkpoint_dir(tensors, to, lambda tmp: write_torch_dist(tensors, tmp), result, progress)
    result.notes.append("ShardedObjects (extra states) are not exported: load with a strict "
                        "mode that skips keys the checkpoint lacks (StrictHandling.LOG_ALL)")  # fmt: skip
    return result
