"""A node a spare took while it was found lost never runs its ranks again: one claimant per
rank in a round, the spare's mark scoped to the job's run (void once the job restarts, removed
when the spare gives the node up), the node's own launcher stopping its workers when it finds
the mark, and the controller refusing the node's agent when it reports again, with its workers
ordered killed. With a real recovery store, real controller and agent, and a real multi-node
job whose agent is stalled past the node timeout."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch.distributed as dist
from conftest import ROOT
from faults import is_dead, poll
from flashckpt.agent.controller import Controller, InThread
from flashckpt.agent.replicas import store_root
from test_controller import JOB, TOKEN, connect, report, spare, start_agent, start_worker, worker
from test_launcher import explain, restores
from test_spare_nodes import spare_cluster

from flashckpt.faults import control
from flashckpt.faults.events import EventLog, read_events
from flashckpt.faults.inprocess import (
    EXIT_CLAIMED,
    EXIT_GROUP_ENDED,
    NAMESPACE_ENV,
    last_round,
    move_round,
)
from flashckpt.faults.inprocess_agent import Member, Supervisor
from flashckpt.faults.spare_marks import (
    current_run,
    mark_replaced,
    run_ended,
    run_key,
    run_started,
    unmark_replaced,
    was_replaced,
)


@pytest.fixture
def store():
    """A real recovery store (a TCPStore server on port 0) and its address."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=30))  # fmt: skip
    yield server, f"127.0.0.1:{server.port}"


# ---- the spare's mark: scoped to the job's run, cleared with it ----------------------------


def test_a_spares_mark_holds_in_its_job_and_run_only_and_is_cleared_when_the_spare_gives_up(
    store,
):
    server, _ = store
    run_started(server, "job-a", "ns1")
    mark_replaced(server, "job-a", "node1", "node2", "ns1")
    assert was_replaced(server, "node1", "job-a") == "node2"
    assert was_replaced(server, "node1", "job-b") is None  # another job's node1
    assert was_replaced(server, "node0", "job-a") is None
    unmark_replaced(server, "job-a", "node1", "node3")  # not node3's to give up
    assert was_replaced(server, "node1", "job-a") == "node2"
    unmark_replaced(server, "job-a", "node1", "node2")  # the spare fell back (or died)
    assert was_replaced(server, "node1", "job-a") is None  # node1 may rejoin


def test_a_spares_mark_is_void_once_the_job_restarts_whole(store):
    server, _ = store
    run_started(server, "job-a", "ns1")
    mark_replaced(server, "job-a", "node1", "node2", "ns1")
    run_ended(server, "job-a", "ns1")  # a node's workers stop for the job's restart
    assert was_replaced(server, "node1", "job-a") is None  # node1 joins the restart
    run_started(server, "job-a", "ns2")
    assert was_replaced(server, "node1", "job-a") is None
    run_ended(server, "job-a", "ns1")  # a late word of the old run ends nothing
    mark_replaced(server, "job-a", "node1", "node2", "ns2")
    assert was_replaced(server, "node1", "job-a") == "node2"


SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


class _Reaped:
    """What TorchElastic's process context does at the end, for a supervisor alone."""

    def close(self) -> None:
        pass


def supervisor_of(tmp_path, address: str, node: str, members: dict[int, Member]) -> Supervisor:
    s = Supervisor(EventLog(tmp_path / f"{JOB}.events.jsonl"), address, deadline=10, standbys=0)
    s.members, s.holder, s.world = members, node, 4
    return s


