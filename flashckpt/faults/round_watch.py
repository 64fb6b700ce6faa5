"""How a rank learns, from outside its training thread, that its round of in-process recovery
is over, and what it does then: abort every process group of its process, which releases a
collective blocked on a lost peer (NCCL's wait out their timeout otherwise).

The job's round comes from the node's round file, which the launcher keeps up to date
(``inprocess_agent.RoundRelay``), so the ranks put no load on the store while they train; or
from the store itself where no launcher relays it. A watch with a deadline also aborts when the
deadline passes first: a round that is forming (its process group made, its first barrier) is
bounded by it, on every backend.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)


def abort_all_groups() -> None:
    """Abort every process group of this process, not only the default one: subgroups
    (DeviceMesh, FSDP, tensor and pipeline parallel, DeepSpeed's) and the communicators torch
    makes for point-to-point operations, so that a collective blocked in any of them returns.
    Under NCCL the aborts run inside one group call, as torch's own ``_abort_process_group``
    does (aborting communicators one by one can deadlock). Unlike it, the groups stay
    registered here: ``destroy_process_group`` then removes them on the training thread."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world  # every group this process made, newest first (torch's own order)
    groups = sorted(world.pg_names, key=lambda pg: world.pg_names[pg], reverse=True)
    nccl = None
    default = c10d.GroupMember.WORLD
    if default is not None and c10d.is_nccl_available():
        with contextlib.suppress(RuntimeError):
            backend = default._get_backend(torch.device("cuda"))
            if isinstance(backend, c10d.ProcessGroupNCCL):
                nccl = backend
    if nccl is not None:
        nccl._group_start()
    try:
        for pg in groups:
            try:
                pg.abort()
            except Exception as exc:  # a backend that cannot abort: destroying closes it
                log.debug("abort of %s: %s", world.pg_names.get(pg), exc)
    finally:
        if nccl is not None:
            nccl._group_end()


class NodeRound:
    """The job's round as this node's launcher relays it: a small file in shared memory
    (``FLASHCKPT_RECOVERY_ROUND_FILE``) that the launcher rewrites when a round is over, so the
    ranks' watches read memory, never the store, while they train."""

    def __init__(self, path: str):
        self.path = path

    def wait_past(self, round: int, halt: threading.Event, until: float | None = None,
                  interval: float = 0.05) -> int | None:  # fmt: skip
        """The job's round once it is past ``round``; None when halted or at ``until``."""
        while not halt.wait(interval) and (until is None or time.monotonic() < until):
            try:
                with open(self.path, "rb") as f:
                    now = int(f.read(32).decode() or "0")
            except (OSError, ValueError):
                continue  # rewritten meanwhile, or not yet there
            if now > round:
                return now
        return None


class StoreRound:
    """The job's round from the store itself (no launcher relays it): one blocking wait for
    the round's ``over`` key, renewed every ``slice_s`` (nothing is polled)."""

    def __init__(self, store: Any, ns: str, slice_s: float = 30.0):
        self.store, self.ns, self.slice_s = store, ns, slice_s

    def wait_past(self, round: int, halt: threading.Event,
                  until: float | None = None) -> int | None:  # fmt: skip
        key = f"flashckpt/{self.ns}/round-{round}/over"
        backoff = 0.05
        while not halt.is_set():
            left = self.slice_s if until is None else min(self.slice_s, until - time.monotonic())
            if left <= 0:
                return None
            try:
                self.store.wait([key], datetime.timedelta(seconds=left))
                return int(self.store.get(key).decode())
            except Exception as exc:  # not over yet, or a store blip: wait again
                if "timeout" not in str(exc).lower():
                    log.debug("round watch: %s", exc)
                    halt.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
        return None


class RoundWatch(threading.Thread):
    """Calls ``abort`` once the job's round is past ``round``, or ``deadline`` seconds have
    passed when one is given (see the module doc)."""

    def __init__(self, source: Any, round: int, abort: Callable[[], None],
                 deadline: float | None = None):  # fmt: skip
        super().__init__(name=f"flashckpt-round-{round}", daemon=True)
        self.source, self.round, self.abort = source, round, abort
        self.until = None if deadline is None else time.monotonic() + deadline
        self._halt = threading.Event()
        self.aborted = False

    def run(self) -> None:
        now = self.source.wait_past(self.round, self._halt, self.until)
        if self._halt.is_set():
            return
        if now is None:
            if self.until is None or time.monotonic() < self.until:
                return
            log.warning("round %d did not form within its deadline: aborting this rank's "
                        "process groups", self.round)  # fmt: skip
        else:
            log.warning("round %d is over (the job moved to round %d): aborting this rank's "
                        "process groups", self.round, now)  # fmt: skip
        self.aborted = True
        try:
            self.abort()
        except Exception as exc:
            log.warning("aborting round %d's process groups: %s", self.round, exc)

    def stop(self) -> bool:
        """Stop watching; whether the groups were aborted. A watch blocked in the store is
        left to end by itself (a daemon thread, done at its next slice)."""
        self._halt.set()
        if isinstance(self.source, NodeRound):
            self.join(5)
        return self.aborted


class RoundStore(dist.Store):
    """The store as a round's process groups see it (their connect, NCCL's unique ids, a
    ``new_group``): a wait ends in an error as soon as the round is over (``over_key`` set)
    or, while the round forms, at ``forming_until`` (``time.monotonic()``; None once formed).
    Without it, ranks that arrived in a round wait in their connect for a rank that died after
    arriving, as long as the group's timeout. Waits poll ``check``, which the store answers at
    once; they happen when a group is made, not on the training step."""

    def __init__(self, inner: Any, over_key: str, forming_until: float | None,
                 poll: float = 0.02, shared: dict | None = None):  # fmt: skip
        super().__init__()
        self.inner, self.over_key, self.poll = inner, over_key, poll
        self.shared = shared if shared is not None else {"until": forming_until, "clones": []}

    def formed(self) -> None:
        """The round formed: from now on only its end cuts a wait short."""
        self.shared["until"] = None

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if (until := self.shared["until"]) is not None:
            end = until if end is None else min(end, until)
        while not self.inner.check(keys):
            if self.inner.check([self.over_key]):
                raise RuntimeError(f"the round is over (waiting for {keys})")
            if end is not None and time.monotonic() > end:
                raise RuntimeError(f"wait timeout: the round did not form in time ({keys})")
            time.sleep(self.poll)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self.inner.append(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> RoundStore:
        """A copy over a connection of its own (gloo connects from threads of its own), kept
        referenced here: the groups hold only its native side."""
        made = RoundStore(self.inner.clone(), self.over_key, None, self.poll, self.shared)
        self.shared["clones"].append(made)
        return made
