"""``flashckpt.restore.export``: a committed step written as files other tools read without flashckpt.

    export("file:///mnt/nvme/ckpt", "out/", "safetensors", step=1200, select="model")

The step is read whole with ``flashckpt.load`` (every chunk verified, DTensor entries
assembled into full tensors, numpy arrays turned into tensors), so memory holds the step
once, plus its data region while it is read; ``select`` ("model", "optim/state") then picks
a subtree, whose keys become the exported names. Formats:

``torch``
    ``torch.load(path, weights_only=True)`` reads it. ``to`` ending in ``.pt``/``.pth``/
    ``.bin`` is that one file, the structure as saved (dicts, lists, tuples, tensors,
    scalars). A directory gets ``pytorch_model.bin`` when the tensors fit in
    ``max_shard_size``, else, as transformers shards, ``pytorch_model-0000k-of-0000n.bin``
    files holding flat dicts of dot-joined names (``model.0.weight``) and
    ``pytorch_model.bin.index.json`` (``metadata.total_size``, ``weight_map``); values that
    hold no tensor are kept whole under their name in the first shard.
``safetensors``
    ``safetensors.torch.load_file`` reads it: the tensors under dot-joined names, as
    Hugging Face names a model's weights. ``to`` ending in ``.safetensors`` is one file; a
    directory gets ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` and
    ``model.safetensors.index.json``. Values that hold no tensor go, as JSON strings under
    their name, in the header metadata of the (first) file and in the index's metadata;
    those JSON cannot hold (bytes, dtypes, NaN, objects) and tensors of dtypes safetensors
    lacks are skipped, each listed in the result's notes. Every file says ``format: pt``.
``dcp``
    A directory ``torch.distributed.checkpoint.load(state_dict, checkpoint_id=dir)`` reads
    in one process, no process group, into a state_dict of the same structure
    (``max_shard_size`` does not apply).
``megatron``
    A directory Megatron-Core's ``dist_checkpointing.load`` reads (its ``torch_dist``
    layout), at any parallel layout: the blocks saved through ``flashckpt.megatron`` under
    ``select`` (default ``megatron/model``, else ``megatron``: what the ``dist_checkpointing``
    backend saves) assembled into Megatron's global tensors (see
    ``export_megatron``).

Every file is written to a ``.tmp-`` name beside its final one, flushed to disk, then
renamed (a DCP directory as a whole), so a crash never leaves a partial file under a final
name; an index is written after its shards, and shards of an earlier export into the same
directory that this one does not use are removed last. Pickled values are refused unless
``allow_pickle=True``; a torch file holding one needs ``weights_only=False`` to be read.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import config
from ..errors import ConfigError
from .export_formats import DEFAULT_MAX_SHARD_SIZE, FORMATS
from .loader import committed, load_from, resolve_job
from .sources import run_with_tier

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# The dtypes the safetensors format names (its spec), by torch name.
SAFETENSORS_DTYPES = frozenset((
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint64",
    "uint32", "uint16", "uint8", "bool", "complex64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz",
))  # fmt: skip
_NAMES = {  # format -> (single file, shard prefix, shard suffix, index)
    "torch": ("pytorch_model.bin", "pytorch_model", ".bin", "pytorch_model.bin.index.json"),
    "safetensors": ("model.safetensors", "model", ".safetensors", "model.safetensors.index.json"),
}
_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device)
MAX_NAMED = 5

Progress = Callable[[int, int], None]
"""Called with (bytes written so far, bytes to write) after each file."""


@dataclass
class ExportResult:
    job: str
    step: int
    format: str
    to: str
    files: list[str] = field(default_factory=list)  # every file written, index last
    index: str | None = None
    tensors: int = 0
    total_size: int = 0  # bytes of the tensors exported
    notes: list[str] = field(default_factory=list)  # what was converted or left out


def parse_size(text: str | int) -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB``, ``1048576`` (``config.parse_size``)."""
    return config.parse_size(text, "a shard size")


