"""The slot protocol: reuse, alternation, growth, readers, ownership, clean-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_python

from flashckpt import Checkpointer, RankBusyError
from flashckpt.format.slot import Slot, SlotState


def headers(ck):
    return [s.header() for s in ck._pair.slots if s is not None]


def test_slots_alternate_and_are_reused(shm_dir):
    t = torch.arange(1000, dtype=torch.float32)
    with Checkpointer(job="alt") as ck:
        ck.restore({"t": t})  # readies the slots off the save path
        for fut in list(ck._prep.pending.values()):
            fut.result()
        inodes = [os.stat(p).st_ino for p in ck._pair.paths[:2]]
        layout = None
        for step in range(6):
            t.fill_(step)
            ck.save(step, {"t": t})
            assert layout is None or ck._layout is layout  # plan cached while structure holds
            layout = ck._layout
        steps = sorted(h.step for h in headers(ck))
        assert steps == [4, 5] and all(h.state == SlotState.READY for h in headers(ck))
        assert [os.stat(p).st_ino for p in ck._pair.paths[:2]] == inodes
        assert sorted(os.listdir(shm_dir / "alt")) == [  # two slots, the owner lock, and
            "rank-0.heartbeat", "rank-0.owner", "rank-0.slot-0", "rank-0.slot-1",
            "rank-0.stacks",  # the heartbeat page and its stack-dump file (hang detection)
        ]  # fmt: skip
    assert not (shm_dir / "alt").exists()  # close() frees the memory


def test_growth_when_state_grows(shm_dir):
    with Checkpointer(job="grow") as ck:
        ck.save(1, {"t": torch.zeros(10)})
        small = ck._pair.slots[0].capacity
        big = torch.arange(3_000_000, dtype=torch.float32)
        ck.save(2, {"t": big})
        ck.save(3, {"t": big * 2})
        assert min(s.capacity for s in ck._pair.slots if s is not None) > small
        out = {"t": torch.zeros(3_000_000)}
        assert ck.restore(out) == 3 and torch.equal(out["t"], big * 2)


def test_writer_never_overwrites_a_slot_being_read_nor_the_newest_snapshot(shm_dir):
    with Checkpointer(job="rd") as ck:
        ck.save(1, {"t": torch.ones(4)})
        ck.save(2, {"t": torch.ones(4) * 2})
        held = next(s for s in ck._pair.slots if s is not None and s.header().step == 1)
        reader = Slot.open_readonly(held.path)  # a reader (the agent) holds the older slot
        assert reader.try_lock(exclusive=False)
        # Step 2 is the newest: writing over it would leave only step 1 if this save died. A
        # spare slot takes step 3, and from then on three slots turn.
        ck.save(3, {"t": torch.ones(4) * 3})
        assert sorted(h.step for h in headers(ck)) == [1, 2, 3]
        ck.save(4, {"t": torch.ones(4) * 4})
        assert held.header().step == 1 and sorted(h.step for h in headers(ck)) == [1, 3, 4]
        other = [Slot.open_readonly(s.path) for s in ck._pair.slots if s and s.header().step == 3]
        assert other[0].try_lock(exclusive=False)  # readers hold all but the newest
        ck.save(5, {"t": torch.ones(4) * 5})
        assert ck.skipped == 1 and sorted(h.step for h in headers(ck)) == [1, 3, 4]
        reader.close()  # closing drops the lock, as a reader's death would
        other[0].close()
        ck.save(6, {"t": torch.ones(4) * 6})
        assert sorted(h.step for h in headers(ck)) == [3, 4, 6]
        restored = {"t": torch.zeros(4)}
        assert ck.restore(restored) == 6 and float(restored["t"][0]) == 6.0


def test_a_reader_holding_an_invalid_slot_sends_the_snapshot_to_the_spare(shm_dir):
    """The agent holds the older slot while it stores it, and the slot breaks meanwhile (its
    header is now invalid, so it sorts first in write order): the spare takes the snapshot."""
    import struct

    with Checkpointer(job="rdbad") as ck:
        ck.save(1, {"t": torch.ones(4)})
        ck.save(2, {"t": torch.ones(4) * 2})
        held = next(s for s in ck._pair.slots if s is not None and s.header().step == 1)
        reader = Slot.open_readonly(held.path)
        assert reader.try_lock(exclusive=False)
        with open(held.path, "r+b") as f:  # the state field: not a state a writer leaves
            f.seek(12)
            f.write(struct.pack("<I", 7))
        ck.save(3, {"t": torch.ones(4) * 3})
        assert ck.skipped == 0
        assert sorted(h.step for s in ck._pair.slots if s is not None and s is not held
                      for h in [s.header()]) == [2, 3]  # fmt: skip
        reader.close()
        restored = {"t": torch.zeros(4)}
        assert ck.restore(restored) == 3 and float(restored["t"][0]) == 3.0


def test_second_live_writer_for_a_rank_is_refused(shm_dir):
    with Checkpointer(job="busy") as ck:
        ck.save(1, {"t": torch.ones(1)})
        code = (
            "import torch; from flashckpt import Checkpointer, RankBusyError\n"
            "try:\n    Checkpointer(job='busy').save(2, {'t': torch.ones(1)})\n"
            "except RankBusyError as e:\n    print('refused:', e)\n"
        )
        out = run_python(code)
        assert f"already saving from pid {os.getpid()}" in out.stdout
    with pytest.raises(RankBusyError):
        a = Checkpointer(job="busy2")
        a.save(1, {"t": torch.ones(1)})
        Checkpointer(job="busy2").save(1, {"t": torch.ones(1)})


def test_wait_from_another_process(shm_dir):
    with Checkpointer(job="w") as ck:
        child = subprocess.Popen(
            [sys.executable, "-c", "from flashckpt import Checkpointer; print(Checkpointer(job='w').wait(7, timeout=30))"],
            stdout=subprocess.PIPE, text=True, env=os.environ,
        )  # fmt: skip
        for step in range(8):
            ck.save(step, {"t": torch.ones(2) * step})
        assert child.communicate(timeout=60)[0].strip() == "7"
        with pytest.raises(TimeoutError, match="step 99 of job .* is not in shared memory"):
            ck.wait(99, timeout=0.1)


def test_corrupt_snapshot_falls_back_to_the_older_one(shm_dir, caplog):
    # 12 MB in three 4 MiB chunks: copied and verified by the restore workers, the path large
    # entries take; the flipped byte is in the last chunk, which the first worker never sees
    n = 3_000_000
    with Checkpointer(job="crc") as ck:
        ck.save(1, {"t": torch.ones(n)})
        ck.save(2, {"t": torch.ones(n) * 2})
        ck._sealer.drain(10)
        newest = next(s for s in ck._pair.slots if s is not None and s.header().step == 2)
        assert newest.header().sealed
        newest.buf[4096 + 3 * 2**20 + 2 * 4 * 2**20] ^= 0xFF  # a byte in chunk 2 of step 2's data
        out = {"t": torch.zeros(n)}
        assert ck.restore(out) == 1 and torch.equal(out["t"], torch.ones(n))
        assert "chunk 2 of 't'" in caplog.text
        assert "crc32c" in caplog.text and "corrupt" in caplog.text


def test_no_room_for_a_spare_slot_skips_the_snapshot_and_training_goes_on(shm_dir, monkeypatch):
    from flashckpt.format.slot import shm_space_error
    from flashckpt.snapshot.slots import SlotPair

    with Checkpointer(job="nospare") as ck:
        ck.save(1, {"t": torch.ones(4)})
        ck.save(2, {"t": torch.ones(4) * 2})
        held = next(s for s in ck._pair.slots if s is not None and s.header().step == 1)
        reader = Slot.open_readonly(held.path)
        assert reader.try_lock(exclusive=False)

        def full(self, capacity):
            raise shm_space_error(self.paths[0], capacity)

        monkeypatch.setattr(SlotPair, "check_space", full)
        ck.save(3, {"t": torch.ones(4) * 3})  # no exception: the snapshot is skipped
        assert ck.skipped == 1 and sorted(h.step for h in headers(ck)) == [1, 2]
        reader.close()
        ck.save(4, {"t": torch.ones(4) * 4})
        assert sorted(h.step for h in headers(ck)) == [2, 4]


def test_each_tier_may_hold_a_slot_and_no_save_is_skipped(shm_dir, run_dir, tmp_path):
    """Two tiers store the job, each one step at its own pace, so each may hold one of the
    rank's slots while the newest is kept: a spare per tier takes the snapshots, and none is
    skipped (a skipped last save would send every rank back a step after a crash)."""
    tiers = [f"file://{tmp_path / name}?every_seconds=3600" for name in ("a", "b")]
    with Checkpointer(*tiers, job="tiers") as ck:
        ck.save(1, {"t": torch.ones(4)})
        for tier in tiers:  # the agent's rounds are over; from now on the throttle holds it
            ck.wait(1, tier=tier, timeout=30)
        ck.save(2, {"t": torch.ones(4) * 2})
        ck.save(3, {"t": torch.ones(4) * 3})
        readers = []
        for step in (2, 3):  # tier a holds step 2's slot, then tier b step 3's
            slot = next(s for s in ck._pair.slots if s and s.header().step == step)
            readers.append(Slot.open_readonly(slot.path))
            assert readers[-1].try_lock(exclusive=False)
            ck.save(step + 2, {"t": torch.ones(4) * (step + 2)})
        assert ck.skipped == 0 and sorted(h.step for h in headers(ck)) == [2, 3, 4, 5]
        ck.save(6, {"t": torch.ones(4) * 6})  # over step 4: neither held nor the newest
        assert ck.skipped == 0 and sorted(h.step for h in headers(ck)) == [2, 3, 5, 6]
        for reader in readers:
            reader.close()
