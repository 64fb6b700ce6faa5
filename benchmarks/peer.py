"""Peer replicas: ``python benchmarks/peer.py [--mib 256] [--rounds 5]``.

Two simulated nodes on this machine, each with its own shared memory and run directory, a
controller, and node 0's real agent holding node 1's replica (``FLASHCKPT_PEER_REPLICAS=1``,
as ``flashckpt-run`` sets for a job of several nodes). Node 1 is one rank saving a state of
``--mib`` MiB (16 tensors and their AdamW state). In one run, side by side:

- restore: node 1 wiped, a fresh process restores its rank from node 0's memory (verified,
  into the live state), against a plain socket copy of the same bytes between the same two
  nodes (node 0 sends the replica's data file with ``sendfile``, node 1 receives it into a
  buffer); medians of ``--rounds``, interleaved. Target: restore >= 0.8 x the socket copy;
- step time: a training step (a matmul of ``--step-ms``) saving every step, with the replica
  kept on node 0 and without (two jobs in one process, alternating blocks of steps, medians
  of ``--rounds`` interleaved rounds). Target: within 3 %;
- steps lost: the saver saves steps 0..``--steps`` - 1 (``--step-ms`` apart) with a shared
  tier persisting at most every ``--every`` steps (default 1000: storage far behind, as it is
  at scale), and node 1 is lost right after its last save (no close, no wait for any tier);
  wiped, the step a restore finds with the replica and with the storage tier only
  (``FLASHCKPT_PEER_REPLICAS=0``). The replica trails by the steps saved while its last round
  and the rest after it ran (``duty``): a few seconds of saving, which is why the default
  run is 60 steps long. A node lost in the first rounds (the first save also goes to
  storage, which slows the replica's first round) may find only step 0 in the replica.

The RESULT line holds the ratios the targets speak of.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "peer-bench-" + uuid.uuid4().hex


def node_env(base: Path, n: int, **more: str) -> dict[str, str]:
    return {**os.environ, "FLASHCKPT_NODE": f"node{n}", "FLASHCKPT_SHM_DIR": str(base / f"shm{n}"),
            "FLASHCKPT_RUN_DIR": str(base / f"run{n}"), "FLASHCKPT_PEER_REPLICAS": "1",
            "OMP_NUM_THREADS": "1", **more}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    """One of node 1's processes: ``save``, ``restore`` (timed, beside the socket copy) or
    ``steps`` (step time with and without the replica). Prints one JSON line."""
    import torch

    from flashckpt import Checkpointer

    def build(seed: int):
        torch.manual_seed(seed)
        n = max(1, int(args.mib * 2**20) // 4 // 3 // 16)
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(16)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model:
            p.grad = torch.randn_like(p)
        opt.step()
        return {"model": model, "optim": opt}

    shared = f"pfs://{args.base / 'pfs'}?every_steps={args.every}"
    if args.child == "save":
        state = build(0)
        ck = Checkpointer(shared, job=args.job)
        ck.save(0, state)
        ck.wait(0, tier=shared, timeout=300)  # storage has the first step, as it would
        for step in range(1, args.steps):
            time.sleep(args.step_ms / 1e3)  # the step's compute: the agent replicates meanwhile
            ck.save(step, state)
        print(json.dumps({"saved": args.steps - 1}), flush=True)
        os._exit(0)  # the node is lost at once: no close(), no wait for any tier
    elif args.child == "restore":
        state = build(1)
        times, copies = [], []
        with Checkpointer(job=args.job) as ck:
            for _ in range(args.rounds + 1):
                t = time.perf_counter()
                step = ck.restore(state)
                times.append(time.perf_counter() - t)
                copies.append(socket_copy(args.copy_port, args.nbytes))
            source = ck._restored_from
            if os.environ.get("PEER_BENCH_PROFILE"):
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.runcall(ck.restore, state)
                pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
        print(json.dumps({"step": step, "source": source, "restore": statistics.median(times[1:]),
                          "copy": statistics.median(copies[1:])}))  # fmt: skip
    elif args.child == "found":  # the newest step a wiped node restores (its tiers: the env's)
        with Checkpointer(shared, job=args.job) as ck:
            print(json.dumps({"step": ck.restore(build(2)), "source": ck._restored_from}))
    else:  # steps
        print(json.dumps(step_times(args, build)))


def step_times(args: argparse.Namespace, build) -> dict:
    import torch

    from flashckpt import Checkpointer

    state = build(0)
    a = torch.randn(512, 512)
    reps = max(1, int(args.step_ms / 2))

    def compute() -> None:
        for _ in range(reps):
            a.mm(a)

    on = Checkpointer(job=f"{args.job}-on")  # tiers: the replica (FLASHCKPT_PEER_REPLICAS)
    os.environ["FLASHCKPT_PEER_REPLICAS"] = "0"
    off = Checkpointer(job=f"{args.job}-off")  # no tier: memory only
    medians = {"on": [], "off": []}
    step = 0
    for _ in range(args.rounds):
        for name, ck in (("on", on), ("off", off)):
            times = []
            for _ in range(10):
                t = time.perf_counter()
                compute()
                ck.save(step, state)
                times.append(time.perf_counter() - t)
                step += 1
            medians[name].append(statistics.median(times[2:]))
    on.close()
    off.close()
    return {k: statistics.median(v) for k, v in medians.items()}


def socket_copy(port: int, nbytes: int) -> float:
    """Receive ``nbytes`` from node 0's plain sender into a buffer; seconds."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < nbytes:
            n = s.recv_into(view[got:])
            if not n:
                raise RuntimeError("the sender hung up")
            got += n
    return time.perf_counter() - t


