"""The configuration reference (``docs/CONFIG.md``) lists every ``FLASHCKPT_*`` setting the
code reads: the names spelled out in the package, the agent, the tiers and the examples, the
ones ``config.setting*`` builds from a lower-case name, and the hang detector's budgets."""

from __future__ import annotations

import re
from pathlib import Path

from flashckpt.faults.hang import HangPolicy

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("flashckpt", "agent", "storage_tiers", "examples")
SPELLED = re.compile(r"FLASHCKPT_[A-Z0-9_]+")
BUILT = re.compile(r"\b(?:setting(?:_int|_float|_bool)?|_dir)\(\s*\"([a-z0-9_]+)\"")


def read_by_the_code() -> dict[str, str]:
    """Each setting's name -> a file that reads it."""
    found: dict[str, str] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".sh", ".sbatch", ".yaml") or "_pb2" in path.name:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            names = [n for n in SPELLED.findall(text) if not n.endswith("_")]  # not a prefix
            names += [f"FLASHCKPT_{n.upper()}" for n in BUILT.findall(text)]
            for name in names:
                found.setdefault(name, str(path.relative_to(ROOT)))
    for field in HangPolicy.__dataclass_fields__:  # read as f"hang_{name}"
        found.setdefault(f"FLASHCKPT_HANG_{field.upper()}", "flashckpt/faults/hang.py")
    return found


def listed() -> set[str]:
    """The names the reference's tables give: a row's first cell, where ``_KEY``-style
    suffixes after a full name share its prefix (``FLASHCKPT_CONTROLLER_TLS_CERT``, ``_KEY``)."""
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    names: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("| `FLASHCKPT_"):
            continue
        cell = line.split("|")[1]
        full = re.findall(r"`(FLASHCKPT_[A-Z0-9_]+)`", cell)
        names.update(full)
        for suffix in re.findall(r"`(_[A-Z0-9_]+)`", cell):
            names.add(full[0].rsplit("_", 1)[0] + suffix)
    return names


def test_every_setting_the_code_reads_is_in_the_reference():
    found = read_by_the_code()
    missing = {name: where for name, where in found.items() if name not in listed()}
    assert not missing, f"docs/CONFIG.md does not list: {missing}"


def test_the_reference_lists_no_setting_the_code_does_not_read():
    stale = listed() - set(read_by_the_code())
    assert not stale, f"docs/CONFIG.md lists what nothing reads: {sorted(stale)}"


def test_the_scan_finds_settings_each_way_they_are_read():
    found = read_by_the_code()
    assert found["FLASHCKPT_JOB"]  # spelled out
    assert found["FLASHCKPT_CLOSE_TIMEOUT"] == "flashckpt/checkpointer.py"  # built by setting_*
    assert found["FLASHCKPT_SHM_DIR"] and found["FLASHCKPT_HANG_RESTORE"]
    assert "FLASHCKPT_CONTROLLER_TLS_KEY" in listed()  # a `_KEY` after its full name
