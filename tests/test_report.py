"""``flashckpt report`` over in-process recoveries: each fault's time split into detect, abort,
rendezvous, replacement and restore, a fallback shown as the restart it became, and the
effective training time of the whole run."""

from __future__ import annotations

import pytest

from flashckpt.faults.report import render, summarize

T0 = 1000.0


def timeline(*rows: tuple) -> list[dict]:
    return [{"time": T0 + t, "kind": kind, **fields} for t, kind, fields in rows]


def closed(t: float, rank: int) -> tuple:
    return (t, "closed", {"rank": rank, "save_stall_s": 0.5, "step_s": 0.1})


def test_training_again_is_every_ranks_first_step_after_the_restore():
    """Resume ends when the last rank has finished its first step after the restore (its
    first save), not when its restore returned: a slow first step counts."""
    events = timeline(
        (0, "launcher_started", {}),
        (10.0, "restored", {"rank": 0, "step": None, "seconds": 0.01}),
        (20.20, "worker_exited", {"rank": 1, "worker_pid": 41, "step": 100, "silent_s": 0.2}),
        (26.0, "restored", {"rank": 0, "step": 100, "seconds": 0.1}),
        (26.1, "restored", {"rank": 1, "step": 100, "seconds": 0.1}),
        (26.9, "stepped", {"rank": 1, "step": 101}),
        (27.3, "stepped", {"rank": 0, "step": 101}),
        (60.0, "launcher_exited", {}),
    )  # fmt: skip
    (f,) = summarize(events).failures
    assert f.resume_s == pytest.approx(27.3 - 20.2)


def test_a_killed_rank_recovered_in_process_is_split_into_its_parts():
    events = timeline(
        (0, "launcher_started", {}),
        (10.0, "restored", {"rank": 0, "step": None, "seconds": 0.01}),  # the first start
        # Rank 1 died 0.05 s after its last heartbeat: peers notice first, then its launcher.
        (20.05, "inprocess_fault", {"rank": 0, "own": False, "step": 99}),
        (20.06, "replacement_started", {"rank": 1, "lost_pid": 41, "pid": 51, "round": 1}),
        (20.20, "worker_exited", {"rank": 1, "worker_pid": 41, "step": 100, "silent_s": 0.2}),
        (20.21, "inprocess_fault", {"rank": 2, "own": False, "step": 100}),
        (20.25, "inprocess_left", {"rank": 0, "abort_s": 0.2}),
        (20.30, "inprocess_left", {"rank": 2, "abort_s": 0.09}),
        (20.70, "inprocess_joined", {"rank": 0, "rendezvous_s": 0.45}),
        (20.70, "inprocess_joined", {"rank": 2, "rendezvous_s": 0.4}),
        (20.72, "inprocess_recovered", {"ranks": [1], "replacement_s": 0.66}),
        (20.80, "restored", {"rank": 0, "step": 100, "seconds": 0.08}),
        (20.85, "restored", {"rank": 1, "step": 100, "seconds": 0.1}),
        # Rank 1's save stall is its lost process's plus its replacement's: the slowest rank.
        closed(20.0, 1), closed(60, 0), closed(60, 1), (60.0, "launcher_exited", {}),
    )  # fmt: skip
    report = summarize(events)
    (f,) = report.failures
    assert (f.kind, f.mode, f.ranks, f.restored_step) == ("exit", "in-process", [1], 100)
    assert f.detect_s == pytest.approx(0.05)  # last heartbeat 20.0, first reaction 20.05
    assert (f.abort_s, f.rendezvous_s, f.replacement_s, f.restore_s) == (0.2, 0.45, 0.66, 0.1)
    assert f.resume_s == pytest.approx(0.8)  # from the first reaction to the last restore
    assert f.recomputed_steps() == 1
    assert report.save_stall_s == pytest.approx(1.0)  # not the 1.5 s of all three closes
    assert report.lost_s() == pytest.approx(1.0 + 0.05 + 0.8 + 0.1)
    text = render(report)
    assert "exit of rank(s) [1], in-process: detect 0.05s, abort 0.20s, rendezvous 0.45s, " \
           "replacement 0.66s, restore 0.10s; training again 0.85s after it" in text  # fmt: skip
    assert report.effective() == pytest.approx(1 - 1.95 / 60)
    assert f"effective training time {100 * report.effective():.1f}%" in text


