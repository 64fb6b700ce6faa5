"""``flashckpt-agent``: the node agent that persists shared-memory snapshots to storage tiers.

Run one per node and job, as a daemon (systemd unit or Kubernetes sidecar: see examples/),
or let the first trainer that names a tier spawn it detached. It streams every READY
snapshot of the job's local ranks to each tier, commits steps, applies retention, and
reports status over a unix socket in FLASHCKPT_RUN_DIR (0700).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from flashckpt import config
from flashckpt.errors import FlashCkptError


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="flashckpt-agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
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
    s.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on PORT (0: any)"
    )
    s.add_argument("--metrics-addr", default="127.0.0.1", help="metrics address (0.0.0.0 in a pod)")
    s.add_argument("--exit-when-idle", type=float, default=None, metavar="S",
                   help="exit once no trainer is alive and everything is persisted for S seconds")  # fmt: skip
    s.add_argument("--give-up-after", type=float, default=None, metavar="S",
                   help="with --exit-when-idle: keep retrying a tier that is behind (failing, with "
                        "backoff) for S seconds after the last trainer left before exiting "
                        "(FLASHCKPT_GIVE_UP_AFTER, default 3600)")  # fmt: skip
    s.add_argument("--while-pid", type=int, default=None, metavar="PID",
                   help="with --exit-when-idle: not idle while process PID lives (the launcher)")  # fmt: skip
    s.add_argument(
        "--drain-timeout", type=float, default=60.0, help="on SIGTERM, seconds to finish persisting"
    )
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
    c.add_argument("--policy", choices=["restart", "notify"], default=None,
                   help="on a detection kill the failed round's workers (restart, default) or only "
                        "log it (notify); FLASHCKPT_RESTART_POLICY")  # fmt: skip
    c.add_argument("--node-timeout", type=float, default=None, metavar="S",
                   help="a node whose agent is silent this long is lost (FLASHCKPT_NODE_TIMEOUT, default 5)")  # fmt: skip
    for sp in (s, c):
        sp.add_argument("--log-format", choices=["text", "json"], default="text")
        sp.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])

    try:
        if args.cmd == "controller":
            from .controller import serve_standalone

            asyncio.run(serve_standalone(args.bind, args.events, args.run_dir, args.policy,
                                         args.node_timeout))  # fmt: skip
            return
        from .daemon import DEFAULT_GIVE_UP_AFTER, serve

        asyncio.run(
            serve(
                config.resolve_job(args.job, from_command=False),
                args.tier,
                config.shm_dir(args.shm_dir),
                config.run_dir(args.run_dir),
                args.metrics_port,
                args.exit_when_idle,
                args.drain_timeout,
                args.metrics_addr,
                config.setting_float("give_up_after", args.give_up_after, DEFAULT_GIVE_UP_AFTER),
                args.while_pid,
            )
        )
    except FlashCkptError as exc:
        sys.exit(f"flashckpt-agent: {exc}")


if __name__ == "__main__":
    main()
