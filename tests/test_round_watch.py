"""``inprocess.RoundWatch``: a rank's process group is aborted from outside the training thread
once the job's round has moved on (what releases a NCCL collective blocked on a dead peer),
and only then; and ``FLASHCKPT_RECOVERY_WATCH`` picks where it runs."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist
from conftest import wait_for

from flashckpt.errors import ConfigError
from flashckpt.faults.inprocess import RoundWatch, watch_setting

KEY = "flashckpt/ns/round"


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    master.set(KEY, "3")
    return master


def test_the_group_is_aborted_once_the_round_moves_on(store):
    calls = []
    watch = RoundWatch(store, KEY, 3, lambda: calls.append(time.monotonic()), interval=0.01)
    watch.start()
    time.sleep(0.1)
    assert calls == []  # the round is still 3
    moved = time.monotonic()
    store.set(KEY, "4")
    wait_for(lambda: calls, 5, what="the abort")
    assert calls[0] - moved < 1.0
    assert watch.stop() is True and len(calls) == 1


def test_a_round_that_ends_normally_aborts_nothing(store):
    calls = []
    watch = RoundWatch(store, KEY, 3, lambda: calls.append(1), interval=0.01)
    watch.start()
    time.sleep(0.05)
    assert watch.stop() is False and not watch.is_alive()
    store.set(KEY, "4")
    time.sleep(0.05)
    assert calls == []


def test_an_abort_that_fails_is_logged_and_counts_as_done(store, caplog):
    def abort():
        raise RuntimeError("backend cannot abort")

    watch = RoundWatch(store, KEY, 2, abort, interval=0.01)  # the round is past 2 already
    watch.start()
    wait_for(lambda: not watch.is_alive(), 5, what="the watch to end")
    assert watch.stop() is True
    assert "backend cannot abort" in caplog.text


def test_a_store_that_goes_away_ends_the_watch():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=1))  # fmt: skip
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                           timeout=datetime.timedelta(seconds=1))  # fmt: skip
    client.set(KEY, "1")
    calls = []
    watch = RoundWatch(client, KEY, 1, lambda: calls.append(1), interval=0.01)
    watch.start()
    del master
    wait_for(lambda: not watch.is_alive(), 10, what="the watch to end")
    assert calls == [] and watch.stop() is False


@pytest.mark.parametrize(("value", "expected"),
                         [("auto", None), ("AUTO", None), ("1", True), ("on", True),
                          ("off", False), ("0", False)])  # fmt: skip
def test_the_watch_setting(monkeypatch, value, expected):
    monkeypatch.setenv("FLASHCKPT_RECOVERY_WATCH", value)
    assert watch_setting() is expected


def test_the_watch_is_auto_by_default_and_a_bad_setting_names_itself(monkeypatch):
    monkeypatch.delenv("FLASHCKPT_RECOVERY_WATCH", raising=False)
    assert watch_setting() is None
    monkeypatch.setenv("FLASHCKPT_RECOVERY_WATCH", "sometimes")
    with pytest.raises(ConfigError, match="FLASHCKPT_RECOVERY_WATCH"):
        watch_setting()
