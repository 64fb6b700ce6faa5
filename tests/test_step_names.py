"""Only canonical names are steps: ``step-%012d[.gG]/rank-R`` as ``layout`` writes them.

A stray ``step-99`` holding only commit markers once made retention remove every real step,
and a ``step-1`` copy merged with ``step-000000000001``, "removed" on every pass and listed
forever. Strays are now ignored by listings, commits and retention, reported by ``verify`` and
``gc``, and never removed; a step whose markers name ranks with no stored manifest is not
committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashckpt.storage_tiers import open_tier
from test_corruption import JOB, Template

from flashckpt.format import layout, tier_io


def run(coro):
    return asyncio.run(coro)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True,
                          text=True, env=os.environ, timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Template:
    return Template(tmp_path_factory.mktemp("template"))


def _stage(template: Template, root: Path) -> None:
    """Real committed steps 1, 2 and 3 (3 is 2's copy under its own number)."""

    async def go() -> None:
        tier = open_tier(f"file://{root}")
        for step in (1, 2, 3):
            manifest, data = template.copies[min(step, 2)]
            manifest = dataclasses.replace(manifest, step=step)
            await tier_io.write_rank(tier, manifest, memoryview(data))
            await tier_io.commit_step(tier, JOB, step, "node0", [0], 1)

    run(go())


def _marker(path: Path, ranks: list[int], world: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(layout.CommitMarker("node9", tuple(ranks), world).to_json())


def _steps(url: str) -> list[int]:
    return sorted(s for _, s in run(tier_io.list_steps(open_tier(url), JOB)))


def test_names_other_than_the_canonical_ones_are_no_steps():
    assert layout.parse_step("step-000000000007") == (0, 7)
    assert layout.parse_step("step-000000000007.g2") == (2, 7)
    assert layout.parse_step("step-1000000000000") == (0, 10**12)  # wider when it must be
    for name in ("step-7", "step-99", "step-0000000000007", "step-000000000007.g02",
                 "step-000000000007.g0", "step-\u0661"):  # fmt: skip
        assert layout.parse_step(name) is None, name
    assert [layout.parse_rank(n) for n in ("rank-0", "rank-12", "rank-01", "rank-00")] == [
        0, 12, None, None,
    ]  # fmt: skip
    keys = ["j/step-1/commit-n.json", "j/step-000000000001/rank-0/manifest.json",
            "j/step-000000000001/rank-01/manifest.json", "j/step-000000000001/commit-n.json"]  # fmt: skip
    found = layout.scan("j", keys)
    assert list(found) == [(0, 1)] and found[0, 1].manifests == {0}
    assert layout.strays("j", keys) == ["j/step-000000000001/rank-01", "j/step-1"]
    assert not layout.written_by("j", "j/step-1/rank-0/data", "n", [0])
    assert not layout.written_by("j", "j/step-000000000001/rank-00/data", "n", [0])


def test_strays_neither_commit_a_step_nor_make_retention_remove_one(template, tmp_path: Path):
    root = tmp_path / "tier"
    url = f"file://{root}"
    _stage(template, root)
    job = root / JOB
    _marker(job / "step-99" / "commit-node9.json", [0], 1)  # markers alone, odd name
    # canonical name, markers naming a rank whose manifest is not there
    _marker(job / layout.step_dir(99) / "commit-node9.json", [0], 1)
    shutil.copytree(job / layout.step_dir(1), job / "step-1")  # a whole copy, odd name
    shutil.copytree(job / layout.step_dir(2) / "rank-0", job / layout.step_dir(98) / "rank-00")
    _marker(job / layout.step_dir(98) / "commit-node9.json", [0], 1)  # its rank dir is odd

    listing = run(tier_io.list_steps(open_tier(url), JOB))
    assert sorted(s for _, s in tier_io.complete(listing)) == [1, 2, 3]
    assert "manifests are not stored there" in listing[0, 99].problems[0]
    assert not listing[0, 99].complete and not listing[0, 98].complete

    dry = cli("gc", url, "--job", JOB, "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    for name in ("step-1", "step-99", f"{layout.step_dir(98)}/rank-00"):
        assert f"kept stray {JOB}/{name} in " in dry.stdout, dry.stdout
    assert "never removed by retention or gc" in dry.stdout
    gc = cli("gc", url, "--job", JOB, "--keep-last", "1", "--json")
    assert gc.returncode == 0, gc.stderr
    doc = json.loads(gc.stdout)
    assert sorted(s["step"] for s in doc["removed"]) == [1, 2]
    assert _steps(url) == [3, 98, 99]  # the newest real step stays; the partial ones too
    assert (job / "step-1" / "rank-0" / "data").is_file() and (job / "step-99").is_dir()
    again = json.loads(cli("gc", url, "--job", JOB, "--keep-last", "1", "--json").stdout)
    assert again["removed"] == []  # a stray is never "removed" pass after pass

    # Step 3 itself is sound, but steps 98 and 99 hold markers naming a rank with no stored
    # manifest: restore and retention ignore them (above), verify reports them as problems
    # (exit 1) whichever step it checks. (It exited 0 here before issue 51.) The odd names
    # stay notes: they are no step at all.
    verify = cli("verify", url, "--job", JOB, "--step", "3")
    assert verify.returncode == 1, verify.stderr
    assert f"stray {JOB}/step-1 in " in verify.stderr and "ignored" in verify.stderr
    assert "step 3 rank 0: " in verify.stdout
    for step in (98, 99):
        said = f"{url}/{JOB}/{layout.step_dir(step)}: step {step}: its commit markers name rank 0"
        assert said in verify.stderr and "it looks like a stray" in verify.stderr
    assert "1 rank(s) verified, no problem found in it; 2 problem(s) found in other steps" in (
        verify.stderr
    )
