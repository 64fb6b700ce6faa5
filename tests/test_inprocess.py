"""In-process recovery under ``flashckpt-run`` (``FLASHCKPT_RESTART_POLICY=in-process``), on two
simulated nodes of two gloo ranks: a killed, a hung or a raising rank is recovered while every
healthy process keeps running (its pid never changes), a lost rank's place is taken by a warm
standby, a second fault during recovery falls back to restarting every worker, and ten faults
in one run leave the survivors' memory, threads and file descriptors where they were. Every
run ends bit-identical to an undisturbed one (``test_launcher``'s reference)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, wait_for
from test_addresses import hold
from test_launcher import NODES, PER_NODE, TOKEN, Cluster, explain, run_job

pytestmark = pytest.mark.serial  # which rank is the culprit is judged by the clock

TRAINER = ROOT / "tests" / "inprocess_trainer.py"
WORLD = NODES * PER_NODE


def env(**more: str) -> dict[str, str]:
    return {"FLASHCKPT_RESTART_POLICY": "in-process", "FLASHCKPT_RECOVERY_DEADLINE": "15",
            **more}  # fmt: skip


def lines(run, word: str) -> list[dict]:
    """Every ``restored``/``done`` report of the workers, as dicts."""
    out = []
    for text in run.logs:
        for m in re.finditer(rf"{word} (\d+) (?:(None|\d+) )?pid=(\d+)((?: \w+=\d+)*)", text):
            fields = dict(kv.split("=") for kv in m.group(4).split())
            out.append({"rank": int(m.group(1)), "step": m.group(2), "pid": int(m.group(3)),
                        **{k: int(v) for k, v in fields.items()}})  # fmt: skip
    return out


def first_pid(run) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in reversed(lines(run, "restored")) if r["step"] == "None"}


def last_pid(run) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in lines(run, "done")}


def events(run, kind: str) -> list[dict]:
    return [e for node in run.events for e in node if e["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("watch", [False, True])
def test_a_killed_rank_is_replaced_and_every_other_keeps_its_process(tmp_path, reference, watch):
    """Without ``watch``, the survivors learn of the fault from their collectives, which fail
    when the kernel closes the dead rank's connections. With it (the default), every survivor's
    RoundWatch releases its group from outside the training thread once the launcher hands out
    the replacement, as it does under NCCL and for a silent host: the survivors
    spend 0.4 s in each step's compute before its collectives, so they learn of the fault
    from the watch, not from a collective failing."""
    more = ({"FLASHCKPT_RECOVERY_WATCH": "1", "FT_STEP_S": "0.4"} if watch
            else {"FLASHCKPT_RECOVERY_WATCH": "0"})  # fmt: skip
    run = run_job(tmp_path, "ip-kill", trainer=TRAINER, **env(FT_FAULTS="kill:1:12", **more))
    if watch:
        assert sum("round 0 is over" in text for text in run.logs) >= 1, explain(run)
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    before, after = first_pid(run), last_pid(run)
    assert sorted(after) == list(range(WORLD))
    assert {r for r in range(WORLD) if before[r] == after[r]} == {0, 2, 3}, (before, after)
    assert {r["step"] for r in lines(run, "restored") if r["step"] != "None"} == {"12"}
    started = events(run, "replacement_started")
    assert [(e["rank"], e["round"], e["lost_status"]) for e in started] == [(1, 1, -9)]
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")


@pytest.mark.slow
def test_a_store_port_held_for_a_moment_at_start_is_still_served_by_the_controllers_node(
    tmp_path, reference
):
    """A passing connection of the host holds the store's port (the controller's + 1) while
    both nodes start: neither may take it for the other's and look for the store there (the
    job then had no store at all); the controller's node serves it once the port is free."""
    cluster = Cluster(tmp_path, "ip-held", trainer=TRAINER, **env(FT_FAULTS="kill:1:8"))
    port = int(cluster.controller.rsplit(":", 1)[1]) + 1
    held = hold(port)
    try:
        for node in range(NODES):
            cluster.start(node)
        logs = [tmp_path / f"ip-held-node{n}-1.log" for n in range(NODES)]
        wait_for(lambda: any("controller serving" in p.read_text() for p in logs), 60)
        time.sleep(1.0)  # the controller's node is trying the store's port meanwhile
    finally:
        held.close()
    run = cluster.finish()
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert sum("serving the job's recovery store" in text for text in run.logs) == 1
    assert not any("cannot be reached" in text for text in run.logs), explain(run)
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")


