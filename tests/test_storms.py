"""Kill storms: the crash promises hold under many SIGKILLs of one job, not just one.

One job trains and saves every step into a ``file://`` tier (and a moto S3 tier) through the
real agent while a seeded plan kills its trainer, or its agent, again and again. After every
kill: a restarted trainer (a fresh process) restores a step no older than the last save() that
returned, holding exactly that step's bytes; every step a tier has committed verifies and holds
exactly its data; no step is committed for part of the world; and no committed step ever
disappears. Replay a run with FLASHCKPT_STORM_SEED=<seed> (each storm prints its seed).

A defect the storms run into is pinned down by a test of its own, at the end of this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, run_python, wait_for
from faults import (
    AFTER_SAVE,
    CLOSING,
    EXTERNAL,
    MID_COPY,
    PHASES,
    KillPlan,
    LineProcess,
    Spares,
    is_dead,
    poll,
    sigkill,
    storm_rng,
)
from storm_trainer import mismatches, new_state

from flashckpt.format import layout, tier_io
from flashckpt.format.slot import Slot
from flashckpt.restore.sources import TierSource, run_with_tier
from flashckpt.snapshot.slots import N_SLOTS, N_STEADY, read_locked, slot_path

JOB = "storm"
TRAINER = [sys.executable, str(ROOT / "tests" / "storm_trainer.py")]
# The agent as a supervisor (systemd, a sidecar) restarts it, with its imports done ahead.
AGENT = [sys.executable, "-c", "import sys\nfrom flashckpt.agent import cli, daemon\n"
         "print('ready', flush=True)\nsys.stdin.readline()\ncli.main(sys.argv[1:])"]  # fmt: skip

TRAINER_KILLS = 20
AGENT_KILLS = 10


class TierLedger:
    """What a tier has committed, checked as it grows: every committed step restores verified
    and holds exactly its step's data, no step is committed for only part of the world, and
    a step once committed never disappears."""

    def __init__(self, url: str, job: str, seed: int):
        self.url, self.job, self.seed = url, job, seed
        self.verified: set[tuple[int, int]] = set()

    def check(self) -> list[int]:
        listing = run_with_tier(self.url, lambda t: tier_io.list_steps(t, self.job))
        partial = {s: c for s, c in listing.items() if c is not None and not c.complete}
        assert not partial, f"seed {self.seed}: steps committed for part of the world: {partial}"
        # (generation, step): a restart that went back would start a new generation
        committed = sorted(k for k, c in listing.items() if c is not None)
        lost = self.verified - set(committed)
        assert not lost, (
            f"seed {self.seed}: committed steps {sorted(lost)} vanished from {self.url}"
        )
        for step in committed:
            if step not in self.verified:
                self._verify(step)
        return sorted(step for _, step in committed)

    def _verify(self, key: tuple[int, int]) -> None:
        state, step = new_state(), key[1]
        loaded = TierSource(self.url, self.job, 0, verify=True).load(state, key, False)
        assert loaded, f"seed {self.seed}: committed step {step} in {self.url} does not restore"
        bad = mismatches(state, step)
        assert not bad, f"seed {self.seed}: committed step {step} holds wrong data in {bad}"
        self.verified.add(key)


def steps_reported(lines: list[str], what: str) -> list[int]:
    """Steps of the trainer's ``saving``/``saved`` lines, in order."""
    return [int(line.split()[1]) for line in lines if line.startswith(what + " ")]


