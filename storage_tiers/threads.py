"""Blocking tier work in a worker thread that a cancelled caller waits for.

``asyncio.to_thread`` lets its caller go on as soon as it is cancelled while the thread runs
on. A put's thread reads the caller's memory (the agent's uploads read a trainer's slot, whose
lock is handed back when the round ends), so a put must not return, cancelled or not, while
its thread may still read: ``in_thread`` waits for the thread before the cancellation goes on,
and sets ``stop`` first so that a long transfer ends at its next piece instead of running on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Stopped(Exception):
    """Raised in a worker thread that saw its ``stop`` set: its caller was cancelled."""


def check(stop: threading.Event | None) -> None:
    """Raise Stopped where ``stop`` is set (call between the pieces of a long transfer)."""
    if stop is not None and stop.is_set():
        raise Stopped("the caller was cancelled; the transfer stopped at a piece boundary")


async def in_thread(
    fn: Callable[..., T], /, *args: Any, stop: threading.Event | None = None, **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)`` in a worker thread. If the caller is cancelled, ``stop`` is set
    and the cancellation waits until the thread has returned: nothing it reads or writes is
    touched after this returns."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if stop is not None:
            stop.set()
        await settled(future)
        raise


async def settled(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` is done, through further cancellations (its caller re-raises)."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # retrieved: what the thread raised once stopped is no news