def sender(path: Path) -> int:
    """Node 0's plain sender: each connection gets ``path``'s bytes by ``sendfile``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            try:
                with conn, open(path, "rb") as f:
                    size, sent = os.fstat(f.fileno()).st_size, 0
                    while sent < size:
                        sent += os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)
            except OSError:
                continue  # the receiver went away: serve the next one

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def run_child(args: argparse.Namespace, kind: str, env: dict, **more: object) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--job", args.job, "--base", str(args.base),
           "--mib", str(args.mib), "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--every", str(args.every), "--step-ms", str(args.step_ms)]  # fmt: skip
    for k, v in more.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if os.environ.get("PEER_BENCH_PROFILE"):
        sys.stderr.write(out.stderr)
    if out.returncode:
        raise SystemExit(f"{kind} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from flashckpt.agent.controller import Controller, InThread

    from flashckpt.config import replicas_dir
    from flashckpt.faults import control

    args.base = Path(tempfile.mkdtemp(prefix="flashckpt-peer-"))
    args.job = f"peer-{uuid.uuid4().hex[:6]}"
    controller = InThread(Controller(), "127.0.0.1:0", TOKEN)
    address = f"127.0.0.1:{controller.start_serving()}"
    agents = []
    try:
        for n in (0, 1):
            (args.base / f"run{n}").mkdir(mode=0o700)
            for job in (args.job, f"{args.job}-on", f"{args.job}-off"):
                control.Endpoint(address, TOKEN).save(args.base / f"run{n}", job)
        for job in (args.job, f"{args.job}-on"):  # node 0's agents hold node 1's replicas
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", job,
                 "--shm-dir", str(args.base / "shm0"), "--run-dir", str(args.base / "run0")],
                env=node_env(args.base, 0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        time.sleep(3)  # they report their replica stores to the controller
        env1 = node_env(args.base, 1)
        saved = run_child(args, "save", env1)["saved"]
        wipe(args.base, 1)  # node 1 is lost: its agent and memory with it
        stored = sorted(int(p.name.split("-")[1].split(".")[0])
                        for p in (args.base / "pfs" / args.job).glob("step-*"))  # fmt: skip
        data = next(replicas_dir(args.base / "shm0", args.job).rglob("data"))
        args.nbytes = data.stat().st_size
        port = sender(data)
        r = run_child(args, "restore", env1, copy_port=port, nbytes=args.nbytes)
        print(f"state {args.nbytes / 2**20:.0f} MiB; restore from node 0's memory "
              f"{r['restore'] * 1e3:.1f} ms (source {r['source']}, step {r['step']}); plain "
              f"socket copy of the same bytes {r['copy'] * 1e3:.1f} ms: "
              f"{r['copy'] / r['restore']:.2f}x (target >= 0.8)")  # fmt: skip
        wipe(args.base, 1)
        with_peer = run_child(args, "found", env1)
        wipe(args.base, 1)
        storage = run_child(args, "found", {**env1, "FLASHCKPT_PEER_REPLICAS": "0"})
        lost_peer, lost_storage = saved - with_peer["step"], saved - storage["step"]
        print(f"node 1 lost after step {saved}: resumes after step {with_peer['step']} with the "
              f"replica ({with_peer['source']}), after step {storage['step']} from storage only "
              f"(every {args.every} steps; it holds {stored}): {lost_peer} vs {lost_storage} "
              "step(s) lost")  # fmt: skip
        s = run_child(args, "steps", env1)
        slower = s["on"] / s["off"] - 1
        print(f"step ({args.step_ms:g} ms of compute, a save every step): {s['off'] * 1e3:.1f} ms "
              f"without the replica, {s['on'] * 1e3:.1f} ms with it: {100 * slower:+.1f} % "
              "(target within 3 %)")  # fmt: skip
        print(f"RESULT case=peer restore_from_peer/socket_copy={r['copy'] / r['restore']:.2f} "
              f"(>= 0.80) step_time_with/without={s['on'] / s['off']:.3f} (<= 1.03) "
              f"steps_lost_replica={lost_peer} steps_lost_storage={lost_storage}")  # fmt: skip
    finally:
        for a in agents:
            a.terminate()
            a.wait(30)
        controller.stop()
        for n in (0, 1):
            wipe(args.base, n)
        shutil.rmtree(args.base, ignore_errors=True)


def wipe(base: Path, n: int) -> None:
    """A node's agents and memory gone (its run directory kept: the controller's address
    is there)."""
    for pidfile in (base / f"run{n}").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), 9)
    shutil.rmtree(base / f"shm{n}", ignore_errors=True)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=float, default=256.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--copy-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments(parser)
    a = parser.parse_args()
    if a.child:
        child(a)
    else:
        main(a)
