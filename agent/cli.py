"""``flashckpt-agent``: the node agent that persists shared-memory snapshots to storage tiers.

Run one per node and job, as a daemon (systemd unit or Kubernetes sidecar: see examples/),
or let the first trainer that names a tier spawn it detached. It streams every READY
snapshot of the job's local ranks to each tier, commits steps, applies retention, and
reports status over a unix socket in FLASHCKPT_RUN_DIR (0700).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from flashckpt import config
from flashckpt.cli.common import SECRETS, ScrubbingFormatter, describe_error, one_line
from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.faults.agent_client import agent_pid_path

USAGE = 2
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return SECRETS.scrub(self._doc(record))

    def _doc(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line that says what to do, credentials masked."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {one_line(message)}; see '{self.prog} --help'\n")


def _usage(message: str) -> NoReturn:
    print(f"flashckpt-agent: {one_line(message)}", file=sys.stderr)
    sys.exit(USAGE)


def _level(text: str) -> str:
    if text.strip().upper() not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level: use one of {', '.join(LEVELS)}"
        )
    return text.strip().upper()


def _version() -> str:
    from flashckpt.cli import version

    return version()


def _check_serve(args: argparse.Namespace) -> str:
    """The job name, every tier (opened once) and the metrics port, checked before the agent
    claims anything: a bad value is one line and exit 2, never a pid file left behind."""
    from flashckpt.storage_tiers import open_tier

    try:
        job = config.resolve_job(args.job, from_command=False)
    except ConfigError as exc:
        _usage(f"--job: {exc}")
    for url in args.tier:
        try:
            tier = open_tier(url)
        except (ConfigError, ImportError, ValueError) as exc:
            _usage(f"--tier: {exc}")
        asyncio.run(tier.close())
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        _usage(f"--metrics-port {args.metrics_port} is not a port (0 to 65535)")
    return job


def _serve(args: argparse.Namespace, job: str) -> None:
    from .daemon import DEFAULT_GIVE_UP_AFTER, serve

    run_dir = config.run_dir(args.run_dir)
    try:
        asyncio.run(
            serve(
                job,
                args.tier,
                config.shm_dir(args.shm_dir),
                run_dir,
                args.metrics_port,
                args.exit_when_idle,
                args.drain_timeout,
                args.metrics_addr,
                config.setting_float("give_up_after", args.give_up_after, DEFAULT_GIVE_UP_AFTER),
                args.while_pid,
            )
        )
    except BaseException:
        _drop_claim(agent_pid_path(run_dir, job))
        raise


def _drop_claim(pid_file: Path) -> None:
    """A serve that failed leaves no pid file of its own: it still holds the claim (its lock
    lives until this process exits), so it removes the file as an owner giving it up does."""
    with contextlib.suppress(OSError):
        if pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="flashckpt-agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                   help="print the installed flashckpt version and exit")  # fmt: skip
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands", parser_class=_Parser)
    s = sub.add_parser(
        "serve", help="run the agent in the foreground (a service manager daemonizes it)"
    )
    s.add_argument(
        "--job",
        default=None,
        help="job name (default: FLASHCKPT_JOB, then TORCHELASTIC_RUN_ID, then 'default')",
    )
    s.add_argument("--tier", action="append", default=[], metavar="URL",
                   help="persist to this tier, fastest first; repeatable (trainers may add theirs). "
                        "e.g. file:///mnt/nvme/ckpt?keep_last=3  pfs:///lustre/ckpt  s3://bucket/run?endpoint_url=...")  # fmt: skip
    s.add_argument("--shm-dir", default=None, help="where trainers' slots live (FLASHCKPT_SHM_DIR)")
    s.add_argument(
        "--run-dir",
        default=None,
        help="socket and pid file directory, created 0700 (FLASHCKPT_RUN_DIR)",
    )
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on PORT (0: any)")  # fmt: skip
    s.add_argument("--metrics-addr", default="127.0.0.1", help="metrics address (0.0.0.0 in a pod)")
    s.add_argument("--exit-when-idle", type=float, default=None, metavar="S",
                   help="exit once no trainer is alive and everything is persisted for S seconds")  # fmt: skip
    s.add_argument("--give-up-after", type=float, default=None, metavar="S",
                   help="with --exit-when-idle: keep retrying a tier that is behind (failing, with "
                        "backoff) for S seconds after the last trainer left before exiting "
                        "(FLASHCKPT_GIVE_UP_AFTER, default 3600)")  # fmt: skip
    s.add_argument("--while-pid", type=int, default=None, metavar="PID",
                   help="with --exit-when-idle: not idle while process PID lives (the launcher)")  # fmt: skip
    s.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds to finish persisting (default 60)")  # fmt: skip
    c = sub.add_parser(
        "controller",
        help="run a job's controller on its own (large jobs, a Kubernetes Service)",
        description="Serve the controller that node agents report to. Point every node at it "
        "with FLASHCKPT_CONTROLLER=HOST:PORT and the same FLASHCKPT_CONTROLLER_TOKEN(_FILE).",
    )
    c.add_argument("--bind", default=None, metavar="HOST:PORT",
                   help="address to serve on (default FLASHCKPT_CONTROLLER_BIND, then "
                        "FLASHCKPT_CONTROLLER); 0.0.0.0 only if you say so")  # fmt: skip
    c.add_argument("--events", default=None, metavar="PATH",
                   help="JSONL event log of detections, kills and global commits "
                        "(default <run_dir>/controller.events.jsonl)")  # fmt: skip
    c.add_argument(
        "--run-dir", default=None, help="default place of the event log (FLASHCKPT_RUN_DIR)"
    )
    c.add_argument("--policy", choices=["restart", "in-process", "notify"], default=None,
                   help="on a detection kill the failed round's workers (restart, default), only "
                        "on a lost node (in-process: the launchers replace a lost worker), or "
                        "only log it (notify); FLASHCKPT_RESTART_POLICY")  # fmt: skip
    c.add_argument("--node-timeout", type=float, default=None, metavar="S",
                   help="a node whose agent is silent this long is lost (FLASHCKPT_NODE_TIMEOUT, default 5)")  # fmt: skip
    for sp in (s, c):
        sp.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="log lines as text or as one JSON object each (default text)")  # fmt: skip
        sp.add_argument("--log-level", type=_level, default="INFO", metavar="LEVEL",
                        help=f"least severe level logged: {', '.join(LEVELS)} (default INFO)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    raw = sys.argv[1:] if argv is None else argv
    SECRETS.learn_argv(raw)  # masked in every message and log line of this process
    p = build_parser()
    args = p.parse_args(raw)
    if args.cmd is None:
        p.print_help(sys.stderr)
        sys.exit(USAGE)
    job = _check_serve(args) if args.cmd == "serve" else None

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else ScrubbingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=args.log_level, handlers=[handler])

    try:
        if args.cmd == "controller":
            from .controller import serve_standalone

            asyncio.run(serve_standalone(args.bind, args.events, args.run_dir, args.policy,
                                         args.node_timeout))  # fmt: skip
            return
        _serve(args, job)
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-agent: {one_line(str(exc))}")
    except OSError as exc:  # a port or socket that cannot be had: one line, details in DEBUG
        logging.getLogger(__name__).debug("the agent stopped", exc_info=True)
        sys.exit(f"flashckpt-agent: cannot serve: {describe_error(exc)}")


if __name__ == "__main__":
    main()
