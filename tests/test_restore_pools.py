"""The threads a restore's blocking work runs on: kept from one restore to the next (a
private event loop's calls on one pool that outlives each loop), and made afresh in a forked
child, whose parent's threads stayed behind (a pool that counted them idle would hang)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import threading

from flashckpt.restore import entry_copy, sources


def _thread_name() -> str:
    return threading.current_thread().name


def test_private_loops_run_blocking_calls_on_one_pool_that_outlives_them():
    names = {sources.run_private(asyncio.to_thread(_thread_name)) for _ in range(20)}
    assert all(n.startswith("flashckpt-tier-io") for n in names)
    assert len(names) <= 2  # the same threads again, not one started a loop
    pool = sources._blocking_pool()
    assert not pool._shutdown  # closing each loop left it running


def test_a_forked_child_gets_pools_of_its_own():
    sources.run_private(asyncio.to_thread(_thread_name))  # both pools have idle threads here
    assert entry_copy._workers().submit(_thread_name).result(timeout=30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch op (libgomp's would hang here), report, leave
        ok = 0
        try:
            name = sources.run_private(asyncio.to_thread(_thread_name))
            worker = entry_copy._workers().submit(_thread_name).result(timeout=30)
            ok = int(
                name.startswith("flashckpt-tier-io") and worker.startswith("flashckpt-restore")
            )
        finally:
            os.write(write, bytes([ok]))
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        assert ready, "the forked child's blocking work hung"
        assert os.read(read, 1) == b"\x01"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
