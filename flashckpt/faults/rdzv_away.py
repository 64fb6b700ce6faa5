"""The rendezvous away while the job trains: a launcher that waits for it instead of exiting.

While its workers are healthy, TorchElastic's agent asks the rendezvous on every look at them
how many nodes wait to join (``num_nodes_waiting``), and an error there (etcd down, the c10d
store's host lost) ends the launcher, and with it a healthy node's workers. With the
rendezvous off the training nodes (etcd, a host of its own) it may restart or be cut off a
while; a training node must not pay for that. So the question is asked with a bound: the
answer within ``WAIT_S`` is used, and an error or no answer counts as "nobody waits", with a
warning when the rendezvous goes away and a note when it answers again. A question left
unanswered is not asked again until it returns (an etcd read on a silent host takes its read
timeout): the agent goes on watching its workers meanwhile. Nodes waiting to join are seen
again once the rendezvous answers; the next restart needs it, and waits for it as TorchElastic
does.

The patience has an end, ``FLASHCKPT_RDZV_PATIENCE`` seconds (default 300; 0: none, as
TorchElastic): a rendezvous away longer is taken to be gone for good (the job ended without
this node, whose network was cut), and its error ends the launcher as it would have at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WAIT_S = 2.0
DEFAULT_PATIENCE_S = 300.0


class PatientCount:
    """``num_nodes_waiting`` of a rendezvous handler, asked with a bound (see the module doc)."""

    def __init__(self, ask: Callable[[], int], wait_s: float = WAIT_S,
                 patience_s: float = DEFAULT_PATIENCE_S):  # fmt: skip
        self.ask, self.wait_s, self.patience_s = ask, wait_s, patience_s
        self._lock = threading.Lock()
        self._pending: _Question | None = None
        self.away_since: float | None = None

    def __call__(self) -> int:
        with self._lock:
            if self._pending is None:
                self._pending = _Question(self.ask)
            question = self._pending
        if not question.done.wait(self.wait_s):
            self._away(f"no answer within {self.wait_s:.0f}s")
            return 0
        with self._lock:
            self._pending = None
        if question.error is not None:
            self._away(f"{type(question.error).__name__}: {question.error}")
            if time.monotonic() - (self.away_since or 0.0) >= self.patience_s:
                log.error("the rendezvous has not answered for %.0fs (FLASHCKPT_RDZV_PATIENCE): "
                          "taken for gone", self.patience_s)  # fmt: skip
                raise question.error
            return 0
        if self.away_since is not None:
            log.warning("the rendezvous answers again after %.1fs",
                        time.monotonic() - self.away_since)  # fmt: skip
            self.away_since = None
        return int(question.answer or 0)

    def _away(self, why: str) -> None:
        if self.away_since is None:
            self.away_since = time.monotonic()
            log.warning("the rendezvous does not answer (%s): the workers keep training; nodes "
                        "waiting to join are seen once it answers again", why.splitlines()[0])  # fmt: skip


class _Question(threading.Thread):
    def __init__(self, ask: Callable[[], int]):
        super().__init__(name="flashckpt-rdzv-ask", daemon=True)
        self.ask = ask
        self.answer: int | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.answer = self.ask()
        except Exception as exc:  # the rendezvous away: the caller says so
            self.error = exc
        finally:
            self.done.set()


def be_patient(handler: Any) -> None:
    """Have ``handler``'s ``num_nodes_waiting`` asked with a bound (once per handler)."""
    if isinstance(getattr(handler, "num_nodes_waiting", None), PatientCount):
        return
    from .. import config

    patience = config.setting_float("rdzv_patience", None, DEFAULT_PATIENCE_S, lo=0.0)
    if patience > 0:
        handler.num_nodes_waiting = PatientCount(handler.num_nodes_waiting, patience_s=patience)
