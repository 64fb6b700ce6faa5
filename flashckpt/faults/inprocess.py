"""In-process recovery: a rank survives its peers' faults with its process, and so with its
CUDA context, allocator pools and compiled graphs.

``run_recoverable(train)`` runs the training function in rounds, each with a process group of
its own (a new prefix of the launcher's recovery store). A fault anywhere breaks the round's
collectives: a rank killed, or hung and then killed by the launcher's watchdog, closes its
connections; a rank whose own ``train`` raises aborts its process group, which closes them.
Every rank then leaves the round and joins the next; a lost rank's replacement (a warm
standby the launcher hands that rank) joins the same round, and ``train`` runs again from the
top: its ``restore()`` rolls the state back in place to the newest step every rank holds,
each from its own shared memory. Each round has the deadline to form: its process group is
made over a ``RoundStore``, whose waits end as soon as the round is over or late (a rank that
arrived and died is not waited for), and its first barrier runs under a ``RoundWatch`` with
that deadline. A rank gives up (``EXIT_GAVE_UP``, and the launcher falls back to restarting
every worker) when no round forms in time. A round admits one process per rank: the first to
claim the rank's number in it holds it, and a second claimant (the workers of a node a spare
took, come back) exits (``EXIT_CLAIMED``) instead of being counted. While a round trains, a ``collectives.Sampler``
copies the collectives issued into the heartbeat page: the evidence that names a hang's
culprit (``culprit``).

A collective blocked on a lost peer is not released by itself: NCCL's wait out their timeout,
and so do gloo's when the peer's host went silent (power lost, cut off the network: its
connections are never closed). Each rank therefore runs a ``RoundWatch``
(``FLASHCKPT_RECOVERY_WATCH``) that releases it as soon as the round has moved on (a rank left
it, the launcher handed out a replacement, a spare node took a lost node's ranks): it aborts
every process group of its process and, under gloo, whose ``abort()`` closes nothing, shuts
down the connections the round opened (``release``). The watch learns of it from the node's
round file, which the launcher keeps up to date (``inprocess_agent.RoundRelay``): the ranks
put no load on the store while they train. Recoveries are bounded by a budget (``Budget``), past
which the job falls back to TorchElastic's restarts.

Under plain torchrun, or ``flashckpt-run`` without ``FLASHCKPT_RESTART_POLICY=in-process``,
it is ``init_process_group()``, ``train()``, ``destroy_process_group()``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from .. import config
from ..errors import ConfigError
from . import heartbeat
from .collectives import Sampler
from .events import EventLog
from .release import Connections
from .round_watch import NodeRound, RoundStore, RoundWatch, StoreRound, abort_all_groups
from .store_client import StoreClient

log = logging.getLogger(__name__)

EXIT_GAVE_UP = 75
"""A worker's exit status when in-process recovery cannot go on (its round did not form in
time, the budget is spent, the same error came back): restart everything."""
EXIT_GROUP_ENDED = 79
"""A worker's exit status when its worker group ended while it waited for a round to form
(another launcher stopped its workers, ``end_rounds``): its launcher waits for the job's
restart, which TorchElastic's rendezvous brings, instead of failing on its own."""
EXIT_CLAIMED = 77
"""A worker's exit status when another process holds its rank in its round: it stands down."""
STORE_ENV = "FLASHCKPT_RECOVERY_STORE"  # host:port of the launcher's recovery store
NAMESPACE_ENV = "FLASHCKPT_RECOVERY_NAMESPACE"  # keys of this incarnation of the worker group
ROUND_ENV = "FLASHCKPT_RECOVERY_ROUND"  # the round a replacement joins
ROUND_FILE_ENV = "FLASHCKPT_RECOVERY_ROUND_FILE"  # the node's relay of the job's round
DEFAULT_DEADLINE = 30.0  # seconds for a round to form (FLASHCKPT_RECOVERY_DEADLINE)
# A round's collectives: 30 minutes (torch's default for gloo; NCCL's is 10). A collective
# blocked on a lost peer is released by the round watch long before.
COLLECTIVE_TIMEOUT = 1800.0

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
        if rounds.round > 0 and not cuda_healthy():
            rounds.leave_broken()
        with rounds.store_lost():
            rounds.join()
        try:
            result = train()
        except Exception as exc:
            fault = rounds.fault(exc)
        else:
            with rounds.store_lost():
                rounds.leave(finished=True)
            return result
        if fault.own:
            if own_error == fault.signature:
                rounds.repeated(fault)  # exits: every worker restarts
            own_error = fault.signature
        del fault  # its traceback holds the round's objects (a DDP wrapper holds the group)
        with rounds.store_lost():
            rounds.leave(finished=False)