def export(
    url: str, to: str | os.PathLike, format: str, job: str | None = None,
    step: int | None = None, select: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, *, allow_pickle: bool = False,
    progress: Progress | None = None,
) -> ExportResult:  # fmt: skip
    """Write ``step`` (default: the newest committed) of ``job`` (default: the only one) in
    tier ``url`` as ``format`` at ``to``; see the module's documentation for what each
    format writes. ``ConfigError`` for a bad format, size or selection; the errors of
    ``flashckpt.load`` for a step that cannot be had."""
    if format not in FORMATS:
        raise ConfigError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    limit = parse_size(max_shard_size)
    if format == "megatron":
        from .export_megatron import export_megatron

        return export_megatron(url, Path(to), job, step, select, progress or (lambda d, t: None))
    if format == "safetensors":
        _safetensors()  # a missing package is said before anything is read

    async def read(tier) -> tuple[str, int, Any]:
        name = await resolve_job(tier, job)
        c = await committed(tier, name, step)
        return name, c.step, await load_from(tier, name, c.step, None, allow_pickle)

    name, at, state = run_with_tier(url, read)
    value = _select(state, select)
    del state
    result = ExportResult(name, at, format, str(to))
    value = _plain(value, "", result)
    write = {"torch": _torch, "safetensors": _safetensors_export, "dcp": _dcp}[format]
    write(value, Path(to), select, limit, result, progress or (lambda done, total: None))
    return result


# ---- the value to export -------------------------------------------------------------------


def _select(state: Any, select: str | None) -> Any:
    """The subtree at ``select``, a ``/``-path of keys (list indices and int keys by number)."""
    value, at = state, ""
    for part in [p for p in (select or "").split("/") if p]:
        if isinstance(value, dict):
            key = part if part in value else _int(part)
            if key not in value:
                keys = ", ".join(repr(k) for k in list(value)[:10])
                raise ConfigError(f"select {select!r}: {repr(at) if at else 'the root'} has no key {part!r} "
                                  f"(its keys: {keys})")  # fmt: skip
        elif isinstance(value, (list, tuple)):
            key = _int(part)
            if not isinstance(key, int) or not 0 <= key < len(value):
                raise ConfigError(f"select {select!r}: {at!r} is a list of {len(value)}, not "
                                  f"indexed by {part!r}")  # fmt: skip
        else:
            raise ConfigError(f"select {select!r}: {at!r} is a {type(value).__name__}, not a dict "
                              "or list")  # fmt: skip
        value, at = value[key], f"{at}/{part}" if at else part
    return value


def _int(part: str) -> int | str:
    return int(part) if re.fullmatch(r"-?\d+", part) else part


def _plain(value: Any, path: str, result: ExportResult) -> Any:
    """``value`` with numpy arrays as tensors and every tensor contiguous on the CPU, owning
    its storage (torch.save writes a view's whole storage); objects only pickle can hold
    (``allow_pickle``) are noted."""
    converted: list[str] = []
    pickled: list[str] = []

    def walk(v: Any, p: str) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()
            return t
        if isinstance(v, np.ndarray):
            converted.append(p)
            return torch.from_numpy(np.ascontiguousarray(v))
        if isinstance(v, dict):
            return {k: walk(x, _join(p, k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x, _join(p, i)) for i, x in enumerate(v))
        if not isinstance(v, _PLAIN):
            pickled.append(p)
        return v

    out = walk(value, path)
    if converted:
        result.notes.append(f"{len(converted)} numpy array(s) exported as tensors: "
                            f"{_named(converted)}")  # fmt: skip
    if pickled:
        result.notes.append(f"{len(pickled)} pickled value(s): {_named(pickled)}")
    return out


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _named(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:MAX_NAMED])
    return shown + (f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED else "")


def _tensors_in(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict):
        v = list(v.values())
    return [t for x in v for t in _tensors_in(x)] if isinstance(v, (list, tuple)) else []


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def flat(value: Any, select: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors by dot-joined name, and the values holding no tensor (kept whole) by
    name. A selected tensor is named by the selection's last key."""
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}

    def walk(v: Any, name: str) -> None:
        if isinstance(v, torch.Tensor):
            _put(tensors, others, name or _leaf_name(select), v)
        elif isinstance(v, (dict, list, tuple)) and (not name or _has_tensor(v)):
            for k, x in v.items() if isinstance(v, dict) else enumerate(v):
                walk(x, f"{name}.{k}" if name else str(k))
        else:
            _put(tensors, others, name or _leaf_name(select), v)

    walk(value, "")
    return tensors, others


