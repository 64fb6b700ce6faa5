"""What ``/proc`` says of a process of this node: its parent and its state, and its children."""

from __future__ import annotations

import os


def parent_and_state(pid: int) -> tuple[int, str]:
    """(parent pid, state letter: R, S, D, T, ...) of a live process; (0, "") if it is gone
    or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return 0, ""
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 2 or fields[0] in ("Z", "X"):
        return 0, ""
    try:
        return int(fields[1]), fields[0]
    except ValueError:
        return 0, ""


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_and_state(int(entry))[0] == pid:
            out.append(int(entry))
    return out