# What NCCL and ProcessGroupNCCL must do for a survivor to stay alive through a peer's fault
# and rejoin: not tear the process down on a communicator error (the abort that releases it
# is one), not rethrow CUDA errors as fatal, and no NVLink SHARP buffers (not released by an
# abort). Values a worker may have, the first the one set when unset.
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "2"),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": ("0",),
    "NCCL_NVLS_ENABLE": ("0",),
}
MIN_NCCL = (2, 26, 2)
EXIT_CUDA_BROKEN = 76
"""A worker's exit status when its CUDA context holds a sticky error: it cannot rejoin in
place, the launcher replaces it."""


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for in-process recovery's workers (those unset in ``env``); a
    ConfigError listing every requirement when ``env`` sets one otherwise."""
    wrong = [f"{k}={env[k]}" for k, ok in NCCL_ENV.items() if k in env and env[k] not in ok]
    if wrong:
        need = ", ".join(f"{k}={'|'.join(ok)}" for k, ok in NCCL_ENV.items())
        raise ConfigError(
            f"in-process recovery needs {need} (a survivor must outlive a peer's fault and the "
            f"abort that releases it); found {', '.join(wrong)}: unset them, or use "
            "FLASHCKPT_RESTART_POLICY=restart"
        )
    return {k: ok[0] for k, ok in NCCL_ENV.items() if k not in env}


def cuda_healthy(cuda: Any = None) -> bool:
    """Whether this process's CUDA context can go on: a sticky error (an illegal address, a
    device lost) poisons it for good, and a rank with one must not rejoin a round."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not (cuda.is_available() and cuda.is_initialized()):
        return True
    try:
        cuda.synchronize()
    except RuntimeError as exc:
        log.error("this process's CUDA context failed (%s): it cannot rejoin in place; its "
                  "replacement takes the rank", exc)  # fmt: skip
        return False
    return True


def _check_nccl(backend: str) -> None:
    if backend != "nccl":
        return
    import torch

    version = tuple(torch.cuda.nccl.version())
    if version < MIN_NCCL:
        log.warning("NCCL %s is older than %s: aborting a communicator while a peer is lost "
                    "may hang there; upgrade NCCL (or torch) for in-process recovery",
                    ".".join(map(str, version)), ".".join(map(str, MIN_NCCL)))  # fmt: skip


def watch_setting() -> bool:
    """``FLASHCKPT_RECOVERY_WATCH``: whether every round runs a RoundWatch (default: on;
    ``auto`` is on too)."""
    if str(config.setting("recovery_watch", None, "auto")).lower() == "auto":
        return True
    return config.setting_bool("recovery_watch")


def _gloo_only() -> bool:
    """Whether this process's default group runs gloo alone (not beside NCCL, whose
    connections its own abort closes and must not be cut under it)."""
    try:
        return dist.is_initialized() and dist.get_backend() == "gloo"
    except Exception:
        return False


def namespace(env: Mapping[str, str]) -> str:
    """The store keys of one rendezvous round's workers: the same on every node, new with
    every restart of the worker group (whose rank 0 serves a new store on a new port)."""
    return env.get(NAMESPACE_ENV) or f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"


def last_round(store: Any, ns: str, rank: int) -> int:
    """The newest round ``rank`` was held in: the round its holder recorded, or a later one
    it claimed (a holder killed between claiming the rank and recording the round). Its
    replacement joins a later one: there the rank is free."""
    key = f"flashckpt/{ns}"
    last, now = (int(store.get(k).decode()) if store.check([k]) else 0
                 for k in (f"{key}/rank-{rank}/round", f"{key}/round"))  # fmt: skip
    for n in range(last + 1, now + 1):
        if store.check([f"{key}/round-{n}/claim-{rank}"]):
            last = n
    return last


def move_round(store: Any, ns: str, past: int, step: int | None) -> int:
    """Move the job from round ``past`` to ``past + 1``, unless a later round is named
    already, and mark round ``past`` over (round watches wake on it); the job's round now.
    Whoever moves it records the step of the fault, for the recovery budget."""
    key = f"flashckpt/{ns}"
    nxt = past + 1
    store.compare_set(f"{key}/round", "", str(past))  # a store restarted since: round ``past``
    found = int(store.compare_set(f"{key}/round", str(past), str(nxt)).decode())
    now = max(nxt, found)
    store.set(f"{key}/round-{past}/over", str(now))
    store.set(f"{key}/round-{past}/formed", "moved on")  # wakes ranks still waiting for it
    # compare_set answers the value it leaves, the same whoever set it: count the movers.
    if store.add(f"{key}/round-{past}/moved", 1) == 1:
        store.append(f"{key}/recoveries", f"{-1 if step is None else step},")
    return now


