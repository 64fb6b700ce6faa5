"""``round_watch.RoundWatch``: a rank's process group is aborted from outside the training thread
once the job's round has moved on (what releases a NCCL collective blocked on a dead peer),
and only then; and ``FLASHCKPT_RECOVERY_WATCH`` picks where it runs."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from conftest import wait_for

from flashckpt.errors import ConfigError
from flashckpt.faults.inprocess import watch_setting
from flashckpt.faults.round_watch import NodeRound, RoundWatch, StoreRound, abort_all_groups

NS = "ns"
OVER = "flashckpt/ns/round-3/over"


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    master.set("flashckpt/ns/round", "3")
    return master


@pytest.fixture(params=["node-file", "store"])
def source(request, store, tmp_path):
    """Where a rank learns that its round is over: the node's round file its launcher relays
    (one store waiter per node), or the store itself (no launcher)."""
    if request.param == "node-file":
        path = tmp_path / "job.recovery-round"
        path.write_text("3")
        return NodeRound(str(path)), lambda r: path.write_text(str(r))

    def move(r: int) -> None:
        store.set(OVER, str(r))
        store.set("flashckpt/ns/round", str(r))

    return StoreRound(store, NS, slice_s=0.2), move


def test_the_groups_are_aborted_once_the_round_moves_on(source):
    where, move = source
    calls = []
    watch = RoundWatch(where, 3, lambda: calls.append(time.monotonic()))
    watch.start()
    time.sleep(0.3)
    assert calls == []  # the round is still 3
    moved = time.monotonic()
    move(4)
    wait_for(lambda: calls, 5, what="the abort")
    assert calls[0] - moved < 3.0  # a few of its 0.2 s polls, even on a loaded machine
    assert watch.stop() is True and len(calls) == 1


def test_a_round_that_does_not_form_by_its_deadline_is_aborted_on_every_backend(source):
    """The watch a forming round runs (its process group made, its first barrier): a rank
    that died after arriving cannot keep the others there past the deadline."""
    where, move = source
    calls = []
    began = time.monotonic()
    watch = RoundWatch(where, 3, lambda: calls.append(time.monotonic()), deadline=0.4)
    watch.start()
    wait_for(lambda: calls, 5, what="the abort at the deadline")
    assert 0.35 < calls[0] - began < 3.0  # at the deadline, not before; late only by load
    assert watch.stop() is True and len(calls) == 1
    formed = RoundWatch(where, 3, lambda: calls.append(1), deadline=0.4)
    formed.start()
    assert formed.stop() is False  # formed in time: nothing aborted
    time.sleep(0.6)
    assert len(calls) == 1


def test_a_round_that_ends_normally_aborts_nothing(source):
    where, move = source
    calls = []
    watch = RoundWatch(where, 3, lambda: calls.append(1))
    watch.start()
    time.sleep(0.05)
    assert watch.stop() is False
    move(4)
    time.sleep(0.5)
    assert calls == [] and not watch.is_alive()


def test_an_abort_that_fails_is_logged_and_counts_as_done(source, caplog):
    where, move = source

    def abort():
        raise RuntimeError("backend cannot abort")

    move(4)
    watch = RoundWatch(where, 3, abort)
    watch.start()
    wait_for(lambda: not watch.is_alive(), 5, what="the watch to end")
    assert watch.stop() is True
    assert "backend cannot abort" in caplog.text


def test_a_store_blip_does_not_end_the_watch(store):
    """A failed wait (the store restarting, a dropped connection) is waited out, not taken
    as the end of watching: the round moving on later still aborts the groups."""

    class Blipping:
        def __init__(self):
            self.failures = 3

        def wait(self, keys, timeout):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("Connection reset by peer")
            return store.wait(keys, timeout)

        def get(self, key):
            return store.get(key)

    blip = Blipping()
    calls = []
    watch = RoundWatch(StoreRound(blip, NS, slice_s=0.2), 3, lambda: calls.append(1))
    watch.start()
    wait_for(lambda: blip.failures == 0, 5, what="the blips")
    store.set(OVER, "4")
    wait_for(lambda: calls, 5, what="the abort after the blips")
    assert watch.stop() is True


def test_abort_all_groups_aborts_every_group_newest_first(monkeypatch, caplog):
    """Subgroups (DeviceMesh, FSDP, TP/PP, DeepSpeed's) hold communicators of their own; a
    survivor blocked in one is released only if it is aborted too. Under NCCL that is
    ncclCommAbort, which no CPU machine has (gloo's abort closes nothing): the groups here
    stand in for NCCL's, and the order, the error handling and the bookkeeping are checked."""
    from torch.distributed import distributed_c10d as c10d

    aborted = []

    class Group:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def abort(self):
            aborted.append(self.name)
            if self.fails:
                raise RuntimeError("cannot abort")

    groups = {Group("0"): "0", Group("1", fails=True): "1", Group("2"): "2"}
    monkeypatch.setattr(c10d, "_pg_names", groups)  # what _world.pg_names returns
    with caplog.at_level("DEBUG", logger="flashckpt.faults.round_watch"):
        abort_all_groups()
    assert aborted == ["2", "1", "0"]  # newest first, one failing does not stop the others
    assert "cannot abort" in caplog.text


def test_abort_all_groups_over_real_groups_leaves_them_to_destroy(tmp_path):
    """With real gloo groups (a default group and a ``new_group``), every line runs and the
    training thread's destroy_process_group still removes them afterwards."""
    script = tmp_path / "groups.py"
    script.write_text(GROUPS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2", "0"], out.stdout


GROUPS = """
import os, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from flashckpt.faults.round_watch import abort_all_groups
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
sub = dist.new_group([0])
print(len(c10d._world.pg_names))
abort_all_groups()
dist.destroy_process_group()
print(len(c10d._world.pg_names))
"""


@pytest.mark.parametrize(("value", "expected"),
                         [("auto", True), ("AUTO", True), ("1", True), ("on", True),
                          ("off", False), ("0", False)])  # fmt: skip
def test_the_watch_setting(monkeypatch, value, expected):
    monkeypatch.setenv("FLASHCKPT_RECOVERY_WATCH", value)
    assert watch_setting() is expected


def test_the_watch_is_on_by_default_and_a_bad_setting_names_itself(monkeypatch):
    monkeypatch.delenv("FLASHCKPT_RECOVERY_WATCH", raising=False)
    assert watch_setting() is True
    monkeypatch.setenv("FLASHCKPT_RECOVERY_WATCH", "sometimes")
    with pytest.raises(ConfigError, match="FLASHCKPT_RECOVERY_WATCH"):
        watch_setting()
