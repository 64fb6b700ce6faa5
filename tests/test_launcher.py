"""``flashckpt-run`` across two simulated nodes on this machine: a killed rank and a hung rank
are brought back, every rank at the same step, and the job ends bit-identical to an
undisturbed run.

Each node is its own launcher process with its own shared-memory and run directories, joined
by a real c10d rendezvous on 127.0.0.1; the workers are real gloo DDP processes that call a
plain ``init_process_group()``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import ROOT, descendants
from faults import poll
from ports import free_port, free_port_pair

from flashckpt import config
from flashckpt.faults.events import events_path, read_events

if TYPE_CHECKING:
    from control_plane import ControlPlane
    from netns import Hosts

TRAINER = ROOT / "tests" / "ft_trainer.py"
LAUNCHER = Path(sys.executable).parent / "flashckpt-run"
NODES, PER_NODE = 2, 2
TOKEN = "launcher-tests-" + uuid.uuid4().hex
_RUN_DIRS = itertools.count()
PEER = config.peer_urls(1)[0]  # the replica a multi-node job keeps by default


def node_addr(node: int) -> str:
    """A simulated node's own loopback address, as a real node has its own host name.

    torch's rendezvous hands out ranks in the order of (address, launcher pid): nodes sharing
    one address would be ordered by pid, and a node started again with a smaller pid than a
    healthy one (pids wrap) would take the healthy node's ranks and leave its memory unused."""
    return f"127.0.0.{node + 1}"


@dataclass
class Run:
    codes: list[int]
    logs: list[str]
    events: list[list[dict]]
    digest: str | None

    def restored(self) -> list[tuple[int, str]]:
        """(rank, step) of every ``restored`` report, in order, over both nodes (two workers'
        reports can share a line of the launcher's output)."""
        return [
            (int(rank), step)
            for text in self.logs
            for rank, step in re.findall(r"restored (\d+) (None|\d+)", text)
        ]


