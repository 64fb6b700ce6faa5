"""The job's controller: its decisions, its token and TLS, and a real agent carrying out its
kill orders on real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from conftest import ROOT
from faults import is_dead, poll
from flashckpt.agent.controller import Controller, InThread
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc

from flashckpt.errors import ConfigError
from flashckpt.faults import control
from flashckpt.faults.events import EventLog, read_events

TOKEN = "t" * 32
JOB = "ctl"


def worker(rank: int, pid: int, age: float, alive: bool = True, silent: float = 0.1,
           phase: str = "train", step: int = 5) -> pb.Worker:  # fmt: skip
    return pb.Worker(rank=rank, pid=pid, phase=phase, step=step, silent_s=silent, age_s=age,
                     alive=alive)  # fmt: skip


def report(node: str, workers: list[pb.Worker], agent: str = "", tiers=(), ranks=(),
           world: int = 4) -> pb.NodeReport:  # fmt: skip
    return pb.NodeReport(job=JOB, node=node, agent_id=agent or f"{node}-a", world_size=world,
                         workers=workers, tiers=list(tiers), ranks=list(ranks))  # fmt: skip


@pytest.fixture
def events(tmp_path) -> EventLog:
    return EventLog(tmp_path / "events.jsonl")


def kinds(log: EventLog) -> list[str]:
    return [e["kind"] for e in read_events(log.path)] if log.path.exists() else []


# ---- decisions --------------------------------------------------------------------------


def test_a_failed_worker_has_every_node_kill_the_workers_of_its_round_only(events):
    c = Controller(events, node_timeout=5, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60), worker(1, 101, 60)]), now=100)
    c.report(report("b", [worker(2, 200, 60), worker(3, 201, 60)]), now=100)
    # b's rank 3 died 0.5 s before this report
    reply = c.report(report("b", [worker(2, 200, 61), worker(3, 201, 61, alive=False,
                                                             silent=0.5)]), now=101)  # fmt: skip
    assert list(reply.kill_pids) == [200]
    assert list(c.report(report("a", [worker(0, 100, 61), worker(1, 101, 61)]),
                         now=101.2).kill_pids) == [100, 101]  # fmt: skip
    assert kinds(events) == ["worker_failed"]
    detection = read_events(events.path)[0]
    assert detection["failed_node"] == "b" and detection["rank"] == 3
    assert detection["ordered"] == {"a": [100, 101], "b": [200]}
    # The killed ones die, TorchElastic starts a new round: its workers are never ordered
    # killed, and the old round's deaths are not new failures.
    a = c.report(report("a", [worker(0, 100, 62, alive=False, silent=1), worker(1, 110, 0.5)]),
                 now=102)  # fmt: skip
    assert list(a.kill_pids) == []
    b = c.report(report("b", [worker(2, 210, 0.4), worker(3, 211, 0.4)]), now=102)
    assert list(b.kill_pids) == []
    assert kinds(events) == ["worker_failed"]
    # A failure of the new round is a new detection, and kills the new round.
    b = c.report(report("b", [worker(2, 210, 5), worker(3, 211, 5, alive=False, silent=0.2)]),
                 now=107)  # fmt: skip
    assert list(b.kill_pids) == [210]
    assert kinds(events) == ["worker_failed", "worker_failed"]


def test_a_node_whose_agent_goes_silent_is_lost_and_the_others_are_killed(events):
    c = Controller(events, node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.report(report("a", [worker(0, 100, 62)]), now=102)
    c.tick(now=103)
    assert kinds(events) == []  # b silent 3 s: not yet past its timeout
    c.tick(now=103.5)
    assert kinds(events) == ["node_lost"]
    lost = read_events(events.path)[0]
    assert lost["failed_node"] == "b" and lost["silent_s"] == pytest.approx(3.5)
    assert list(c.report(report("a", [worker(0, 100, 64)]), now=104).kill_pids) == [100]
    c.report(report("a", [worker(0, 110, 1)]), now=109)
    c.tick(now=110)
    assert kinds(events) == ["node_lost"]  # once per loss
    c.report(report("b", [worker(1, 300, 1)], agent="b-new"), now=111)
    assert kinds(events) == ["node_lost", "node_back"]
    status = c.status(JOB, now=111)
    assert [(n.node, n.lost) for n in status.nodes] == [("a", False), ("b", False)]
    assert [(d.kind, d.node, d.action) for d in status.detections] == [("node_lost", "b", "kill")]


def spare(name: str) -> pb.NodeReport:
    return pb.NodeReport(job=JOB, node=name, agent_id=f"{name}-s", spare=True)


def test_under_in_process_a_lost_node_goes_to_a_free_spare_and_nothing_is_killed(events):
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    pushed = []
    c.watch(JOB, "s1", pushed.append)
    for now in (100, 102):
        c.report(report("a", [worker(0, 100, 60)]), now=now)
        assert c.report(spare("s1"), now=now).take_node == ""
        assert c.report(spare("s2"), now=now).take_node == ""
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.tick(now=103.5)
    (lost,) = read_events(events.path)
    assert (lost["kind"], lost["action"], lost["spares"]) == ("node_lost", "replace", {"b": "s1"})
    assert lost["ordered"] == {}  # the healthy workers keep running
    assert [(r.take_node, r.lost_silent_s) for r in pushed] == [("b", 3.5)]
    assert list(c.report(report("a", [worker(0, 100, 63)]), now=103.6).kill_pids) == []
    again = c.report(spare("s1"), now=103.7)  # told again until it stops reporting as a spare
    assert (again.take_node, c.report(spare("s2"), now=103.7).take_node) == ("b", "")
    status = c.status(JOB, now=103.7)
    assert [(n.node, n.spare, n.taking) for n in status.nodes if n.spare] == [
        ("s1", True, "b"), ("s2", True, "")]  # fmt: skip
    assert [(d.action, d.spare) for d in status.detections] == [("replace", "s1")]
    # The spare now runs b's ranks under b's name; silent as a spare, it is forgotten.
    c.report(report("b", [worker(1, 300, 1)], agent="b-on-s1"), now=104)
    c.report(spare("s2"), now=106)
    c.report(report("a", [worker(0, 100, 66)]), now=106)
    c.report(report("b", [worker(1, 300, 3)], agent="b-on-s1"), now=106)
    c.tick(now=107.5)
    assert sorted(n.node for n in c.status(JOB, now=107.5).nodes) == ["a", "b", "s2"]
    assert kinds(events) == ["node_lost", "node_back"]


def test_nodes_lost_beyond_the_free_spares_restart_the_job_and_say_why(events):
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.report(report("c", [worker(2, 300, 60)]), now=100)
    c.report(spare("s1"), now=100)  # silent since: gone, it counts for nothing
    c.report(spare("s2"), now=102)
    c.report(report("a", [worker(0, 100, 62)]), now=102)
    c.tick(now=103.5)
    (lost,) = read_events(events.path)
    assert (lost["action"], lost["nodes"]) == ("kill", ["b", "c"])
    assert "2 node(s) lost and 1 free spare node(s)" in lost["fallback"]
    assert lost["ordered"]["a"] == [100]  # the healthy node's workers restart too
    reply = c.report(spare("s2"), now=103.6)
    assert reply.take_node == ""  # not half a replacement
    # It joins the restart as one of the lost nodes, so that the restart has its node count
    # once the scheduler brings the other back; told until it stops reporting as a spare.
    assert (reply.join_node, lost["joining"]) == ("b", {"b": "s2"}), lost
    assert not reply.job_over and "joining as b" in lost["fallback"]
    assert c.report(spare("s2"), now=104).join_node == "b"


def test_a_spare_not_heard_for_a_heartbeat_and_a_half_is_not_handed_a_node(events):
    """A spare lost with the node it would take reported last about when that node did: it
    is silent for more than 1.5 heartbeats when the node is found lost, and is not chosen."""
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.report(spare("s1"), now=101.9)
    c.report(report("a", [worker(0, 100, 62)]), now=103.4)
    c.tick(now=103.5)
    (lost,) = read_events(events.path)
    assert lost["action"] == "kill" and "0 free spare" in lost["fallback"], lost


def test_a_spare_is_told_the_job_is_over_once_every_worker_has_closed(events):
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    assert not c.report(spare("s1"), now=99).job_over  # nothing has run yet
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60, phase="closed")]), now=100)
    assert not c.report(spare("s1"), now=100).job_over  # a still runs
    c.report(report("a", [worker(0, 100, 61, alive=False)]), now=101)  # died: not an end
    assert not c.report(spare("s1"), now=101).job_over
    c.report(report("a", [worker(0, 110, 1, phase="closed")]), now=102)  # its replacement
    c.report(report("b", []), now=102)  # its page removed at close
    assert c.report(spare("s1"), now=102).job_over
    pushed = []
    c.watch(JOB, "s1", pushed.append)
    c.job_over(JOB)  # the launcher serving the controller exits: said at once
    assert [r.job_over for r in pushed] == [True]


def test_a_spare_is_told_a_failed_job_is_over_once_every_launcher_is_gone(events):
    """A standalone controller outlives the job: when the job fails, its workers never close.
    Once every node's agent has gone silent (its launcher exited) with no worker running when
    last heard, the job is over for the spare too. A node lost with workers running is not an
    end: a spare or the restart takes it."""
    c = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.report(report("a", [worker(0, 100, 61, alive=False)]), now=101)  # failed, then exits
    c.report(report("b", [worker(1, 200, 61, alive=False)]), now=101)
    assert not c.report(spare("s1"), now=103).job_over  # silent for less than the timeout
    c.tick(now=104.5)
    assert c.report(spare("s1"), now=104.5).job_over
    c2 = Controller(events, policy="in-process", node_timeout=3, heartbeat=1)
    c2.report(report("a", [worker(0, 100, 60)]), now=100)
    c2.report(report("b", [worker(1, 200, 60)]), now=100)
    c2.report(spare("s1"), now=103.5)
    c2.tick(now=103.6)  # both silent with workers running: lost, not over
    assert not c2.report(spare("s2"), now=110).job_over


def test_a_controller_that_hears_no_node_judges_none_lost_until_they_are_heard_again(events):
    """Every node silent at once (the controller's own network cut, not theirs): none is
    judged lost. Once one is heard again the others get the node timeout and a redial
    (``REDIAL_S``) to be heard too; one that stays silent is lost then."""
    c = Controller(events, policy="restart", node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.tick(now=104)
    c.tick(now=130)
    assert [e["kind"] for e in read_events(events.path)] == ["controller_deaf"]
    for t in range(130, 138):  # a heard again, a report a heartbeat
        c.report(report("a", [worker(0, 100, t - 40)]), now=t + 0.5)
        c.tick(now=t + 0.9)  # b has the node timeout and a redial to be heard too
    assert [e["kind"] for e in read_events(events.path)] == ["controller_deaf"]
    c.report(report("a", [worker(0, 100, 99.5)]), now=139.5)
    c.tick(now=139.6)  # b still silent past the grace: lost
    lost = [e for e in read_events(events.path) if e["kind"] == "node_lost"]
    assert [e["nodes"] for e in lost] == [["b"]], lost


def test_spares_serve_in_process_recovery_only(events):
    c = Controller(events, policy="restart", node_timeout=3, heartbeat=1)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    c.report(report("b", [worker(1, 200, 60)]), now=100)
    c.report(spare("s1"), now=102)
    c.report(report("a", [worker(0, 100, 62)]), now=102)
    c.tick(now=103.5)
    (lost,) = read_events(events.path)
    assert lost["action"] == "kill" and "spares" not in lost
    assert c.report(spare("s1"), now=103.6).take_node == ""


def test_a_node_with_no_running_worker_is_not_lost_when_its_agent_leaves(events):
    c = Controller(events, node_timeout=1)
    c.report(report("a", [worker(0, 100, 60, phase="closed")]), now=100)
    c.tick(now=200)
    assert kinds(events) == []


def test_a_node_lost_before_it_reported_its_workers_is_lost_while_the_round_lacks_its_ranks(
    events,
):
    """Node b's agent reported once, before its workers started; its ranks joined the round
    (a's started with them) and b went silent: b is lost, and a's round is killed although it
    started after b's last report. A silent spare, in a round short of nothing, is not, nor
    is a node that last reported a larger world."""
    c = Controller(events, node_timeout=3, heartbeat=1)
    c.report(report("a", []), now=100)
    c.report(report("b", []), now=100)
    c.report(report("spare", []), now=100)
    c.report(report("a", [worker(0, 100, 0.5), worker(1, 101, 0.5)]), now=101)
    c.report(report("a", [worker(0, 100, 3), worker(1, 101, 3)]), now=103.5)
    c.tick(now=103.6)
    lost = [e for e in read_events(events.path) if e["kind"] == "node_lost"]
    assert [(e["nodes"], e["ranks"]) for e in lost] == [(["b", "spare"], [])], lost
    assert lost[0]["ordered"] == {"a": [100, 101]} and lost[0]["silent_s"] == pytest.approx(3.6)

    c2 = Controller(None, node_timeout=3, heartbeat=1)
    c2.report(report("spare", []), now=100)
    c2.report(report("gone", [], world=8), now=100)  # of a larger world: not this round's
    for t in (100, 102, 103.5):
        c2.report(report("a", [worker(0, 100, t - 99), worker(1, 101, t - 99)], world=4), now=t)
        c2.report(report("b", [worker(2, 200, t - 99), worker(3, 201, t - 99)], world=4), now=t)
    c2.tick(now=103.6)
    assert [d.kind for d in c2.status(JOB, now=103.6).detections] == []
    c2.report(report("b", [worker(2, 200, 6), worker(3, 201, 6, phase="closed")]), now=106)
    c2.tick(now=106.1)  # rank 3 closed early: the round is short, the spare still is not in it
    assert [d.kind for d in c2.status(JOB, now=106.1).detections] == []


def test_policy_notify_records_detections_and_kills_nothing(events):
    c = Controller(events, policy="notify", node_timeout=5)
    c.report(report("a", [worker(0, 100, 60)]), now=100)
    reply = c.report(report("b", [worker(1, 200, 60, alive=False)]), now=100)
    assert list(reply.kill_pids) == []
    assert list(c.report(report("a", [worker(0, 100, 61)]), now=101).kill_pids) == []
    assert read_events(events.path)[0]["action"] == "notify"


def test_a_global_commit_needs_every_rank_of_the_job(events):
    c = Controller(events)

    def tier(step: int) -> pb.TierCommit:
        return pb.TierCommit(url="pfs:///ckpt", shared=True, step=step, generation=0)

    c.report(report("a", [], tiers=[tier(7)], ranks=[0, 1]), now=1)
    assert list(c.status(JOB).commits) == []  # ranks 2 and 3 have not reported
    c.report(report("b", [], tiers=[tier(5)], ranks=[2, 3]), now=1)
    assert [(g.url, g.step) for g in c.status(JOB).commits] == [("pfs:///ckpt", 5)]
    c.report(report("b", [], tiers=[tier(7)], ranks=[2, 3]), now=2)
    assert [(g.url, g.step) for g in c.status(JOB).commits] == [("pfs:///ckpt", 7)]
    commits = [e for e in read_events(events.path) if e["kind"] == "global_commit"]
    assert [(e["tier"], e["step"]) for e in commits] == [("pfs:///ckpt", 5), ("pfs:///ckpt", 7)]


def test_nodes_lost_together_are_one_detection(events):
    """A rack going dark is one detection naming its nodes, not one per node."""
    c = Controller(events, node_timeout=3, heartbeat=1)
    for i in range(6):
        c.report(report(f"n{i}", [worker(i, 100 + i, 60)]), now=100 + i / 10)
    for i in range(3):  # the others keep reporting
        c.report(report(f"n{i}", [worker(i, 100 + i, 63)]), now=103)
    c.tick(now=103.6)
    lost = [e for e in read_events(events.path) if e["kind"] == "node_lost"]
    assert len(lost) == 1
    assert lost[0]["nodes"] == ["n3", "n4", "n5"] and lost[0]["failed_node"] == "n3"
    assert lost[0]["ordered"] == {f"n{i}": [100 + i] for i in range(6)}
    assert lost[0]["ranks"] == [3, 4, 5]


def test_a_global_commit_follows_nodes_that_leave_a_tier_or_come_back(events):
    c = Controller(events)
    pfs = pb.TierCommit(url="pfs:///ckpt", shared=True, step=4, generation=0)
    s3 = pb.TierCommit(url="s3://b/ckpt", shared=True, step=4, generation=0)
    c.report(report("a", [], tiers=[pfs, s3], ranks=[0, 1], world=4), now=1)
    c.report(report("b", [], tiers=[pfs], ranks=[2, 3], world=4), now=1)
    assert {g.url: g.step for g in c.status(JOB).commits} == {"pfs:///ckpt": 4}
    # b's agent restarts and now reports s3 too, not pfs: pfs stays at what it had.
    s3_b = pb.TierCommit(url="s3://b/ckpt", shared=True, step=6, generation=0)
    c.report(report("b", [], tiers=[s3_b], ranks=[2, 3], world=4, agent="b-2"), now=2)
    assert {g.url: g.step for g in c.status(JOB).commits} == {"pfs:///ckpt": 4,
                                                             "s3://b/ckpt": 4}  # fmt: skip
    # A newer generation with a step not yet committed on one node holds the commit back.
    none_yet = pb.TierCommit(url="s3://b/ckpt", shared=True, step=-1, generation=1)
    c.report(report("a", [], tiers=[none_yet], ranks=[0, 1], world=4), now=3)
    c.report(report("b", [], tiers=[pb.TierCommit(url="s3://b/ckpt", step=9, generation=1)],
                    ranks=[2, 3], world=4), now=3)  # fmt: skip
    assert {g.url: g.step for g in c.status(JOB).commits}["s3://b/ckpt"] == 4
    c.report(report("a", [], tiers=[pb.TierCommit(url="s3://b/ckpt", step=8, generation=1)],
                    ranks=[0, 1], world=4), now=4)  # fmt: skip
    got = {g.url: (g.generation, g.step) for g in c.status(JOB).commits}
    assert got == {"pfs:///ckpt": (0, 4), "s3://b/ckpt": (1, 8)}


def test_coverage_counts_each_rank_once_however_many_nodes_claim_it():
    from flashckpt.agent.commits import Coverage

    cov = Coverage()
    cov.update("a", (0, 5), frozenset({0, 1}), 4)
    cov.update("b", (0, 7), frozenset({1, 2}), 4)
    assert cov.committed() is None  # rank 3 missing
    cov.update("c", (0, 6), frozenset({3}), 4)
    assert cov.committed() == (0, 5)
    cov.update("a", (0, 9), frozenset({0, 1}), 4)
    assert cov.committed() == (0, 6)
    cov.drop("a")
    assert cov.committed() is None and dict(cov.ranks) == {1: 1, 2: 1, 3: 1}
    cov.update("a", (0, 9), frozenset({0}), 8)  # a larger world now: ranks 4-7 missing
    assert cov.committed() is None


def test_the_controller_state_is_rebuilt_from_reports(events):
    """A restarted controller learns the job from the next reports: a failure that is still
    on a page is detected, and only workers older than it are killed."""
    c = Controller(events)
    c.report(report("a", [worker(0, 100, 60), worker(1, 101, 0.3)]), now=50)
    reply = c.report(report("b", [worker(2, 200, 60, alive=False, silent=10)]), now=50)
    assert list(reply.kill_pids) == []
    assert read_events(events.path)[0]["ordered"] == {"a": [100]}


# ---- gRPC: token, TLS, binding ------------------------------------------------------------


def call(address: str, token: str, tls: control.Tls | None = None) -> pb.ReportReply:
    async def go() -> pb.ReportReply:
        if tls is None:
            channel = grpc.aio.insecure_channel(address)
        else:
            channel = grpc.aio.secure_channel(address, tls.channel_credentials())
        async with channel:
            stub = pb_grpc.ControllerStub(channel)
            return await stub.Report(report("a", []), timeout=5,
                                     metadata=(("authorization", f"Bearer {token}"),))  # fmt: skip

    return asyncio.run(go())


@pytest.fixture
def served(events):
    thread = InThread(Controller(events), "127.0.0.1:0", TOKEN)
    port = thread.start_serving()
    yield thread, f"127.0.0.1:{port}"
    thread.stop()


def test_only_a_caller_with_the_token_is_heard(served):
    _, address = served
    assert call(address, TOKEN).heartbeat_s > 0
    for wrong in ("", "x" * 32, TOKEN + "x"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call(address, wrong)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "FLASHCKPT_CONTROLLER_TOKEN" in err.value.details()


def connect(address: str, token: str, reports: list[pb.NodeReport], until) -> list:
    """Open a report stream, write ``reports``, read replies until ``until(replies)``."""

    async def go() -> list:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.ControllerStub(channel).Connect(
                metadata=(("authorization", f"Bearer {token}"),)
            )
            await call.initial_metadata()  # accepted or refused before the first report
            for r in reports if not call.done() else []:  # refused: the read says why
                await call.write(r)
            got = []
            async for reply in call:
                got.append(reply)
                if until(got):
                    break
            call.cancel()
            return got

    return asyncio.run(asyncio.wait_for(go(), 20))


def test_a_report_stream_is_answered_and_gets_orders_pushed(served):
    """Each report of a stream is answered when it has news (and every tenth as a sign of
    life), and a detection pushes the node's kill order at once, between its reports."""
    thread, address = served
    c = thread.controller
    first = report("a", [worker(0, 100, 60)])
    first.seq = 1
    more = [report("a", [worker(0, 100, 60)]) for _ in range(10)]
    for i, r in enumerate(more):
        r.seq = i + 2

    def fail_b_once_a_is_heard(got: list) -> bool:
        if len(got) == 1:  # fail a worker elsewhere, from the controller's own loop
            thread._loop.call_soon_threadsafe(
                c.report, report("b", [worker(1, 200, 60, alive=False)])
            )
        return any(list(r.kill_pids) == [100] for r in got)

    replies = connect(address, TOKEN, [first], fail_b_once_a_is_heard)
    assert replies[0].seq == 1 and replies[0].heartbeat_s > 0
    assert [(r.seq, list(r.kill_pids)) for r in replies[1:]] == [(0, [100])]  # pushed unasked
    replies = connect(address, TOKEN, [first, *more], lambda got: len(got) == 2)
    assert [r.seq for r in replies] == [1, 10]  # nothing new in 2-9: one sign of life at 10


def test_a_report_stream_without_the_token_is_refused(served):
    _, address = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        connect(address, "x" * 32, [report("a", [])], lambda got: True)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "FLASHCKPT_CONTROLLER_TOKEN" in err.value.details()


def test_a_second_controller_cannot_take_the_same_address(served, events):
    _, address = served
    with pytest.raises(RuntimeError):
        InThread(Controller(events), address, TOKEN).start_serving()


def test_tls_with_the_controllers_certificate(tmp_path, events, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TLS_CERT", str(cert))
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TLS_KEY", str(key))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        control.Tls.from_env(server=True)
    key.chmod(0o600)
    thread = InThread(Controller(events), "127.0.0.1:0", TOKEN, control.Tls.from_env(server=True))
    port = thread.start_serving()
    try:
        assert call(f"127.0.0.1:{port}", TOKEN, control.Tls.from_env(server=False)).heartbeat_s
        with pytest.raises(grpc.aio.AioRpcError):  # plain text to a TLS port
            call(f"127.0.0.1:{port}", TOKEN)
    finally:
        thread.stop()


def test_tokens_that_are_short_or_readable_by_others_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHCKPT_CONTROLLER_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("s" * 40 + "\n")
    path.chmod(0o644)
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TOKEN_FILE", str(path))
    with pytest.raises(ConfigError, match="chmod 600"):
        control.token_from_env()
    path.chmod(0o600)
    assert control.token_from_env() == "s" * 40
    monkeypatch.setenv("FLASHCKPT_CONTROLLER_TOKEN", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        control.token_from_env()


def test_a_torn_or_foreign_endpoint_file_means_no_controller(tmp_path):
    tmp_path.chmod(0o700)
    control.Endpoint("127.0.0.1:1", TOKEN).save(tmp_path, JOB)
    assert control.Endpoint.load(tmp_path, JOB) == control.Endpoint("127.0.0.1:1", TOKEN)
    for junk in (b"", b"{", b'{"address": "nohost", "token": "' + TOKEN.encode() + b'"}',
                 b'{"address": "127.0.0.1:1", "token": "short"}', b"[1, 2]"):  # fmt: skip
        control.file_path(tmp_path, JOB).write_bytes(junk)
        assert control.Endpoint.load(tmp_path, JOB) is None, junk


# ---- a real agent carries out the orders ---------------------------------------------------

WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flashckpt.faults.heartbeat import Heartbeat, heartbeat_path, stacks_path
    shm, job, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    (shm / job).mkdir(parents=True, exist_ok=True)
    hb = Heartbeat(heartbeat_path(shm, job, rank), stacks_path(shm, job, rank))
    hb.progress(1)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def start_agent(shm_dir, run_dir, log=None) -> subprocess.Popen:
    """The job's node agent as its own process (its stderr to ``log`` where given)."""
    with open(log, "w") if log is not None else contextlib.nullcontext() as err:
        return subprocess.Popen(
            [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", JOB, "--shm-dir",
             str(shm_dir), "--run-dir", str(run_dir)], cwd=ROOT, stderr=err,
        )  # fmt: skip


def start_worker(shm: Path, rank: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(shm), JOB, str(rank)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
def test_an_agent_reports_its_workers_and_kills_the_ones_ordered(shm_dir, run_dir, events,
                                                                  monkeypatch):  # fmt: skip
    monkeypatch.setenv("FLASHCKPT_NODE", "here")
    monkeypatch.setenv("FLASHCKPT_KILL_GRACE", "1")
    c = Controller(events, node_timeout=30, heartbeat=0.2)
    thread = InThread(c, "127.0.0.1:0", TOKEN)
    port = thread.start_serving()
    control.Endpoint(f"127.0.0.1:{port}", TOKEN).save(run_dir, JOB)
    running, stopped = start_worker(shm_dir, 0), start_worker(shm_dir, 1)
    os.kill(stopped.pid, signal.SIGSTOP)
    agent = start_agent(shm_dir, run_dir)
    try:

        def ours():
            job = c.jobs.get(JOB)
            return job.nodes.get("here") if job else None

        assert poll(lambda: ours() is not None and len(ours().workers) == 2, 30)
        seen = {s.worker.rank: s.worker for s in ours().workers.values()}
        assert seen[0].pid == running.pid and seen[0].alive and seen[0].step == 1
        # Another node's worker failed: the controller orders both of ours killed.
        c.report(report("there", [worker(5, 999, 60, alive=False)]))
        assert poll(lambda: running.poll() is not None and stopped.poll() is not None, 15)
        assert running.returncode == -signal.SIGTERM  # a live worker is asked first
        assert stopped.returncode == -signal.SIGKILL  # a stopped one cannot hear SIGTERM
        assert poll(lambda: not ours().kill, 10)
    finally:
        for p in (running, stopped):
            p.kill()
            p.wait()
        agent.terminate()
        assert agent.wait(30) == 0
        thread.stop()
    assert is_dead(running.pid) and is_dead(stopped.pid)


def test_an_agent_refused_warns_once_and_follows_the_next_controller_file(shm_dir, run_dir,
                                                                         events, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """A controller that refuses the agent's token costs one warning, not one a heartbeat, and
    the agent's report stream follows the controller file once it names the right token."""
    monkeypatch.setenv("FLASHCKPT_NODE", "here")
    c = Controller(events, node_timeout=30, heartbeat=1)
    thread = InThread(c, "127.0.0.1:0", TOKEN)
    port = thread.start_serving()
    control.Endpoint(f"127.0.0.1:{port}", "w" * 32).save(run_dir, JOB)
    log = tmp_path / "agent.log"
    agent = start_agent(shm_dir, run_dir, log)
    try:
        assert poll(lambda: "does not take reports" in log.read_text(), 30)
        time.sleep(3.5)  # three more heartbeats, refused
        text = log.read_text()
        assert text.count("does not take reports") == 1, text
        assert "UNAUTHENTICATED" in text and JOB not in c.jobs
        control.Endpoint(f"127.0.0.1:{port}", TOKEN).save(run_dir, JOB)
        assert poll(lambda: JOB in c.jobs and "here" in c.jobs[JOB].nodes, 15)
    finally:
        agent.terminate()
        assert agent.wait(30) == 0
        thread.stop()


def test_the_standalone_controller_needs_a_token_and_serves_with_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHCKPT_CONTROLLER")}
    cmd = [sys.executable, "-m", "flashckpt.agent.cli", "controller", "--bind", "127.0.0.1:0",
           "--events", str(tmp_path / "ev.jsonl")]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0 and "FLASHCKPT_CONTROLLER_TOKEN_FILE" in out.stderr
    proc = subprocess.Popen(cmd, env={**env, "FLASHCKPT_CONTROLLER_TOKEN": TOKEN},
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        line = ""
        while "serving on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
        address = line.split("serving on ")[1].split()[0]
        assert call(address, TOKEN).heartbeat_s > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_flashckpt_list_shows_the_controllers_nodes_detections_and_global_commits(
    served, run_dir, shm_dir
):
    thread, address = served
    c = thread.controller
    pfs = pb.TierCommit(url="pfs:///ckpt", shared=True, step=9, generation=0)
    c.report(report("a", [worker(0, 100, 60)], tiers=[pfs], ranks=[0, 1], world=2))
    c.report(report("b", [worker(2, 200, 60, alive=False)], world=2))
    control.Endpoint(address, TOKEN).save(run_dir, JOB)
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", "list", "--job", JOB], capture_output=True,
        text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"controller {address} (policy restart):" in out.stdout
    assert "node a: seen" in out.stdout and "running ranks [0]" in out.stdout
    assert "worker failed: rank 2 on b" in out.stdout
    assert "pfs:///ckpt: step 9 committed for every rank" in out.stdout
    thread.stop()
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", "list", "--job", JOB], capture_output=True,
        text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0 and "does not answer" in out.stdout, out
