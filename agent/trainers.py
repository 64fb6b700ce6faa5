"""What the agent knows of a job's trainers on this node: who must hold a step before it is
stored, and which step a closing trainer asked to flush."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class Trainers:
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid, as registered
    closing: set[int] = field(default_factory=set)  # ranks whose trainer sent its final step
    local_world_size: int = 0  # ranks of the job on this node (LOCAL_WORLD_SIZE); 0: unknown
    final_step: int = -1  # the newest step a closing trainer asked to flush past throttles

    def register(self, rank: int, pid: int, local_world_size: int) -> None:
        self.pids[rank] = pid
        self.closing.discard(rank)  # a restarted trainer takes its rank back
        self.local_world_size = max(self.local_world_size, local_world_size)

    def close(self, rank: int, step: int) -> None:
        self.closing.add(rank)
        self.final_step = max(self.final_step, step)

    def alive(self) -> bool:
        return any(pid_alive(pid) for pid in self.pids.values())

    def required(self) -> set[int] | None:
        """Ranks that must hold a step before it is stored; None while the node's ranks are
        still registering (a step stored before then would miss theirs). Ranks with slots in
        shared memory are required by the caller as well."""
        if len(self.pids) < self.local_world_size and not self.closing:
            return None
        return {r for r, pid in self.pids.items() if r not in self.closing and pid_alive(pid)}
