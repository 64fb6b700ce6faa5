"""An etcd rendezvous restarting while the job trains (``rdzv_away``): a refused connection
counts as nobody waiting, for a patience; any other error ends the launcher as TorchElastic
has it. (With real etcd, killed and started again under a training job:
``test_control_restart.py``.)"""

from __future__ import annotations

import socket
import time

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from flashckpt.faults.rdzv_away import PatientCount, be_patient, refused


def refused_by_etcd() -> Exception:
    """What torch's etcd client raises at a port nobody serves (the real client, a real
    refused connection)."""
    etcd = pytest.importorskip("etcd", reason="torch's etcd client (python-etcd) not installed")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    try:
        etcd.Client(host="127.0.0.1", port=port, read_timeout=2).read("/rdzv")
    except Exception as exc:
        return exc
    raise AssertionError("nobody serves the port, yet etcd answered")


def test_a_refused_connection_is_told_from_other_errors():
    assert refused(refused_by_etcd())
    try:
        raise RendezvousConnectionError("wrapped") from refused_by_etcd()
    except RendezvousConnectionError as exc:
        assert refused(exc)
    assert not refused(TimeoutError("no answer"))  # a silent host: this node may be cut off
    assert not refused(OSError(113, "No route to host"))
    assert not refused(RendezvousConnectionError("the c10d store is gone"))


def test_a_refused_rendezvous_counts_as_nobody_waiting_until_it_answers_again(caplog):
    answers: list = [refused_by_etcd(), refused_by_etcd(), 2]

    def ask() -> int:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    count = PatientCount(ask)
    assert count() == 0 and count() == 0 and count.away_since is not None
    assert "refuses connections" in caplog.text
    assert count() == 2 and count.away_since is None and "answers again" in caplog.text


def test_any_other_error_ends_the_launcher_at_once():
    def ask() -> int:
        raise RendezvousConnectionError("etcd timed out")

    with pytest.raises(RendezvousConnectionError):
        PatientCount(ask)()


def test_a_rendezvous_refusing_past_the_patience_is_taken_for_gone():
    error = refused_by_etcd()

    def ask() -> int:
        raise error

    count = PatientCount(ask, patience_s=0.3)
    assert count() == 0
    time.sleep(0.4)
    with pytest.raises(type(error)):
        count()


class Handler:
    def __init__(self, backend: str):
        self.backend = backend

    def get_backend(self) -> str:
        return self.backend

    def num_nodes_waiting(self) -> int:
        return 3


def test_only_an_etcd_handler_is_made_patient_and_only_once(monkeypatch):
    etcd_v2, c10d = Handler("etcd-v2"), Handler("c10d")
    be_patient(etcd_v2)
    be_patient(c10d)
    first = etcd_v2.num_nodes_waiting
    assert isinstance(first, PatientCount) and not isinstance(c10d.num_nodes_waiting, PatientCount)
    be_patient(etcd_v2)
    assert etcd_v2.num_nodes_waiting is first and first() == 3
    monkeypatch.setenv("FLASHCKPT_RDZV_PATIENCE", "0")
    plain = Handler("etcd")
    be_patient(plain)
    assert not isinstance(plain.num_nodes_waiting, PatientCount)
