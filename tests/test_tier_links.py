"""Directory tiers write and delete through no symbolic link inside them, as they read none.

A link at the job, step or rank level once took the writes of a step elsewhere while listings
(which follow no link) found nothing there: a restore started over, retention never pruned.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from flashckpt.storage_tiers import open_tier

from flashckpt.errors import TierUnavailableError
from flashckpt.format import layout, tier_io

JOB = "linked"
STEP = layout.step_prefix(JOB, 1).split("/")[1]  # step-000000000001
LEVELS = {"job": JOB, "step": f"{JOB}/{STEP}", "rank": f"{JOB}/{STEP}/rank-0"}


def run(coro):
    return asyncio.run(coro)


def _files(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob("*") if p.is_file())


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_a_put_refuses_a_link_on_its_way_and_names_it(tmp_path: Path, scheme: str, level: str):
    root, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
    link = root / LEVELS[level]
    link.parent.mkdir(parents=True, exist_ok=True)
    elsewhere.mkdir()
    link.symlink_to(elsewhere)
    tier = open_tier(f"{scheme}://{root}")
    with pytest.raises(TierUnavailableError) as caught:
        run(tier.put(layout.data_key(JOB, 1, 0), [memoryview(b"data")], 4))
    text = str(caught.value)
    assert f"{link} is a symbolic link" in text
    assert "replace the link with the directory it points at, or remove it" in text
    assert _files(elsewhere) == []  # nothing went through it, not even a temporary
    assert run(tier.list(f"{JOB}/")) == []


@pytest.mark.parametrize("scheme", ["file", "pfs"])
def test_a_link_in_place_of_a_step_is_neither_listed_nor_deleted_through(
    tmp_path: Path, scheme: str
):
    """A step directory that is a link holds a whole committed copy elsewhere: retention and
    delete leave what it points at alone, and later steps are still written beside it."""
    root, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
    tier = open_tier(f"{scheme}://{root}")

    async def commit(tier, step: int) -> None:
        key = layout.manifest_key(JOB, step, 0)
        await tier.put(key, [memoryview(b"{}")], 2)
        await tier_io.commit_step(tier, JOB, step, "n0", [0], 1)

    run(commit(open_tier(f"{scheme}://{elsewhere}"), 1))
    (root / JOB).mkdir(parents=True)
    (root / JOB / STEP).symlink_to(elsewhere / JOB / STEP)
    kept = _files(elsewhere)
    for step in (2, 3):
        run(commit(tier, step))
    assert sorted(k[1] for k in run(tier_io.list_steps(tier, JOB))) == [2, 3]
    run(tier_io.apply_retention(tier, JOB, keep_last=1, keep_every=None))
    assert sorted(k[1] for k in run(tier_io.list_steps(tier, JOB))) == [3]
    with pytest.raises(TierUnavailableError, match="nothing is deleted through a link"):
        run(tier.delete(f"{JOB}/{STEP}/rank-0"))
    assert _files(elsewhere) == kept
    run(tier.delete(f"{JOB}/{STEP}"))  # the link itself goes, never what it points at
    assert not (root / JOB / STEP).is_symlink() and _files(elsewhere) == kept
