"""One culprit for a hang, chosen for the whole job under in-process recovery.

When a rank hangs, the ranks in a collective with it go silent too, on every node. Each
node's watchdog sees only its own ranks: judged per node, every node with a blocked rank would
replace one, and at a thousand nodes the standbys would drain into a full restart. So the
nodes agree, through the job's recovery store, on one culprit per round:

- a node with a rank past its hang timeout posts its own likeliest culprit (a stopped process
  first, else the rank silent longest) as a suspect of the round;
- once ``settle`` seconds have passed since its first post (the other nodes' ranks, blocked
  with the same hang, cross their timeouts within moments), it picks the job's culprit among
  every suspect posted, by the same rule, and records it unless another node did first; a
  stopped process is recorded at once (it is the cause, whatever the others post: only another
  stopped one could rank with it, and then either is right);
- every node acts on the recorded culprit alone: the node that runs it kills it (its
  replacement then moves the job to the next round), the others wait.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

SETTLE_S = 0.5


@dataclass(frozen=True)
class Suspect:
    node: str
    rank: int
    pid: int
    stopped: bool  # the process is stopped (SIGSTOP, a debugger): the cause, not a victim
    silent_s: float

    def key(self) -> tuple[bool, float, str, int]:
        """Sorts the likeliest culprit first."""
        return (not self.stopped, -self.silent_s, self.node, self.rank)


class JobCulprit:
    """This node's side of choosing one culprit per round (see the module doc). ``where``
    gives the store's key prefix of the current worker group and its round, or None when
    there is none yet."""

    def __init__(self, store: Any, node: str, where: Any, settle: float = SETTLE_S):
        """``store``: a store client, or a callable that makes one when first needed (the
        store may not serve yet when the launcher starts)."""
        self._store, self.node, self.where, self.settle = store, node, where, settle
        self._posted: dict[str, float] = {}  # round prefix -> when this node first posted

    @property
    def store(self) -> Any:
        if callable(self._store) and not hasattr(self._store, "check"):
            self._store = self._store()
        return self._store

    @classmethod
    def connect(cls, address: str, node: str, where: Any) -> JobCulprit:
        from .control import split_address

        host, port = split_address(address, "the recovery store")

        def make() -> Any:
            import torch.distributed as dist

            return dist.TCPStore(host, port, is_master=False,
                                 timeout=datetime.timedelta(seconds=10))  # fmt: skip

        return cls(make, node, where)

    def decide(self, mine: Suspect | None) -> Suspect | None:
        """The job's culprit of the current round, once chosen (None before: wait). ``mine``:
        this node's likeliest culprit, if it has a rank past its timeout."""
        prefix = self.where()
        if prefix is None:
            return mine  # no worker group known yet: judge alone, as without the store
        culprit = f"{prefix}/culprit"
        if self.store.check([culprit]):
            return Suspect(**json.loads(self.store.get(culprit)))
        if mine is None:
            return None
        now = time.monotonic()
        if prefix not in self._posted:
            n = self.store.add(f"{prefix}/suspects", 1)
            self.store.set(f"{prefix}/suspect-{n}", json.dumps(asdict(mine)))
            self._posted[prefix] = now
            if not mine.stopped:
                return None
        elif now - self._posted[prefix] < self.settle and not mine.stopped:
            return None
        if mine.stopped:
            posted, choice = [mine], mine
        else:
            count = int(self.store.add(f"{prefix}/suspects", 0))
            posted = [Suspect(**json.loads(self.store.get(f"{prefix}/suspect-{n}")))
                      for n in range(1, count + 1)]  # fmt: skip
            choice = min(posted, key=Suspect.key)
        found = self.store.compare_set(culprit, "", json.dumps(asdict(choice)))
        decided = Suspect(**json.loads(found))
        log.info("the job's culprit for this hang: rank %d on node %s (%s, silent %.1fs), of "
                 "%d suspect(s)", decided.rank, decided.node,
                 "stopped" if decided.stopped else "running", decided.silent_s, len(posted))  # fmt: skip
        return decided
