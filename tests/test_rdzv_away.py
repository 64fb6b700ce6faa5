"""The rendezvous asked with a bound while the workers train (``rdzv_away``): an error or no
answer counts as nobody waiting, a question left unanswered is not asked twice, and the count
comes back with the rendezvous. (With real etcd, killed and restarted under a training job:
``test_control_restart.py``.)"""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from flashckpt.faults.rdzv_away import PatientCount, be_patient


def test_an_error_counts_as_nobody_waiting_until_the_rendezvous_answers_again(caplog):
    answers = [RendezvousConnectionError("etcd is down"), 2]

    def ask() -> int:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    count = PatientCount(ask, wait_s=1)
    assert count() == 0 and count.away_since is not None
    assert "does not answer" in caplog.text and "etcd is down" in caplog.text
    assert count() == 2 and count.away_since is None
    assert "answers again" in caplog.text


def test_no_answer_is_waited_for_a_bound_and_not_asked_twice():
    release, asked = threading.Event(), []

    def ask() -> int:
        asked.append(1)
        release.wait(30)  # a silent host: the read waits out its timeout
        return 1

    count = PatientCount(ask, wait_s=0.2)
    began = time.monotonic()
    assert count() == 0 and count() == 0
    assert time.monotonic() - began < 2 and len(asked) == 1
    release.set()
    assert count() == 1 and len(asked) == 1  # the pending question's answer
    assert count() == 1 and len(asked) == 2


def test_a_handler_is_wrapped_once():
    class Handler:
        def num_nodes_waiting(self) -> int:
            return 3

    handler = Handler()
    be_patient(handler)
    first = handler.num_nodes_waiting
    be_patient(handler)
    assert handler.num_nodes_waiting is first and handler.num_nodes_waiting() == 3


def test_a_rendezvous_away_past_the_patience_is_taken_for_gone():
    """Past ``FLASHCKPT_RDZV_PATIENCE`` the rendezvous's error ends the launcher, as it would
    have at once without the patience (the job ended without this node)."""

    def ask() -> int:
        raise RendezvousConnectionError("nobody serves the rendezvous")

    count = PatientCount(ask, wait_s=1, patience_s=0.3)
    assert count() == 0
    time.sleep(0.4)
    with pytest.raises(RendezvousConnectionError):
        count()


def test_no_patience_leaves_the_handler_as_torchelastic_has_it(monkeypatch):
    class Handler:
        def num_nodes_waiting(self) -> int:
            return 3

    monkeypatch.setenv("FLASHCKPT_RDZV_PATIENCE", "0")
    handler = Handler()
    be_patient(handler)
    assert not isinstance(handler.num_nodes_waiting, PatientCount)
