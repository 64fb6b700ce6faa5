"""An etcd rendezvous that restarts while the job trains: the launchers wait for it.

While its workers are healthy, TorchElastic's agent asks the rendezvous on every look at them
how many nodes wait to join (``num_nodes_waiting``), and an error there ends the launcher, and
with it a healthy node's workers. With the rendezvous on an etcd server off the training nodes
(the README's multi-node launch), that server may be restarted (a pod rescheduled, a member
replaced) while the job trains; a training node must not pay for that.

So an etcd rendezvous's question is asked as before, and one answer is read differently: the
etcd host *refuses* the connection (the host is there, its server is not serving yet). That
counts as "nobody waits", with a warning when it starts and a note when etcd answers again,
for at most ``FLASHCKPT_RDZV_PATIENCE`` seconds (default 300; 0: as TorchElastic). Anything
else ends the launcher as TorchElastic has it: a host that does not answer at all or cannot be
reached (this node cut off the network, whose launcher must leave the job to the spare that
takes its ranks), an error etcd itself returns, and a c10d rendezvous (its store lives in a
launcher, and a lost one does not come back). Nodes waiting to join are seen again once etcd
answers; the next restart needs it, and waits for it as TorchElastic does.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_PATIENCE_S = 300.0


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` comes of a connection refused: its chain of causes (Python's, an etcd
    error's ``cause``, a urllib3 retry's ``reason``) holds one."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return True
        todo += [e.__cause__, e.__context__]
        todo += [x for x in (getattr(e, "cause", None), getattr(e, "reason", None))
                 if isinstance(x, BaseException)]  # fmt: skip
    return False


class PatientCount:
    """``num_nodes_waiting`` of an etcd rendezvous handler, waiting out a restart of etcd
    (see the module doc)."""

    def __init__(self, ask: Callable[[], int], patience_s: float = DEFAULT_PATIENCE_S):
        self.ask, self.patience_s = ask, patience_s
        self.away_since: float | None = None

    def __call__(self) -> int:
        try:
            answer = self.ask()
        except Exception as exc:
            if not refused(exc):
                raise
            now = time.monotonic()
            if self.away_since is None:
                self.away_since = now
                log.warning("the rendezvous (etcd) refuses connections: it is restarting, or "
                            "gone; the workers keep training, for at most %.0fs "
                            "(FLASHCKPT_RDZV_PATIENCE)", self.patience_s)  # fmt: skip
            if now - self.away_since >= self.patience_s:
                log.error("the rendezvous has refused connections for %.0fs "
                          "(FLASHCKPT_RDZV_PATIENCE): taken for gone", self.patience_s)  # fmt: skip
                raise
            return 0
        if self.away_since is not None:
            log.warning("the rendezvous answers again after %.1fs",
                        time.monotonic() - self.away_since)  # fmt: skip
            self.away_since = None
        return answer


def be_patient(handler: Any) -> None:
    """Have an etcd rendezvous ``handler`` wait out etcd's restart (once per handler)."""
    if isinstance(getattr(handler, "num_nodes_waiting", None), PatientCount):
        return
    try:
        backend = str(handler.get_backend())
    except Exception:  # a handler that cannot say: left as TorchElastic has it
        return
    if not backend.startswith("etcd"):
        return
    from .. import config

    patience = config.setting_float("rdzv_patience", None, DEFAULT_PATIENCE_S, lo=0.0)
    if patience > 0:
        handler.num_nodes_waiting = PatientCount(handler.num_nodes_waiting, patience)
