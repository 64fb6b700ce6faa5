"""A warm standby: a process with torch and flashckpt imported, waiting to become a lost rank.

``flashckpt-run`` in in-process mode keeps one per node (``FLASHCKPT_STANDBY``). When a worker
dies, the launcher writes the assignment to the standby's stdin, one JSON line: the lost
worker's environment (with the round to join), its command line and working directory. The
standby then runs the training script as that rank, in this process, as ``python script``
or ``python -m module`` would, and the launcher starts the next standby. An empty stdin (the
launcher exiting) ends it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path

READY_FD_ENV = "FLASHCKPT_STANDBY_READY_FD"
WARM_ENV = "FLASHCKPT_STANDBY_WARM"  # more modules to import ahead, comma-separated
SCRIPT_ENV = "FLASHCKPT_STANDBY_SCRIPT"  # the worker's command line (JSON): its imports warmed


def warm() -> None:
    """What every training script imports, imported now."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401

    # Above faults/ in the layers, by design: a standby warms what the script it becomes
    # imports, the package's doors included, and what a Checkpointer loads when it is made
    # and restores (the agent's client and messages, the tiers' registry, the restore path):
    # every module imported here is time the job does not wait for when a rank is lost.
    more = [m for m in os.environ.pop(WARM_ENV, "").split(",") if m]
    for name in (*WARM, *more):
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional part not installed: the script never needs it
            print(f"standby: {name} not warmed ({exc})", file=sys.stderr)
    script = os.environ.pop(SCRIPT_ENV, "")
    if script:
        warm_script(json.loads(script))


def script_imports(args: list[str]) -> tuple[str | None, list[str]]:
    """(the directory the script runs from, the modules it imports at its top level) for the
    worker command line ``args`` (``script.py ...`` or ``-m module ...``, interpreter flags
    first); only absolute imports, the ones a process can make before it has a rank."""
    args = list(args)
    while args and args[0].startswith("-") and args[0] != "-m":
        args.pop(0)
    if not args:
        return None, []
    if args[0] == "-m":
        spec = importlib.util.find_spec(args[1]) if len(args) > 1 else None
        path, where = (spec.origin if spec else None), os.getcwd()
    else:
        path = args[0]
        where = os.path.dirname(os.path.abspath(path))
    try:
        tree = ast.parse(Path(path).read_text()) if path else None
    except (OSError, SyntaxError, ValueError):
        return where, []
    names: list[str] = []
    for node in tree.body if tree else ():
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return where, [n for n in names if n != "__future__"]


def warm_script(args: list[str]) -> None:
    """Import what the training script imports at its top level, from where it runs: its own
    modules and libraries are loaded before this process becomes a rank. A module that fails
    to import here is left for the script to import (and fail on) as it would anyway."""
    where, names = script_imports(args)
    if where is None:
        return
    sys.path.insert(0, where)
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # e.g. it reads a rank's variables at import
                print(f"standby: {name} (imported by the script) not warmed ({exc})",
                      file=sys.stderr)  # fmt: skip
    finally:
        sys.path.remove(where)


WARM = (
    "torch._dynamo",  # what making any torch.optim optimizer loads (about 1 s of imports)
    "torch.nn.parallel",
    "flashckpt",
    "flashckpt.checkpointer",
    "flashckpt.faults.inprocess",
    "flashckpt.faults.agent_client",
    "flashckpt.proto.agent_pb2",
    "flashckpt.proto.agent_pb2_grpc",
    "flashckpt.storage_tiers.registry",
    "flashckpt.storage_tiers.peer",
    "flashckpt.restore.sources",
    "flashckpt.restore.into_state",
    "flashckpt.restore.steady_load",
)


def run_as(assignment: dict) -> None:
    """Become the worker ``assignment`` describes; returns when its script does."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    args = list(assignment["args"])
    while args and args[0].startswith("-") and args[0] != "-m":
        args.pop(0)  # interpreter flags (-u): this process already runs as they ask
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    warm()
    # What it imported is for good: out of the collector's sight now, while it waits, not
    # when it has become a rank.
    from .inprocess import freeze_setup

    freeze_setup()
    ready = os.environ.pop(READY_FD_ENV, None)
    if ready is not None:
        with contextlib.suppress(OSError):  # taken before it was warm: nobody listens
            os.write(int(ready), b"ready\n")
        os.close(int(ready))
    line = sys.stdin.readline()
    if not line.strip():
        return
    run_as(json.loads(line))


if __name__ == "__main__":
    main()
