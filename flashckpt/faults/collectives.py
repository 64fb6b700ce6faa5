"""What each rank has issued, and who waits for whom: the evidence that names a hang's culprit.

When a rank hangs (it sleeps, spins in a loop, waits on a lock) every rank in a collective with
it falls silent within milliseconds, and their heartbeats stop at the same step. What tells
them apart is what they issued since: each rank blocked behind the culprit has issued the
collective it waits in, which the culprit never reached. Process groups count the collectives
issued on them (their sequence number, under gloo and NCCL alike), so:

- ``Sampler``, a small thread in each rank under in-process recovery, copies those counts into
  the rank's heartbeat page every ``interval`` (a page write, no store or network request),
  from outside the training thread, so it goes on while that thread is blocked or busy;
- ``likeliest`` orders the silent ranks of a job by that evidence: a stopped process first;
  then a rank that no other has to wait for is never chosen while another is waited for; among
  the rest, the rank that issued least, then the one behind in steps, then the one whose last
  progress (on its node's wall clock) came first;
- ``causes`` names every cause among them, for faults that struck several ranks at once (two
  ranks hung together, a node's workers all stopped): every stopped process if one is; else,
  where the counts show who waits for whom, every rank that others wait for and that waits
  for none; else (no such evidence) the likeliest alone.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger(__name__)


def group_key(name: str) -> int:
    """A process group's name as the page stores it (the same on every rank of the group)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def issued() -> dict[int, int]:
    """{group key: collectives issued} for every process group of this process; {} when there
    is none or a backend does not count them."""
    from torch.distributed import distributed_c10d as c10d

    from .heartbeat import MAX_GROUPS

    out: dict[int, int] = {}
    try:
        groups = list(c10d._world.pg_names.items())
    except RuntimeError:  # changed while listed (a group made or destroyed): next time
        return out
    for pg, name in groups[:MAX_GROUPS]:
        try:
            out[group_key(name)] = int(pg._get_sequence_number_for_group())
        except Exception:  # a backend without a count, or a group torn down meanwhile
            continue
    return out


class Evidence(Protocol):
    stopped: bool
    step: int | None
    last_progress: float  # wall clock
    issued: dict[str, int]  # group key (hex) -> collectives issued


def _ahead(a: Evidence, b: Evidence) -> bool:
    """Whether ``a`` issued a collective, in a group of both, that ``b`` has not: ``a`` waits
    in it for ``b`` (or for a rank ``b`` waits for)."""
    return any(a.issued[g] > b.issued[g] for g in a.issued.keys() & b.issued.keys())


def likeliest(ranks: Sequence[Evidence]) -> Evidence:
    """The likeliest culprit among silent ``ranks`` (see the module doc)."""
    waiting = [any(_ahead(r, o) for o in ranks if o is not r) for r in ranks]
    waited_for = [any(_ahead(o, r) for o in ranks if o is not r) for r in ranks]

    def key(i: int) -> tuple:
        r = ranks[i]
        step = -1 if r.step is None else r.step
        return (not r.stopped, waiting[i], not waited_for[i], step, r.last_progress)

    return ranks[min(range(len(ranks)), key=key)]


def causes(ranks: Sequence[Evidence]) -> list[Evidence]:
    """Every cause among silent ``ranks`` (see the module doc), in their order; [] for none.

    A stopped process is a cause whatever the others show, so every stopped one is. Without
    one, a rank is a cause when the collective counts show another waiting for it while it
    waits for none (its peers blocked behind two sleepers have issued a collective neither
    reached). Where the counts show no one waiting (a backend that keeps none), or only ranks
    that each wait on another, the evidence cannot tell several causes from one blocked on
    another: only the likeliest is named."""
    if not ranks:
        return []
    stopped = [r for r in ranks if r.stopped]
    if stopped:
        return stopped
    found = [
        r
        for r in ranks
        if any(_ahead(o, r) for o in ranks if o is not r)
        and not any(_ahead(r, o) for o in ranks if o is not r)
    ]
    return found or [likeliest(ranks)]


class Sampler(threading.Thread):
    """Writes this process's collective counts (``count()``) to ``write`` every ``interval``
    while it runs (see the module doc)."""

    def __init__(self, write: Callable[[dict[int, int]], None],
                 count: Callable[[], dict[int, int]] = issued, interval: float = 0.1):  # fmt: skip
        super().__init__(name="flashckpt-collectives", daemon=True)
        self.write, self.count, self.interval = write, count, interval
        self._halt = threading.Event()

    def run(self) -> None:
        last: dict[int, int] | None = None
        while not self._halt.is_set():
            try:
                now = self.count()
                if now != last:
                    self.write(now)
                    last = now
            except Exception as exc:  # evidence only: never take the rank down
                log.debug("collective counts: %s", exc)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
