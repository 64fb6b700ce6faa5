"""The scale harness at 64 nodes: one real controller, 64 simulated agents on their own gRPC
connections, the benchmark's fault schedule (silent nodes, a dead worker, a hung worker, a
rack of half the nodes lost at once), and the controller's answers checked against the targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.serial  # the controller's CPU and latencies, by the clock
TIMEOUT = 2.0


def test_64_nodes_through_the_fault_schedule(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--nodes", "64",
         "--node-timeout", str(TIMEOUT), "--json", str(out), "--keep", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (row,) = json.loads(out.read_text())
    # Every silenced node (8, then a 32-node rack: half the job) is detected once past its
    # timeout, and no node that kept reporting is.
    assert row["silenced"] == 8 + 32 and row["detected"] == row["silenced"], row
    assert row["missed"] == 0 and row["false_detections"] == 0, row
    assert TIMEOUT <= row["detect_p50_s"] <= row["detect_p99_s"] <= TIMEOUT + 1, row
    # Four detections (silent nodes, dead worker, hang, rack) each reached every node still
    # reporting, pushed over its stream well before its next report was due.
    assert row["detections_with_kills"] == 4 and row["undelivered"] == 0, row
    assert row["delivery_max_s"] < 1.0, row
    # The three commit windows became global commits within a report interval or so.
    assert row["commits_recorded"] == 3 and row["commit_lag_max_s"] < 2.0, row
    assert row["reports"] > 0 and row["errors"] == [], row
    assert 0 < row["controller_cores"] < 1 and 0 < row["controller_rss_mib"] < 1024, row