@pytest.mark.gpu
def test_on_nccl_a_rank_that_dies_in_the_forming_barrier_is_replaced_within_the_deadline(
    tmp_path,
):
    """NCCL makes its communicator in the round's first barrier, where a dead peer is waited
    for on the device: the forming watch aborts it at the deadline or once the job moves on,
    and the group's timeout is the training one only after it formed. One node of one rank on
    GPU 0 (NCCL takes a device a rank): it raises, then dies in round 1's barrier, and its
    replacement forms round 2 and finishes."""
    run = run_job(tmp_path, "ipf-nccl", trainer=TRAINER, timeout=180, nodes=1, per_node=1,
                  node_env=({},), **env(FT_FAULTS="raise:0:8", FT_DIE_FORMING="0:barrier",
                                        FT_BACKEND="nccl"))  # fmt: skip
    assert run.codes == [0], explain(run)
    assert [e["rank"] for e in events(run, "replacement_started")] == [0]
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")


@pytest.mark.slow
def test_survivors_blocked_in_a_subgroup_collective_are_released_and_the_groups_rebuilt(
    tmp_path, reference
):
    """Ranks pair up in ``new_group``s and all-reduce in their pair after each step. Rank 1
    dies: rank 0 is blocked in their pair's all-reduce. Under the round watch (as under NCCL)
    every group of rank 0's process is aborted, which releases it; the next round makes the
    pairs again, with rank 1's replacement, and training goes on in them to the end."""
    run = run_job(tmp_path, "ip-pairs", trainer=TRAINER,
                  **env(FT_FAULTS="kill:1:10", FT_SUBGROUPS="1", FLASHCKPT_RECOVERY_WATCH="1",
                        FT_STEP_S="0.2"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert [e["rank"] for e in events(run, "replacement_started")] == [1]
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")
    before, after = first_pid(run), last_pid(run)
    assert {r for r in range(WORLD) if before[r] == after[r]} == {0, 2, 3}, (before, after)
    # The world and the rank's own pair, in every process at the end: rebuilt, none left over.
    assert sorted(r["groups"] for r in lines(run, "trained")) == [2] * WORLD, lines(run, "trained")


@pytest.mark.slow
def test_with_a_standalone_controller_its_recovery_store_serves_every_node(tmp_path, reference):
    """``flashckpt-agent controller --policy in-process`` (large jobs): no launcher serves the
    controller, so none serves the recovery store; the controller does, at its port + 1."""
    cluster = Cluster(tmp_path, "ip-alone", trainer=TRAINER, **env(FT_FAULTS="kill:1:12"))
    log = open(tmp_path / "controller.log", "w")  # noqa: SIM115
    controller = subprocess.Popen(
        [sys.executable, "-m", "flashckpt.agent.cli", "controller", "--bind", cluster.controller,
         "--policy", "in-process", "--events", str(tmp_path / "controller.events.jsonl")],
        env={**os.environ, "FLASHCKPT_CONTROLLER_TOKEN": TOKEN}, stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: "recovery store serving" in (tmp_path / "controller.log").read_text(),
                 60, what="the standalone controller")  # fmt: skip
        for node in range(NODES):
            cluster.start(node)
    except BaseException:
        cluster.close()
        controller.kill()
        raise
    try:
        run = cluster.finish()
    finally:
        controller.terminate()
        controller.wait(30)
        log.close()
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert not events(run, "controller_started")  # no launcher served it
    started = events(run, "replacement_started")
    assert [(e["rank"], e["round"]) for e in started] == [(1, 1)], started
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")


@pytest.mark.slow
def test_a_hung_rank_is_killed_replaced_and_the_ranks_waiting_on_it_recover(tmp_path, reference):
    # Node 0's ranks wait in the collective for rank 3 and go silent with it: a higher floor
    # there lets node 1 judge first, and kill the stopped rank alone.
    run = run_job(tmp_path, "ip-hang", trainer=TRAINER,
                  node_env=({"FLASHCKPT_HANG_FLOOR": "8"}, {"FLASHCKPT_HANG_FLOOR": "3"}),
                  **env(FT_FAULTS="stop:3:10"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    hangs = events(run, "hang_detected")
    assert [(e["rank"], e["process_state"]) for e in hangs] == [(3, "T")], hangs
    before, after = first_pid(run), last_pid(run)
    assert {r for r in range(WORLD) if before[r] == after[r]} == {0, 1, 2}, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("kind,rank", [("stop", 3), ("sleep", 3), ("spin", 1)])
def test_with_equal_hang_floors_on_every_node_the_rank_that_hung_is_the_one_replaced(
    tmp_path, reference, kind, rank
):
    """Every node's ranks go silent together (the others blocked in a collective with the hung
    rank): the nodes agree on one culprit from the evidence (a stopped process; else the rank
    the others have issued a collective ahead of), and the survivors, waiting for its
    replacement once their collective failed, are not judged hung."""
    run = run_job(tmp_path, f"ip-{kind}{rank}", trainer=TRAINER,
                  **env(FT_FAULTS=f"{kind}:{rank}:10", FLASHCKPT_HANG_FLOOR="3"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    hangs = events(run, "hang_detected")
    state = "T" if kind == "stop" else ("R" if kind == "spin" else "S")
    assert [(e["rank"], e["process_state"]) for e in hangs] == [(rank, state)], hangs
    assert [e["rank"] for e in events(run, "replacement_started")] == [rank]
    before, after = first_pid(run), last_pid(run)
    assert {r for r in range(WORLD) if before[r] == after[r]} == set(range(WORLD)) - {rank}


@pytest.mark.slow
def test_an_exception_in_one_rank_reruns_training_in_every_process(tmp_path, reference):
    run = run_job(tmp_path, "ip-raise", trainer=TRAINER, **env(FT_FAULTS="raise:2:8"))
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert first_pid(run) == last_pid(run)  # no process was lost or replaced
    assert {r["step"] for r in lines(run, "restored") if r["step"] != "None"} == {"8"}
    faults = events(run, "inprocess_fault")
    assert any(e["rank"] == 2 and e["own"] for e in faults), faults
    assert not events(run, "replacement_started")


@pytest.mark.slow
@pytest.mark.parametrize("what", ["init"])  # the barrier: the NCCL test below
def test_a_rank_that_dies_while_a_round_forms_after_an_exception_costs_one_more_round(
    tmp_path, reference, what
):
    """Rank 2 raises: every rank leaves round 0 for round 1 (no launcher involved). Rank 1
    dies in round 1 after arriving, before its process group connects (``init``) or in the
    round's first barrier. The others leave round 1 within its deadline (gloo's connect and
    barrier have that timeout; the forming watch aborts them) and form round 2 with rank 1's
    replacement: in-process, never a 30-minute wait."""
    run = run_job(tmp_path, f"ipf-{what}", trainer=TRAINER, timeout=120,
                  **env(FT_FAULTS="raise:2:8", FT_DIE_FORMING=f"1:{what}"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert [e["rank"] for e in events(run, "replacement_started")] == [1]
    assert events(run, "inprocess_recovered") and not events(run, "inprocess_fallback")
    joined = [e for e in events(run, "inprocess_joined") if e["rank"] == 0]
    assert joined and max(e["round"] for e in joined) >= 2, joined
    assert all(e["since_fault_s"] < 15 + 5 for e in joined), joined  # within the deadline


@pytest.mark.slow
def test_with_no_standby_left_a_fault_falls_back_to_restarting_every_worker(tmp_path, reference):
    run = run_job(tmp_path, "ip-none", trainer=TRAINER,
                  **env(FT_FAULTS="kill:1:12", FLASHCKPT_STANDBY="0"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    fallback = events(run, "inprocess_fallback")
    assert fallback and "no standby" in fallback[0]["reason"], fallback


@pytest.mark.slow
def test_a_second_fault_during_recovery_takes_the_next_standby(tmp_path, reference):
    """The replacement dies before its round forms: the next standby takes the rank, the
    round moves on, and every other worker keeps its process."""
    cluster = Cluster(tmp_path, "ip-second", trainer=TRAINER, **env(FT_FAULTS="kill:1:12"))
    try:
        for node in range(NODES):
            cluster.start(node)
        started = wait_for(lambda: [e for n in range(NODES) for e in cluster.events(n)
                                    if e["kind"] == "replacement_started"], 180, interval=0.01,
                           what="a replacement")  # fmt: skip
        os.kill(started[0]["pid"], signal.SIGKILL)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish()
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert not events(run, "inprocess_fallback")
    assert [e["rank"] for e in events(run, "replacement_started")] == [1, 1]
    assert events(run, "inprocess_recovered")


@pytest.mark.slow
def test_a_fault_that_recurs_spends_the_recovery_budget_then_the_restarts_and_the_job_ends(
    tmp_path,
):
    """Rank 2 fails at step 8 every time, with an error worded as NCCL words its own (the
    "same error twice" guard takes it for a peer's fault). In-process recovery stops after
    its budget (2 within 100 steps here), TorchElastic's restarts (1 here) are spent the same
    way, and the job ends failed instead of recovering forever."""
    began = time.monotonic()
    run = run_job(tmp_path, "ip-budget", trainer=TRAINER, timeout=300, max_restarts=1,
                  **env(FT_FAULTS="recurring-raise:2:8", FLASHCKPT_RECOVERY_BUDGET="2/100"))  # fmt: skip
    assert run.codes != [0, 0], explain(run)
    assert time.monotonic() - began < 300
    gave_up = events(run, "inprocess_gave_up")
    assert gave_up and all("recovery budget 2/100" in e["reason"] for e in gave_up), gave_up
    faults = [e for e in events(run, "inprocess_fault") if e["rank"] == 2]
    # per worker group (the first and its restart): at most the budget, plus the one over
    assert 3 <= len(faults) <= 2 * 3, len(faults)
    groups = {e["worker_pid"] for e in events(run, "worker_started") if e["rank"] == 2}
    assert len(groups) == 2, (groups, explain(run))  # the one restart was spent too


@pytest.mark.slow
def test_the_same_error_twice_in_a_row_restarts_every_worker_and_replaces_no_rank(
    tmp_path, reference
):
    """Rank 2's training function raises the same error of its own at step 8 every time in
    the first worker group: the first is a fault (every rank reruns ``train``), the second a
    bug: the rank exits with 75 and the launcher restarts every worker (not a standby for a
    "lost" rank). The restarted group restores and finishes bit-identical."""
    run = run_job(tmp_path, "ip-bug", trainer=TRAINER, **env(FT_FAULTS="bug:2:8"))
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    gave_up = events(run, "inprocess_gave_up")
    assert gave_up and all("the same error twice" in e["reason"] and e["rank"] == 2
                           for e in gave_up), gave_up  # fmt: skip
    fallbacks = events(run, "inprocess_fallback")
    assert fallbacks and all("gave up" in e["reason"] for e in fallbacks), fallbacks
    assert not events(run, "replacement_started"), explain(run)
    assert "ValueError: a bug in rank 2's training function" in "".join(run.logs)


@pytest.mark.slow
def test_ten_faults_in_one_run_and_nothing_grows_in_the_survivors(tmp_path, reference):
    ranks = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # rank 0 is never hit: it survives all ten
    kinds = ["kill", "raise"] * 5
    plan = ",".join(f"{k}:{r}:{s}" for k, r, s in zip(kinds, ranks, range(2, 22, 2), strict=True))
    began = time.monotonic()
    run = run_job(tmp_path, "ip-ten", trainer=TRAINER, timeout=400,
                  **env(FT_FAULTS=plan, FLASHCKPT_RECOVERY_BUDGET="10/100"))  # fmt: skip
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert not events(run, "inprocess_fallback"), events(run, "inprocess_fallback")
    zero = [r for r in lines(run, "restored") if r["rank"] == 0]
    assert len(zero) == 11 and len({r["pid"] for r in zero}) == 1  # ten recoveries, one process
    # After the second recovery (the first starts helpers a process starts once: the other
    # slot's preparer) against after the tenth: eight recoveries add nothing.
    second, last = zero[2], zero[-1]
    # A descriptor or two may still be closing when a busy machine samples (a destroyed
    # group's sockets); one kept per recovery would be eight.
    assert last["fds"] <= second["fds"] + 2 and last["threads"] <= second["threads"], (second, last)
    assert last["rss_kb"] - second["rss_kb"] < 30_000, (second, last)
    assert {r["groups"] for r in zero} == {1}  # each round's group, the old ones destroyed
    assert [r["groups"] for r in lines(run, "done")] == [0] * WORLD
    assert len(events(run, "replacement_started")) == 5
    assert time.monotonic() - began < 400


@pytest.mark.slow
def test_a_rank_that_crashes_after_its_last_step_and_close_is_not_recovered(tmp_path, reference):
    """Rank 1 exits with status 1 after its last step and ``ckpt.close()``: a crash in its
    teardown, not a fault. Its launcher warns, replaces nothing, and the job succeeds."""
    run = run_job(tmp_path, "ip-teardown", trainer=TRAINER, **env(FT_CRASH_AFTER_CLOSE="1"))
    assert run.codes == [0, 0], explain(run)
    assert run.digest == reference
    assert "rank 1 (pid" in run.logs[0] and "after closing its Checkpointer" in run.logs[0]
    crashed = events(run, "worker_crashed_after_closing")
    assert [(e["rank"], e["status"]) for e in crashed] == [(1, 1)], crashed
    recovery = [e for node in run.events for e in node
                if e["kind"].startswith(("inprocess_", "replacement_"))]  # fmt: skip
    assert not recovery, recovery
    assert len(lines(run, "restored")) == WORLD  # every rank started once: no restart
