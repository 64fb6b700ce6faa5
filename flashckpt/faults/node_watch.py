"""The watchdog over this node's workers, one thread of ``flashckpt-run`` (and of a spare node
running a node it took): it reads the node's heartbeat pages (``heartbeat``) ten or four times a
second, records each worker's start and exit in the event log, and kills a worker hung past its
phase's timeout (``hang``) once its stacks are logged.

Under the restart policy the kill makes TorchElastic restart the node's worker group (and,
through the rendezvous, every other node's). Under in-process recovery the kill hands the rank
to a warm standby (``inprocess_agent``), and of ranks found hung together only the causes
are killed (``collectives.causes``: the likely culprit, or every one of several hung at once):
the others are blocked in a collective with them and recover once their replacements join.
Across nodes, the culprits are the job's, agreed with the other nodes through the recovery
store (``culprit``), and each is killed only by the node that runs it; a node found cut off the
training network leaves the job instead (``leave``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ..pidfile import doomed
from .events import EventLog
from .hang import Hang, HangPolicy, Watchdog
from .heartbeat import Phase, heartbeat_path, pages, read
from .proc import parent_and_state

log = logging.getLogger(__name__)


class NodeWatch(threading.Thread):
    """Polls this node's heartbeat pages of ``job``: logs worker starts and exits, and kills
    a hung worker (its stacks logged first)."""

    def __init__(self, shm_dir: Path, job: str, events: EventLog, policy: HangPolicy,
                 interval: float = 0.25, one_at_a_time: bool = False,
                 culprits: Any = None, leave: Any = None):  # fmt: skip
        """``one_at_a_time`` (in-process recovery): of the ranks found hung together, only
        the causes are killed (see ``_culprit``); the others, blocked in a collective with
        them, are not judged again before their replacements have started (at most the
        start-up budget) and had the hang floor to join them. ``culprits`` (a
        ``culprit.JobCulprit``): the culprits are the job's, agreed with the other nodes, and
        this node kills those it runs. ``leave(why)``: called when the job names this node
        cut off the training network (``reach``): it takes the node out of the job."""
        super().__init__(name="flashckpt-watchdog", daemon=True)
        self.shm_dir, self.job = shm_dir, job
        self.watchdog = Watchdog(shm_dir, job, policy)
        self.events, self.interval = events, interval
        self.one_at_a_time, self.floor = one_at_a_time, policy.floor
        self._quiet_until = 0.0
        self._startup = policy.startup
        # the culprits killed in one decision and not replaced yet, and when they were killed
        self._replacing: tuple[list[Hang], float] | None = None
        self.seen: dict[int, int] = {}  # pid -> rank, of our live workers
        self.culprits, self.leave = culprits, leave
        self._round_seen: str | None = None  # the round prefix of the last poll
        self._halt = self.halted = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.poll()
            except Exception:  # the watchdog must never take the launcher down
                log.exception("watchdog poll failed")

    def poll(self) -> None:
        workers = self._workers()
        for rank, pid in workers.items():
            if pid not in self.seen:
                self.seen[pid] = rank
                self.events.record("worker_started", rank=rank, worker_pid=pid)
        me = os.getpid()
        for pid, rank in list(self.seen.items()):
            if parent_and_state(pid)[0] == me:
                continue
            del self.seen[pid]
            # A worker that closed its Checkpointer removed its page (or marked it closed);
            # one that died left it as it was at its last sign of life.
            beat = read(heartbeat_path(self.shm_dir, self.job, rank))
            if beat is None or beat.pid != pid or beat.phase == Phase.CLOSED:
                self.events.record("worker_finished", rank=rank, worker_pid=pid)
            else:
                self.events.record("worker_exited", rank=rank, worker_pid=pid, step=beat.step,
                                   phase=beat.phase.name.lower(),
                                   silent_s=time.monotonic() - beat.updated_at)  # fmt: skip
        # A worker killed already whose kill has not taken (held in the kernel) is not judged
        # again: its launcher counts it lost (``reap``).
        silences = self.watchdog.silences({r: p for r, p in workers.items() if not doomed(p)})
        hangs = [h for h in silences if h.silent_s > h.timeout_s]
        # The store is asked only while a rank here is silent past half the floor: blocked
        # with a culprit elsewhere, or about to be judged (a quiet node costs the store nothing).
        suspect = bool(self._suspects(silences))
        if self.culprits is not None:
            self._note_round()
        if self.one_at_a_time and (hangs or (self.culprits is not None and suspect)):
            if self._awaiting_replacement() or time.monotonic() < self._quiet_until:
                hangs = []
            elif self.culprits is not None:
                hangs = self._jobs_culprit(silences, hangs)
            else:
                hangs = self._culprit(silences)
            if hangs:
                self._replacing = list(hangs), time.monotonic()
                self._quiet_until = time.monotonic() + self.floor
        states = {h.pid: parent_and_state(h.pid)[1] for h in hangs}
        # A stopped worker first: its dump needs it continued, and it must not die first of
        # the SIGTERM TorchElastic sends once another worker is killed (a stopped process
        # with SIGTERM's default action dies at once). Each is killed right after its dump.
        for hang in sorted(hangs, key=lambda h: states[h.pid] != "T"):
            log.error(
                "rank %d (pid %d) is hung: no progress for %.1fs in its %s phase at step %s "
                "(timeout %.1fs); dumping its stacks and killing it so the job restarts",
                hang.rank, hang.pid, hang.silent_s, hang.phase, hang.step, hang.timeout_s,
            )  # fmt: skip
            self.events.record("hang_detected", rank=hang.rank, worker_pid=hang.pid,
                               phase=hang.phase, step=hang.step, silent_s=hang.silent_s,
                               timeout_s=hang.timeout_s,
                               process_state=states[hang.pid])  # fmt: skip
            stacks = self.watchdog.stacks(hang.rank, hang.pid, stopped=states[hang.pid] == "T")
            self.events.record("stacks", rank=hang.rank, worker_pid=hang.pid, stacks=stacks)
            with contextlib.suppress(ProcessLookupError):
                os.kill(hang.pid, signal.SIGKILL)  # a stopped process dies too
            self.events.record("killed", rank=hang.rank, worker_pid=hang.pid, signal="SIGKILL")

    def _note_round(self) -> None:
        """A move of the job to a new round means a fault was handled meanwhile (a culprit
        killed on another node, a crash): ranks here silent with it get the floor to join."""
        try:
            prefix = self.culprits.where()
        except Exception:
            return
        if prefix != self._round_seen:
            if self._round_seen is not None:
                self._quiet_until = max(self._quiet_until, time.monotonic() + self.floor)
            self._round_seen = prefix

    def _awaiting_replacement(self) -> bool:
        """Whether a rank last killed as a culprit has no new process yet: the ranks blocked
        with them wait for every one (however long a loaded node takes to start them)."""
        if self._replacing is None:
            return False
        killed, at = self._replacing
        waiting = []
        for hang in killed:
            beat = read(heartbeat_path(self.shm_dir, self.job, hang.rank))
            if beat is None or beat.pid == hang.pid:  # the replacement has no page yet
                waiting.append(hang)
        if not waiting:  # every replacement has its page: the floor starts now
            self._replacing = None
            self._quiet_until = time.monotonic() + self.floor
            return True
        if time.monotonic() - at > self._startup:  # not all replaced here: judge again
            self._replacing = None
            return False
        self._replacing = waiting, at
        return True

    def _jobs_culprit(self, silences: list[Hang], hangs: list[Hang]) -> list[Hang]:
        """The job's culprits that run here (see ``culprit``); [] while the nodes agree, or
        when they all run elsewhere."""
        from .culprit import Suspect

        node = self.culprits.node
        mine = [Suspect.of(node, h) for h in self._suspects(silences)]
        try:
            decided = self.culprits.decide(mine, judged=bool(hangs))
        except Exception as exc:  # the store out of reach: judge alone, as without it
            log.warning("the job's culprits cannot be agreed on (%s): judging this node alone",
                        exc)  # fmt: skip
            decided = [Suspect.of(node, h) for h in self._culprit(silences)] if hangs else []
        if not decided:
            return []
        if any(d.cut_off and d.node == node for d in decided) and self.leave is not None:
            self.leave("this node reached none of the nodes it probed on the training network, "
                       "and none of them reached it, while they reach each other")  # fmt: skip
            return []
        here = {(d.rank, d.pid) for d in decided if d.node == node}
        if not here:
            # Ranks here were blocked with them: they recover once their replacements join.
            # Not judged again before they have had the hang floor to (as on their nodes).
            self._quiet_until = max(self._quiet_until, time.monotonic() + self.floor)
            return []
        return [h for h in silences if (h.rank, h.pid) in here]

    def _suspects(self, silences: list[Hang]) -> list[Hang]:
        """The ranks silent past half the hang floor, whatever their phase's own timeout: a
        rank hung in ``save()`` (five minutes) is a suspect as soon as the peers blocked on it
        (thirty seconds) are."""
        return [h for h in silences if h.silent_s > min(h.timeout_s, self.floor) / 2]

    def _culprit(self, silences: list[Hang]) -> list[Hang]:
        """Of ranks hung together (one past its timeout, the others silent at least half the
        floor: blocked in a collective with it, or about to be judged), the causes, by the
        evidence their pages carry (``collectives.causes``: every stopped one, every one the
        others wait for, or the likeliest alone), within their own phase's budget or not."""
        from .collectives import causes

        return causes(self._suspects(silences))

    def _workers(self) -> dict[int, int]:
        """{rank: pid} of the live workers of this launcher that have a heartbeat page."""
        me = os.getpid()
        return {rank: beat.pid for rank, beat in pages(self.shm_dir, self.job)
                if parent_and_state(beat.pid)[0] == me}  # fmt: skip
