"""``flashckpt``: look at, check, copy and clean up flash checkpoints, in this node's shared
memory (``shm``) and in storage tiers (``file:///dir``, ``pfs:///dir``, ``s3://bucket/prefix``).

commands:
  ls URL                        the jobs at a location, or a job's steps there
  verify URL... [--step N]      re-read a stored step and check every chunk
  restore URL... --to DIR|shm   copy a step, verified, into a directory/tier or shared memory
  gc URL --keep-last K          apply retention to a tier; 'gc shm' removes dead jobs' files
  export URL --format F --to P  write a stored step as torch, safetensors or DCP files
  status                        the node agent's and the controller's view of a job
  report EVENTS.jsonl...        effective training time from flashckpt-run event logs
  list --job J [--tier URL]     the older one-screen overview of a job on this node

The job is --job, else FLASHCKPT_JOB, else the only job stored at the location.
Exit codes: 0 nothing wrong, 1 a problem found (or the work could not be done), 2 usage.
Credentials in tier URLs (key=, secret=, token=, user:password@) are never printed.
'flashckpt COMMAND --help' says more; docs/CLI.md documents every command and --json.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

from .common import (
    PROBLEM,
    SECRETS,
    USAGE,
    Output,
    Problem,
    UsageError,
    describe_error,
    one_line,
    setup_logging,
)


def commands() -> tuple:
    """The subcommand modules, in the order help lists them (imported only when parsing)."""
    from . import export, gc, listing, ls, report, restore, status, verify

    return (ls, verify, restore, export, gc, status, report, listing)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("flashckpt")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors say what to do in one line, credentials masked."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {one_line(message)}; see '{self.prog} --help'\n")


def _common(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: given before or after the command, neither default overwrites the other.
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="print one JSON document on stdout instead of text (see docs/CLI.md)")  # fmt: skip
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on an error, also print the traceback (credentials still masked)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="flashckpt", description=__doc__, formatter_class=raw)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                   help="print the installed flashckpt version and exit")  # fmt: skip
    _common(p)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands",
                           parser_class=_Parser)  # fmt: skip
    for mod in commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__, formatter_class=raw)
        mod.add_arguments(sp)
        _common(sp)
        sp.set_defaults(module=mod)
    return p


def _fail(args: argparse.Namespace, out: Output, exc: BaseException, code: int) -> int:
    text = str(exc) if isinstance(exc, (UsageError, Problem)) else describe_error(exc)
    if args.debug:
        print(SECRETS.scrub(traceback.format_exc()), file=sys.stderr, end="")
    hint = "" if args.debug or isinstance(exc, (UsageError, Problem)) else " (--debug shows where)"
    print(f"flashckpt {args.cmd}: {one_line(text)}{hint}", file=sys.stderr, flush=True)
    out.document({"command": args.cmd, "ok": False, "error": one_line(text), "exit_code": code})
    return code


def main(argv: list[str] | None = None) -> None:
    raw = sys.argv[1:] if argv is None else argv
    SECRETS.learn_argv(raw)
    parser = build_parser()
    args = parser.parse_args(raw)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        sys.exit(USAGE)
    args.json, args.debug = getattr(args, "json", False), getattr(args, "debug", False)
    setup_logging(args.debug)
    out = Output(args.json)
    try:
        code = args.module.run(args, out)
    except (UsageError, Problem) as exc:
        code = _fail(args, out, exc, exc.code)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # piped into head: stop quietly
        sys.stderr.close()
        code = PROBLEM
    except Exception as exc:  # a tier that cannot be reached, a file that cannot be read
        code = _fail(args, out, exc, PROBLEM)
    sys.exit(code)
