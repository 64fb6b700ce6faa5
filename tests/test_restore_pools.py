"""The threads a restore's blocking work runs on: kept from one restore to the next (a
private event loop's calls on one pool that outlives each loop), and made afresh in a forked
child, whose parent's threads stayed behind (a pool that counted them idle would hang)."""

from __future__ import annotations

import asyncio
import threading
import time

from conftest import in_forked_child

from flashckpt.restore import entry_copy, sources


def _thread_name() -> str:
    return threading.current_thread().name


def test_private_loops_run_blocking_calls_on_one_pool_that_outlives_them():
    first = sources.run_private(asyncio.to_thread(_thread_name))
    assert first.startswith("flashckpt-tier-io")
    kept = {t.name for t in threading.enumerate() if t.name.startswith("flashckpt-tier-io")}
    names = {sources.run_private(asyncio.to_thread(_thread_name)) for _ in range(20)}
    assert names <= kept  # threads the pool had already: none started for a loop
    pool = sources._blocking_pool()
    assert not pool._shutdown  # closing each loop left it running


def test_the_kept_pool_never_grows():
    """Its threads are started with it: many blocking calls at once start no more."""
    sources.run_private(asyncio.to_thread(_thread_name))
    before = [t for t in threading.enumerate() if t.name.startswith("flashckpt-tier-io")]

    async def many() -> None:
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.01) for _ in range(40)))

    sources.run_private(many())
    after = [t for t in threading.enumerate() if t.name.startswith("flashckpt-tier-io")]
    assert before and after == before


def test_a_forked_child_gets_pools_of_its_own():
    sources.run_private(asyncio.to_thread(_thread_name))  # both pools have idle threads here
    assert entry_copy._workers().submit(_thread_name).result(timeout=30)

    def child() -> bool:
        name = sources.run_private(asyncio.to_thread(_thread_name))
        worker = entry_copy._workers().submit(_thread_name).result(timeout=30)
        return name.startswith("flashckpt-tier-io") and worker.startswith("flashckpt-restore")

    assert in_forked_child(child)
