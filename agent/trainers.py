"""What the agent knows of a job's trainers on this node: which ranks the live job runs here
(so which must hold a step before it is stored), which leftover ranks are stale, and which
step a closing trainer asked to flush.

Which ranks a step needs comes from the live job (registrations, with the launcher's
LOCAL_WORLD_SIZE and WORLD_SIZE), never from slot files left behind by an earlier run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from flashckpt.pidfile import pid_alive

LATE_GRACE_S = 30.0
"""How long a closing trainer's last step waits for the node's ranks that never registered."""


@dataclass
class Trainers:
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid, this incarnation's
    closing: set[int] = field(default_factory=set)  # ranks whose trainer sent its final step
    # ranks whose trainer (this incarnation's process) has told a snapshot since it registered:
    # its restore, which may read other ranks' slots, is behind it
    saved: set[int] = field(default_factory=set)
    world_size: int = 0  # ranks of the whole job (WORLD_SIZE); 0: unknown
    local_world_size: int = 0  # ranks of the job on this node (LOCAL_WORLD_SIZE); 0: unknown
    # the newest (generation, step) a closing trainer asked to flush past throttles
    final_step: tuple[int, int] = (0, -1)
    closing_since: float | None = None  # when the first trainer asked to flush (monotonic)
    # the job is being preempted (its launcher's mark, or this agent got SIGTERM): the newest
    # step every rank here holds goes out past every throttle, as a closing trainer's does
    preempting: bool = False

    def register(self, rank: int, pid: int, world_size: int, local_world_size: int) -> None:
        if self.pids and (world_size, local_world_size) != (self.world_size, self.local_world_size):
            # The job was restarted with another shape: the earlier incarnation's trainers (dead,
            # or about to be killed by the launcher) no longer count.
            self.pids.clear()
            self.closing.clear()
            self.saved.clear()
        elif pid not in self.pids.values():
            # A new process: ranks whose process is gone were the earlier incarnation's. After
            # a restart this node may run other ranks than before (the rendezvous assigns
            # them), and a step must not wait for ranks that moved to another node.
            for old in [r for r, p in self.pids.items() if r != rank and not pid_alive(p)]:
                del self.pids[old]
                self.closing.discard(old)
                self.saved.discard(old)
        self.world_size, self.local_world_size = max(0, world_size), max(0, local_world_size)
        if self.pids.get(rank) != pid:
            self.saved.discard(rank)  # a new process: its restore may be ahead of it
        self.pids[rank] = pid
        self.closing.discard(rank)  # a restarted trainer takes its rank back

    def told(self, rank: int) -> None:
        """Rank ``rank``'s registered trainer told a snapshot: it has restored (or had
        nothing to restore) and trains."""
        if rank in self.pids:
            self.saved.add(rank)

    def close(self, rank: int, step: tuple[int, int]) -> None:
        if not self.closing:
            self.closing_since = time.monotonic()
        self.closing.add(rank)
        self.final_step = max(self.final_step, step)

    def flushes(self, step: tuple[int, int]) -> bool:
        """Whether ``step`` goes out past every throttle and grid: a closing trainer's last
        step (or an older one), or any step while the job is being preempted."""
        return self.preempting or step <= self.final_step

    def alive(self) -> bool:
        return any(pid_alive(pid) for pid in self.pids.values())

    def required(
        self, with_slots: Collection[int], owned: Callable[[int], bool]
    ) -> set[int] | None:
        """Ranks that must hold a step before it is stored; None while the node's ranks are
        still registering (a step stored before then would miss theirs).

        Registered ranks count while they are alive or still have slots (a trainer SIGKILLed
        right after ``save()`` still gets its last step out, with the others'). An agent that
        no trainer registered with (started after them) takes the ranks whose slots a live
        process owns, else every rank with slots: those are all it can know.
        """
        if not self.pids:
            live = {r for r in with_slots if owned(r)}
            return live or set(with_slots)
        if len(self.pids) < self.local_world_size and not self._given_up_on_the_rest():
            # Even for a closing trainer's last step: stored without the ranks still to
            # register, it would count as stored and theirs would never go out.
            return None
        return {r for r, pid in self.pids.items() if r in with_slots or pid_alive(pid)}

    def _given_up_on_the_rest(self) -> bool:
        """Whether a trainer has been closing for ``LATE_GRACE_S`` while some of the node's
        ranks never registered (ranks that make no Checkpointer): its last step then goes
        out with the ranks that did, rather than never."""
        since = self.closing_since
        return bool(self.closing) and since is not None and time.monotonic() - since > LATE_GRACE_S

    def stale(self, with_slots: Collection[int], owned: Callable[[int], bool]) -> set[int]:
        """Ranks with slots that the live job does not run on this node and no live process
        owns: left behind by an earlier run with more ranks here, or by a dead rank.

        Empty until every rank the live job runs here has registered and saved: until then a
        restore may still read them. A job restarted at another world size reshards from the
        old ranks' snapshots in this node's memory, and ranks that moved to another node
        restore from a peer that reads them here."""
        all_known = 0 < self.local_world_size <= len(self.pids)
        if not self.pids or not set(self.pids) <= self.saved:
            return set()
        if self.local_world_size and not all_known:
            return set()
        return {
            r
            for r in set(with_slots) - set(self.pids)
            if (all_known or 0 < self.world_size <= r) and not owned(r)
        }
