"""A client of the job's recovery store that outlives the store's restart.

The recovery store is served by the controller (or by the launcher that embeds it); when that
process is killed and started again, on its host or another, every client's connection breaks
and the store comes back empty. A plain ``TCPStore`` client then fails its next call, which
under in-process recovery would turn the next fault into a restart of every worker. A
``StoreClient`` instead connects again (until ``timeout``) and makes the call once more.

It also tells a new store from the one it knew: every client stamps the store with an id when
it connects (``compare_set`` on ``STAMP_KEY``: the first stamp stays, and every client reads
the same). A process whose client reads another id than the one it read last has a new, empty
store in front of it, and runs what its parts registered with ``on_new_store`` once, before
any of its clients goes on: each puts back what this process knows (the job's round and where
its ranks are, its node's record, a spare's marks, its training address), so that what the
store held is rebuilt from the nodes. What no node knows is lost with the old store: the
recovery budget's count.

A caller that cannot wait the whole window (a launcher on its way out, whose last word to
the store is a courtesy) bounds it with ``patience``.

Only a ``DistNetworkError`` (the connection lost) is retried, once per call: a call whose
connection broke after the store applied it is applied twice (an ``add`` counts twice), which
a round that then fails to form turns into one more round, never into a wrong one.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

STAMP_KEY = "flashckpt/store-id"
RETRY_PAUSE_S = 0.25
CONNECT_S = 5.0  # one attempt's wait for the store to accept

_actions: list[Callable[[Any], None]] = []
_stamps: dict[tuple[str, int], str] = {}  # store address -> the id this process read last
_guard = threading.Lock()


def on_new_store(action: Callable[[Any], None]) -> Callable[[Any], None]:
    """Have ``action(store)`` put this process's part back into a new recovery store."""
    with _guard:
        _actions.append(action)
    return action


def forget(action: Callable[[Any], None]) -> None:
    with _guard, contextlib.suppress(ValueError):
        _actions.remove(action)


def _seen(address: tuple[str, int], stamp: str, store: Any, what: str) -> None:
    """This process read ``stamp`` from the store at ``address``: if it knew another, put
    its parts back (once per new store; the other clients wait until it is done)."""
    with _guard:
        known = _stamps.get(address)
        _stamps[address] = stamp
        if known is None or known == stamp:
            return
        log.warning("%s at %s:%d is a new one (it restarted): what it held is put back from "
                    "this process", what, *address)  # fmt: skip
        for action in list(_actions):
            try:
                action(store)
            except Exception as exc:  # one part's failure leaves the others to put back
                log.warning("%s: putting back %s failed: %s", what,
                            getattr(action, "__qualname__", action), exc)  # fmt: skip


class StoreClient:
    """A ``TCPStore`` client of ``host:port`` that connects again when its connection is lost
    (see the module doc). Any store method may be called on it."""

    def __init__(self, host: str, port: int, timeout: float, what: str = "the recovery store"):
        """``timeout``: how long a call waits for the store, and how long the store may be
        away before a call fails (one window from the first failure: the calls after it
        fail at once until the store answers again)."""
        self.address, self.timeout, self.what = (host, port), timeout, what
        self._store: Any = None
        self._away_since: float | None = None
        self._patience: float | None = None
        self.reconnects = 0
        self._connect()

    @contextlib.contextmanager
    def patience(self, seconds: float) -> Iterator[StoreClient]:
        """Within it, a lost store is waited for ``seconds`` at most (not the whole window)."""
        saved, self._patience = self._patience, seconds
        try:
            yield self
        finally:
            self._patience = saved

    def _tcp_store(self, connect_s: float) -> Any:
        import torch.distributed as dist

        store = dist.TCPStore(*self.address, is_master=False,
                              timeout=datetime.timedelta(seconds=connect_s))  # fmt: skip
        store.set_timeout(datetime.timedelta(seconds=self.timeout))
        return store

    def _connect(self) -> Any:
        """Connect, retrying until the store has been away ``timeout``; the new connection."""
        import torch.distributed as dist

        if self._away_since is None:
            self._away_since = time.monotonic()
        deadline = self._away_since + self.timeout
        if self._patience is not None:
            deadline = min(deadline, time.monotonic() + self._patience)
        while True:
            try:
                store = self._tcp_store(min(CONNECT_S, max(deadline - time.monotonic(), 0.5)))
                stamp = store.compare_set(STAMP_KEY, "", uuid.uuid4().hex).decode()
                break
            except dist.DistNetworkError:
                if time.monotonic() + RETRY_PAUSE_S > deadline:
                    raise
                time.sleep(RETRY_PAUSE_S)
        self._away_since = None
        _seen(self.address, stamp, store, self.what)
        self._store = store
        return store

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        import torch.distributed as dist

        def call(*args: Any, **kwargs: Any) -> Any:
            store = self._store
            try:
                return getattr(store, name)(*args, **kwargs)
            except dist.DistNetworkError as exc:
                log.warning("%s at %s:%d: connection lost (%s); connecting again", self.what,
                            *self.address, str(exc).splitlines()[0])  # fmt: skip
            self.reconnects += 1
            store = self._store if self._store is not store else self._connect()
            return getattr(store, name)(*args, **kwargs)

        return call