def end_rounds(store: Any, ns: str) -> None:
    """The worker group of namespace ``ns`` is over (a launcher stops its workers: the job
    restarts whole, or has finished): its rounds form no more. Ranks waiting for the current
    round to form wake and give up at once, instead of at the recovery deadline (a spare's
    ranks taken into a round the job's restart left behind)."""
    key = f"flashckpt/{ns}"
    store.set(f"{key}/ended", "1")
    now = int(store.get(f"{key}/round").decode()) if store.check([f"{key}/round"]) else 0
    store.set(f"{key}/round-{now}/formed", "ended")


def restore_round(store: Any, ns: str, round: int, ranks: Mapping[int, int]) -> int:
    """Put the job's round back in a store that restarted (``store_client``): at least
    ``round`` (a node's newest), whichever node comes first, and the round each of the node's
    ``ranks`` (rank -> round) was in, at least (``last_round`` reads it when the rank is
    replaced): whoever knows a newer round wins, whatever the order. The job's round now."""
    key = f"flashckpt/{ns}"
    now = _raise_to(store, f"{key}/round", round)
    for rank, was_in in ranks.items():
        _raise_to(store, f"{key}/rank-{rank}/round", was_in)
    return now


def _raise_to(store: Any, key: str, value: int) -> int:
    """Set the integer at ``key`` to at least ``value`` (a missing one too); what it holds."""
    seen = store.compare_set(key, "", str(value)).decode()
    while int(seen) < value:
        seen = store.compare_set(key, seen, str(value)).decode()
    return int(seen)


@dataclass(frozen=True)
class Budget:
    """At most ``count`` in-process recoveries within ``steps`` steps
    (``FLASHCKPT_RECOVERY_BUDGET=count/steps``, default 3/100): past it, the job falls back to
    TorchElastic's restarts, which ``--max-restarts`` bounds, so a fault that recurs at the
    same step ends the job instead of looping forever."""

    count: int = 3
    steps: int = 100

    def __str__(self) -> str:
        return f"{self.count}/{self.steps}"

    @classmethod
    def from_env(cls) -> Budget:
        text = str(config.setting("recovery_budget", None, "3/100")).strip()
        count, _, steps = text.partition("/")
        try:
            budget = cls(int(count), int(steps))
        except ValueError:
            budget = cls(-1, -1)
        if budget.count < 0 or budget.steps < 1:
            raise ConfigError(
                f"FLASHCKPT_RECOVERY_BUDGET={text!r} is not COUNT/STEPS (recoveries allowed "
                "within a window of steps, e.g. 3/100); fix the variable or unset it"
            )
        return budget


