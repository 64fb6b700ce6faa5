"""In-process recovery: a rank survives its peers' faults with its process, and so with its
CUDA context, allocator pools and compiled graphs.

``run_recoverable(train)`` runs the training function in rounds, each with a process group of
its own (a new prefix of the launcher's recovery store). A fault anywhere breaks the round's
collectives: a rank killed, or hung and then killed by the launcher's watchdog, closes its
connections; a rank whose own ``train`` raises aborts its process group, which closes them.
Every rank then leaves the round and joins the next; a lost rank's replacement (a warm
standby the launcher hands that rank) joins the same round, and ``train`` runs again from the
top: its ``restore()`` rolls the state back in place to the newest step every rank holds,
each from its own shared memory. A round that does not form within the deadline ends the
process with ``EXIT_GAVE_UP``, and the launcher falls back to restarting every worker.

Gloo's collectives fail within milliseconds when a peer's connections close. NCCL's do not:
a collective blocked on a dead peer waits out its timeout. Under every backend but gloo each
rank therefore runs a ``RoundWatch`` (``FLASHCKPT_RECOVERY_WATCH``) that aborts its own
process group as soon as the round has moved on (a rank left it, or the launcher handed out a
replacement), which releases it.

Under plain torchrun, or ``flashckpt-run`` without ``FLASHCKPT_RESTART_POLICY=in-process``,
it is ``init_process_group()``, ``train()``, ``destroy_process_group()``.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from .. import config
from . import heartbeat
from .events import EventLog

log = logging.getLogger(__name__)

EXIT_GAVE_UP = 75
"""A worker's exit status when its round did not form in time: restart everything."""
STORE_ENV = "FLASHCKPT_RECOVERY_STORE"  # host:port of the launcher's recovery store
NAMESPACE_ENV = "FLASHCKPT_RECOVERY_NAMESPACE"  # keys of this incarnation of the worker group
ROUND_ENV = "FLASHCKPT_RECOVERY_ROUND"  # the round a replacement joins
DEFAULT_DEADLINE = 30.0  # seconds for a round to form (FLASHCKPT_RECOVERY_DEADLINE)
COLLECTIVE_TIMEOUT = 1800.0  # a round's collectives: torch's own default

_PEER_GONE = ("connection", "closed", "reset by peer", "broken pipe", "gloo", "nccl", "aborted",
              "timed out", "timeout", "socket", "end of file", "transport")  # fmt: skip


def run_recoverable(train: Callable[[], Any], backend: str | None = None,
                    deadline: float | None = None) -> Any:  # fmt: skip
    """Run ``train()`` with in-process recovery; its return value. The process group is made
    here for each round: ``train`` must not create or destroy it (see the README for what it
    must tolerate when it runs again)."""
    address = os.environ.get(STORE_ENV)
    if not address:
        dist.init_process_group(backend)
        try:
            return train()
        finally:
            dist.destroy_process_group()
    rounds = Rounds(address, backend, config.setting_float(
        "recovery_deadline", deadline, DEFAULT_DEADLINE, lo=1.0))  # fmt: skip
    own_error: tuple[str, str] | None = None
    while True:
        rounds.join()
        try:
            result = train()
        except Exception as exc:
            fault = rounds.fault(exc)
        else:
            rounds.leave(finished=True)
            return result
        if fault.own:
            if own_error == fault.signature:
                log.error("rank %d raised the same error again after recovering from it: %s; "
                          "giving up on in-process recovery", rounds.rank, fault.message)  # fmt: skip
                raise fault.error
            own_error = fault.signature
        del fault  # its traceback holds the round's objects (a DDP wrapper holds the group)
        rounds.leave(finished=False)


def watch_setting() -> bool | None:
    """``FLASHCKPT_RECOVERY_WATCH``: whether every round runs a RoundWatch; None for ``auto``
    (the default: under every backend but gloo)."""
    if str(config.setting("recovery_watch", None, "auto")).lower() == "auto":
        return None
    return config.setting_bool("recovery_watch")


def namespace(env: Mapping[str, str]) -> str:
    """The store keys of one rendezvous round's workers: the same on every node, new with
    every restart of the worker group (whose rank 0 serves a new store on a new port)."""
    return env.get(NAMESPACE_ENV) or f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"


class Fault:
    def __init__(self, exc: BaseException):
        self.error = exc
        self.message = f"{type(exc).__name__}: {exc}"
        low = self.message.lower()
        self.own = not any(word in low for word in _PEER_GONE)
        self.signature = (type(exc).__name__, str(exc))


