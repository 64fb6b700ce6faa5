"""The controller at thousands of nodes: one real controller, N simulated node agents.

    python benchmarks/scale.py [--nodes 256,1024,4096] [--node-timeout 5] [--json OUT]

The controller is the real one (``flashckpt-agent controller``, policy restart) in its own
process; the node agents are simulated (``scale_sim.py``), many per process, each with its own
gRPC connection on loopback, sending the reports a node agent sends every second (8 workers,
one shared tier) and acting on kill orders. Each run plays one schedule:

- three global commits, each node finishing its part at its own moment of a 0.5 s window;
- 8 nodes silent at once (agents lost), back as new agents after the timeout;
- a worker that exits, then a worker that hangs (its node's watchdog kills it after 3 s);
- a rack of 64 nodes silent at once (half the nodes below 128).

Printed per N: detection latency of the silent nodes (from a node's last report to the
controller's detection naming it, p50 and p99, against ``--node-timeout``), the controller's
CPU (cores, mean over the run and its busiest 5 s; it runs on a core of its own, the
simulators on the others) and peak resident memory, report round
trip p99, delivery (from a detection to every node holding its kill order, slowest node,
worst detection), global-commit lag (the last node's commit to the commit recorded, worst),
and false detections. The simulators share the machine with the controller: when they fall
behind their own schedule (p99 lateness over 0.2 s) or use every core left, the row says
that the simulators, not the controller, were the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RACK = 64
# The controller gets a core of its own, as it would have a machine of its own; the
# simulators share the others (on one core, everything shares it).
_ALL = sorted(os.sched_getaffinity(0))
CONTROLLER_CPUS = set(_ALL[:1])
SIM_CPUS = set(_ALL[1:]) or set(_ALL)


def pin(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def cpu_ticks(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def schedule(n: int, timeout: float, t0: float, rng) -> tuple[list[dict], list[dict], float]:
    """The commits, the faults (absolute times) and the end of one run."""
    nodes = list(range(n))
    rng.shuffle(nodes)
    commits = [{"step": 10 * (k + 1), "at": t0 + 1 + 2 * k, "spread": 0.5} for k in range(3)]
    t = t0 + 7
    away = timeout + 6
    silent = sorted(nodes[:8])
    faults = [{"kind": "silent", "nodes": silent, "at": t, "for_s": away}]
    t += away + 4
    faults.append({"kind": "dead", "nodes": [nodes[8]], "local": 1, "at": t})
    t += 6
    faults.append({"kind": "hang", "nodes": [nodes[9]], "local": 2, "at": t, "floor": 3.0})
    t += 9
    size = min(RACK, n // 2)  # in a small run, half the nodes: some must be left to order
    start = rng.randrange(0, n - size + 1)
    rack = list(range(start, start + size))
    faults.append({"kind": "silent", "nodes": rack, "at": t, "for_s": away})
    return commits, faults, t + timeout + 5


def start_controller(events: Path, timeout: float, interval: float, token: str, log: Path,
                     source: str | None = None):  # fmt: skip
    """The controller as ``flashckpt-agent controller`` runs it, or with ``source`` the
    controller module of that file (an earlier version, for a before/after comparison)."""
    env = dict(os.environ, FLASHCKPT_CONTROLLER_TOKEN=token,
               FLASHCKPT_HEARTBEAT_INTERVAL=str(interval))  # fmt: skip
    events.unlink(missing_ok=True)
    argv = ["controller", "--bind", "127.0.0.1:0", "--events", str(events),
            "--node-timeout", str(timeout), "--policy", "restart"]  # fmt: skip
    if source is None:
        cmd = [sys.executable, "-m", "flashckpt.agent.cli", *argv]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-controller", source, *argv]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: pin(CONTROLLER_CPUS))  # fmt: skip
    port = None
    out = open(log, "w")  # noqa: SIM115 - closed by the drain thread
    for line in proc.stderr:
        out.write(line)
        if "controller serving on" in line:
            port = int(line.split("serving on ")[1].split()[0].rsplit(":", 1)[1])
            break
    if port is None:
        raise RuntimeError(f"the controller did not start: see {log}")

    def drain() -> None:
        with out:
            for line in proc.stderr:
                out.write(line)

    threading.Thread(target=drain, daemon=True).start()
    return proc, port


def serve_controller(source: str, argv: list[str]) -> None:
    """Serve the controller of the module file ``source`` as the agent's CLI would."""
    import asyncio
    import importlib.util
    import logging

    from flashckpt.agent.cli import build_parser

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spec = importlib.util.spec_from_file_location("flashckpt.agent.baseline_controller", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    asyncio.run(module.serve_standalone(args.bind, args.events, None, args.policy,
                                        args.node_timeout))  # fmt: skip


def run_one(n: int, args, work: Path, baseline: bool = False) -> dict:
    import random

    rng = random.Random(n)
    token = secrets.token_hex(16)
    tag = f"{n}-{'baseline' if baseline else 'now'}"
    events = work / f"controller-{tag}.events.jsonl"
    proc, port = start_controller(events, args.node_timeout, args.interval, token,
                                  work / f"controller-{tag}.log",
                                  args.baseline if baseline else None)  # fmt: skip
    t0 = time.time() + 3 + n / 500  # time to start the simulators and connect
    commits, faults, stop = schedule(n, args.node_timeout, t0 + 2, rng)
    plan = {
        "job": "scale", "target": f"127.0.0.1:{port}", "token": token, "nodes": n,
        "workers": args.workers, "interval": args.interval, "step_s": 0.5, "restart_s": 2.0,
        "transport": "unary" if baseline else args.transport, "nodes_per_channel": args.nodes_per_channel,
        "start": t0, "stop": stop, "commits": commits, "faults": faults,
    }  # fmt: skip
    plan_path = work / f"plan-{tag}.json"
    plan_path.write_text(json.dumps(plan))
    sims = min(args.simulators, n)
    bounds = [(i * n // sims, (i + 1) * n // sims) for i in range(sims)]
    outs = [work / f"sim-{tag}-{i}.json" for i in range(sims)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "scale_sim.py"), str(plan_path), str(a), str(b - a), str(o)]
        )  # fmt: skip
        for (a, b), o in zip(bounds, outs, strict=True)
    ]
    samples = []  # (wall, controller cpu seconds)
    while any(p.poll() is None for p in procs):
        samples.append((time.time(), cpu_ticks(proc.pid)))
        time.sleep(1.0)
    rss = peak_rss_mib(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a simulator failed at N={n}")
    sim = [json.loads(o.read_text()) for o in outs]
    row = analyse(n, args, plan, samples, rss, sim, events)
    row["controller"] = "baseline" if baseline else "now"
    return row


def analyse(n: int, args, plan: dict, samples, rss: float, sim: list[dict], events: Path) -> dict:
    from flashckpt.faults.events import read_events

    # Once the simulators stop, every node goes silent: what follows is not the schedule's.
    evs = [e for e in read_events(events) if e["time"] <= plan["stop"]]
    silenced = [(node, last) for s in sim for node, last in s["silenced"]]
    lost = [e for e in evs if e["kind"] == "node_lost"]
    for e in lost:  # a controller of before nodes lost together were one detection each
        e.setdefault("nodes", [e.get("failed_node")])
    detect, missed = [], 0
    never = sum(1 for _, last in silenced if not last)  # silenced before it was ever heard
    silenced = [(node, last) for node, last in silenced if last]
    for node, last in silenced:
        t = next((e["time"] for e in lost if node in e.get("nodes", []) and e["time"] > last), None)
        if t is None:
            missed += 1
        else:
            detect.append(t - last)
    ever_silent = {node for node, _ in silenced}
    false = sum(1 for e in lost for x in e.get("nodes", []) if x not in ever_silent)
    away = [(set(f["nodes"]), f["at"] - plan["interval"], f["at"] + f["for_s"] + plan["interval"])
            for f in plan["faults"] if f["kind"] == "silent"]  # fmt: skip

    def silent_at(node: str, t: float) -> bool:
        i = int(node.removeprefix("node"))
        return any(i in nodes and a <= t <= b for nodes, a, b in away)

    # Delivery: from each detection that ordered kills to the slowest node holding its order.
    got: dict[tuple[str, int], float] = {}
    for s in sim:
        for node, pids, t, _pushed in s["kills"]:
            for pid in pids:
                got.setdefault((node, pid), t)
    delivery, undelivered = [], 0
    for e in evs:
        if not e.get("ordered"):
            continue
        times = []
        for node, pids in e["ordered"].items():
            if silent_at(node, e["time"]):
                continue  # a silent node hears nothing; its workers go with it
            t = min((got[node, p] for p in pids if (node, p) in got), default=None)
            if t is None:
                undelivered += 1
            else:
                times.append(t - e["time"])
        if times:
            delivery.append(max(times))
    # Global commit lag: from the last node's commit of a step to the controller recording it.
    last_commit: dict[int, float] = {}
    for s in sim:
        for _node, step, t in s["commits"]:
            last_commit[step] = max(last_commit.get(step, 0.0), t)
    recorded = {e["step"]: e["time"] for e in evs if e["kind"] == "global_commit"}
    lag = [recorded[c["step"]] - last_commit[c["step"]] for c in plan["commits"]
           if c["step"] in recorded and c["step"] in last_commit]  # fmt: skip
    # The controller's CPU over the run and over its busiest 5 s.
    (w0, c0), (w1, c1) = samples[0], samples[-1]
    windows = [
        (samples[i + 5][1] - samples[i][1]) / (samples[i + 5][0] - samples[i][0])
        for i in range(len(samples) - 5)
    ]
    rtt = [x for s in sim for x in s["rtt"]]
    late = [x for s in sim for x in s["late"]]
    sim_cores = sum(s["cpu_s"] for s in sim) / (plan["stop"] - plan["start"])
    cores_left = len(SIM_CPUS) if SIM_CPUS != CONTROLLER_CPUS else 1 - (c1 - c0) / (w1 - w0)
    row = {
        "nodes": n,
        "node_timeout_s": args.node_timeout,
        "detect_p50_s": pct(detect, 50),
        "detect_p99_s": pct(detect, 99),
        "detected": len(detect),
        "silenced": len(silenced),
        "missed": missed,
        "never_heard": never,
        "false_detections": false,
        "controller_cores": (c1 - c0) / (w1 - w0),
        "controller_cores_peak5s": max(windows, default=float("nan")),
        "controller_rss_mib": rss,
        "rtt_p50_ms": 1000 * pct(rtt, 50),
        "rtt_p99_ms": 1000 * pct(rtt, 99),
        "reports": len(rtt),
        "delivery_max_s": max(delivery, default=float("nan")),
        "delivery_p50_s": pct(delivery, 50),
        "detections_with_kills": len(delivery),
        "undelivered": undelivered,
        "commit_lag_max_s": max(lag, default=float("nan")),
        "commits_recorded": len(lag),
        "sim_late_p99_s": pct(late, 99),
        "sim_cores": sim_cores,
        "errors": [x for s in sim for x in s["errors"]][:5],
    }
    row["simulators_bottleneck"] = row["sim_late_p99_s"] > 0.2 or sim_cores > 0.9 * cores_left
    return row


def show(rows: list[dict]) -> None:
    print(f"{'N':>5} {'detect p50/p99 s':>17} {'ctl cores mean/5s':>18} {'RSS MiB':>8} "
          f"{'RTT p99 ms':>10} {'deliver max s':>13} {'commit lag s':>12} {'false':>5}  sims")  # fmt: skip
    for r in rows:
        if r["controller"] == "baseline":
            print("  baseline controller, unary reports:")
        print(f"{r['nodes']:>5} {r['detect_p50_s']:>8.2f}/{r['detect_p99_s']:<8.2f} "
              f"{r['controller_cores']:>9.2f}/{r['controller_cores_peak5s']:<8.2f} "
              f"{r['controller_rss_mib']:>8.0f} {r['rtt_p99_ms']:>10.1f} "
              f"{r['delivery_max_s']:>13.2f} {r['commit_lag_max_s']:>12.2f} "
              f"{r['false_detections']:>5}  "
              f"{'BOTTLENECK ' if r['simulators_bottleneck'] else ''}"
              f"late p99 {r['sim_late_p99_s']:.2f}s, {r['sim_cores']:.2f} cores")  # fmt: skip
        if r["missed"] or r["undelivered"] or r["errors"] or r["never_heard"]:
            print(f"      missed {r['missed']}, never heard before silenced {r['never_heard']}, "
                  f"undelivered {r['undelivered']}, "
                  f"errors {r['errors']}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="256,1024,4096", help="comma-separated node counts")
    ap.add_argument("--workers", type=int, default=8, help="workers per node (default 8)")
    ap.add_argument("--node-timeout", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=1.0, help="report interval (default 1 s)")
    ap.add_argument("--transport", choices=["stream", "unary"], default="stream",
                    help="agents keep a report stream open (today's agent) or call Report "
                         "once per heartbeat (the earlier agent)")  # fmt: skip
    ap.add_argument(
        "--nodes-per-channel",
        type=int,
        default=1,
        help="simulated nodes sharing one connection (default 1: one each)",
    )
    ap.add_argument("--simulators", type=int, default=2, help="simulator processes")
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="FILE",
        help="also run, before each N, the controller module in FILE (an earlier "
        "agent/controller.py) with agents calling Report once per heartbeat",
    )
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the event logs, plans and observations here",
    )
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashckpt-scale-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for n in [int(x) for x in args.nodes.split(",")]:
            for baseline in [True, False] if args.baseline else [False]:
                rows.append(run_one(n, args, work, baseline))
                show(rows[-1:])
    print()
    show(rows)
    print(f"\nmachine: {os.cpu_count()} cores; node timeout {args.node_timeout}s, report "
          f"interval {args.interval}s, transport {args.transport}; "
          f"median detection overshoot "
          f"{statistics.median([r['detect_p50_s'] for r in rows]) - args.node_timeout:.2f}s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-controller"]:
        serve_controller(sys.argv[2], sys.argv[3:])
    else:
        main()
