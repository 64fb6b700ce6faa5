"""``flashckpt export URL --format torch|safetensors|dcp|megatron --to PATH [--step N] [--select KEYS]``:
write a committed step as files that torch, safetensors, DCP or Megatron read without flashckpt.

The step (default: the newest committed) is read from the tier whole, every chunk verified,
DTensor shards assembled into full tensors (``flashckpt.load``); ``--select model`` (a
``/``-path of keys) exports that subtree only, its keys becoming the names. ``--to``:

  torch        a file ending in .pt/.pth/.bin (torch.load(path, weights_only=True)), or a
               directory: pytorch_model.bin, or shards and pytorch_model.bin.index.json
  safetensors  a file ending in .safetensors, or a directory: model.safetensors, or shards
               and model.safetensors.index.json (names dot-joined: model.0.weight)
  dcp          a directory torch.distributed.checkpoint.load reads in one process
  megatron     a directory Megatron-Core's dist_checkpointing.load reads at any parallel
               layout (torch_dist); --select defaults to megatron/model, else megatron

A directory export is sharded as transformers shards when the tensors exceed
--max-shard-size (default 5GB). Files are written under temporary names and renamed once
complete. What a format cannot hold (safetensors: values JSON cannot hold, dtypes it lacks)
is left out and said on stderr. See ``flashckpt.restore.export`` for the details of each format.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict
from pathlib import Path

from .. import config
from ..errors import CheckpointNotFoundError, ConfigError, PickleNotAllowedError
from ..restore.export_formats import DEFAULT_MAX_SHARD_SIZE, FORMATS
from .common import (
    OK,
    SHM,
    Output,
    Problem,
    Progress,
    UsageError,
    add_job,
    chosen_job,
    describe_error,
    human_bytes,
    locations,
    step_arg,
)
from .locations import TierLocation, job_at

NAME = "export"
HELP = "write a stored step as torch, safetensors or DCP files that load without flashckpt"


def _size_arg(text: str) -> int:
    try:
        return config.parse_size(text, "a shard size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs=1, metavar="URL",
                   help="the tier to read the step from (file:///dir, pfs:///dir, s3://bucket/prefix, or any fsspec URL: gs://...)")  # fmt: skip
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="torch (torch.load), safetensors, dcp (torch.distributed.checkpoint), or "
                   "megatron (Megatron-Core's torch_dist, for dist_checkpointing.load)")  # fmt: skip
    p.add_argument("--to", required=True, metavar="PATH",
                   help="a directory, or for torch/safetensors a single .pt/.safetensors file")  # fmt: skip
    add_job(p)
    p.add_argument("--step", type=step_arg, default=None, metavar="N",
                   help="the step (default: the newest committed one)")  # fmt: skip
    p.add_argument("--select", default=None, metavar="KEYS",
                   help="export only this subtree, a /-path of keys: model, optim/state")  # fmt: skip
    p.add_argument("--max-shard-size", type=_size_arg, default=DEFAULT_MAX_SHARD_SIZE,
                   metavar="SIZE", help="shard a directory export past this size of tensors "
                                        "(5GB, 500MB, 2GiB; default 5GB)")  # fmt: skip
    p.add_argument("--allow-pickle", action="store_true",
                   help="export values stored pickled (a torch file then needs "
                        "weights_only=False to be read)")  # fmt: skip


def _check_to(to: str) -> None:
    """``--to`` must lie under directories: a file (or a FIFO, a device) standing where one of
    its parents must be is a usage error now, before the step is read."""
    from ..storage_tiers.os_errors import kind_of

    for parent in Path(to).expanduser().absolute().parents:  # the nearest first
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue  # created by the export
        except OSError as exc:
            raise Problem(f"--to {to}: {describe_error(exc)}") from exc
        kind = kind_of(mode) or "a regular file"
        if kind != "a directory":
            raise UsageError(f"--to {to}: {parent} is {kind}, not a directory; name a path "
                             "whose parents are directories (missing ones are created)")  # fmt: skip
        return


async def _job(url: str, named: str | None) -> str:
    async with TierLocation(url) as loc:
        return await job_at(loc, named)


def run(args: argparse.Namespace, out: Output) -> int:
    url = locations(args)[0]
    if url == SHM:
        raise UsageError("export reads a tier; copy the step out of shared memory first with "
                         "'flashckpt restore shm --to DIR', then export from file://DIR")  # fmt: skip
    _check_to(args.to)
    job = asyncio.run(_job(url, chosen_job(args)))
    with Progress(f"exporting {args.format}") as progress:

        def shown(done: int, total: int) -> None:
            if total > progress.total:
                progress.add_total(total - progress.total)
            progress.update(done - progress.done)

        from ..restore.export import export  # torch: only when exporting

        try:
            result = export(url, args.to, args.format, job, args.step, args.select,
                            args.max_shard_size, allow_pickle=args.allow_pickle,
                            progress=shown)  # fmt: skip
        except CheckpointNotFoundError as exc:  # no such step (or job) there
            raise Problem(describe_error(exc)) from exc
        except PickleNotAllowedError as exc:
            raise Problem(f"{describe_error(exc)} (here: --allow-pickle)") from exc
        except ConfigError as exc:  # a selection that is not there, a target that will not do
            raise UsageError(describe_error(exc)) from exc
        except ImportError as exc:  # safetensors not installed
            raise Problem(describe_error(exc)) from exc
    for note in result.notes:
        out.note(f"note: {note}")
    what = f" ({args.select})" if args.select else ""
    out.line(f"step {result.step} of job {result.job}{what} exported as {result.format}: "
             f"{result.tensors} tensors, {human_bytes(result.total_size)}, to {result.to}")  # fmt: skip
    for path in result.files:
        out.line(f"  {path}")
    out.document({"command": NAME, "ok": True, **asdict(result)})
    return OK
