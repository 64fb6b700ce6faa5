"""Recovery time: from a fault to every rank training again, on two simulated nodes.

    python benchmarks/recovery.py [--rounds 3] [--hang-floor 3] [--baseline-timeout 90]
    python benchmarks/recovery.py --repeat 20 --cases kill,raise,hang,sleep,spin

Each node is one ``flashckpt-run`` (two gloo ranks, its own shared memory and run directory)
joined by a c10d rendezvous on 127.0.0.1, as two hosts would be. The job is the launcher
tests' (``tests/inprocess_trainer.py``: ``flashckpt.run_recoverable(train)``, 40 steps, a
snapshot every step). Each case runs ``--rounds`` times under both restart policies:

- kill: rank 1 SIGKILLs itself after step 20;
- hang: rank 3 SIGSTOPs itself after step 20 (``FLASHCKPT_HANG_FLOOR`` = ``--hang-floor`` on
  every node, as a real job sets it: the other node's ranks, blocked on it, fall silent too,
  and the nodes agree on one culprit);
- raise: rank 2's training function raises after step 20;
- sleep: rank 3 sleeps for an hour after step 20 (alive, no progress), spin: rank 1 spins
  in a Python loop that never returns, and save: rank 3 hangs inside its ``save()`` of step 21
  (its own phase's timeout is five minutes; its peers wait in step 22's all-reduce, judged at
  the floor) (``--cases`` picks them);

With ``--repeat N``, instead: every case N times in-process, and how many runs passed (the job
finished in-process, only the faulty rank replaced, the weights equal to an undisturbed run's)
with the p50 and p90 of the time until every rank trained again.

With ``--lost-node``, instead: a node lost whole (SIGKILLed, its memory wiped), taken in-process
by a spare node and, side by side, by today's full restart (``recovery_node.py``, with the
phases: detection, round, restore).

With ``--effective MINUTES``, instead: one run of that length per policy, a fault every
``--every`` seconds (kill of rank 1, hang of rank 3, exception in rank 2, in turn) on steps
of ``--step-ms`` of simulated compute, and each run's ``flashckpt report``: the effective
training time and where the lost time went.

``restart`` is today's full restart (every worker of every node killed and started again),
``in-process`` keeps every healthy process and hands the lost rank to a warm standby. In the
same run, the baseline: the kill case under plain ``torchrun`` with the same arguments (a
whole restart, then the job's own restore), timed to its end.

The split comes from the launchers' event logs (``flashckpt report``); medians are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "tests" / "inprocess_trainer.py"
STEPS, FAULT_STEP = 40, 20
NODES = NPROC = 2  # --nccl: one node of one rank (NCCL takes one GPU a rank)
LAUNCHERS = {"flashckpt-run": [sys.executable, "-P", "-m", "flashckpt.faults.launcher"],
             "torchrun": [sys.executable, "-P", "-m", "torch.distributed.run"]}  # fmt: skip
sys.path.insert(0, str(ROOT / "tests"))
from ports import free_port, free_port_pair  # noqa: E402  (tests/ holds the job and its helpers)

FAULTS = {"kill": f"kill:1:{FAULT_STEP}", "hang": f"stop:3:{FAULT_STEP}",
          "raise": f"raise:2:{FAULT_STEP}", "sleep": f"sleep:3:{FAULT_STEP}",
          "spin": f"spin:1:{FAULT_STEP}", "save": f"savehang:3:{FAULT_STEP}"}  # fmt: skip
HUNG = {"hang": 3, "sleep": 3, "spin": 1, "save": 3}  # the rank that must be the one killed


def two_nodes(launcher: str, tmp: Path, timeout: float, node_env: tuple[dict, dict] = ({}, {}),
              **env: str) -> tuple[list[int], float, list[Path]]:  # fmt: skip
    """Run the job on two simulated nodes (``NODES`` x ``NPROC``); (exit codes, seconds, the
    nodes' event logs)."""
    port, job = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
    procs, runs, shms = [], [], []
    marks = tmp / f"{job}-marks"
    marks.mkdir()
    common = {"FLASHCKPT_CONTROLLER_TOKEN": uuid.uuid4().hex,
              "FLASHCKPT_CONTROLLER": f"127.0.0.1:{free_port_pair()}",
              "FT_MARKS": str(marks),
              "FT_DIGEST": str(tmp / f"{job}.digest"), "FT_STEPS": str(STEPS),
              "OMP_NUM_THREADS": "1",
              "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                          os.environ.get("PYTHONPATH")]))}  # fmt: skip
    for node in range(NODES):
        run_dir, shm = tmp / f"{job}-run{node}", Path("/dev/shm") / f"flashckpt-bench-{job}-{node}"
        runs.append(run_dir)
        shms.append(shm)
        full = {**os.environ, "FLASHCKPT_SHM_DIR": str(shm), "FLASHCKPT_RUN_DIR": str(run_dir),
                "FLASHCKPT_NODE": f"node{node}", **common, **env, **node_env[node]}  # fmt: skip
        full.pop("FLASHCKPT_JOB", None)
        # Each node its own address, as real hosts have: the rendezvous orders nodes by address,
        # then by launcher pid, so a node started again keeps its ranks (and its memory's use).
        cmd = [*LAUNCHERS[launcher], f"--nnodes={NODES}", f"--nproc-per-node={NPROC}",
               "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", "--max-restarts=30",
               "--monitor-interval=0.1", f"--local-addr=127.0.0.{node + 1}",
               str(TRAINER)]  # fmt: skip
        with open(tmp / f"{job}-node{node}.log", "w") as out:  # kept when a run fails
            procs.append(subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        if node == 0:
            time.sleep(1.0)  # node 0 hosts the rendezvous store
    began, codes = time.monotonic(), []
    try:
        for p in procs:
            try:
                codes.append(p.wait(max(1.0, timeout - (time.monotonic() - began))))
            except subprocess.TimeoutExpired:
                codes.append(-999)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _kill_leftovers(shms)
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)
    return codes, time.monotonic() - began, [r / f"{job}.events.jsonl" for r in runs]


def _kill_leftovers(shms: list[Path]) -> None:
    """Workers and standbys run in their own sessions: end any that used these directories."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if any(f"FLASHCKPT_SHM_DIR={s}".encode() in env for s in shms):
                os.kill(int(pid), signal.SIGKILL)


def run_policy(policy: str, tmp: Path, hang_floor: float, timeout: float, **env: str):
    """One job under ``policy``; its ``flashckpt report``."""
    from flashckpt.faults.events import read_events
    from flashckpt.faults.report import summarize

    codes, _, logs = two_nodes("flashckpt-run", tmp, timeout,
                               FLASHCKPT_HANG_FLOOR=str(hang_floor),
                               FLASHCKPT_RESTART_POLICY=policy, **env)  # fmt: skip
    if codes != [0] * NODES:
        raise SystemExit(f"{policy}: the job did not finish (exit codes {codes}); logs in {tmp}")
    events = [e for log in logs if log.exists() for e in read_events(log)]
    return summarize(events), sum(e["kind"] == "killed" for e in events)


def measure(policy: str, case: str, tmp: Path, hang_floor: float) -> dict:
    report, killed = run_policy(policy, tmp, hang_floor, 240, FT_FAULTS=FAULTS[case])
    failures = report.failures
    if policy == "in-process" and case == "hang" and killed != 1:
        raise SystemExit(f"in-process hang: {killed} ranks killed as hung (one expected)")
    if not failures or failures[0].resume_s is None:
        raise SystemExit(f"{policy} {case}: no failure and restore in the event logs")
    f = failures[0]
    if policy == "in-process" and f.mode != "in-process":
        raise SystemExit(f"in-process {case}: fell back to a restart ({f.fallback})")
    zero = lambda v: v or 0.0  # noqa: E731
    return {"again": f.detect_s + f.resume_s, "detect": f.detect_s,
            "abort": zero(f.abort_s), "rendezvous": zero(f.rendezvous_s),
            "replacement": zero(f.replacement_s), "restart": zero(f.restart_s),
            "restore": zero(f.restore_s), "steps": f.recomputed_steps() or 0}  # fmt: skip


def repeat(args: argparse.Namespace, tmp: Path) -> None:
    """``--repeat N``: every case N times in-process; how many runs passed (finished in-process,
    only the faulty rank replaced, weights equal to an undisturbed run's) and the p50 and p90
    of the time from the fault until every rank trained again."""
    from flashckpt.faults.events import read_events
    from flashckpt.faults.report import summarize

    env = {"FLASHCKPT_HANG_FLOOR": str(args.hang_floor), "FLASHCKPT_RESTART_POLICY": "in-process"}
    codes, _, _ = two_nodes("flashckpt-run", tmp, 240, **env)
    (undisturbed,) = [p.read_text() for p in tmp.glob("*.digest")]
    print(f"{NODES} nodes x {NPROC} gloo ranks, in-process, hang floor {args.hang_floor:g}s on "
          f"every node, {args.repeat} runs a case (seconds from the fault until every rank "
          "trained again)")  # fmt: skip
    print(f"{'case':<7}{'passed':>8}{'p50':>8}{'p90':>8}{'max':>8}  failures")
    logs_of: list[Path] = []  # the failed runs' event logs
    for case in args.cases.split(","):
        times, failed = [], []
        for _ in range(args.repeat):
            for old in tmp.glob("*.digest"):
                old.unlink()
            codes, took, logs = two_nodes("flashckpt-run", tmp, 180, FT_FAULTS=FAULTS[case], **env)
            events = [e for log in logs if log.exists() for e in read_events(log)]
            digest = [p.read_text() for p in tmp.glob("*.digest")]
            failures = summarize(events).failures
            killed = sorted(e["rank"] for e in events if e["kind"] == "killed")
            why = None
            if codes != [0] * NODES:
                why = f"exit codes {codes} after {took:.0f}s"
            elif digest != [undisturbed]:
                why = "weights differ from the undisturbed run's"
            elif not failures or failures[0].mode != "in-process" or failures[0].resume_s is None:
                why = "not recovered in-process"
            elif case in HUNG and killed != [HUNG[case]]:
                why = f"killed ranks {killed}, not [{HUNG[case]}]"
            if why:
                failed.append(why)
                logs_of.extend(logs)
            else:
                times.append(failures[0].detect_s + failures[0].resume_s)
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        cells = (f"{statistics.median(times):.2f}", f"{q[8]:.2f}", f"{max(times):.2f}") if (
            times) else ("-", "-", "-")  # fmt: skip
        print(f"{case:<7}{len(times):>5}/{args.repeat:<2}" + "".join(f"{c:>8}" for c in cells)
              + f"  {'; '.join(failed) or '-'}", flush=True)  # fmt: skip
    if logs_of:
        print(f"the failed runs' logs: {', '.join(sorted({str(p.parent) for p in logs_of}))}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def torchrun_kill(tmp: Path, timeout: float) -> str:
    """The kill case under plain torchrun: no launcher events, so the fault is dated by the
    trainer's fault marker and every rank training again by the workers' own restores."""
    from flashckpt.faults.events import ENV, read_events

    log = tmp / "torchrun.events.jsonl"
    codes, took, _ = two_nodes("torchrun", tmp, timeout, FT_FAULTS=FAULTS["kill"],
                               **{ENV: str(log)})  # fmt: skip
    if codes != [0] * NODES:
        return f"not finished after {took:.0f}s (exit codes {codes})"
    (mark,) = tmp.glob(f"*-marks/kill-1-{FAULT_STEP}")
    restored = [e["time"] for e in read_events(log)
                if e["kind"] == "restored" and e.get("step") is not None]  # fmt: skip
    if len(restored) < 4:
        return f"finished in {took:.1f}s, but its restores are not in {log}"
    return f"{max(restored) - mark.stat().st_mtime:.2f}s to every rank training again"


def effective(args: argparse.Namespace, tmp: Path) -> None:
    from flashckpt.faults.report import render

    step_s = args.step_ms / 1000
    steps = int(args.effective * 60 / (step_s + 0.03))  # about 30 ms of real step and save
    for policy in args.policies.split(","):
        report, _ = run_policy(policy, tmp, args.hang_floor, args.effective * 120 + 300,
                            FT_STEPS=str(steps), FT_STEP_S=str(step_s), FT_EVERY=str(args.every),
                            FT_SCHEDULE="kill:1,stop:3,raise:2", FT_T0=str(time.time()))  # fmt: skip
        print(f"--- {policy}: {steps} steps, a fault every {args.every:g}s, hang floor "
              f"{args.hang_floor:g}s")  # fmt: skip
        print(render(report))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hang-floor", type=float, default=3.0)
    p.add_argument("--baseline-timeout", type=float, default=90.0)
    p.add_argument("--cases", default="kill,hang,raise")
    p.add_argument("--effective", type=float, metavar="MINUTES")
    p.add_argument("--every", type=float, default=60.0)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--policies", default="in-process,restart")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="every case N times in-process: runs passed, p50 and p90")  # fmt: skip
    p.add_argument(
        "--nccl",
        action="store_true",
        help="the kill case on NCCL: one node of one rank on GPU 0 (rank 0 killed)",
    )
    p.add_argument("--lost-node", action="store_true",
                   help="instead: a node lost whole, taken by a spare node and by a full restart "
                        "(benchmarks/recovery_node.py, --repeat runs, default 5)")  # fmt: skip
    args = p.parse_args()
    if args.lost_node:
        import recovery_node

        sys.argv = [sys.argv[0], "--repeat", str(args.repeat or 5)]
        return recovery_node.main()
    cases = args.cases.split(",")
    if args.nccl:
        global NODES, NPROC
        NODES = NPROC = 1
        FAULTS["kill"] = f"kill:0:{FAULT_STEP}"
        os.environ["FT_BACKEND"] = "nccl"
        cases = ["kill"]
    tmp = Path(tempfile.mkdtemp(prefix="fc-recovery-"))
    if args.repeat:
        return repeat(args, tmp)  # its directory removed unless a run failed
    if args.effective:
        try:
            return effective(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = {(policy, case): [measure(policy, case, tmp, args.hang_floor)
                             for _ in range(args.rounds)]
            for case in cases for policy in args.policies.split(",")}  # fmt: skip
    baseline = torchrun_kill(tmp, args.baseline_timeout) if args.baseline_timeout > 0 else None
    shutil.rmtree(tmp, ignore_errors=True)  # a failed run exits above, its logs kept
    backend = os.environ.get("FT_BACKEND", "gloo")
    print(f"fault -> every rank training again, {NODES} nodes x {NPROC} {backend} ranks, median of "
          f"{args.rounds} (seconds; hang floor {args.hang_floor:g}s)")  # fmt: skip
    cols = ("again", "detect", "abort", "rendezvous", "replacement", "restart", "restore")
    print(f"{'case':<7}{'policy':<12}" + "".join(f"{c:>12}" for c in cols) + f"{'steps lost':>12}")
    unused = {"in-process": {"restart"}, "restart": {"abort", "rendezvous", "replacement"}}
    for (policy, case), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        cells = ("-" if c in unused[policy] else f"{med[c]:.2f}" for c in cols)
        print(f"{case:<7}{policy:<12}" + "".join(f"{c:>12}" for c in cells)
              + f"{med['steps']:>12.0f}")  # fmt: skip
    for case in cases:
        if ("in-process", case) not in rows or ("restart", case) not in rows:
            continue
        fast = statistics.median(r["again"] for r in rows["in-process", case])
        slow = statistics.median(r["again"] for r in rows["restart", case])
        print(f"{case}: in-process recovers {slow / fast:.1f}x faster than a full restart")
    if baseline is not None:
        print(f"baseline, plain torchrun, kill case: {baseline}")


if __name__ == "__main__":
    main()
