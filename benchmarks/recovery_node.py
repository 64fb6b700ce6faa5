"""A node lost whole: from its SIGKILL to every rank training again, with a spare node and without.

    python benchmarks/recovery_node.py [--repeat 5] [--node-timeout 3] [--restart-every 1]
    python benchmarks/recovery_node.py --power-loss --control-off --lose 0 --restart-every 100

Two simulated nodes x two gloo ranks under ``flashckpt-run`` with ``FLASHCKPT_RESTART_POLICY=
in-process`` (the launcher tests' job, ``tests/inprocess_trainer.py``), each node with its own
shared memory, run directory, agent and loopback address, a shared ``pfs://`` tier persisting
every 1,000 steps, every node's newest step in another node's memory (the multi-node default).
Rank 2 (node 1) saves step 12, waits until node 0 holds its replica, and node 1 is lost whole:
its launcher, workers and agent SIGKILLed, its memory and run directory wiped. Side by side,
interleaved, ``--repeat`` runs of each:

- spare: a third node runs ``flashckpt-run --spare``; the controller hands it node 1, which it
  runs in-process (node 0's ranks keep their processes);
- restart (today without a spare): node 1 is started again, wiped, as soon as the controller
  has found it lost (a scheduler that needs no time at all), and the job restarts whole.

A run passes when the job finishes, every rank restored step 12 and the weights equal an
undisturbed run's; for the spare, node 0's ranks also kept their pids. Times are from the
SIGKILL until every rank has trained a step again; the spare's phases come from its
``node_replaced_in_process`` event (detect: from the SIGKILL to the controller's verdict;
round: the spare's ranks handed over until the round formed; restore: the slowest rank's).
The RESULT line holds the medians and their ratio.

With ``--control-off`` (and ``--power-loss``), the rendezvous runs on a real etcd server and the
controller (with the recovery store) standalone, both on a host of their own
(``tests/control_plane.py``), and ``--lose 0`` loses node 0 instead: no host is special.

With ``--power-loss`` (root: network namespaces), each node runs in a host of its own
(``tests/netns.py``: its own stack and address on one switch) and node 1 loses power: its host
is unplugged first, then everything in it killed, so that none of its connections close and
node 0's ranks stay blocked in a gloo collective on it until their round watch releases them.
The run without a spare then uses the restart policy, and the fresh node is plugged in again.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402
from faults import poll  # noqa: E402  (tests/ holds the job and its cluster of simulated nodes)
from test_launcher import PEER, Cluster, explain, run_job  # noqa: E402

TRAINER = ROOT / "tests" / "inprocess_trainer.py"


def cluster(tmp: Path, name: str, spare: bool, node_timeout: float, lost: int,
            hosts: netns.Hosts | None = None, control=None) -> Cluster:  # fmt: skip
    nodes = 3 if spare else 2
    policy = "restart" if hosts is not None and not spare else "in-process"
    return Cluster(tmp, name, tuple({} for _ in range(nodes)), trainer=TRAINER, nodes=nodes,
                   spares=int(spare), FT_TIERS=f"pfs://{tmp / f'{name}-pfs'}?every_steps=1000",
                   FT_WAIT_TIERS=PEER, FT_FAULTS=f"pause:{2 * lost}:12", hosts=hosts,
                   control=control, FLASHCKPT_RESTART_POLICY=policy,
                   FLASHCKPT_RECOVERY_DEADLINE="15",
                   FLASHCKPT_NODE_TIMEOUT=f"{node_timeout:g}")  # fmt: skip


def one_run(tmp: Path, name: str, spare: bool, node_timeout: float, reference: str,
            power_loss: bool = False, lost: int = 1, control_off: bool = False) -> dict:  # fmt: skip
    count = (3 if spare else 2) + int(control_off)
    hosts = netns.Hosts(count) if power_loss else None
    control = None
    try:
        if control_off:
            from control_plane import ControlPlane
            from test_launcher import TOKEN

            control = ControlPlane(tmp / f"{name}-control", TOKEN, hosts=hosts, host=count - 1,
                                   node_timeout=node_timeout)  # fmt: skip
        return _one_run(tmp, name, spare, node_timeout, reference, hosts, lost, control)
    finally:
        if control is not None:
            control.close()
        if hosts is not None:
            hosts.close()


def _start(c: Cluster, spare: bool) -> None:
    """Every node, the one serving the control plane first (node 0, unless it runs off the
    nodes), until the pausing rank saved step 12 and its peer holds it, the spare warm."""
    if c.control is None:
        c.start(0)
        assert poll(lambda: (c.run_dirs[0] / f"{c.job}.controller").exists(), 60)
    for n in range(0 if c.control is not None else 1, c.n):
        c.start(n)
    assert poll(lambda: (c.marks / "paused").exists(), 180), "the job never paused"
    if spare:
        assert poll(lambda: any(e["kind"] == "spare_ready" for e in c.events(2)), 60)
        time.sleep(1.0)


def _lost_events(c: Cluster, run=None) -> list[dict]:
    """The controller's ``node_lost`` events: its own log off the nodes, else node 0's."""
    if c.control is not None:
        from flashckpt.faults.events import read_events

        path = c.control.events_path
        events = read_events(path) if path.exists() else []
    else:
        events = run.events[0] if run is not None else c.events(0)
    return [e for e in events if e["kind"] == "node_lost"]


def _one_run(tmp: Path, name: str, spare: bool, node_timeout: float, reference: str,
             hosts: netns.Hosts | None, lost: int, control=None) -> dict:  # fmt: skip
    c = cluster(tmp, name, spare, node_timeout, lost, hosts, control)
    kept_node = 1 - lost
    try:
        _start(c, spare)
        killed = time.time()
        if hosts is not None:  # power lost: the host falls silent before its processes die
            hosts.unplug(lost)
        c.lose(lost)
        if not spare:  # the scheduler starts a fresh node in its place at once
            assert poll(lambda: bool(_lost_events(c)), 30)
            if hosts is not None:
                hosts.heal(lost)
            c.start(lost)
    except BaseException:
        c.close()
        raise
    run = c.finish(300)
    taker = 2 if spare else lost
    events = [e for n in (kept_node, taker) for e in run.events[n]]
    restored = {e["rank"]: e["step"] for e in events if e["kind"] == "restored"
                and e["time"] > killed}  # fmt: skip
    first = {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "stepped" and e["time"] > killed:
            first.setdefault(e["rank"], e["time"])
    ranks = (2 * kept_node, 2 * kept_node + 1)
    kept = all(len(set(re.findall(rf"restored {r} \S+ pid=(\d+)", run.logs[kept_node]))) == 1
               for r in ranks)  # fmt: skip
    ok = (run.codes[kept_node] == 0 and run.codes[taker] == 0 and run.digest == reference
          and restored == dict.fromkeys(range(4), 12) and sorted(first) == [0, 1, 2, 3]
          and (kept or not spare))  # fmt: skip
    out = {"ok": ok, "back_s": max(first.values()) - killed if ok else None}
    if found := _lost_events(c, run):
        out["detect_s"] = found[0]["time"] - killed
    done = [e for e in run.events[taker] if e["kind"] == "node_replaced_in_process"]
    if done:
        out.update(round_s=done[0]["round_s"], restore_s=done[0]["restore_s"])
    if not ok:
        print(
            f"  {name}: FAILED (codes {run.codes}, restored {restored}, pids kept {kept}, "
            f"digest {'ok' if run.digest == reference else run.digest})\n{explain(run)[-3000:]}"
        )
    return out


def summary(runs: list[dict], key: str) -> str:
    values = sorted(r[key] for r in runs if r.get(key) is not None)
    if not values:
        return "-"
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return f"{statistics.median(values):.2f} / {p90:.2f} / {values[-1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--node-timeout", type=float, default=3.0)
    parser.add_argument(
        "--restart-every",
        type=int,
        default=1,
        help="run the restart case only every N-th round (it takes 20 s more)",
    )
    parser.add_argument(
        "--power-loss",
        action="store_true",
        help="each node a host of its own; node 1 unplugged, then killed",
    )
    parser.add_argument("--lose", type=int, choices=(0, 1), default=1,
                        help="the node lost (0: the first; see --control-off)")  # fmt: skip
    parser.add_argument("--control-off", action="store_true",
                        help="with --power-loss: the rendezvous (etcd) and a standalone "
                             "controller on a host of their own, off the training nodes")  # fmt: skip
    args = parser.parse_args()
    if args.power_loss and (why := netns.unavailable()):
        parser.error(f"--power-loss: {why}")
    if args.control_off:
        import control_plane

        if not args.power_loss:
            parser.error("--control-off needs --power-loss (hosts of their own)")
        if why := control_plane.unavailable():
            parser.error(f"--control-off: {why}")
    if args.lose == 0 and not args.control_off:
        parser.error("--lose 0 needs --control-off: node 0 otherwise serves the control plane")
    tmp = Path(tempfile.mkdtemp(prefix="recovery-node-"))
    reference = run_job(tmp, "ref").digest
    results: dict[str, list[dict]] = {"spare": [], "restart": []}
    for i in range(args.repeat):
        for case in results:
            if case == "restart" and i % args.restart_every:
                continue
            r = one_run(tmp, f"{case}{i}", case == "spare", args.node_timeout, reference,
                        args.power_loss, args.lose, args.control_off)  # fmt: skip
            results[case].append(r)
            print(f"run {i + 1} {case}: " + ", ".join(
                f"{k} {v:.2f}s" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
                flush=True)  # fmt: skip
    how = "power lost (unplugged, then killed)" if args.power_loss else "lost whole"
    if args.control_off:
        how += ", the control plane on a host of its own"
    print(f"\nnode {args.lose} of 2 {how} (2 gloo ranks a node), node timeout {args.node_timeout:g}s, "
          f"{args.repeat} runs with a spare; seconds p50 / p90 / max")  # fmt: skip
    print(f"{'case':<9}{'passed':>8}{'SIGKILL -> every rank trained':>32}{'detect':>22}"
          f"{'round':>22}{'restore':>22}")  # fmt: skip
    for case, runs in results.items():
        passed = sum(r["ok"] for r in runs)
        print(f"{case:<9}{f'{passed}/{len(runs)}':>8}{summary(runs, 'back_s'):>32}"
              f"{summary(runs, 'detect_s'):>22}{summary(runs, 'round_s'):>22}"
              f"{summary(runs, 'restore_s'):>22}")  # fmt: skip
    med = {c: statistics.median([r["back_s"] for r in runs if r["back_s"] is not None] or [0])
           for c, runs in results.items()}  # fmt: skip
    ratio = med["restart"] / med["spare"] if med["spare"] else float("nan")
    print(f"RESULT node {how}: spare {med['spare']:.2f}s, full restart {med['restart']:.2f}s "
          f"(p50, SIGKILL -> every rank trained again): {ratio:.1f}x faster with a spare; "
          f"passed {sum(r['ok'] for r in results['spare'])}/{len(results['spare'])} and "
          f"{sum(r['ok'] for r in results['restart'])}/{len(results['restart'])}")  # fmt: skip


if __name__ == "__main__":
    main()
