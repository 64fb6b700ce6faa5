"""One culprit for a hang, chosen for the whole job under in-process recovery.

When a rank hangs, the ranks in a collective with it go silent too, on every node. Each
node's watchdog sees only its own ranks: judged per node, every node with a blocked rank would
replace one, and at a thousand nodes the standbys would drain into a full restart. So the
nodes agree, through the job's recovery store, on one culprit per round, from evidence rather
than from when each node happened to look:

- a node with a rank silent past half the hang floor (whatever its phase: a rank hung in
  ``save()``, whose own timeout is longer, is posted as soon as its peers blocked on it are)
  posts every such rank's evidence (see ``collectives``: whether it is stopped, its step, its
  last progress on the wall clock, the collectives it issued) under its own name, and keeps
  it current while they stay silent;
- once a rank here is past its timeout and ``settle`` seconds have passed since this node
  first posted, it orders every rank posted by the job (``collectives.likeliest``) and records
  the first as the culprit, unless another node recorded one first: the rank the others wait
  for, even one within its own phase's budget (a ``save()`` that its peers, blocked in the
  next collective past their timeout, wait for is the cause, not them); a stopped process
  here is recorded at once (it is the cause, whatever the others post);
- every node acts on the recorded culprit alone: the node that runs it kills it (its
  replacement then moves the job to the next round), the others wait.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .collectives import likeliest

log = logging.getLogger(__name__)

SETTLE_S = 0.5


@dataclass(frozen=True)
class Suspect:
    node: str
    rank: int
    pid: int
    stopped: bool  # the process is stopped (SIGSTOP, a debugger): the cause, not a victim
    step: int | None = None
    last_progress: float = 0.0  # wall clock
    issued: dict[str, int] = field(default_factory=dict)  # see collectives

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, raw: bytes | str) -> Suspect:
        return cls(**json.loads(raw))

    @classmethod
    def of(cls, node: str, hang: Any) -> Suspect:
        """A ``hang.Hang`` of this node as the job sees it."""
        return cls(node, hang.rank, hang.pid, hang.stopped, hang.step, hang.last_progress,
                   dict(hang.issued))  # fmt: skip


class JobCulprit:
    """This node's side of choosing one culprit per round (see the module doc). ``where``
    gives the store's key prefix of the current worker group and its round, or None when
    there is none yet."""

    def __init__(self, store: Any, node: str, where: Any, settle: float = SETTLE_S):
        """``store``: a store client, or a callable that makes one when first needed (the
        store may not serve yet when the launcher starts)."""
        self._store, self.node, self.where, self.settle = store, node, where, settle
        # round prefix -> (when this node first posted, what it posted last)
        self._posted: dict[str, tuple[float, str]] = {}

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

    def decide(self, mine: list[Suspect], judged: bool) -> Suspect | None:
        """The job's culprit of the current round, once chosen (None before: wait). ``mine``:
        this node's ranks silent past half their timeout; ``judged``: one of them is past it."""
        prefix = self.where()
        if prefix is None:  # no worker group known yet: judge alone, as without the store
            return likeliest(mine) if judged and mine else None
        culprit = f"{prefix}/culprit"
        if self.store.check([culprit]):
            return Suspect.loads(self.store.get(culprit))
        if not mine:
            return None
        now = time.monotonic()
        posted = json.dumps([asdict(s) for s in mine], sort_keys=True)
        if self._posted.get(prefix, (0.0, ""))[1] != posted:
            self.store.set(f"{prefix}/suspects/{self.node}", posted)
            if prefix not in self._posted:
                self.store.append(f"{prefix}/posters", json.dumps(self.node) + "\n")
            first = self._posted.get(prefix, (now, ""))[0]
            self._posted[prefix] = (first, posted)
        if not judged:
            return None
        choice = likeliest(mine)
        every = [choice]
        if not choice.stopped:
            if now - self._posted[prefix][0] < self.settle:
                return None
            every = self._every(prefix)
            choice = likeliest(every)
        found = self.store.compare_set(culprit, "", choice.dumps())
        decided = Suspect.loads(found)
        log.info("the job's culprit for this hang: rank %d on node %s (%s, step %s, last progress "
                 "%.1fs ago), of %d suspect(s)", decided.rank, decided.node,
                 "stopped" if decided.stopped else "running", decided.step,
                 time.time() - decided.last_progress, len(every))  # fmt: skip
        return decided

    def _every(self, prefix: str) -> list[Suspect]:
        """Every rank the job's nodes posted in this round."""
        nodes = [json.loads(line) for line in
                 self.store.get(f"{prefix}/posters").decode().splitlines() if line]  # fmt: skip
        out = []
        for node in dict.fromkeys(nodes):
            raw = self.store.get(f"{prefix}/suspects/{node}")
            out.extend(Suspect(**one) for one in json.loads(raw))
        return out