class Cluster:
    """Two flashckpt-run "nodes" of two workers each, each with its own shared-memory and run
    directories and node name (``node_env``: each node's own variables), joined by one c10d
    rendezvous. The last ``spares`` of the ``nodes`` are spare nodes (``--spare``).

    With ``hosts`` (``netns.Hosts``, one a node), node ``n`` runs in host ``n``, its own network
    stack: it binds and advertises its host's address (``--local-addr``, gloo on the host's
    interface) and reaches the rendezvous, the controller and the recovery store at node 0's
    (``is_host`` tells torch which node serves the rendezvous: it cannot tell from the address),
    or, with ``control`` (``control_plane.ControlPlane``), off the nodes: etcd's rendezvous and
    a standalone controller, on a host of their own.
    The files (tiers, run and shared-memory directories) stay the machine's, as a parallel file
    system mounted on every host."""

    def __init__(self, tmp: Path, name: str, node_env: tuple[dict, ...] = ({}, {}),
                 trainer: Path = TRAINER, nodes: int = NODES, per_node: int = PER_NODE,
                 spares: int = 0, hosts: Hosts | None = None, control: ControlPlane | None = None,
                 max_restarts: int = 3, job: str | None = None, **env: str):  # fmt: skip
        self.tmp, self.name, self.trainer, self.n = tmp, name, trainer, nodes
        self.max_restarts = max_restarts
        self.per_node, self.spares, self.hosts = per_node, spares, hosts
        assert hosts is None or len(hosts) >= nodes, "one host a node"
        self.port, self.job = free_port(), job or f"{name}-{uuid.uuid4().hex[:8]}"
        # A free port, not the default rendezvous port + 1, which another test may hold.
        self.controller = f"{self.addr(0, '127.0.0.1')}:{free_port_pair()}"
        self.control = control  # the rendezvous and the controller off the nodes, if given
        if control is not None:
            self.controller = control.address
        self.marks = tmp / f"{name}-marks"
        self.marks.mkdir()
        self.env, self.node_env = env, node_env
        self.procs: list[subprocess.Popen | None] = [None] * nodes
        self.logs: list = [None] * nodes
        self.shm = [Path("/dev/shm") / f"flashckpt-test-{self.job}-n{n}" for n in range(nodes)]
        # Short names: the agent's unix socket path, under them, holds at most 107 bytes.
        self.run_dirs = [tmp / f"r{next(_RUN_DIRS)}" for n in range(nodes)]
        self.starts = [0] * nodes

    def addr(self, node: int, alone: str | None = None) -> str:
        """Node ``node``'s address: its host's, else ``alone`` or its own loopback address."""
        if self.hosts is not None:
            return self.hosts.address(node)
        return alone or node_addr(node)

    def start(self, node: int) -> None:
        full = {**os.environ, "FLASHCKPT_SHM_DIR": str(self.shm[node]),
                "FLASHCKPT_RUN_DIR": str(self.run_dirs[node]), "FT_MARKS": str(self.marks),
                "FT_DIGEST": str(self.tmp / f"{self.name}.digest"), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "FLASHCKPT_CONTROLLER_TOKEN": TOKEN, "FLASHCKPT_NODE": f"node{node}",
                "FLASHCKPT_CONTROLLER": self.controller, **self.env,
                **self.node_env[node]}  # fmt: skip
        full.pop("FLASHCKPT_JOB", None)
        spare = ["--spare"] if node >= self.n - self.spares else []
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.addr(0, '127.0.0.1')}:{self.port}"]
        if self.hosts is not None:
            full["GLOO_SOCKET_IFNAME"] = self.hosts.training_iface
            rdzv.append(f"--rdzv-conf=is_host={int(node == 0)}")
        if self.control is not None:
            rdzv = self.control.rdzv_args()
        cmd = [str(LAUNCHER), *spare, f"--nnodes={self.n - self.spares}",
               f"--nproc-per-node={self.per_node}", *rdzv, f"--rdzv-id={self.job}",
               f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1", f"--local-addr={self.addr(node)}",
               str(self.trainer)]  # fmt: skip
        if self.hosts is not None:
            cmd = self.hosts.command(node, cmd)
        self.starts[node] += 1
        log = open(self.tmp / f"{self.name}-node{node}-{self.starts[node]}.log", "w")  # noqa: SIM115
        self.logs[node] = log
        self.procs[node] = subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)  # fmt: skip

    def node_pids(self, node: int) -> list[int]:
        """The node's launcher, its workers (own sessions) and its agent (detached)."""
        proc = self.procs[node]
        pids = [proc.pid] + descendants(proc.pid) if proc else []
        pidfile = self.run_dirs[node] / f"{self.job}.pid"
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pidfile.read_text()))
        return pids

    def signal_node(self, node: int, sig: int) -> None:
        for pid in self.node_pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def lose(self, node: int) -> None:
        """The node is gone for good: every process killed, its memory and disks wiped."""
        self.signal_node(node, signal.SIGKILL)
        self.procs[node].wait()
        self.logs[node].close()
        for path in (self.shm[node], self.run_dirs[node], self.tmp / f"{self.name}-nvme{node}"):
            shutil.rmtree(path, ignore_errors=True)

    def events(self, node: int) -> list[dict]:
        path = events_path(self.run_dirs[node], self.job)
        return read_events(path) if path.exists() else []

    def finish(self, timeout: float = 240) -> Run:
        codes = []
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                try:
                    codes.append(proc.wait(max(1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(-999)
        finally:
            self.close()
        logs = []
        for n in range(self.n):
            logs.append("".join((self.tmp / f"{self.name}-node{n}-{i}.log").read_text()
                                for i in range(1, self.starts[n] + 1)))  # fmt: skip
        digest_file = self.tmp / f"{self.name}.digest"
        digest = digest_file.read_text() if digest_file.exists() else None
        return Run(codes, logs, [self.events(n) for n in range(self.n)], digest)

    def close(self) -> None:
        for n in range(self.n):
            if self.procs[n] is not None:
                self.signal_node(n, signal.SIGKILL)
                self.procs[n].wait()
            if self.logs[n] is not None:
                self.logs[n].close()
            shutil.rmtree(self.shm[n], ignore_errors=True)


def run_job(tmp: Path, name: str, timeout: float = 240, node_env: tuple[dict, ...] = ({}, {}),
            trainer: Path = TRAINER, nodes: int = NODES, per_node: int = PER_NODE,
            max_restarts: int = 3, **env: str) -> Run:  # fmt: skip
    """Every node from start to end; waits for all to exit."""
    cluster = Cluster(tmp, name, node_env, trainer, nodes, per_node, max_restarts=max_restarts,
                      **env)  # fmt: skip
    try:
        for node in range(nodes):
            cluster.start(node)
    except BaseException:
        cluster.close()
        raise
    return cluster.finish(timeout)


def explain(run: Run) -> str:
    return "\n".join(f"--- node {n} (exit {c}) ---\n{text[-4000:]}"
                     for n, (c, text) in enumerate(zip(run.codes, run.logs, strict=True)))  # fmt: skip


@pytest.mark.slow
def test_a_killed_rank_restarts_every_node_at_the_step_after_the_last_saved(tmp_path, reference):
    run = run_job(tmp_path, "kill", FT_FAULT="kill", FT_RANK="1", FT_STEP="12")
    assert run.codes == [0, 0], explain(run)
    resumed = [(r, s) for r, s in run.restored() if s != "None"]
    assert sorted(r for r, _ in resumed) == list(range(NODES * PER_NODE)), explain(run)
    assert {s for _, s in resumed} == {"12"}, explain(run)
    assert run.digest == reference
    exited = [e for e in run.events[0] if e["kind"] == "worker_exited" and e["rank"] == 1]
    assert exited, run.events[0]


@pytest.mark.slow
def test_a_hung_rank_is_detected_within_its_floor_and_the_job_resumes(tmp_path, reference):
    # Node 0's ranks wait in the collective for rank 3 and go silent with it; a higher floor
    # there lets node 1 act first, so the stopped rank's stacks are taken before the restart
    # it causes reaches node 0 (the other order: README, hang detection).
    run = run_job(tmp_path, "hang", FT_FAULT="stop", FT_RANK="3", FT_STEP="10",
                  node_env=({"FLASHCKPT_HANG_FLOOR": "8"}, {"FLASHCKPT_HANG_FLOOR": "3"}))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    hangs = [e for e in run.events[1] if e["kind"] == "hang_detected" and e["rank"] == 3]
    assert hangs, run.events[1]
    assert 3 <= hangs[0]["silent_s"] <= 3 + 2 and hangs[0]["timeout_s"] == 3
    assert hangs[0]["process_state"] == "T"  # the stopped one is told apart in the log
    stacks = [e for e in run.events[1] if e["kind"] == "stacks" and e["rank"] == 3]
    assert stacks and "ft_trainer.py" in stacks[0]["stacks"], stacks
    resumed = {s for _, s in run.restored() if s != "None"}
    assert len(resumed) == 1 and int(next(iter(resumed))) >= 10, explain(run)
    assert run.digest == reference


def tier_urls(tmp: Path, name: str, node: int, s3: str) -> str:
    """Node ``node``'s tiers, fastest first: its own NVMe directory, the shared PFS, S3."""
    return ",".join([f"file://{tmp / f'{name}-nvme{node}'}", f"pfs://{tmp / f'{name}-pfs'}", s3])


def restores(events: list[dict]) -> dict[int, dict]:
    """The last ``restored`` event of each rank that resumed a step."""
    return {e["rank"]: e for e in events if e["kind"] == "restored" and e["step"] is not None}


def lose_a_node(cluster: Cluster, node: int, **wait: str) -> float:
    """Start every node, wait until the pausing rank saved its step and saw it where
    ``FT_WAIT_TIERS`` says, take ``node`` away whole (stopped first: nothing answers, no socket
    closes), wipe it and start it again; the seconds the controller took to notice."""
    cluster.start(0)  # first: it hosts the rendezvous store and the controller
    assert poll(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
    for n in range(1, cluster.n):
        cluster.start(n)
    assert poll(lambda: (cluster.marks / "paused").exists(), 180), cluster.finish(1)
    cluster.signal_node(node, signal.SIGSTOP)
    vanished = time.monotonic()
    assert poll(lambda: any(e["kind"] == "node_lost" for e in cluster.events(0)), 30)
    detected = time.monotonic() - vanished
    cluster.lose(node)
    cluster.start(node)  # a fresh machine in its place: empty memory and NVMe
    return detected


def back_from_a_peer(run: Run, reference: str) -> None:
    """Every rank resumed at 12, node 0's from their own memory and node 1's from node 0's,
    and the job ended bit-identical to ``reference``."""
    kept, fresh = restores(run.events[0]), restores(run.events[1])
    assert len(kept) == len(fresh) == PER_NODE, explain(run)
    steps = {e["step"] for e in [*kept.values(), *fresh.values()]}
    assert steps == {12}, (kept, fresh, explain(run))
    assert {e["source"] for e in kept.values()} == {"shared memory"}, kept
    assert all(e["source"].startswith("peer node0 ") for e in fresh.values()), fresh
    assert run.digest == reference


@pytest.mark.slow
def test_a_lost_node_comes_back_from_a_peers_memory_at_the_newest_step(tmp_path, reference):
    """Two nodes under the README's multi-node settings (each node's newest step in the other
    node's memory), the shared tier persisting every 1000 steps only: node 1 is lost whole
    after step 12, wiped and started again; every rank resumes at 13, node 0's ranks from
    their own memory and node 1's from node 0's, and the job ends bit-identical."""
    pfs = f"pfs://{tmp_path / 'lost-pfs'}?every_steps=1000"
    env = tuple({"FT_TIERS": f"file://{tmp_path / f'lost-nvme{n}'},{pfs}"} for n in range(NODES))
    cluster = Cluster(tmp_path, "lost", env, FT_FAULT="pause", FT_RANK="2", FT_STEP="12",
                      FT_WAIT_TIERS=PEER, FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip
    try:
        detected = lose_a_node(cluster, 1)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0], explain(run)
    assert detected <= 3 + 2, detected
    lost = next(e for e in run.events[0] if e["kind"] == "node_lost")
    assert lost["action"] == "kill" and len(lost["ordered"].get("node0", [])) == 2, lost
    back_from_a_peer(run, reference)


@pytest.mark.slow
def test_a_ranks_newest_step_corrupt_everywhere_sends_every_rank_to_the_step_before(
    tmp_path, reference, s3_server, s3_bucket
):
    s3 = f"s3://{s3_bucket}/ckpt?endpoint_url={s3_server.endpoint_url}"
    env = tuple({"FT_TIERS": tier_urls(tmp_path, "bad", n, s3)} for n in range(NODES))
    run = run_job(tmp_path, "bad", node_env=env, FT_FAULT="corrupt", FT_RANK="3", FT_STEP="9")
    assert run.codes == [0, 0], explain(run)
    resumed = {**restores(run.events[0]), **restores(run.events[1])}
    assert sorted(resumed) == list(range(NODES * PER_NODE)), explain(run)
    assert {e["step"] for e in resumed.values()} == {8}, resumed
    assert run.digest == reference


def held_steps(root: Path, job: str) -> dict[int, set[int]]:
    """The steps a directory tier holds of ``job``, with the ranks stored in each."""
    out = {}
    for step_dir in sorted((root / job).glob("step-*")):
        ranks = {int(p.name.split("-")[1]) for p in step_dir.glob("rank-*")}
        out[int(step_dir.name.split("-")[1].split(".")[0])] = ranks
    return out


@pytest.mark.slow
def test_node_tiers_of_a_multi_node_job_keep_only_keep_last_steps(tmp_path):
    """Two nodes, each with its own NVMe directory and the shared PFS, both ``keep_last=2``:
    after 30 steps every tier holds two steps, the last one (29) and the one committed before
    it (a lagging tier skips steps, so not always 28), each node's NVMe its own two ranks."""
    pfs = tmp_path / "keep-pfs"
    env = tuple({"FT_TIERS": f"file://{tmp_path / f'keep-nvme{n}'}?keep_last=2,"
                             f"pfs://{pfs}?keep_last=2"} for n in range(NODES))  # fmt: skip
    cluster = Cluster(tmp_path, "keep", env)
    try:
        for node in range(NODES):
            cluster.start(node)
        for proc in cluster.procs:
            proc.wait(240)
        # The agents prune right after each commit, which close() waited for: give the last
        # pass a moment before the agents are stopped.
        tiers = [pfs, *(tmp_path / f"keep-nvme{n}" for n in range(NODES))]
        poll(lambda: all(len(held_steps(t, cluster.job)) <= 2 for t in tiers), 10, 0.1)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0], explain(run)
    shared = held_steps(pfs, cluster.job)
    assert len(shared) == 2 and max(shared) == 29, shared
    assert all(ranks == {0, 1, 2, 3} for ranks in shared.values()), shared
    for node in range(NODES):
        ours = {node * PER_NODE + r for r in range(PER_NODE)}
        nvme = held_steps(tmp_path / f"keep-nvme{node}", cluster.job)
        assert len(nvme) == 2 and max(nvme) == 29, (node, nvme)  # not all 30
        assert all(ranks == ours for ranks in nvme.values()), (node, nvme)
