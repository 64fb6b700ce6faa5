"""``flashckpt report --html/--svg``: the timeline drawn from the event logs. Faults are marked
at their times with their node and ranks, each recovery is split into its phases with the path
taken and the restore's source, each tier shows its commits, lag and outages, the headline's
effective training time is the text report's, and a week of events stays drawable."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from flashckpt.cli import report_page, report_svg
from flashckpt.faults import timeline
from flashckpt.faults.report import render, summarize

T0 = 1_700_000_000.0
SVG = "{http://www.w3.org/2000/svg}"


def events(*rows: tuple) -> list[dict]:
    return [
        {"time": T0 + t, "kind": kind, "node": node, **fields} for t, kind, node, fields in rows
    ]


def night() -> list[dict]:
    """Two nodes: a killed rank (restart, from memory), a hang (killed, restart), node1 lost
    whole and started again (its ranks from a peer), one tier failing for a while."""
    rows = [(0.0, "launcher_started", n, {}) for n in ("node0", "node1")]
    rows += [(1.0 + s, "tier_committed", "node0", {"tier": "file:///nvme", "step": s,
                                                    "seconds": 0.1, "bytes": 2**20})
             for s in range(0, 30)]  # fmt: skip
    rows += [
        (10.0, "worker_exited", "node1", {"rank": 3, "worker_pid": 11, "step": 9, "silent_s": 0.1}),
        (13.0, "restored", "node0", {"rank": 0, "step": 9, "seconds": 0.2, "source": "shared memory"}),
        (13.1, "restored", "node1", {"rank": 3, "step": 9, "seconds": 0.3, "source": "shared memory"}),
        (13.5, "stepped", "node1", {"rank": 3, "step": 10}),
        (20.0, "hang_detected", "node0", {"rank": 1, "worker_pid": 12, "step": 19, "silent_s": 3.0}),
        (20.4, "killed", "node0", {"rank": 1, "worker_pid": 12}),
        (24.0, "restored", "node0", {"rank": 1, "step": 19, "seconds": 0.2, "source": "shared memory"}),
        (24.2, "stepped", "node0", {"rank": 1, "step": 20}),
        (40.0, "tier_failed", "node0", {"tier": "s3://bucket/run", "error": "EndpointConnectionError"}),
        (50.0, "tier_committed", "node0", {"tier": "s3://bucket/run", "step": 26, "seconds": 2.0,
                                           "bytes": 2**30}),
        (60.0, "launcher_started", "node1", {}),  # its last launcher never exited
        (66.0, "restored", "node1", {"rank": 2, "step": 29,
                                     "seconds": 0.5, "source": "peer node0 (10.0.0.5:1) memory"}),
        (66.2, "restored", "node0", {"rank": 0, "step": 29, "seconds": 0.1, "source": "shared memory"}),
        (66.5, "stepped", "node1", {"rank": 2, "step": 30}),
        (90.0, "closed", "node0", {"rank": 0, "save_stall_s": 0.4, "step_s": 0.5, "saves": 60}),
        (90.0, "launcher_exited", "node0", {}),
        (90.0, "launcher_exited", "node1", {}),
    ]  # fmt: skip
    rows.append((55.0, "worker_started", "node1", {"rank": 2}))  # node1's last sign of life
    return events(*rows)


def test_a_launcher_started_again_where_the_last_never_exited_is_a_lost_node():
    report = summarize(night())
    kinds = [(f.kind, f.node) for f in report.failures]
    assert kinds == [("exit", "node1"), ("hang", "node0"), ("node", "node1")]
    lost = report.failures[2]
    assert lost.detect_s == pytest.approx(5.0) and lost.from_replica
    assert lost.restored_step == 29


def test_the_timeline_splits_each_recovery_into_its_phases_and_marks_where_it_restored_from():
    evs = night()
    report = summarize(evs)
    tl = timeline.build(evs, report)
    paths = [(r.failure.kind, r.path, r.source) for r in tl.recoveries]
    assert paths == [("exit", "restart", "own memory"), ("hang", "restart", "own memory"),
                     ("node", "node replaced", "peer")]  # fmt: skip
    hang = tl.recoveries[1]
    names = [p.name for p in hang.phases]
    assert names == ["detect", "decide", "restart", "restore", "first step", "recompute"]
    assert hang.phases[0].start == pytest.approx(T0 + 17.0)  # its last heartbeat
    assert hang.phases[1].end == pytest.approx(T0 + 20.4)  # the kill, after its stacks
    # The phases follow one another and add up to what the text report counts lost.
    lost = sum(p.end - p.start for r in tl.recoveries for p in r.phases) + report.save_stall_s
    assert lost == pytest.approx(report.lost_s())
    for r in tl.recoveries:
        assert all(a.end == pytest.approx(b.start) for a, b in itertools.pairwise(r.phases))
    (nvme, s3) = tl.tiers
    assert nvme.tier == "file:///nvme" and len(nvme.commits) == 30 and not nvme.outages
    assert s3.outages == [(T0 + 40.0, T0 + 50.0, "EndpointConnectionError")]
    assert s3.commits[0].lag == 29 - 26  # the newest step saved by then was 29


def test_the_page_and_the_image_show_every_fault_at_its_time_and_the_text_reports_figure():
    evs = night()
    report = summarize(evs)
    tl = timeline.build(evs, report)
    page = report_page.render(tl, report)
    figure = re.search(r"effective training time (\d+\.\d)%", render(report)).group(1)
    assert f'id="effective">{figure}%<' in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )  # nothing fetched, nothing run
    svg = report_svg.draw(tl, "night")
    root = ET.fromstring(svg)  # a well-formed standalone image
    faults = root.findall(f".//{SVG}g[@class='fault']")
    got = [(g.get("data-kind"), g.get("data-node"), round(float(g.get("data-time")) - T0, 1))
           for g in faults]  # fmt: skip
    assert got == [("exit", "node1", 9.9), ("hang", "node0", 17.0), ("node", "node1", 55.0)]
    assert "hang on node0, rank(s) [1]" in faults[1].find(f"{SVG}title").text
    bars = root.findall(f".//{SVG}g[@class='recovery']")
    assert [b.get("data-path") for b in bars] == ["restart", "restart", "node replaced"]
    outage = [t.text for t in root.iter(f"{SVG}title") if t.text.startswith("failing from")]
    assert len(outage) == 1 and "EndpointConnectionError" in outage[0]


def test_a_week_of_events_is_thinned_to_what_can_be_drawn():
    week = 7 * 86400
    rows = [(float(s), "tier_committed", "node0", {"tier": "file:///nvme", "step": s, "seconds":
             0.1, "bytes": 1}) for s in range(0, week, 6)]  # fmt: skip
    rows += [(float(week), "launcher_exited", "node0", {})]
    evs = events(*rows)
    report = summarize(evs)
    tl = timeline.build(evs, report)
    svg = report_svg.draw(tl, "a week")
    assert len(svg) < 2_000_000
    root = ET.fromstring(svg)
    commits = [ln for ln in root.iter(f"{SVG}line") if ln.get("class") == "commit"]
    assert 0 < len(commits) <= report_svg.PLOT
    assert "the last of" in commits[0].find(f"{SVG}title").text
    thinned = timeline.thin([(float(t), t) for t in range(1000)], 0.0, 1000.0, 10)
    assert [(v, n) for _, v, n in thinned] == [(99 + 100 * k, 100) for k in range(10)]


def test_the_command_writes_both_files_and_says_what_it_needs(tmp_path):
    log = tmp_path / "node0.events.jsonl"
    import json

    log.write_text("".join(json.dumps(e) + "\n" for e in night()))
    html, svg = tmp_path / "page.html", tmp_path / "timeline.svg"
    cli = [sys.executable, "-m", "flashckpt.cli"]
    out = subprocess.run([*cli, "report", str(log), "--html", str(html), "--svg", str(svg)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"wrote the job's timeline page to {html}" in out.stdout
    assert html.read_text().startswith("<!DOCTYPE html>") and ET.parse(svg).getroot() is not None
    projected = subprocess.run([*cli, "report", str(log), "--project", "--html", str(html)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert projected.returncode == 0 and 'id="projection"' in html.read_text()
    bare = subprocess.run([*cli, "report", "--project", "--svg", str(svg)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bare.returncode == 1 and "--html and --svg draw the event logs" in bare.stderr


def test_an_in_process_recovery_is_a_round_and_a_crowded_lane_stays_four_rows_high():
    rows = [(0.0, "launcher_started", "node0", {})]
    for k in range(200):  # an exception every second, each recovered in process in 0.6 s
        t = 1.0 + k
        rows += [
            (t, "inprocess_fault", "node0", {"rank": 1, "own": True, "step": k}),
            (t + 0.1, "inprocess_left", "node0", {"rank": 0, "abort_s": 0.1}),
            (t + 0.4, "inprocess_joined", "node0", {"rank": 0, "rendezvous_s": 0.3}),
            (t + 0.5, "restored", "node0", {"rank": 0, "step": k, "seconds": 0.1,
                                            "source": "shared memory"}),
            (t + 0.6, "stepped", "node0", {"rank": 0, "step": k + 1}),
        ]  # fmt: skip
    rows.append((300.0, "launcher_exited", "node0", {}))
    evs = events(*rows)
    report = summarize(evs)
    tl = timeline.build(evs, report)
    assert len(tl.recoveries) == 200
    first = tl.recoveries[0]
    assert (first.path, first.source, first.failure.kind) == (
        "in-process",
        "own memory",
        "exception",
    )
    assert [p.name for p in first.phases][:3] == ["round", "restore", "first step"]
    root = ET.fromstring(report_svg.draw(tl, "storm"))
    bars = [g for g in root.iter(f"{SVG}g") if g.get("class") == "recovery"]
    assert len(bars) == 200 and {b.get("data-path") for b in bars} == {"in-process"}
    ys = {float(b.find(f"{SVG}rect").get("y")) for b in bars}
    assert len(ys) <= report_svg.MAX_ROWS


def test_hostile_event_fields_are_escaped_and_bad_lines_skipped(tmp_path):
    """Event logs are untrusted: markup in a tier's or node's name is shown as text, a line
    with no finite time or a step that is not an integer is left out."""
    import json

    from flashckpt.faults.events import read_events

    evil = '<script>alert("x")</script>'
    rows = [
        (0.0, "launcher_started", evil, {}),
        (1.0, "tier_committed", evil, {"tier": evil, "step": 3, "bytes": "many", "seconds": None}),
        (2.0, "tier_committed", evil, {"tier": evil, "step": "4"}),
        (3.0, "worker_exited", evil, {"rank": '"><b>', "worker_pid": 1, "step": 3, "silent_s": 0.5}),
        (5.0, "restored", evil, {"rank": 0, "step": 3, "seconds": 0.1, "source": evil}),
        (9.0, "launcher_exited", evil, {}),
    ]  # fmt: skip
    log = tmp_path / "evil.jsonl"
    lines = [json.dumps(e) for e in events(*rows)]
    lines.insert(2, '{"time": NaN, "kind": "stepped", "step": 99}')
    log.write_text("\n".join(lines) + "\n")
    evs = read_events(log)
    assert len(evs) == len(rows)  # the NaN-timed line is skipped
    report = summarize(evs)
    tl = timeline.build(evs, report)
    assert [c.step for c in tl.tiers[0].commits] == [3]  # "4" is no step
    page = report_page.render(tl, report)
    assert "<script" not in page and "&lt;script&gt;" in page
    root = ET.fromstring(report_svg.draw(tl, evil))
    assert root.find(f"{SVG}title").text == evil  # shown as text, parsed as such


def test_the_jobs_start_up_is_a_cause_on_the_page():
    """A run's launch to every rank's first step is lost time of its own in the bar."""
    evs = events(
        (0.0, "launcher_started", "node0", {}),
        (6.0, "restored", "node0", {"rank": 0, "step": None, "seconds": 0.01}),
        (8.0, "stepped", "node0", {"rank": 0, "step": 0}),
        (40.0, "closed", "node0", {"rank": 0, "save_stall_s": 0.4, "step_s": 0.5, "saves": 60}),
        (40.0, "launcher_exited", "node0", {}),
    )  # fmt: skip
    report = summarize(evs)
    assert report.startup_s == pytest.approx(8.0)
    page = report_page.render(timeline.build(evs, report), report)
    assert re.search(r'title="start-up: 8(\.0+)?\s*s', page), page[page.find("lost-bar") :][:600]


def test_a_tier_lane_is_labelled_by_its_scheme_and_where_it_keeps_the_job():
    """The lane labels say which tier at a glance, without the query or the middle of a long
    path; the whole URL stays the label's tooltip."""
    label = report_svg.tier_label
    assert label("file:///mnt/nvme/ckpt") == "file …/ckpt"
    assert label("pfs:///lustre/team/run7?every_steps=1000") == "pfs …/run7"
    assert label("s3://bucket/run1?endpoint_url=x") == "s3 bucket/run1"
    assert label("s3://bkt/team/run1") == "s3 bkt/…/run1"
    assert label("peer://auto?hop=1") == "peer auto"
    assert label("file:///ckpt") == "file /ckpt"
    long = label("s3://a-very-long-bucket-name/p/a-long-run-directory-name")
    assert long.startswith("s3 …") and long.endswith("directory-name") and len(long) <= 18
    assert label("memory") == "memory" and len(label("x" * 40)) == 18