def test_a_launcher_whose_node_a_spare_took_stops_its_workers_and_replaces_none(
    store, tmp_path, monkeypatch
):
    """Node 1's rank 3 dies (the controller's kill, when its agent came back): its launcher
    finds spare node 2's mark of this run, kills rank 2 too (a second claimant of a rank the
    spare holds), replaces nothing, and leaves the run to the spare. A launcher that finds no
    mark falls back as before."""
    server, address = store
    monkeypatch.setenv("FLASHCKPT_NODE", "node1")
    env = {NAMESPACE_ENV: "ns1", "FLASHCKPT_JOB": JOB}
    alive = subprocess.Popen(SLEEPER)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    assert poll(lambda: is_dead(dead.pid), 30)  # exited, not reaped: its status is in /proc
    try:
        members = {0: Member(2, alive.pid, env), 1: Member(3, dead.pid, env)}
        run_started(server, JOB, "ns1")
        mark_replaced(server, JOB, "node1", "node2", "ns1")
        s = supervisor_of(tmp_path, address, "node1", members)
        assert s.taken_by() == "node2"
        result = s.monitor(lambda: pytest.fail("no fall back when fenced"), _Reaped())
        assert result.state.name == "SUCCEEDED" and s.fenced == "node2"
        assert alive.wait(10) == -signal.SIGKILL
        (fenced,) = [e for e in read_events(s.events.path) if e["kind"] == "node_fenced"]
        assert (fenced["spare"], fenced["ranks"]) == ("node2", [2, 3]), fenced
        s.stop()
        assert was_replaced(server, "node1", JOB) == "node2"  # the run is the spare's still
        # The spare runs the node: it is the mark's holder, never fenced by it.
        assert supervisor_of(tmp_path, address, "node2", members).taken_by() is None
        # No mark: the worker's death is recovered as before (here: no standby, a fall back),
        # and the launcher that stops its workers ends the run.
        unmark_replaced(server, JOB, "node1", "node2")
        mark_replaced(server, JOB, "node1", "node2", "ns1")
        run_ended(server, JOB, "ns1")
        s = supervisor_of(tmp_path, address, "node1", {1: Member(3, dead.pid, env)})
        fell = []
        s.monitor(lambda: fell.append(1) or result, _Reaped())
        assert fell == [1] and not s.fenced
    finally:
        alive.kill()
        alive.wait()
        dead.wait()


# ---- the exit barrier of a job a spare took a node of -------------------------------------


def test_the_launcher_serving_the_store_leaves_the_exit_barrier_after_every_other_node(
    store, tmp_path, monkeypatch
):
    """Node 0's launcher serves the recovery store; spare node 2 runs node 1's ranks. Both
    finish: node 0 leaves the barrier only once node 2 has seen every node finished and said
    the run ended (node 2 looking at a store that left with node 0 waited out its reconnect
    window, 30 s). Node 2's own stop says nothing more; with a node that never leaves, node 0
    waits ``LEAVING_S``, no longer."""
    from flashckpt.faults import inprocess_agent

    server, address = store
    env = {NAMESPACE_ENV: "ns1", "FLASHCKPT_JOB": JOB}
    run_started(server, JOB, "ns1")
    serving = supervisor_of(tmp_path, address, "node0",
                            {0: Member(0, os.getpid(), env), 1: Member(1, os.getpid(), env)})  # fmt: skip
    serving.serves_store = True
    spare_node = supervisor_of(tmp_path, address, "node2",
                               {0: Member(2, os.getpid(), env), 1: Member(3, os.getpid(), env)})  # fmt: skip
    left: dict[str, float] = {}

    def finish(s: Supervisor, name: str) -> None:
        s.finished_together(30)
        left[name] = time.monotonic()

    spare_thread = threading.Thread(target=finish, args=(spare_node, "spare"))
    spare_thread.start()
    assert poll(lambda: server.add("flashckpt/ns1/finished", 0) == 1, 10)  # the spare waits
    time.sleep(0.25)  # between two of its looks
    finish(serving, "serving")
    spare_thread.join(10)
    assert left["spare"] <= left["serving"] < left["spare"] + 2, left
    assert current_run(server, JOB) == ""  # said by the spare, while the store was there
    server.set(run_key(JOB), "ns2")  # a later run: the spare's stop must not touch the store
    spare_node.stop()
    assert current_run(server, JOB) == "ns2"

    # The other node never leaves (it died between the two counts): a bounded wait.
    monkeypatch.setattr(inprocess_agent, "LEAVING_S", 0.5)
    env2 = {NAMESPACE_ENV: "ns2", "FLASHCKPT_JOB": JOB}
    server.add("flashckpt/ns2/finished", 1)
    alone = supervisor_of(tmp_path, address, "node0",
                          {0: Member(0, os.getpid(), env2), 1: Member(1, os.getpid(), env2)})  # fmt: skip
    alone.serves_store = True
    began = time.monotonic()
    alone.finished_together(30)
    assert 0.4 < time.monotonic() - began < 3


# ---- a round admits one claimant per rank ---------------------------------------------------