def _leaf_name(select: str | None) -> str:
    parts = [p for p in (select or "").split("/") if p]
    return parts[-1] if parts else "value"


def _put(tensors: dict, others: dict, name: str, v: Any) -> None:
    if name in tensors or name in others:
        raise ConfigError(f"two values are both named {name!r} once their keys are joined "
                          "with dots; export them to a single torch file (.pt)")  # fmt: skip
    (tensors if isinstance(v, torch.Tensor) else others)[name] = v


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Names grouped in order into shards of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


# ---- writing -------------------------------------------------------------------------------


def _temp_beside(path: Path) -> Path:
    return path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temp)`` beside ``path``, flushed, then renamed over it."""
    tmp = _temp_beside(path)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _target(to: Path, suffixes: tuple[str, ...]) -> tuple[Path, bool]:
    """The directory to write in, and whether ``to`` names the one file to write."""
    single = to.suffix in suffixes and not to.is_dir()
    where = to.parent if single else to
    where.mkdir(parents=True, exist_ok=True)
    return where, single


def _write_files(
    fmt: str, to: Path, tensors: dict[str, torch.Tensor], others: dict[str, Any],
    limit: int, result: ExportResult, progress: Progress,
    save: Callable[[Path, list[str], bool], None], index_meta: dict[str, Any],
) -> None:  # fmt: skip
    """One file (``to`` itself, or the format's name in directory ``to``) or shards and an
    index; ``save(path, names, first)`` writes one of them. ``others``: the names of values
    the first shard holds besides tensors (in the weight map too); ``index_meta``: what the
    index's metadata holds besides ``total_size``."""
    single_name, prefix, suffix, index_name = _NAMES[fmt]
    where, one_file = _target(to, TORCH_SUFFIXES if fmt == "torch" else (".safetensors",))
    result.tensors = len(tensors)
    total = result.total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    groups = [list(tensors)] if one_file else _shards(tensors, limit)
    done = 0
    if len(groups) == 1:
        path = to if one_file else where / single_name
        _atomic(path, lambda tmp: save(tmp, groups[0], True))
        result.files.append(str(path))
        progress(total, total)
        keep = {path.name}
    else:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(groups):
            fname = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}{suffix}"
            _atomic(where / fname, lambda tmp, n=names, i=i: save(tmp, n, i == 0))
            result.files.append(str(where / fname))
            weight_map |= dict.fromkeys(names, fname)
            if i == 0:
                weight_map |= dict.fromkeys(others, fname)
            done += sum(tensors[n].numel() * tensors[n].element_size() for n in names)
            progress(done, total)
        index = {"metadata": {"total_size": total, **index_meta},
                 "weight_map": dict(sorted(weight_map.items()))}  # fmt: skip
        raw = json.dumps(index, indent=2).encode()
        _atomic(where / index_name, lambda tmp: tmp.write_bytes(raw))
        result.index = str(where / index_name)
        result.files.append(result.index)
        keep = {f.rsplit("/", 1)[-1] for f in result.files}
    _fsync(where, directory=True)
    if not one_file:  # what an earlier export into this directory left that this one replaces
        stale = re.compile(rf"{re.escape(prefix)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}")
        for p in where.iterdir():
            if p.name not in keep and (
                p.name in (single_name, index_name) or stale.fullmatch(p.name)
            ):
                p.unlink(missing_ok=True)


def _torch(value: Any, to: Path, select: str | None, limit: int, result: ExportResult,
           progress: Progress) -> None:  # fmt: skip
    if any("pickled" in n for n in result.notes):
        result.notes.append("torch.load needs weights_only=False (or safe globals) to read the "
                            "pickled values")  # fmt: skip
    _, one_file = _target(to, TORCH_SUFFIXES)
    found = _tensors_in(value)
    if one_file or sum(t.numel() * t.element_size() for t in found) <= limit:
        # The structure as saved, in one file (the names only count and size the tensors).
        _write_files("torch", to, {str(i): t for i, t in enumerate(found)}, {}, limit, result,
                     progress, lambda tmp, names, first: torch.save(value, tmp), {})  # fmt: skip
        return
    tensors, others = flat(value, select)

    def save_shard(tmp: Path, names: list[str], first: bool) -> None:
        torch.save({n: tensors[n] for n in names} | (others if first else {}), tmp)

    _write_files("torch", to, tensors, others, limit, result, progress, save_shard, {})