def trainer_plans(rng) -> Iterator[KillPlan]:
    """Kill plans for trainer rounds: every phase TRAINER_KILLS / 5 times in a seeded order,
    then drawn at random (rounds whose timed cut of close() came too late need more). Steps
    count from the round's first save; ``index`` picks one of the state's five tensors."""
    phases = [p for p in PHASES for _ in range(TRAINER_KILLS // len(PHASES))]
    rng.shuffle(phases)
    while True:
        phase = phases.pop() if phases else rng.choice(PHASES)
        index = rng.randint(0, 1) if phase == CLOSING else rng.randint(0, 4)
        yield KillPlan(phase, step=rng.randint(0, 4), index=index, fraction=rng.random())


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests")}


@contextlib.contextmanager
def agent_logs_checked(run_dir: Path) -> Iterator[None]:
    """A storm ends with no failure in any agent's log; a failing one prints their ends."""
    try:
        yield
        problems = [
            f"{log.name}: {line}"
            for log in run_dir.glob("*.log")
            for line in log.read_text(errors="replace").splitlines()
            if "Traceback" in line or " ERROR " in line or "Bus error" in line
        ]
        assert problems == []
    except BaseException:
        for log in sorted(run_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-30:]
            print(f"---- {log.name} (last {len(tail)} lines)", *tail, sep="\n")
        raise


class Job:
    """What the storm knows of the job across its trainers' lives."""

    def __init__(self) -> None:
        self.known: int | None = None  # newest step some trainer returned from save() for
        self.begun: int | None = None  # newest step some trainer called save() for
        self.exact = False  # the last trainer died where the restore must give ``known`` itself
        self.lost: int | None = None  # see ``after_kill``
        self.defect_hits: list[str] = []

    def check_restore(self, line: str, where: str) -> int | None:
        """A restarted trainer's ``restored`` line: the step the job reached, its exact bytes."""
        _, got, source, verdict = line.split()
        restored = None if got == "None" else int(got)
        assert verdict == "ok", f"{where}: step {restored} restored from {source}: {verdict}"
        if self.lost is not None:
            # The defect: the restore can only give the older step left intact.
            assert restored == self.lost, f"{where}: restored {restored}, expected {self.lost}"
            self.defect_hits.append(f"{where}: lost step {self.known}, restored {restored}")
            print(f"save over the newest snapshot cut: {self.defect_hits[-1]}")
            self.lost = None
        elif self.known is None:
            # Nothing returned from save() yet; a step published before the kill may be back.
            assert restored is None or restored <= (self.begun or 0), f"{where}: {restored}"
        else:
            assert restored is not None and self.known <= restored <= self.begun, (
                f"{where}: restored {restored} from {source}; the last save() returned for "
                f"step {self.known}, the last one begun was {self.begun}"
            )
            assert not self.exact or restored == self.known, (
                f"{where}: restored {restored} from {source}, expected {self.known}"
            )
        if restored is not None:  # the job goes on from here, even after a lost step
            self.known = restored
        return restored

    def after_kill(self, lines: list[str], shm_dir: Path, committed: list[int]) -> None:
        """Before the restart: did the kill cut a save that was writing over the newest
        snapshot because a reader held the older one? That loses the step save() last returned
        for, the defect test_kill_mid_save_over_the_newest_snapshot pins down; a kill from
        outside or from the sealer's thread can land there (the in-process mid-copy kill never
        cuts such a save). If the newest step still intact is older than that, the restore
        must give it."""
        saving = steps_reported(lines, "saving")
        if not saving or f"over-newest {saving[-1]} held" not in lines:
            return
        if any(line in (f"saved {saving[-1]}", f"skipped {saving[-1]}") for line in lines):
            return
        intact = max(memory_snapshots(shm_dir) + committed, default=None)
        if self.known is not None and intact is not None and intact < self.known:
            self.lost = intact

    def record(self, lines: list[str]) -> None:
        self.known = _newest(self.known, *steps_reported(lines, "saved"))
        self.begun = _newest(self.begun, *steps_reported(lines, "saving"))


def memory_snapshots(shm_dir: Path) -> list[int]:
    """The steps READY in the job's rank-0 slots."""
    ready = []
    for i in range(N_SLOTS):
        try:
            slot = Slot.open_readonly(slot_path(shm_dir, JOB, 0, i))
        except OSError:  # absent, or left unfinished by a kill while it was created
            continue
        h = slot.header()
        slot.close()
        if h.readable:
            ready.append(h.step)
    return ready


def assert_no_needless_overwrite(lines: list[str], where: str) -> None:
    """A save may write over the newest snapshot only when a reader holds every other slot."""
    free = [line for line in lines if line.startswith("over-newest") and line.endswith("free")]
    assert not free, f"{where}: a save wrote over the newest snapshot with a slot free: {free}"


def _newest(*steps: int | None) -> int | None:
    return max((s for s in steps if s is not None), default=None)


def trainer_round(trainer: LineProcess, job: Job, url: str, plan: KillPlan | None,
                  delay: float, where: str) -> int:  # fmt: skip
    """Hand ``trainer`` its orders, check its restore, let ``plan`` kill it (None: let it train
    a few steps and close); its exit status."""
    inside = plan is not None and plan.phase != EXTERNAL
    # Steps to run: past the planned kill, by more for a mid-copy kill, which may wait for a
    # save over the older snapshot.
    margin = {CLOSING: 1, MID_COPY: 10}
    steps = 3 if plan is None else plan.step + margin.get(plan.phase, 3)
    cfg = {"job": JOB, "tiers": [url], "pace": 0.01,
           "steps": 1000 if plan is not None and not inside else steps,
           "kill": dataclasses.asdict(plan) if inside else None}  # fmt: skip
    trainer.send(json.dumps(cfg))
    job.check_restore(trainer.expect("restored"), where)
    if plan is not None and not inside:
        time.sleep(delay)
        sigkill(trainer.pid)
    rc = trainer.finish()
    lines = trainer.seen
    job.record(lines)
    assert_no_needless_overwrite(lines, where)
    print(f"{where}: {lines[1]}; last saved {steps_reported(lines, 'saved')[-1:]}; exit {rc}")
    assert not [x for x in lines if x.startswith("missed")], f"{where}: {lines[-3:]}"
    if rc != -signal.SIGKILL:
        # Only a timed cut of close() may come after close() returned; any other exit is a
        # crash (an exception, a SIGBUS).
        assert rc == 0 and lines[-1].startswith("closed"), (
            f"{where}: trainer exited {rc}; last lines {lines[-3:]}\n{trainer.stderr[-3000:]}"
        )
        assert plan is None or plan.phase == CLOSING, where
    # After these the newest step is in memory (or committed, once close() has freed memory).
    job.exact = rc != -signal.SIGKILL or plan.phase in (MID_COPY, AFTER_SAVE, CLOSING)
    return rc


@pytest.mark.slow
def test_trainer_kill_storm(shm_dir, run_dir, tmp_path):
    """>= 20 SIGKILLs of a saving trainer at drawn phases; each restart restores from where
    the killed one was, bit for bit, and the tier only ever holds whole, exact steps."""
    rng, seed = storm_rng("trainer-storm")
    url = f"file://{tmp_path / 'tier'}"
    ledger = TierLedger(url, JOB, seed)
    spares = Spares(lambda: LineProcess(TRAINER, child_env()))
    job = Job()
    plans = trainer_plans(rng)
    kills: Counter[str] = Counter()
    with agent_logs_checked(run_dir), contextlib.closing(spares):
        for i in range(TRAINER_KILLS + 10):
            left = TRAINER_KILLS - sum(kills.values())
            plan = next(plans) if left > 0 else None
            delay = rng.uniform(0.0, 0.4)
            trainer = spares.take(more=left)
            rc = trainer_round(trainer, job, url, plan, delay, f"seed {seed} round {i} {plan}")
            committed = ledger.check()
            if rc == -signal.SIGKILL:
                kills[plan.phase] += 1
                job.after_kill(trainer.seen, shm_dir, committed)
            if plan is None:
                break
        print(f"trainer storm: seed {seed}, kills by phase {dict(kills)}, steps 0..{job.known}, "
              f"known defect hit {len(job.defect_hits)} times")  # fmt: skip
        assert sum(kills.values()) >= TRAINER_KILLS, f"seed {seed}: only {dict(kills)}"
        # The last trainer closed cleanly: its last step is committed and its memory freed.
        committed = ledger.check()
        assert committed[-1] == job.known, f"seed {seed}: committed {committed[-5:]}"
        assert not list((shm_dir / JOB).glob("rank-*.slot-*"))
        # No trainer's death took the agent down: every agent that started (one, unless it
        # left when idle on a loaded machine) exited cleanly, and the last one still runs.
        log = (run_dir / f"{JOB}.log").read_text()
        assert log.count("serving job") == log.count("drained; exiting") + 1, log[-3000:]
        assert not is_dead(int((run_dir / f"{JOB}.pid").read_text()))


def upload_in_flight(root: Path, newest: int) -> bool:
    """A temporary file of an upload sits in one of the newest steps' directories."""
    for step in range(newest, max(-1, newest - 4), -1):
        base = root / layout.step_prefix(JOB, step)
        for d in (base, base / "rank-0"):
            try:
                if any(name.startswith(".tmp-") for name in os.listdir(d)):
                    return True
            except FileNotFoundError:
                continue
    return False


def agent_spare(tiers: list[str], shm_dir: Path, run_dir: Path, n: list[int]) -> LineProcess:
    """An agent as a supervisor restarts it (imports done ahead); its log in the run dir."""
    n[0] += 1
    argv = [*AGENT, "serve", "--job", JOB, "--shm-dir", str(shm_dir), "--run-dir", str(run_dir)]
    argv += [a for url in tiers for a in ("--tier", url)]
    return LineProcess(argv, child_env(), log=run_dir / f"agent-{n[0]}.log")


def newest_saved(trainer: LineProcess) -> int:
    """The trainer's newest ``saved`` step (searched from the end: it is polled often)."""
    return next(int(x.split()[1]) for x in reversed(trainer.drain()) if x.startswith("saved "))


def log_says(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text(errors="replace")


def kill_agent_when(phase: str, rng, log: Path, root: Path, trainer: LineProcess) -> str:
    """Wait for the moment ``phase`` names in the life of the agent logging to ``log``; the
    phase as it happened ("-missed" when the moment did not come in time)."""
    if phase == "startup":  # importing done, setting up its tiers and socket
        time.sleep(rng.uniform(0.0, 0.3))
        return phase
    if phase == "upload":  # a file half written in the tier
        hit = poll(lambda: upload_in_flight(root, newest_saved(trainer)), timeout=5, interval=0.005)
    elif phase == "committed":  # right after a commit: retention, the next round
        hit = poll(lambda: log_says(log, "committed step"), timeout=10, interval=0.005)
    else:  # any moment of a serving agent
        hit = poll(lambda: log_says(log, "serving job"), timeout=10, interval=0.01)
        time.sleep(rng.uniform(0.0, 1.0))
    return phase if hit else f"{phase}-missed"


AGENT_PHASES = ["startup"] * 2 + ["upload"] * 3 + ["committed"] * 3 + ["random"] * 2


@pytest.mark.slow
def test_agent_kill_storm(shm_dir, run_dir, tmp_path, s3_bucket):
    """>= 10 SIGKILLs of the agent (starting up, mid-upload, right after a commit, at a random
    moment) while a trainer saves into a file:// tier and a moto S3 tier; a supervisor restarts
    the agent each time. Training never stops or fails, the tiers only ever hold whole, exact
    steps, and the trainer's last step gets committed in both."""
    rng, seed = storm_rng("agent-storm")
    root = tmp_path / "tier"
    tiers = [f"file://{root}", f"s3://{s3_bucket}/ckpt"]
    ledgers = [TierLedger(url, JOB, seed) for url in tiers]
    stop = tmp_path / "stop"
    trainer = LineProcess(TRAINER, child_env())
    spares = Spares(lambda n=[0]: agent_spare(tiers, shm_dir, run_dir, n))
    phases = list(AGENT_PHASES)
    assert len(phases) >= AGENT_KILLS
    rng.shuffle(phases)
    kills: Counter[str] = Counter()
    with agent_logs_checked(run_dir), contextlib.closing(spares), contextlib.closing(trainer):
        trainer.expect("ready")
        trainer.send(json.dumps({"job": JOB, "tiers": tiers, "pace": 0.05, "stop_file": str(stop)}))
        trainer.expect("saved")
        # The first agent is the one the trainer started; later ones the test restarts.
        agent = int(wait_for(lambda: (run_dir / f"{JOB}.pid").read_text().strip(), what="agent"))
        log = run_dir / f"{JOB}.log"
        for i, phase in enumerate(phases):
            if i == 0 and phase == "startup":  # the first agent started with the trainer
                phase = "random"
            phase = kill_agent_when(phase, rng, log, root, trainer)
            sigkill(agent)
            kills[phase] += 1
            before = newest_saved(trainer)
            print(f"seed {seed} agent kill {i} ({phase}): trainer at step {before}, committed "
                  f"{[ledger.check()[-3:] for ledger in ledgers]}")  # fmt: skip
            # Training goes on without an agent ...
            wait_for(lambda b=before: newest_saved(trainer) >= b + 2, timeout=30,
                     what=f"seed {seed}: training to go on after agent kill {i}")  # fmt: skip
            # ... until the supervisor restarts it.
            restarted = spares.take(more=len(phases) - 1 - i)
            restarted.send("go")
            agent, log = restarted.pid, restarted.log
        stop.touch()
        closed = int(trainer.expect("closed", 120).split()[1])
        assert trainer.finish() == 0, trainer.stderr[-3000:]
        # Training never stopped: every step was saved (or, with both slots held by the two
        # tiers' uploads, skipped without waiting), and nothing went wrong in the trainer.
        saving = steps_reported(trainer.seen, "saving")
        done = steps_reported(trainer.seen, "saved") + steps_reported(trainer.seen, "skipped")
        assert saving == sorted(done) == list(range(closed + 1)), f"seed {seed}: {saving}"
        assert "Traceback" not in trainer.stderr, trainer.stderr[-3000:]
        assert_no_needless_overwrite(trainer.seen, f"seed {seed}")
        for ledger in ledgers:
            wait_for(lambda ledger=ledger: closed in ledger.check(), timeout=60, interval=0.5,
                     what=f"seed {seed}: the last step {closed} committed in {ledger.url}")  # fmt: skip
        print(f"agent storm: seed {seed}, kills {dict(kills)}, steps 0..{closed}, committed "
              f"{[len(ledger.verified) for ledger in ledgers]}")  # fmt: skip


HELD_TRAINER = """
import sys, torch, faults
from flashckpt import Checkpointer
ck = Checkpointer(job="held")
t = torch.zeros(2**20)
ck.restore({"t": t})
for step in (0, 1):
    t.fill_(step); ck.save(step, {"t": t}); print("saved", step, flush=True)
sys.stdin.readline()  # a reader now holds step 0
switch = faults.kill_at(faults.KillPlan(faults.MID_COPY, 2, over_newest=True))
switch.step(2)
t.fill_(2); ck.save(2, {"t": t})
faults.kill_self()  # if save(2) wrote elsewhere or skipped the snapshot, nothing was cut
"""


def test_kill_mid_save_over_the_newest_snapshot_keeps_the_step_save_returned_for(shm_dir):
    trainer = LineProcess([sys.executable, "-c", HELD_TRAINER], child_env())
    with contextlib.closing(trainer):
        trainer.expect("saved 1")
        slots = [Slot.open_readonly(slot_path(shm_dir, "held", 0, i)) for i in range(N_STEADY)]
        older = min(slots, key=lambda s: s.header().step)
        # The agent holds a snapshot this way for the whole of its upload.
        with read_locked(older) as snap:
            assert snap is not None and snap.step == 0
            trainer.send("go")
            assert trainer.finish() == -signal.SIGKILL, trainer.stderr[-3000:]
        for s in slots:
            s.close()
    out = run_python(
        "import torch; from flashckpt import Checkpointer\n"
        "t = torch.zeros(2**20)\n"
        "step = Checkpointer(job='held').restore({'t': t})\n"
        "print(step, bool((t == step).all()))\n"
    )
    assert out.stdout.split() == ["1", "True"]