def test_an_exception_hangs_and_fallbacks_each_count_as_one_failure():
    events = timeline(
        (0, "launcher_started", {}),
        # An exception: detected where it is raised, every rank rolls back in place.
        (10.0, "inprocess_fault", {"rank": 2, "own": True, "step": 50}),
        (10.1, "inprocess_fault", {"rank": 0, "own": False, "step": 50}),
        (10.2, "inprocess_left", {"rank": 2, "abort_s": 0.15}),
        (10.5, "inprocess_joined", {"rank": 0, "rendezvous_s": 0.3}),
        (10.6, "restored", {"rank": 0, "step": 50, "seconds": 0.05}),
        (10.6, "restored", {"rank": 2, "step": 50, "seconds": 0.06}),
        # A hang: the watchdog kills rank 3 and a standby takes it; its exit is the hang's.
        (30.0, "hang_detected", {"rank": 3, "worker_pid": 7, "silent_s": 3.0, "step": 70}),
        (30.1, "replacement_started", {"rank": 3, "lost_pid": 7, "pid": 8, "round": 2}),
        (30.2, "worker_exited", {"rank": 3, "worker_pid": 7, "step": 70, "silent_s": 3.2}),
        (30.3, "inprocess_fault", {"rank": 0, "own": False, "step": 70}),
        (30.9, "inprocess_recovered", {"ranks": [3], "replacement_s": 0.8}),
        (31.0, "restored", {"rank": 3, "step": 69, "seconds": 0.07}),
        # A kill whose replacement dies too: in-process recovery gives way to a restart.
        (40.0, "replacement_started", {"rank": 1, "lost_pid": 9, "pid": 10, "round": 3}),
        (40.2, "worker_exited", {"rank": 1, "worker_pid": 9, "step": 80, "silent_s": 0.3}),
        (41.0, "inprocess_fallback", {"reason": "a second fault during recovery"}),
        (41.1, "worker_exited", {"rank": 0, "worker_pid": 11, "step": 80, "silent_s": 1.0}),
        (47.0, "restored", {"rank": 0, "step": 80, "seconds": 0.5}),
        closed(100, 0), (100.0, "launcher_exited", {}),
    )  # fmt: skip
    report = summarize(events)
    exc, hang, fell = report.failures
    assert (exc.kind, exc.mode, exc.ranks, exc.detect_s) == ("exception", "in-process", [2], 0)
    assert exc.resume_s == pytest.approx(0.6) and exc.recomputed_steps() == 1
    assert (hang.kind, hang.mode, hang.ranks) == ("hang", "in-process", [3])
    assert hang.detect_s == pytest.approx(3.0) and hang.replacement_s == 0.8
    assert hang.recomputed_steps() == 2  # restored 69 with step 70 saved by some rank
    assert (fell.kind, fell.mode, fell.ranks) == ("exit", "restart", [1])
    assert fell.fallback == "a second fault during recovery"
    assert fell.detect_s == pytest.approx(0.1)  # last heartbeat 39.9, replaced at 40.0
    assert fell.resume_s == pytest.approx(7.0)
    text = render(report)
    assert "exception of rank(s) [2], in-process: detect 0.00s" in text
    assert "restart (in-process fell back: a second fault during recovery)" in text


def test_events_that_are_not_failures_change_nothing():
    events = timeline(
        (0, "launcher_started", {}),
        (1, "restored", {"rank": 0, "step": None, "seconds": 0.01}),
        (2, "inprocess_left", {"rank": 0, "abort_s": "x"}),  # stray fields of a torn log
        (3, "inprocess_recovered", {"replacement_s": None}),
        (4, "worker_finished", {"rank": 0, "worker_pid": 1}),
        closed(10, 0),
    )  # fmt: skip
    report = summarize(events)
    assert report.failures == [] and report.lost_s() == pytest.approx(0.5)
    assert "0 failure(s)" in render(report)


# ---- the projection (--project) ----------------------------------------------------------


def project(*argv: str, events: list[dict] | None = None):
    import argparse

    from flashckpt.cli import report as cli
    from flashckpt.faults import projection

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--project", *argv])
    return projection.build(summarize(events) if events else None, args)


