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
- a node posting for the first time in a round also posts which nodes it reached on the
  training network (``reach``); a node that none reached, while they reached others, and
  that reached none itself, is cut off that network: it is the culprit, whole (its ranks
  stall because its network does, and a standby there would stall again), and it leaves the
  job so that a spare or a restart takes it. A judge that reached none of the nodes it
  probed waits up to ``REACH_WAIT_S`` for their word before it names anyone;
- the culprits are recorded once per round (one ``compare_set``), so every node acts on the
  same set: each node kills those it runs (their replacements then move the job to the next
  round together), the others wait.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .collectives import causes
from .reach import cut_off

log = logging.getLogger(__name__)

SETTLE_S = 0.5
REACH_WAIT_S = 2.0
"""How long a judge whose probes all failed waits for the nodes it could not reach to post."""


@dataclass(frozen=True)
class Suspect:
    node: str
    rank: int
    pid: int
    stopped: bool  # the process is stopped (SIGSTOP, a debugger): the cause, not a victim
    step: int | None = None
    last_progress: float = 0.0  # wall clock
    issued: dict[str, int] = field(default_factory=dict)  # see collectives
    cut_off: bool = False  # its node is cut off the training network (``reach``): it leaves

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

    def __init__(self, store: Any, node: str, where: Any, settle: float = SETTLE_S,
                 reach: Any = None):  # fmt: skip
        """``store``: a store client, or a callable that makes one when first needed (the
        store may not serve yet when the launcher starts). ``reach``: this node's
        ``reach.Reach``, or None (no evidence of the training network is posted)."""
        self._store, self.node, self.where, self.settle = store, node, where, settle
        self.reach = reach
        # round prefix -> (when this node first posted, what it posted last)
        self._posted: dict[str, tuple[float, str]] = {}

    @property
    def store(self) -> Any:
        if callable(self._store) and not hasattr(self._store, "check"):
            self._store = self._store()
        return self._store

    @classmethod
    def connect(cls, address: str, node: str, where: Any, reach: Any = None) -> JobCulprit:
        from .control import split_address

        host, port = split_address(address, "the recovery store")

        def make() -> Any:
            from .store_client import StoreClient

            return StoreClient(host, port, timeout=10)  # outlives the store's restart

        return cls(make, node, where, reach=reach)

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
                if self.reach is not None:  # before the name: a poster's word is complete
                    got = self.reach.probe(self.store, self.node)
                    self.store.set(f"{prefix}/reach/{self.node}", json.dumps(got))
                self.store.append(f"{prefix}/posters", json.dumps(self.node) + "\n")
            first = self._posted.get(prefix, (now, ""))[0]
            self._posted[prefix] = (first, posted)
        if not judged:
            return []
        if not any(s.stopped for s in mine) and now - self._posted[prefix][0] < self.settle:
            return []
        # Every rank posted in this round, this node's as it posted them: with a stopped
        # process here, every stopped one (``causes``), at once; else the causes among them.
        posters = self._posters(prefix)
        every = self._every(prefix, posters)
        every += [s for s in mine if s not in every]
        cut = self._cut_off(prefix, posters, every, now - self._posted[prefix][0])
        if cut is None:
            return []
        found = self.store.compare_set(culprit, "", _dumps(cut or causes(every)))
        decided = _loads(found)
        log.info("the job's culprits for this hang, of %d suspect(s): %s", len(every),
                 "; ".join(_describe(d) for d in decided))  # fmt: skip
        return decided

    def _posters(self, prefix: str) -> list[str]:
        raw = self.store.get(f"{prefix}/posters").decode()
        return list(dict.fromkeys(json.loads(line) for line in raw.splitlines() if line))

    def _every(self, prefix: str, posters: list[str]) -> list[Suspect]:
        """Every rank the job's nodes (``posters``) posted in this round."""
        out = []
        for node in posters:
            raw = self.store.get(f"{prefix}/suspects/{node}")
            out.extend(Suspect(**one) for one in json.loads(raw))
        return out

    def _cut_off(self, prefix: str, posters: list[str], every: list[Suspect],
                 since: float) -> list[Suspect] | None:  # fmt: skip
        """The nodes cut off the training network by what the posters reached (``reach``),
        as culprits: their posted ranks, or the node alone (rank -1) if it posted none. [] if
        none is; None while this node reached none of those it probed and one of them has not
        posted yet (for up to ``REACH_WAIT_S``): it may be the one cut off."""
        if self.reach is None:
            return []
        reached = {}
        for node in posters:
            if self.store.check([key := f"{prefix}/reach/{node}"]):
                reached[node] = json.loads(self.store.get(key))
        mine = reached.get(self.node, {})
        if mine and not any(mine.values()) and since < REACH_WAIT_S and any(
                n not in reached for n in mine):  # fmt: skip
            return None
        out = []
        for node in cut_off(reached):
            ranks = [replace(s, cut_off=True) for s in every if s.node == node]
            out.extend(ranks or [Suspect(node, -1, 0, False, cut_off=True)])
        if out:
            log.error("node(s) %s reached none of the nodes they probed on the training network "
                      "and none reached them, while the others reach each other: cut off",
                      ", ".join(sorted({s.node for s in out})))  # fmt: skip
        return out


def _describe(s: Suspect) -> str:
    if s.cut_off:
        return f"node {s.node}{f' (rank {s.rank})' if s.rank >= 0 else ''}: cut off the network"
    return (f"rank {s.rank} on node {s.node} ({'stopped' if s.stopped else 'running'}, step "
            f"{s.step}, last progress {time.time() - s.last_progress:.1f}s ago)")  # fmt: skip


def _dumps(suspects: list[Suspect]) -> str:
    return json.dumps([asdict(s) for s in suspects], sort_keys=True)


def _loads(raw: bytes | str) -> list[Suspect]:
    """The recorded culprits (one suspect's object, as recorded before there were several, is
    read as a list of one)."""
    found = json.loads(raw)
    return [Suspect(**one) for one in (found if isinstance(found, list) else [found])]