RANK = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from flashckpt.faults.inprocess import Rounds
    rounds = Rounds(sys.argv[1], "gloo", 60.0)
    rounds.join()
    dist.barrier()
    print("formed", rounds.round, dist.get_rank(), dist.get_world_size(), flush=True)
    rounds.leave(finished=True)
    """
)


def rank_process(address: str, rank: int, tmp_path, name: str) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", NAMESPACE_ENV: "claims",
           "FLASHCKPT_EVENTS": str(tmp_path / f"{name}.events.jsonl"), "FLASHCKPT_NODE": name,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", RANK, address], env=env, cwd=ROOT / "tests",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.slow
def test_a_second_claimant_of_a_rank_in_a_round_exits_and_is_not_counted(store, tmp_path):
    """Two processes claim rank 1 of a world of 2 in round 0, before rank 0 arrives: the
    second exits (counted, it would have formed the round with two ranks 1 and no rank 0), and
    the round forms with rank 0 and the first."""
    server, address = store
    first = rank_process(address, 1, tmp_path, "first")
    claim = "flashckpt/claims/round-0/claim-1"
    assert poll(lambda: server.check([claim]), 60, 0.05), first.communicate()
    second = rank_process(address, 1, tmp_path, "second")
    out, err = second.communicate(timeout=60)
    assert second.returncode == EXIT_CLAIMED, err
    assert "holds rank 1 in round 0 already" in err and "second claimant" in err, err
    assert int(server.add("flashckpt/claims/round-0/arrived", 0)) == 1
    zero = rank_process(address, 0, tmp_path, "zero")
    for proc, rank in ((zero, 0), (first, 1)):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and f"formed 0 {rank} 2" in out, err[-3000:]
    (refused,) = read_events(tmp_path / "second.events.jsonl")
    assert refused["kind"] == "inprocess_claim_refused" and "first" in refused["holder"]


@pytest.mark.slow
def test_a_rank_waiting_for_a_round_gives_up_at_once_when_a_launcher_stops_its_workers(
    store, tmp_path
):
    """Rank 1 waits for round 0 to form (a deadline of 60 s), rank 0 never comes: a launcher
    stops its workers (the job restarts whole), and the rank gives up within seconds, as does
    one arriving later, instead of at the deadline."""
    server, address = store
    waiting = rank_process(address, 1, tmp_path, "waiting")
    assert poll(lambda: server.check(["flashckpt/claims/round-0/claim-1"]), 60, 0.05)
    env = {NAMESPACE_ENV: "claims", "FLASHCKPT_JOB": JOB}
    stopped = time.monotonic()
    supervisor_of(tmp_path, address, "node0", {0: Member(0, os.getpid(), env)}).stop()
    for proc in (waiting, rank_process(address, 0, tmp_path, "late")):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == EXIT_GROUP_ENDED, err[-3000:]
        assert "the job's worker group ended" in err, err[-3000:]
    assert time.monotonic() - stopped < 20  # each process's start included
    events = read_events(tmp_path / "waiting.events.jsonl")
    ended = [e for e in events if e["kind"] == "inprocess_group_ended"]
    assert [e["round"] for e in ended] == [0], events


def test_a_replacement_joins_a_round_after_every_one_its_rank_was_claimed_in(store):
    """Rank 1's holder claimed round 1 and was killed before it recorded the round: its
    replacement goes past round 1, where the rank is free, not into it (and be refused)."""
    server, _ = store
    server.set("flashckpt/ns/round", "1")
    server.set("flashckpt/ns/rank-1/round", "0")
    server.set("flashckpt/ns/round-1/claim-1", "node1 (pid 1)")
    assert last_round(server, "ns", 1) == 1 and last_round(server, "ns", 0) == 0
    assert move_round(server, "ns", last_round(server, "ns", 1), None) == 2


# ---- the controller refuses the agent of a node a spare took --------------------------------


def taken_b(c: Controller) -> None:
    """Node b (rank 1) is lost and spare s1 takes it; a keeps reporting."""
    for now in (100, 102):
        c.report(report("a", [worker(0, 100, 60)]), now=now)
        c.report(spare("s1"), now=now)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.tick(now=103.5)


def test_the_agent_of_a_node_a_spare_took_is_refused_and_its_workers_killed(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    taken_b(c)
    # b's own agent was only stalled: it reports its worker, still running.
    back = c.report(report("b", [worker(1, 200, 64)]), now=104)
    assert (list(back.kill_pids), back.taken_by) == ([200], "s1")
    b = c.jobs[JOB].nodes["b"]
    assert b.lost and b.agent_id == "b-a"  # its entry is not taken back
    # Its keeper's new agent, reporting the same worker: refused too.
    again = c.report(report("b", [worker(1, 200, 65)], agent="b-kept"), now=105)
    assert (list(again.kill_pids), again.taken_by) == ([200], "s1")
    # The spare's agent, under b's name with its own worker: the node's entry from now on.
    held = c.report(report("b", [worker(1, 300, 0.5)], agent="b-on-s1"), now=105)
    assert (list(held.kill_pids), held.taken_by) == ([], "")
    assert c.jobs[JOB].nodes["b"].agent_id == "b-on-s1" and not c.jobs[JOB].nodes["b"].lost
    fenced = [e for e in read_events(events.path) if e["kind"] == "node_fenced"]
    assert [(e["agent_id"], e["spare"], e["ordered"]) for e in fenced] == [
        ("b-a", "s1", [200]), ("b-kept", "s1", [200])]  # fmt: skip
    # A node lost with no spare to take it comes back as before; the job restarting whole
    # (a kill) forgets what spares took.
    c.report(report("a", [worker(0, 100, 66)]), now=106)
    c.report(report("b", [worker(1, 300, 1.5)], agent="b-on-s1"), now=106)
    c.report(spare("s2"), now=109)  # heard: the controller hears, and a and b are lost
    c.tick(now=109.5)  # a and b both silent, one spare for two: every worker restarts
    assert not c.jobs[JOB].taken
    assert c.report(report("b", [worker(1, 200, 70)]), now=110).taken_by == ""


def test_a_report_stream_of_a_node_a_spare_took_gets_its_kill_order_then_ends(tmp_path):
    c = Controller(EventLog(tmp_path / "events.jsonl"), policy="in-process", node_timeout=3,
                   heartbeat=1)  # fmt: skip
    taken_b(c)
    c.jobs[JOB].nodes["a"].last_seen = time.monotonic()  # on the served controller's clock
    thread = InThread(c, "127.0.0.1:0", TOKEN)
    address = f"127.0.0.1:{thread.start_serving()}"
    read: list[list] = []  # the replies read, as the stream ends
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            connect(address, TOKEN, [report("b", [worker(1, 200, 0)])],
                    lambda got: read.append(got) and False)  # fmt: skip
    finally:
        thread.stop()
    assert [(list(r.kill_pids), r.taken_by) for r in read[-1]] == [([200], "s1")]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "spare node s1 took this node" in err.value.details()
    assert ("b" not in {n for _, n in c.watchers}) and c.jobs[JOB].nodes["b"].lost


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
def test_a_real_agent_back_after_a_spare_took_its_node_is_refused_and_its_worker_killed(
    shm_dir, run_dir, tmp_path, monkeypatch
):
    """Node b's agent is stopped past the node timeout while its worker runs; spare s1 takes
    b. Continued, the agent reports again: it is refused (b's entry stays the lost one), told
    why, and carries out the kill order on its worker; the refusal is recorded once."""
    monkeypatch.setenv("FLASHCKPT_NODE", "b")
    monkeypatch.setenv("FLASHCKPT_KILL_GRACE", "1")
    events = EventLog(tmp_path / "events.jsonl")
    c = Controller(events, policy="in-process", node_timeout=2, heartbeat=0.5)
    thread = InThread(c, "127.0.0.1:0", TOKEN)
    port = thread.start_serving()
    control.Endpoint(f"127.0.0.1:{port}", TOKEN).save(run_dir, JOB)
    running = start_worker(shm_dir, 1)
    log = tmp_path / "agent.log"
    agent = start_agent(shm_dir, run_dir, log)
    job = lambda: c.jobs.get(JOB)  # noqa: E731

    def spare_heard() -> bool:  # s1 reports (from the controller's own loop) until it takes b
        thread._loop.call_soon_threadsafe(c.report, spare("s1"))
        return "b" in job().taken

    try:
        assert poll(lambda: job() and "b" in job().nodes and job().nodes["b"].workers, 30)
        os.kill(agent.pid, signal.SIGSTOP)
        assert poll(spare_heard, 20, 0.1)
        os.kill(agent.pid, signal.SIGCONT)
        assert running.wait(20) == -signal.SIGTERM
        assert poll(lambda: "spare node s1 took this node" in log.read_text(), 10)
        time.sleep(1.5)  # three more reports, refused
        assert job().nodes["b"].lost and job().nodes["b"].agent_id.startswith("b-")
        fenced = [e for e in read_events(events.path) if e["kind"] == "node_fenced"]
        assert [(e["fenced_node"], e["spare"], e["ordered"]) for e in fenced] == [
            ("b", "s1", [running.pid])]  # fmt: skip
    finally:
        running.kill()
        running.wait()
        agent.send_signal(signal.SIGCONT)
        agent.terminate()
        assert agent.wait(30) == 0
        thread.stop()


# ---- a real job: node 1's agent stalled past the node timeout, a spare present ---------------


def claims(run) -> dict[tuple[int, int], set[int]]:
    """(round, rank) -> the processes that held that rank in that round, over every node."""
    held: dict[tuple[int, int], set[int]] = {}
    for e in (e for node in run.events for e in node if e["kind"] == "rank_claimed"):
        held.setdefault((e["round"], e["rank"]), set()).add(e["pid"])
    return held


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
def test_an_agent_stalled_past_the_node_timeout_never_leaves_two_claimants_of_a_rank(
    tmp_path, reference
):
    """2 nodes x 2 ranks and a spare: node 1's agent is stopped (SIGSTOP) for the node timeout
    + 2 s while its launcher and workers run on. The controller finds node 1 lost and hands it
    to the spare: node 1's own workers are stopped (by its launcher, which finds the spare's
    mark, or by the controller's kill order when the agent is back, refused), no round ever has
    two processes of one rank, and the job ends bit-identical. (If node 1 is not taken, it is
    kept, and trains to the end.)"""
    cluster = spare_cluster(tmp_path, "stall", FT_FAULTS="", FT_STEP_S="0.4")
    try:
        cluster.start(0)  # it serves the controller and the recovery store
        assert poll(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
        cluster.start(2)  # the spare: its standbys warm while the rendezvous waits for node 1
        assert poll(lambda: any(e["kind"] == "spare_ready" for e in cluster.events(2)), 180,
                    0.1), explain(cluster.finish(1))  # fmt: skip
        cluster.start(1)
        held = store_root(cluster.shm[0], cluster.job) / "node1"  # node 1's replica on node 0
        assert poll(lambda: any(held.rglob("commit-node1.json")), 180, 0.1), explain(
            cluster.finish(1)
        )
        agent = int((cluster.run_dirs[1] / f"{cluster.job}.pid").read_text())
        os.kill(agent, signal.SIGSTOP)
        time.sleep(3 + 2)  # FLASHCKPT_NODE_TIMEOUT + 2 s
        os.kill(agent, signal.SIGCONT)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(300)
    assert run.codes == [0, 0, 0], explain(run)
    assert run.digest == reference
    two = {k: pids for k, pids in claims(run).items() if len(pids) > 1}
    assert not two, (two, explain(run))
    originals = {(e["rank"], e["pid"]) for e in run.events[1] if e["kind"] == "rank_claimed"}
    lost = [e for e in run.events[0] if e["kind"] == "node_lost"]
    if not lost:  # kept: node 1's own workers trained to the end
        assert sorted(restores(run.events[1])) == [2, 3], explain(run)
        return
    assert [(e["action"], e["spares"]) for e in lost] == [("replace", {"node1": "node2"})], lost
    # Taken: node 1's own workers were stopped, never replaced there, and the spare's ran on.
    fenced = [e for n in (0, 1) for e in run.events[n] if e["kind"] == "node_fenced"]
    assert fenced, explain(run)
    assert not any(e["kind"] == "replacement_started" for e in run.events[1]), explain(run)
    assert all(is_dead(pid) for _, pid in originals)
    assert not any(f"done {rank} pid={pid} " in run.logs[1] for rank, pid in originals)
    assert sorted(restores(run.events[2])) == [2, 3], explain(run)


LEAVER = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from pathlib import Path
    from flashckpt.faults.heartbeat import Heartbeat, read
    from flashckpt.faults.inprocess import Rounds
    page = Path(sys.argv[2]) / f"rank-{os.environ['RANK']}.heartbeat"
    hb = Heartbeat(page, page.with_suffix(".stacks"))
    rounds = Rounds(sys.argv[1], "gloo", 60.0)
    rounds.join()
    for _ in range(3):
        dist.barrier()
    deadline = time.monotonic() + 30
    while not read(page).issued and time.monotonic() < deadline:
        time.sleep(0.02)
    print("in the round", sum(read(page).issued.values()), flush=True)
    rounds.leave(finished=True)
    print("left", len(read(page).issued), flush=True)
    """
)


@pytest.mark.slow
def test_a_rank_that_leaves_its_round_shows_no_collective_counts(store, tmp_path):
    """A rank's page carries its collective counts while it is in a round, none once it has
    left: a rank waiting for the next round is never read as the one the ranks still blocked
    in the old round wait for (its old counts would be behind theirs)."""
    _, address = store
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", NAMESPACE_ENV: "leave",
               "FLASHCKPT_NODE": f"node{rank}", "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", LEAVER, address, str(tmp_path)],
                                      env=env, cwd=ROOT / "tests", stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        lines = out.splitlines()
        assert lines[0].startswith("in the round ") and int(lines[0].split()[-1]) > 0, out
        assert lines[1] == "left 0", out
