"""Headless Chromium for the tests: load a local page, take its screenshot, read back the DOM
it parsed and the console messages it logged. Chromium comes from the system's packages
(Debian: ``apt-get install chromium``); where it is missing, ``find`` says how to get it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# No network (this machine's is closed), no sandbox (tests may run as root), no GPU.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]  # fmt: skip


def find() -> tuple[str | None, str]:
    """Chromium's path, or None and why (with how to install it)."""
    for name in (os.environ.get("FLASHCKPT_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path, ""
    return None, ("headless Chromium is not installed (Debian: apt-get install chromium; "
                  "or point FLASHCKPT_CHROMIUM at one)")  # fmt: skip


@dataclass
class Loaded:
    dom: str  # the document as Chromium parsed it
    console: list[str]  # the console messages it logged (errors among them)
    screenshot: Path


def load(chromium: str, page: Path, screenshot: Path, size: str = "1280,800") -> Loaded:
    """Load ``page`` twice: once for its screenshot and console, once for its DOM."""
    with tempfile.TemporaryDirectory(prefix="fc-chromium-") as profile:
        common = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
        shot = subprocess.run(
            [*common, "--enable-logging=stderr", "--v=0", f"--screenshot={screenshot}",
             page.as_uri()], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    if shot.returncode != 0 or dom.returncode != 0:
        raise RuntimeError(f"chromium failed: {shot.stderr[-2000:]}{dom.stderr[-2000:]}")
    console = [line for line in shot.stderr.splitlines() if ":CONSOLE" in line]
    return Loaded(dom.stdout, console, screenshot)