def _safetensors():
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError("--format safetensors needs the safetensors package: "
                          "pip install 'flashckpt[export]'") from exc  # fmt: skip
    return save_file


def _as_json(v: Any) -> Any:
    """``v`` as JSON can hold it exactly (tuples as lists); ValueError where it cannot."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError("a non-finite float")
    if v is None or isinstance(v, (str, int, float)):  # bool is an int
        return v
    if isinstance(v, (list, tuple)):
        return [_as_json(x) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ValueError("keys that are not strings")
        return {k: _as_json(x) for k, x in v.items()}
    raise ValueError(f"a {type(v).__name__}")


def _safetensors_export(value: Any, to: Path, select: str | None, limit: int,
                        result: ExportResult, progress: Progress) -> None:  # fmt: skip
    save_file = _safetensors()
    tensors, others = flat(value, select)
    odd = [
        n
        for n, t in tensors.items()
        if str(t.dtype).removeprefix("torch.") not in SAFETENSORS_DTYPES
    ]
    if odd:
        result.notes.append(f"skipped {len(odd)} tensor(s) of dtypes safetensors lacks: "
                            f"{_named([f'{n} ({tensors[n].dtype})' for n in odd])}")  # fmt: skip
        tensors = {n: t for n, t in tensors.items() if n not in odd}
    meta, skipped = {}, []
    for name, v in others.items():
        try:
            if name == "format":
                raise ValueError("the name safetensors files use for 'pt'")
            meta[name] = json.dumps(_as_json(v), allow_nan=False)
        except ValueError as exc:
            skipped.append(f"{name} ({exc})")
    if skipped:
        result.notes.append(f"skipped {len(skipped)} value(s) JSON metadata cannot hold: "
                            f"{_named(skipped)}")  # fmt: skip

    def save(tmp: Path, names: list[str], first: bool) -> None:
        header = {"format": "pt"} | (meta if first else {})
        save_file({n: tensors[n] for n in names}, tmp, metadata=header)

    _write_files("safetensors", to, tensors, {}, limit, result, progress, save, meta)


def _dcp(value: Any, to: Path, select: str | None, limit: int, result: ExportResult,
         progress: Progress) -> None:  # fmt: skip
    import torch.distributed.checkpoint as dcp

    if not isinstance(value, dict):
        raise ConfigError(f"DCP exports a dict; select {select!r} is a {type(value).__name__}")
    tensors, _ = flat(value, select)

    def fill(tmp: Path) -> None:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(value, storage_writer=writer, no_dist=True)

    write_checkpoint_dir(tensors, to, fill, result, progress)
    if limit != DEFAULT_MAX_SHARD_SIZE:
        result.notes.append("max_shard_size does not apply to dcp: it writes one data file")


def write_checkpoint_dir(tensors: dict[str, torch.Tensor], to: Path, fill: Callable[[Path], None],
                    result: ExportResult, progress: Progress) -> None:  # fmt: skip
    """A DCP directory at ``to``, filled by ``fill`` in a temporary beside it and put in
    place whole (an earlier one steps aside, then goes)."""
    result.tensors = len(tensors)
    result.total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    to.parent.mkdir(parents=True, exist_ok=True)
    if to.exists() and not (to.is_dir() and (not any(to.iterdir()) or (to / ".metadata").exists())):
        raise ConfigError(f"{to} exists and is not a DCP checkpoint; name a new directory")
    tmp = _temp_beside(to)
    try:
        fill(tmp)
        old = _temp_beside(to) if to.exists() else None
        if old is not None:
            os.replace(to, old)  # the earlier checkpoint steps aside whole, then goes
        os.replace(tmp, to)
        _fsync(to.parent, directory=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.files = sorted(str(p) for p in to.iterdir())
    progress(result.total_size, result.total_size)
