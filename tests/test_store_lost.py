"""A rank whose recovery store goes away (its host lost, the network cut) while it joins a
round: it looks for the store again for as long as the round's deadline (the store may only be
restarting), then gives up on in-process recovery with ``EXIT_GAVE_UP`` and says why, so that
its launcher restarts every worker, instead of a traceback its launcher would take for a lost
rank and hand to a standby."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import torch.distributed as dist
from ports import free_port

from flashckpt.faults.inprocess import EXIT_GAVE_UP, NAMESPACE_ENV, STORE_ENV

RANK = """
import flashckpt
flashckpt.run_recoverable(lambda: None, backend="gloo")
"""


def test_a_rank_whose_store_goes_away_while_it_joins_gives_up_and_says_why(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))  # fmt: skip
    events = tmp_path / "events.jsonl"
    env = {**os.environ, STORE_ENV: f"127.0.0.1:{port}", NAMESPACE_ENV: "ns", "RANK": "0",
           "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "FLASHCKPT_EVENTS": str(events),
           "FLASHCKPT_RECOVERY_DEADLINE": "8", "FLASHCKPT_RUN_DIR": str(tmp_path / "run"),
           "FLASHCKPT_SHM_DIR": str(tmp_path / "shm")}  # fmt: skip
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30  # rank 0 waits in round 0 for rank 1, who never comes
        while not store.check(["flashckpt/ns/round-0/arrived"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.check(["flashckpt/ns/round-0/arrived"]), rank.stderr and rank.poll()
        del store  # the store's host is gone: its connections close
        gone = time.monotonic()
        code = rank.wait(60)  # it looks for the store again as long as the round's deadline
        waited = time.monotonic() - gone
    finally:
        rank.kill()
    err = rank.stderr.read()
    assert code == EXIT_GAVE_UP, err[-2000:]
    assert waited < 8 + 10, waited
    assert "the recovery store cannot be reached" in err, err[-2000:]
    gave_up = [json.loads(line) for line in events.read_text().splitlines()
               if '"inprocess_gave_up"' in line]  # fmt: skip
    assert gave_up and "recovery store cannot be reached" in gave_up[0]["reason"], gave_up
