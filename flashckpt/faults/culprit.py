"""The culprits of a hang, chosen once for the whole job under in-process recovery.

When a rank hangs, the ranks in a collective with it go silent too, on every node. Each
node's watchdog sees only its own ranks: judged per node, every node with a blocked rank would
replace one, and at a thousand nodes the standbys would drain into a full restart. So the
nodes agree, through the job's recovery store, on the culprits of each round, from evidence
rather than from when each node happened to look:

- a node with a rank silent past half the hang floor (whatever its phase: a rank hung in
  ``save()``, whose own timeout is longer, is posted as soon as its peers blocked on it are)
  posts every such rank's evidence (see ``collectives``: whether it is stopped, its step, its
  last progress on the wall clock, the collectives it issued) under its own name, and keeps
  it current while they stay silent;
- once a rank here is past its timeout and ``settle`` seconds have passed since this node
  first posted, it names the causes among every rank posted by the job
  (``collectives.causes``) and records them as the round's culprits, unless another node
  recorded them first: the ranks the others wait for, even one within its own phase's budget
  (a ``save()`` that its peers, blocked in the next collective past their timeout, wait for
  is the cause, not them), every one of them when several are (two ranks hung at once), or
  the likeliest alone where the evidence cannot tell; a stopped process here is recorded at
  once (it is a cause, whatever the others post), with every other stopped process this node
  runs or another node posted (a node whose workers all stopped);
- the culprits are recorded once per round (one ``compare_set``), so every node acts on the
  same set: each node kills those it runs (their replacements then move the job to the next
  round together), the others wait.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .collectives import causes

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
    """This node's side of choosing the culprits of each round (see the module doc).
    ``where`` gives the store's key prefix of the current worker group and its round, or None
    when there is none yet."""

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

    def decide(self, mine: list[Suspect], judged: bool) -> list[Suspect]:
        """The job's culprits of the current round, once chosen ([] before: wait). ``mine``:
        this node's ranks silent past half their timeout; ``judged``: one of them is past it."""
        prefix = self.where()
        if prefix is None:  # no worker group known yet: judge alone, as without the store
            return causes(mine) if judged and mine else []
        culprit = f"{prefix}/culprit"
        if self.store.check([culprit]):
            return _loads(self.store.get(culprit))
        if not mine:
            return []
        now = time.monotonic()
        posted = _dumps(mine)
        if self._posted.get(prefix, (0.0, ""))[1] != posted:
            self.store.set(f"{prefix}/suspects/{self.node}", posted)
            if prefix not in self._posted:
                self.store.append(f"{prefix}/posters", json.dumps(self.node) + "\n")
            first = self._posted.get(prefix, (now, ""))[0]
            self._posted[prefix] = (first, posted)
        if not judged:
            return []
        if not any(s.stopped for s in mine) and now - self._posted[prefix][0] < self.settle:
            return []
        # Every rank posted in this round, this node's as it posted them: with a stopped
        # process here, every stopped one (``causes``), at once; else the causes among them.
        every = self._every(prefix)
        every += [s for s in mine if s not in every]
        found = self.store.compare_set(culprit, "", _dumps(causes(every)))
        decided = _loads(found)
        log.info("the job's culprits for this hang, of %d suspect(s): %s", len(every),
                 "; ".join(_describe(d) for d in decided))  # fmt: skip
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


def _describe(s: Suspect) -> str:
    return (f"rank {s.rank} on node {s.node} ({'stopped' if s.stopped else 'running'}, step "
            f"{s.step}, last progress {time.time() - s.last_progress:.1f}s ago)")  # fmt: skip


def _dumps(suspects: list[Suspect]) -> str:
    return json.dumps([asdict(s) for s in suspects], sort_keys=True)


def _loads(raw: bytes | str) -> list[Suspect]:
    """The recorded culprits (one suspect's object, as recorded before there were several, is
    read as a list of one)."""
    found = json.loads(raw)
    return [Suspect(**one) for one in (found if isinstance(found, list) else [found])]
