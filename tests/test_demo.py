"""The README's demo: a flashckpt-run job survives a SIGKILLed rank, a hung rank and a lost node
with bit-identical results, and ends by drawing their timeline as a page, which headless
Chromium loads: the three faults appear as marks at their times, and the effective training
time shown is the text report's."""

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import browser
import pytest
from conftest import ROOT

from flashckpt.faults.events import read_events

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_resumes_bit_exact_and_draws_its_timeline(shm_dir, run_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting at step 30 (restored step 29)" in out.stdout
    assert "starting at step 20 (restored step 19)" in out.stdout  # the hung rank's run
    assert "from file://" in out.stdout  # the lost node's run came back from the disk tier
    assert "identical bit for bit to the undisturbed run" in out.stdout
    page = Path(re.search(r"^timeline page: (.+)$", out.stdout, re.M).group(1))
    text = re.search(r"effective training time (\d+\.\d%)", out.stdout).group(1)
    jobs = {kind: next(run_dir.glob(f"demo-{kind}-*.events.jsonl")) for kind in
            ("crash", "hang", "node")}  # fmt: skip
    logs = {kind: read_events(path) for kind, path in jobs.items()}
    spans = {kind: [e["time"] for e in evs] for kind, evs in logs.items()}

    def first(job: str, kind: str, skip: int = 0) -> dict:
        return [e for e in logs[job] if e["kind"] == kind][skip]

    chromium, why = browser.find()
    if chromium is None:
        pytest.skip(f"the demo passed; its page was not loaded in a browser: {why}")
    loaded = browser.load(chromium, page, tmp_path / "report.png", size="1280,720")
    assert loaded.console == []  # no error, no message at all: the page runs no script
    assert loaded.screenshot.stat().st_size > 20_000  # a drawn page, not a blank one
    assert f'<div class="big" id="effective">{text}</div>' in loaded.dom
    svg = ET.fromstring(re.search(r"<svg.*</svg>", loaded.dom, re.S).group(0))
    marks = [(g.get("data-kind"), float(g.get("data-time"))) for g in svg.iter(f"{SVG}g")
             if g.get("class") == "fault"]  # fmt: skip
    assert [kind for kind, _ in marks] == ["exit", "hang", "node"], marks
    for (kind, at), job in zip(marks, ("crash", "hang", "node"), strict=True):
        assert min(spans[job]) <= at <= max(spans[job]), (kind, at, job)  # within its own run
    exited, hung = first("crash", "worker_exited"), first("hang", "hang_detected")
    assert exited["time"] - 2 <= marks[0][1] <= exited["time"]  # the kill, before its exit seen
    assert marks[1][1] == pytest.approx(hung["time"] - hung["silent_s"], abs=0.01)  # last beat
    relaunched = first("node", "launcher_started", skip=1)["time"]
    stored = [e["time"] for e in logs["node"] if e["kind"] == "tier_committed"
              and e["time"] < relaunched and e["step"] == 44]  # fmt: skip
    assert stored and stored[0] - 0.01 <= marks[2][1] < relaunched  # after step 44 was stored
    commits = [ln for ln in svg.iter(f"{SVG}line") if ln.get("class") == "commit"]
    assert commits and "committed at" in commits[-1].find(f"{SVG}title").text  # the tier's lane
    if target := os.environ.get("FLASHCKPT_SCREENSHOT_TO"):
        shutil.copyfile(loaded.screenshot, target)  # the README's picture, made here