def test_the_projection_is_the_model_worked_by_hand():
    m = project("--gpus", "8192", "--step-s", "2", "--stall-s", "0.02", "--save-every", "2",
                "--restart-s", "100", "--inprocess-s", "3", "--in-place", "0.5",
                "--detect-exit-s", "1", "--hang-timeout-s", "20", "--node-timeout-s", "5",
                "--recomputed", "1.5", "--mix", "exit=2,hang=1,node=1",
                "--recovery-deadline-s", "10", "--node-extra-s", "50")  # fmt: skip
    rate = 419 / (54 * 24) / 2 / 3600  # per second: half Llama 3's GPUs, half its rate
    mix = {"exit": 0.5, "hang": 0.25, "node": 0.25}
    detect = {"exit": 1, "hang": 20, "node": 5.25}
    stall = 0.02 / (2 * 2)
    for policy, recover in (
        # A lost node restarts on a spare, restored from a shared tier: 50 s more.
        ("restart", {"exit": 100, "hang": 100, "node": 150}),
        # Half the exits and hangs recover in place; the others fail that attempt, wait up to
        # the recovery deadline, then restart; a lost node always restarts.
        ("in-process", {"exit": 3 + 0.5 * (10 + 100), "hang": 3 + 0.5 * (10 + 100), "node": 150}),
    ):
        lost = sum(rate * mix[k] * (detect[k] + recover[k] + 1.5 * 2) for k in mix)
        got = m.project(policy)
        assert got["save stall"] == pytest.approx(stall)
        assert got["recovery"] == pytest.approx(sum(rate * mix[k] * recover[k] for k in mix))
        assert got["effective"] == pytest.approx((1 - lost) * (1 - stall))
    assert m.project("in-process")["effective"] > m.project("restart")["effective"]


def test_saving_less_often_costs_more_recomputed_steps_and_the_mix_says_it_is_assumed():
    """A save every 100 steps loses, on average, the step in progress and half the steps since
    the last save: saving less often must not raise the projection for free."""
    every = {n: project("--save-every", str(n), "--stall-s", "0.02") for n in (1, 10, 100)}
    assert [every[n].recomputed.value for n in (1, 10, 100)] == [1.0, 5.5, 50.5]
    lost = {n: 1 - every[n].project("restart")["effective"] for n in every}
    recomputed = {n: every[n].project("restart")["recomputed"] for n in every}
    assert recomputed[1] < recomputed[10] < recomputed[100]
    assert every[100].project("restart")["save stall"] < every[1].project("restart")["save stall"]
    assert lost[1] > 0 and every[1].mix_source.startswith("default: an assumption")
    assert lost[100] > lost[1]  # a 20 ms stall a save does not pay for 50 more steps redone


def test_the_projection_takes_its_parts_from_the_logs_and_names_their_sources():
    events = timeline(
        (0, "launcher_started", {}),
        (10.0, "restored", {"rank": 0, "step": None, "seconds": 0.01}),
        (20.2, "worker_exited", {"rank": 1, "worker_pid": 41, "step": 100, "silent_s": 0.2}),
        (27.2, "restored", {"rank": 0, "step": 99, "seconds": 0.5}),
        (27.2, "restored", {"rank": 1, "step": 99, "seconds": 0.5}),
        (60, "closed", {"rank": 0, "save_stall_s": 0.5, "saves": 100, "step_s": 0.25}),
        (60, "closed", {"rank": 1, "save_stall_s": 0.8, "saves": 100, "step_s": 0.25}),
        (60.0, "launcher_exited", {}),
    )  # fmt: skip
    m = project("--restart-s", "40", events=events)
    assert (m.step_s.value, m.step_s.source) == (0.25, "measured")
    assert (m.stall_s.value, m.stall_s.source) == (pytest.approx(0.008), "measured")
    assert (m.detect["exit"].value, m.detect["exit"].source) == (pytest.approx(0.2), "measured")
    assert m.recomputed.value == 2 and m.recomputed.source == "measured"
    assert (m.recover["restart"].value, m.recover["restart"].source) == (40, "given")
    assert m.recover["in-process"].source.startswith("default")  # no in-process recovery ran
    from flashckpt.faults import projection

    text = projection.render(m)
    assert "save stall 8.0 ms a save (measured)" in text and "target 98.8%" in text
    assert "recover, restart: 40.00s (given)" in text


@pytest.mark.parametrize("argv, says", [
    (["--mix", "exit=1,disk=1"], "'disk' is not one of exit, hang, node"),
    (["--mix", "exit=0"], "add up to 0"),
    (["--in-place", "1.5"], "not in [0, 1]"),
    (["--gpus", "0"], "not in [1,"),
    (["--step-s", "fast"], "'fast' is not a number"),
])  # fmt: skip
def test_the_cli_refuses_bad_projection_options(argv, says):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "flashckpt.cli", "report", "--project", *argv],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and says in run.stderr, run.stderr