class Rounds:
    """This rank's side of the rounds: join, leave, and what the launcher sees in the store."""

    def __init__(self, address: str, backend: str | None, deadline: float):
        from .control import split_address

        host, port = split_address(address, STORE_ENV)
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=deadline))  # fmt: skip
        self.ns = namespace(os.environ)
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.backend, self.deadline = backend, deadline
        self.round = int(os.environ.get(ROUND_ENV, "0"))
        self.store.compare_set(self.key("round"), "", "0")  # the first round, if none yet
        self.events = EventLog.from_env()
        self._left_at: float | None = None
        self._fault_at: float | None = None
        self._address = (host, port)
        self._watch: RoundWatch | None = None
        self._watch_client: dist.TCPStore | None = None
        self._watch_on = watch_setting()

    def _watch_store(self) -> dist.TCPStore:
        """A store client of the watch's own (one per process), so that it never waits on a
        request of the training thread."""
        if self._watch_client is None:
            host, port = self._address
            self._watch_client = dist.TCPStore(host, port, is_master=False,
                                               timeout=datetime.timedelta(seconds=self.deadline))  # fmt: skip
        return self._watch_client

    def key(self, name: str) -> str:
        return f"flashckpt/{self.ns}/{name}"

    def join(self) -> None:
        """Make this round's process group once every rank has arrived; the process exits
        with EXIT_GAVE_UP if they do not within the deadline."""
        self.store.set(self.key(f"rank-{self.rank}/round"), str(self.round))
        began = time.monotonic()
        arrived = self.key(f"round-{self.round}/arrived")
        count = self.store.add(arrived, 1)
        while count < self.world:
            if time.monotonic() - began > self.deadline:
                self._give_up(f"{count} of {self.world} ranks arrived")
            time.sleep(0.005)
            count = self.store.add(arrived, 0)
        prefix = dist.PrefixStore(self.key(f"round-{self.round}"), self.store)
        try:
            dist.init_process_group(self.backend, store=prefix, rank=self.rank,
                                    world_size=self.world,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))  # fmt: skip
            dist.barrier()  # formed: every rank of the round is in it
        except Exception as exc:  # a rank died between arriving and connecting
            self._give_up(str(exc))
        watch = self._watch_on if self._watch_on is not None else dist.get_backend() != "gloo"
        if watch:
            self._watch = RoundWatch(self._watch_store(), self.key("round"), self.round,
                                     dist.group.WORLD.abort)  # fmt: skip
            self._watch.start()
        self.store.add(self.key(f"round-{self.round}/joined"), 1)
        if self._left_at is not None:
            self._record("inprocess_joined", rendezvous_s=time.monotonic() - self._left_at,
                         since_fault_s=time.monotonic() - (self._fault_at or began))  # fmt: skip

    def _give_up(self, why: str) -> None:
        log.error("rank %d: round %d of in-process recovery did not form within %.0fs (%s); "
                  "the launcher restarts every worker", self.rank, self.round, self.deadline,
                  why)  # fmt: skip
        self._record("inprocess_gave_up", reason=why[:300])
        os._exit(EXIT_GAVE_UP)

    def fault(self, exc: BaseException) -> Fault:
        self._fault_at = time.monotonic()
        fault = Fault(exc)
        log.warning("rank %d, round %d: %s; leaving the round for the next one", self.rank,
                    self.round, fault.message)  # fmt: skip
        self._record("inprocess_fault", own=fault.own, step=heartbeat.last_step(),
                     error=fault.message[:300])  # fmt: skip
        return fault

    def leave(self, finished: bool) -> None:
        """Abort and destroy this round's process group; unless ``finished``, move on to the
        next round (the newest any rank has reached)."""
        began = time.monotonic()
        aborted = False
        if self._watch is not None:
            aborted = self._watch.stop()
            self._watch = None
        gc.collect()  # what still refers to the group (a wrapper of the old round) goes first
        group = dist.group.WORLD
        if not finished and not aborted and group is not None:
            try:
                group.abort()  # closes its connections: peers blocked on this rank wake
            except Exception as exc:  # a backend that cannot abort: destroying closes them
                log.debug("abort: %s", exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        if finished:
            return
        self._left_at = time.monotonic()
        self._record("inprocess_left", abort_s=self._left_at - began)
        # The first rank to leave round r names round r + 1 (or the launcher did, when it
        # handed out a replacement); a rank that finds a later one (another fault) joins that.
        nxt = self.round + 1
        found = self.store.compare_set(self.key("round"), str(self.round), str(nxt))
        self.round = max(nxt, int(found.decode()))

    def _record(self, kind: str, **fields: object) -> None:
        if self.events is not None:
            self.events.record(kind, rank=self.rank, round=self.round, **fields)


class RoundWatch(threading.Thread):
    """Calls ``abort`` once the store's round is past ``round`` (see the module doc)."""

    def __init__(self, store: Any, key: str, round: int, abort: Callable[[], None],
                 interval: float = 0.05):  # fmt: skip
        super().__init__(name=f"flashckpt-round-{round}", daemon=True)
        self.store, self.key, self.round = store, key, round
        self.abort, self.interval = abort, interval
        self._halt = threading.Event()
        self.aborted = False

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                now = int(self.store.get(self.key).decode())
            except Exception as exc:  # the store gone: the launcher falls back on its own
                log.debug("round watch: %s", exc)
                return
            if now > self.round and not self._halt.is_set():
                log.warning("round %d is over (the job moved to round %d): aborting this "
                            "rank's process group", self.round, now)  # fmt: skip
                self.aborted = True
                try:
                    self.abort()
                except Exception as exc:
                    log.warning("aborting round %d's process group: %s", self.round, exc)
                return

    def stop(self) -> bool:
        """Stop watching; whether the group was aborted."""
        self._halt.set()
        self.join(5)
        return self.aborted