def freeze_setup() -> None:
    """Move what exists before the first round (the imports, the model, the optimizer) out of
    the garbage collector's sight (``gc.freeze``), after one full collection: a recovery's
    collection of the old round then scans that round's objects alone, a few milliseconds
    instead of some 150 ms with torch loaded, on every survivor's way to the next round."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


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
        self.store = StoreClient(host, port, deadline)  # outlives the store's restart
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
        self._sampler: Sampler | None = None  # the collectives issued, for culprit's evidence
        self._round_store: RoundStore | None = None  # the round's groups' store: kept alive
        self._connections = Connections({port})  # what a round's gloo groups open
        self._watch_on = watch_setting()
        self.budget = Budget.from_env()
        # Who claims this rank in a round: unique to this process, readable in a refusal.
        self.claimant = (f"{config.node_name()} (host {socket.gethostname()}, pid {os.getpid()}, "
                         f"{uuid.uuid4().hex[:8]})")  # fmt: skip

    def _round_source(self) -> NodeRound | StoreRound:
        """Where this rank's watch learns that its round is over: the node's round file when
        the launcher relays it (no store request per rank), else the store, with a client of
        the watch's own (a blocked wait must not hold the training thread's connection)."""
        if path := os.environ.get(ROUND_FILE_ENV):
            return NodeRound(path)
        host, port = self._address
        client = dist.TCPStore(host, port, is_master=False,
                               timeout=datetime.timedelta(seconds=self.deadline))  # fmt: skip
        return StoreRound(client, self.ns)

    def key(self, name: str) -> str:
        return f"flashckpt/{self.ns}/{name}"

    def join(self) -> None:
        """Make this round's process group once every rank has arrived, following the job to
        a later round when another fault moves it on meanwhile; the process exits with
        EXIT_GAVE_UP if no round forms within the deadline (or the recovery budget is spent)."""
        began = time.monotonic()
        if self._left_at is None:
            freeze_setup()
        while not self._form(time.monotonic()):  # each round its own deadline
            self._next_round()
        if self._left_at is None:
            _check_nccl(dist.get_backend())
        if self._watch_on:
            self._watch = RoundWatch(self._round_source(), self.round, self._release)
            self._watch.start()
        self._sampler = Sampler(heartbeat.record_issued)
        self._sampler.start()
        self.store.add(self.key(f"round-{self.round}/joined"), 1)
        if self._left_at is not None:
            self._record("inprocess_joined", rendezvous_s=time.monotonic() - self._left_at,
                         since_fault_s=time.monotonic() - (self._fault_at or began))  # fmt: skip

    def _form(self, began: float) -> bool:
        """Arrive in this round and make its process group; False if the job moved to a later
        round meanwhile (a rank that arrived has died, and was replaced into the next)."""
        if self.round > 0:
            self._check_budget()
        self._check_ended()
        self._claim()
        self.store.set(self.key(f"rank-{self.rank}/round"), str(self.round))
        arrived, formed = (
            self.key(f"round-{self.round}/arrived"),
            self.key(f"round-{self.round}/formed"),
        )
        if self.store.add(arrived, 1) == self.world:
            self.store.set(formed, "1")
        # One blocking wait, not a poll: the store answers when the last rank arrives, or when
        # the round is moved on without forming (``move_round`` marks it formed then).
        left = self.deadline - (time.monotonic() - began)
        try:
            self.store.wait([formed], datetime.timedelta(seconds=max(left, 0.001)))
        except Exception:
            self._give_up(f"{int(self.store.add(arrived, 0))} of {self.world} ranks arrived")
        self._check_ended()
        if self._current_round() > self.round:
            return False
        # Made and checked within what is left of the deadline: a rank that dies meanwhile
        # fails the round's connect or barrier (gloo: its timeout; every backend: the watch,
        # at the deadline or as soon as the job moves on), never a 30-minute wait.
        left = max(self.deadline - (time.monotonic() - began), 1.0)
        forming = RoundWatch(self._round_source(), self.round, self._release, deadline=left)
        forming.start()
        self._round_store = RoundStore(self.store, self.key(f"round-{self.round}/over"),
                                       time.monotonic() + left)  # fmt: skip
        prefix = dist.PrefixStore(self.key(f"round-{self.round}"), self._round_store)
        error: Exception | None = None
        self._connections.begin()
        try:
            dist.init_process_group(self.backend, store=prefix, rank=self.rank,
                                    world_size=self.world,
                                    timeout=datetime.timedelta(seconds=left))  # fmt: skip
            dist.barrier()  # formed: every rank of the round is in it
        except Exception as exc:  # a rank died between arriving and connecting
            error = exc
        if forming.stop() and error is None:
            error = RuntimeError("aborted by its watch")
        if error is not None:
            log.warning("rank %d: round %d did not form (%s); moving on to the next",
                        self.rank, self.round, error)  # fmt: skip
            self._close_groups(abort=True)
            self._move_on()
            return False
        _set_pg_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))  # for training
        self._round_store.formed()
        return True

    def _release(self) -> None:
        """Release every collective of this process that its round is blocked in: abort its
        process groups and, under gloo (whose abort closes nothing), shut down the connections
        the round opened, as a dead peer's kernel would (``release``)."""
        abort_all_groups()
        if _gloo_only():
            cut = self._connections.cut()
            log.warning("rank %d: shut down %d connection(s) of round %d", self.rank, cut,
                        self.round)  # fmt: skip

    def _claim(self) -> None:
        """Hold this rank in this round, or exit (``EXIT_CLAIMED``) if another process does:
        the round counts each rank once, and its process group has one process a rank."""
        key = self.key(f"round-{self.round}/claim-{self.rank}")
        holder = self.store.compare_set(key, "", self.claimant).decode()
        if holder == self.claimant:
            self._record("rank_claimed")
            return
        log.error("rank %d: %s holds rank %d in round %d already; this process (%s) is a second "
                  "claimant of it (its node was taken by a spare node while it was found lost) "
                  "and exits", self.rank, holder, self.rank, self.round, self.claimant)  # fmt: skip
        self._record("inprocess_claim_refused", holder=holder)
        os._exit(EXIT_CLAIMED)

    def _current_round(self) -> int:
        return int(self.store.get(self.key("round")).decode())

    def _next_round(self) -> None:
        self.round = max(self.round + 1, self._current_round())

    def _move_on(self) -> int:
        return move_round(self.store, self.ns, self.round, heartbeat.last_step())

    def _check_ended(self) -> None:
        """Give up where the worker group is over (``end_rounds``): a launcher stopped its
        workers, so the job restarts whole and this round can never form."""
        if self.store.check([self.key("ended")]):
            log.warning("rank %d: the job's worker group ended (a launcher stopped its "
                        "workers: the job restarts whole); leaving round %d", self.rank,
                        self.round)  # fmt: skip
            self._record("inprocess_group_ended")
            os._exit(EXIT_GROUP_ENDED)

    def _check_budget(self) -> None:
        """Give up on in-process recovery once the job has recovered ``budget.count`` times
        within ``budget.steps`` steps: a fault that comes back every time (an OOM, a bad
        batch) falls back to TorchElastic's restarts, which its ``--max-restarts`` bounds."""
        key = self.key("recoveries")
        steps = [int(s) for s in self.store.get(key).decode().split(",") if s] if (
            self.store.check([key])) else []  # fmt: skip
        if len(steps) <= self.budget.count:
            return
        newest = max(steps)
        recent = [s for s in steps if s > newest - self.budget.steps]
        if len(recent) > self.budget.count:
            self._give_up(f"{len(recent)} recoveries within {self.budget.steps} steps (at steps "
                          f"{recent}), over the recovery budget {self.budget}", budget=True)  # fmt: skip

    def repeated(self, fault: Fault) -> None:
        """Exit for good, and have every worker restarted (``EXIT_GAVE_UP``): this rank raised
        the same error again right after recovering from it, a bug, not a fault. Not exit 1,
        which the launcher takes for a lost rank and hands to a standby."""
        log.error("rank %d raised the same error again after recovering from it; giving up on "
                  "in-process recovery, the launcher restarts every worker",
                  self.rank, exc_info=fault.error)  # fmt: skip
        self._record("inprocess_gave_up", reason=f"the same error twice: {fault.message[:250]}")
        logging.shutdown()
        os._exit(EXIT_GAVE_UP)

    @contextlib.contextmanager
    def store_lost(self) -> Iterator[None]:
        """Joining or leaving a round with the recovery store out of reach (its host lost, the
        network cut): give up on in-process recovery (``EXIT_GAVE_UP``), so that the launcher
        falls back to restarting every worker, instead of a traceback the launcher would take
        for a lost rank."""
        try:
            yield
        except dist.DistError as exc:  # lost, or a store wait timed out
            self._give_up(f"the recovery store cannot be reached ({str(exc).splitlines()[0]})",
                          budget=True)  # fmt: skip

    def leave_broken(self) -> None:
        """Exit for good: this process cannot go on (see ``cuda_healthy``)."""
        self._record("inprocess_cuda_broken")
        os._exit(EXIT_CUDA_BROKEN)

    def _give_up(self, why: str, budget: bool = False) -> None:
        if budget:
            log.error("rank %d: in-process recovery gives up: %s; the launcher restarts every "
                      "worker", self.rank, why)  # fmt: skip
        else:
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
        heartbeat.recovering(self.deadline)
        return fault

    def leave(self, finished: bool) -> None:
        """Abort and destroy this round's process groups; unless ``finished``, move on to the
        next round (the newest any rank has reached)."""
        began = time.monotonic()
        aborted = False
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        # This rank is in no collective of the round any more: its page shows no counts. Left
        # there, the counts of a group it left would make it, waiting for the next round to
        # form, look like the rank that a rank still blocked in the old round waits for.
        heartbeat.record_issued({})
        if self._watch is not None:
            aborted = self._watch.stop()
            self._watch = None
        nxt = None
        if not finished:
            # The round is named over first: the other ranks' watches wake on it while this
            # one is still aborting and destroying (which can take a while).
            nxt = self._move_on()
        gc.collect()  # what still refers to the group (a wrapper of the old round) goes first
        self._close_groups(abort=not finished and not aborted)
        if nxt is None:
            return
        self._left_at = time.monotonic()
        self._record("inprocess_left", abort_s=self._left_at - began)
        self.round = nxt

    @staticmethod
    def _close_groups(abort: bool) -> None:
        if abort:
            abort_all_groups()  # closes their connections: peers blocked on this rank wake
        if dist.is_initialized():
            dist.destroy_process_group()
        # A group that failed to connect was never registered, but it took a name: the next
        # round's default group must have the name every other rank gives it ("0").
        world = dist.distributed_c10d._world
        if not world.pg_names:
            world.group_count = 0

    def _record(self, kind: str, **fields: object) -> None:
        if self.events is not None:
            self.events.record(kind, rank=self.rank, round=self.round, **fields)