def test_the_cli_projects_without_logs_and_asks_for_them_otherwise():
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "flashckpt.cli", "report", "--project", "--json",
                          "--gpus", "16384"], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["interruptions_per_hour"] == pytest.approx(419 / (54 * 24))
    assert set(doc["projection"]) == {"restart", "in-process"} and doc["target"] == 0.988
    run = subprocess.run([sys.executable, "-m", "flashckpt.cli", "report"], capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode != 0 and "--project" in run.stderr


def test_lost_nodes_are_split_by_whether_a_peers_replica_served_them():
    events = timeline(
        (0, "launcher_started", {}),
        (5.0, "node_lost", {"nodes": ["node1"], "ranks": [2, 3], "age_s": 3.0, "step": 12}),
        (9.0, "restored", {"rank": 0, "step": 12, "seconds": 0.1, "source": "shared memory"}),
        (9.1, "restored", {"rank": 2, "step": 12, "seconds": 0.2,
                           "source": "peer node0 (10.0.0.1:4242) memory"}),
        (30.0, "node_lost", {"nodes": ["node1", "node2"], "ranks": [2, 3, 4, 5], "step": 40}),
        (35.0, "restored", {"rank": 2, "step": 30, "seconds": 1.0, "source": "pfs:///ckpt"}),
        (60.0, "launcher_exited", {}),
    )  # fmt: skip
    report = summarize(events)
    assert [f.from_replica for f in report.failures] == [True, False]
    losses = report.node_losses()
    assert losses["replica"] == {"failures": 1, "recomputed_steps": 1}
    assert losses["storage"] == {"failures": 1, "recomputed_steps": 11}
    text = render(report)
    assert "restored step 12 from a peer's replica" in text
    assert (
        "lost nodes: 1 served by a peer's replica (1 step(s) recomputed), 1 from storage (11)"
        in text
    )


def test_each_runs_start_up_is_a_cause_of_its_own_and_a_recoverys_first_step_stays_its():
    """From a run's first launcher to every rank's first step the job trains nothing: each
    run's start-up counts as lost, apart from the failures, whose first step after the
    restore stays theirs."""
    events = timeline(
        (0, "launcher_started", {"node": "n0"}),
        (0.5, "launcher_started", {"node": "n1"}),
        (10.0, "restored", {"rank": 0, "step": None, "seconds": 0.01, "node": "n0"}),
        (10.1, "restored", {"rank": 1, "step": None, "seconds": 0.01, "node": "n1"}),
        (12.0, "stepped", {"rank": 0, "step": 0, "node": "n0"}),
        (14.0, "stepped", {"rank": 1, "step": 0, "node": "n1"}),  # the run trains: 14 s
        (20.20, "worker_exited", {"rank": 1, "worker_pid": 41, "step": 50, "silent_s": 0.2,
                                  "node": "n1"}),
        (26.0, "restored", {"rank": 0, "step": 50, "seconds": 0.1, "node": "n0"}),
        (26.1, "restored", {"rank": 1, "step": 50, "seconds": 0.1, "node": "n1"}),
        (26.9, "stepped", {"rank": 1, "step": 51, "node": "n1"}),
        (27.3, "stepped", {"rank": 0, "step": 51, "node": "n0"}),
        (60.0, "launcher_exited", {"node": "n0"}),
        (60.1, "launcher_exited", {"node": "n1"}),
        (100.0, "launcher_started", {"node": "n0"}),  # the job run again: a start-up of 5 s
        (103.0, "restored", {"rank": 0, "step": 99, "seconds": 0.2, "node": "n0"}),
        (105.0, "stepped", {"rank": 0, "step": 100, "node": "n0"}),
        (130.0, "launcher_exited", {"node": "n0"}),
    )  # fmt: skip
    report = summarize(events)
    assert report.startups == 2 and report.startup_s == pytest.approx(14.0 + 5.0)
    (f,) = report.failures
    assert f.resume_s == pytest.approx(27.3 - 20.2)  # not the next run's first step
    assert report.lost_s() == pytest.approx(19.0 + f.detect_s + f.resume_s, abs=0.5)
    assert "start-up 19.00s: launch to every rank's first step, 2 run(s)" in render(report)
    assert report.to_dict()["startup_s"] == pytest.approx(19.0)
