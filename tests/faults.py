"""Fault injection for the storm tests: seeded plans, SIGKILLs at chosen phases, and the
processes a storm starts, kills and restarts.

Two sides. In a trainer process, ``kill_at(plan)`` arms a ``KillSwitch`` that SIGKILLs the
process itself at one phase of one step (mid-copy of a save, right after a save, inside the
sealer's checksum, inside ``close()``): a real SIGKILL at a point an outside timer could only
hit by luck. It also reports each save that writes over the newest snapshot, and whether a
reader forced it to. In the test process, ``storm_rng`` draws the plans from a seed that is
printed and can be set with ``FLASHCKPT_STORM_SEED``, ``LineProcess`` runs a child that
reports in lines, and ``Spares`` keeps the next ones started ahead.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SEED_ENV = "FLASHCKPT_STORM_SEED"
DEFAULT_SEED = 20250917

# Phases a trainer can be killed in: the first four by the trainer itself (a KillSwitch), the
# last by the test from outside, after a drawn delay.
MID_COPY, AFTER_SAVE, SEALING, CLOSING, EXTERNAL = (
    "mid_copy", "after_save", "sealing", "closing", "external",
)  # fmt: skip
PHASES = (MID_COPY, AFTER_SAVE, SEALING, CLOSING, EXTERNAL)


def storm_rng(name: str) -> tuple[random.Random, int]:
    """A Random for storm ``name``, seeded from FLASHCKPT_STORM_SEED (or a fixed default, so a
    plain run repeats the same plan); the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get(SEED_ENV) or DEFAULT_SEED)
    print(f"{name}: seed {seed} (replay with {SEED_ENV}={seed})")
    return random.Random(f"{name}-{seed}"), seed


@dataclass(frozen=True)
class KillPlan:
    """Where a trainer dies: ``phase`` at ``step`` (a mid-copy kill: the first save from
    ``step`` on that writes into an empty slot or over the older snapshot, or over any with
    ``over_newest``). ``index`` picks the tensor a mid-copy kill lands in, or how close() is
    cut (0: after ``fraction`` x 0.1 s, 1: between the slot files being removed);
    ``fraction`` is how far into the copy or the checksum it lands. Plain data: it travels
    to the trainer as JSON (``dataclasses.asdict``)."""

    phase: str
    step: int
    index: int = 0
    fraction: float = 0.5
    over_newest: bool = False  # a mid-copy kill may also cut a save over the newest snapshot


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillSwitch:
    """SIGKILLs this process at the plan's phase and step (no plan: never), and reports every
    save that writes over the newest snapshot. The trainer calls ``step(s)`` before
    ``save(s)``, ``saved(s)`` after it, and ``closing()`` before ``close()``; the library's own
    functions are wrapped, never replaced, so everything up to the kill is the real path."""

    def __init__(self, plan: KillPlan | None, report: Callable[[str], None]):
        self.plan = plan or KillPlan(EXTERNAL, step=-1)  # EXTERNAL: nothing fires in here
        self.report = report
        self._step = -1
        self._copies = 0
        self._tries: list[tuple[object, bool]] | None = None
        self._cut_at: int | None = None  # the step whose copy a mid-copy kill cuts

    def install(self) -> KillSwitch:
        from flashckpt.format import slot
        from flashckpt.snapshot import copy_plan, sealer, slots
        from flashckpt.snapshot.flatten import copy_into

        real_acquire, real_try = slots.SlotPair.acquire_for_write, slot.Slot.try_lock

        def try_lock(s, exclusive):  # type: ignore[no-untyped-def]
            got = real_try(s, exclusive)
            if self._tries is not None:
                self._tries.append((s, got))
            return got

        def acquire_for_write(pair, *args):  # type: ignore[no-untyped-def]
            self._tries = []
            try:
                chosen = real_acquire(pair, *args)
            finally:
                tries, self._tries = self._tries, None
            self._chosen(pair, chosen, tries)
            return chosen

        slot.Slot.try_lock = try_lock
        slots.SlotPair.acquire_for_write = acquire_for_write
        if self.plan.phase == MID_COPY:
            real_host_copy = copy_plan.CopyPlan.host_copy

            def host_copy(plan, tensors):  # type: ignore[no-untyped-def]
                if self._step != self._cut_at:
                    return real_host_copy(plan, tensors)
                # Tensor by tensor, as the batched copy lays them down: part of tensor
                # ``index`` lands in the slot, the rest never will.
                for i in plan.batched + plan.one_by_one:
                    dst, src = plan.views[i], tensors[i]
                    if self._copies == self.plan.index:
                        n = int(src.numel() * self.plan.fraction)
                        dst.reshape(-1)[:n].copy_(src.reshape(-1)[:n])
                        kill_self()
                    self._copies += 1
                    copy_into(dst, src)

            copy_plan.CopyPlan.host_copy = host_copy
        elif self.plan.phase == SEALING:
            real_sums = sealer.chunk_checksums

            def chunk_checksums(data, entries, chunk_size, cancel=None):  # type: ignore[no-untyped-def]
                entries = list(entries)
                if self._step >= self.plan.step:
                    total = sum(len(e.chunk_ranges(chunk_size)) for e in entries)
                    cancel = _Tripwire(cancel, int(total * self.plan.fraction))
                return real_sums(data, entries, chunk_size, cancel)

            sealer.chunk_checksums = chunk_checksums
        elif self.plan.phase == CLOSING and self.plan.index == 1:
            real_close = slot.Slot.close
            closes = []

            def close(s):  # type: ignore[no-untyped-def]
                if self._step == _CLOSING:
                    closes.append(s.path)
                    if len(closes) == 2:  # the first slot file is gone, the second is not
                        kill_self()
                return real_close(s)

            slot.Slot.close = close
        return self

    def _chosen(self, pair, chosen, tries: list[tuple[object, bool]]) -> None:  # type: ignore[no-untyped-def]
        """Report a save about to overwrite the newest snapshot: ``held`` when every other slot
        was tried and refused (a reader holds it), ``free`` when one could have been taken
        instead. Pick the save a mid-copy kill cuts: from the plan's step on, the first one
        into an empty slot or over the older snapshot (or any, with ``over_newest``)."""
        ready = pair.ready()
        over_newest = chosen is not None and bool(ready) and ready[0] is chosen
        if over_newest:
            others = [s for s in pair.slots if s is not None and s is not chosen]
            refused = all(any(t is s and not got for t, got in tries) for s in others)
            self.report(f"over-newest {self._step} {'held' if refused else 'free'}")
        if (
            self.plan.phase == MID_COPY and self._cut_at is None and chosen is not None
            and self._step >= self.plan.step and (self.plan.over_newest or not over_newest)
        ):  # fmt: skip
            self._cut_at = self._step

    def step(self, step: int) -> None:
        self._step = step

    def saved(self, step: int) -> None:
        if self.plan.phase == AFTER_SAVE and step >= self.plan.step:
            kill_self()

    def closing(self) -> None:
        if self.plan.phase != CLOSING:
            return
        self._step = _CLOSING
        if self.plan.index == 0:
            timer = threading.Timer(0.1 * self.plan.fraction, kill_self)
            timer.daemon = True
            timer.start()

    @property
    def may_miss(self) -> bool:
        """True unless the plan's kill must have come before close() returned (a timed cut of
        close() may come after it)."""
        return self.plan.phase == EXTERNAL or (self.plan.phase == CLOSING and self.plan.index == 0)


