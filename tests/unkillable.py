"""Processes that a SIGKILL does not take, made real with the cgroup v1 freezer.

A task in a FROZEN v1 freezer cgroup is held in the kernel (``/proc`` shows it in state D,
uninterruptible sleep) and a SIGKILL stays pending until the cgroup is thawed: what a worker
in a read from a hung NFS server, or in a wedged driver, shows a launcher. ``Freezer(name)``
makes a cgroup of its own (``fc-<name>-<test pid>``), ``freeze(pid)`` moves a process in and
freezes it, ``thaw()`` lets it go, ``close()`` thaws and removes the cgroup; always close it
(a ``with`` block) so that no frozen process outlives its test.

``unavailable()`` says why a test of it must skip (not root, or no v1 freezer mounted), None
where it can run. ``Adopter`` makes this process the reaper of its orphaned descendants
(``PR_SET_CHILD_SUBREAPER``), so that a left-behind process whose parent exited is reaped here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from pathlib import Path

FREEZER = Path("/sys/fs/cgroup/freezer")
PR_SET_CHILD_SUBREAPER = 36


def unavailable() -> str | None:
    """Why a frozen process cannot be made here, None where it can."""
    if os.geteuid() != 0:
        return "freezing a process needs root (the cgroup v1 freezer)"
    if not (FREEZER / "cgroup.procs").exists():
        return f"no cgroup v1 freezer mounted at {FREEZER}"
    probe = FREEZER / f"fc-probe-{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a cgroup in the v1 freezer at {FREEZER}: {exc}"
    return None


def state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z...), "" once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return raw[raw.rfind(")") + 2 :].split()[0]


class Freezer:
    """A v1 freezer cgroup of this test's own."""

    def __init__(self, name: str):
        self.path = FREEZER / f"fc-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        self.pids: list[int] = []

    def freeze(self, pid: int, timeout: float = 10) -> None:
        """Move ``pid`` (every thread of it) in and freeze the cgroup; returns once FROZEN."""
        (self.path / "cgroup.procs").write_text(str(pid))
        self.pids.append(pid)
        self._set("FROZEN", timeout)

    def thaw(self, timeout: float = 10) -> None:
        self._set("THAWED", timeout)

    def _set(self, want: str, timeout: float) -> None:
        (self.path / "freezer.state").write_text(want)
        deadline = time.monotonic() + timeout
        while (self.path / "freezer.state").read_text().strip() != want:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path} not {want} within {timeout}s")
            (self.path / "freezer.state").write_text(want)  # FREEZING: ask again
            time.sleep(0.01)

    def close(self, timeout: float = 10) -> None:
        """Thaw, wait for the cgroup's processes to go (each killed, if it has not died of
        a pending SIGKILL), then remove the cgroup."""
        with contextlib.suppress(OSError):
            self.thaw()
        deadline = time.monotonic() + timeout
        while self._members() and time.monotonic() < deadline:
            for pid in self._members():
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def _members(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def __enter__(self) -> Freezer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Adopter:
    """This process as the reaper of its orphaned descendants while the block lasts; on
    leaving, every orphan it adopted that has exited is reaped (``reaped`` lists them)."""

    def __init__(self) -> None:
        self.reaped: list[int] = []
        self._before: set[int] = set()

    def __enter__(self) -> Adopter:
        self._before = set(_children())
        _subreaper(1)
        return self

    def reap(self, pid: int, timeout: float = 10) -> bool:
        """Wait for adopted ``pid`` to exit and reap it; whether it was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) a child of this process
                return state(pid) == ""
            if done == pid:
                self.reaped.append(pid)
                return True
            time.sleep(0.05)
        return False

    def __exit__(self, *exc: object) -> None:
        _subreaper(0)
        for pid in set(_children()) - self._before:
            if state(pid) == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                    self.reaped.append(pid)


def _subreaper(on: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children() -> list[int]:
    """This process's children, live or zombie, from /proc."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(raw[raw.rfind(")") + 2 :].split()[1]) == me:
            out.append(int(entry))
    return out