_CLOSING = -2


class _Tripwire:
    """Stands in for the sealer's cancel event: the checksum loop asks it once per chunk, and
    it SIGKILLs the process at chunk ``at``."""

    def __init__(self, cancel: threading.Event | None, at: int):
        self.cancel, self.at, self.asked = cancel, at, 0

    def is_set(self) -> bool:
        if self.asked >= self.at:
            kill_self()
        self.asked += 1
        return self.cancel is not None and self.cancel.is_set()


def kill_at(plan: KillPlan | None, report: Callable[[str], None] = print) -> KillSwitch:
    """Arm a KillSwitch for ``plan`` in this process (None, or an EXTERNAL plan: report only)."""
    return KillSwitch(plan, report).install()


# ---- the test process's side --------------------------------------------------------------


def poll(predicate: Callable[[], object], timeout: float, interval: float = 0.002) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def is_dead(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it holds no files or locks any more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def sigkill(pid: int, timeout: float = 10) -> None:
    """SIGKILL ``pid`` and return once it is dead."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not is_dead(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still alive {timeout}s after SIGKILL")
        time.sleep(0.002)


class LineProcess:
    """A child process that reports progress as stdout lines, read by a thread into a queue.

    Started ahead of use (it imports torch and waits for its first stdin line), so a storm
    spends its time on kills and restarts rather than on imports."""

    def __init__(self, argv: list[str], env: dict | None = None, log: Path | None = None):
        self.log = log  # where its stderr goes (None: kept in ``stderr``)
        err = open(log, "ab") if log else subprocess.PIPE  # noqa: SIM115  (handed to the child)
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
        if log:
            err.close()
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []  # every line taken from the queue, in order
        self._err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True)]
        if self.proc.stderr is not None:
            self._readers.append(threading.Thread(target=self._read_err, daemon=True))
        for t in self._readers:
            t.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self._err.append(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def expect(self, prefix: str, timeout: float = 60) -> str:
        """The next line starting with ``prefix`` (the lines before it are kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"pid {self.pid}: no line {prefix!r} after {timeout}s; last lines "
                    f"{self.seen[-5:]}"
                ) from None
            if line is None:
                self.lines.put(None)  # stay at the end for later calls
                self.proc.wait()
                raise AssertionError(
                    f"pid {self.pid} exited ({self.proc.returncode}) before printing {prefix!r}; "
                    f"last lines {self.seen[-5:]}; stderr:\n{self.stderr[-3000:]}"
                )
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def drain(self) -> list[str]:
        """Take every line printed so far; ``seen``."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return self.seen
            if line is None:
                self.lines.put(None)
                return self.seen
            self.seen.append(line)

    def finish(self, timeout: float = 60) -> int:
        """Wait for the exit and for all its output; the return code."""
        self.proc.wait(timeout)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        for t in self._readers:
            t.join(timeout)
        self.drain()
        return self.proc.returncode

    def close(self) -> None:
        """Kill it if it still runs (a spare never used, or a test that failed midway)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


class Spares:
    """Processes started ahead and kept waiting for their first stdin line: ``take()`` hands
    out one that has printed ``ready`` and starts replacements (each costs a torch import,
    so no more than will be used)."""

    def __init__(self, start: Callable[[], LineProcess], depth: int = 2):
        self._start = start
        self._waiting = [start() for _ in range(depth)]
        self.taken: list[LineProcess] = []

    def take(self, more: int, timeout: float = 120) -> LineProcess:
        """A ready process; ``more`` is how many the caller may still take after this one."""
        proc = self._waiting.pop(0) if self._waiting else self._start()
        if len(self._waiting) < min(2, more):
            self._waiting.append(self._start())
        proc.expect("ready", timeout)
        self.taken.append(proc)
        return proc

    def close(self) -> None:
        """Kill whatever still runs, spares and taken ones alike."""
        for proc in self._waiting + self.taken:
            proc.close()
