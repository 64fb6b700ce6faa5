"""``flashckpt verify`` reports steps that are no checkpoint (issue 51).

A step directory whose commit markers name ranks with no stored manifest (a cut-short copy, a
stale writer's, markers copied by hand) does not count as committed: restore and retention
take it as uncommitted. ``verify`` once printed a warning for it and exited 0 ("no problem
found"); it now reports it as a problem (exit 1) whichever step it verifies, says whether it
looks like a stray or like a stale writer's leftover / cut-short copy, and what to do. So are
steps holding commit markers that a newer run of the job fenced out (``CommittedStep.fenced``).

Steps are stored as the agent stores them (``tier_io.write_rank``, ``commit_step``) in real
directory tiers and in S3 (moto's server), and checked with the installed ``flashckpt``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from flashckpt.storage_tiers import open_tier
from test_cli_commands import as_json, cli, store

from flashckpt.format import layout, tier_io

JOB = "job"
OLDER = "the steps older than the newest committed one"


@pytest.fixture(autouse=True)
def no_job_from_env(monkeypatch):
    monkeypatch.delenv("FLASHCKPT_JOB", raising=False)


def commit(url: str, step: int, node: str, ranks: list[int], world: int = 2,
           incarnation: int = 0) -> None:  # fmt: skip
    async def go() -> None:
        tier = open_tier(url)
        try:
            await tier_io.commit_step(tier, JOB, step, node, ranks, world,
                                      incarnation=incarnation)  # fmt: skip
        finally:
            await tier.close()

    asyncio.run(go())


def committed(url: str) -> list[int]:
    async def go() -> list[int]:
        tier = open_tier(url)
        try:
            return await tier_io.committed_steps(tier, JOB)
        finally:
            await tier.close()

    return asyncio.run(go())


def tier_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "file":
        return f"file://{tmp_path / 'tier'}"
    bucket = request.getfixturevalue("s3_bucket")
    server = request.getfixturevalue("s3_server")
    return f"s3://{bucket}/ckpt?endpoint_url={server.endpoint_url}"


def only(doc: dict, **like) -> list[dict]:
    [result] = doc["results"]
    return [p for p in result["problems"] if all(p.get(k) == v for k, v in like.items())]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_cut_short_newest_step_fails_verify(kind, tmp_path, request):
    url = tier_url(kind, tmp_path, request)
    store(url, JOB, [1, 2])
    store(url, JOB, [3], ranks=[0], commit=False)  # rank 1 never landed ...
    commit(url, 3, "node0", [0, 1])  # ... yet the marker names it
    assert committed(url) == [1, 2]  # restore and retention do not count step 3

    out = cli("verify", url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 2 rank 0: " in out.stdout and "step 2 rank 1: " in out.stdout
    said = (f"/{layout.step_prefix(JOB, 3)}: step 3: its commit markers name ranks 0-1, but the "
            "manifest of rank 1 is not stored there; it looks like a stale writer's leftover")  # fmt: skip
    assert said in out.stderr
    assert "or a cut-short copy" in out.stderr
    assert "retention keeps it (it is newer than the newest committed step" in out.stderr
    assert "by hand once no writer of job job is at work there" in out.stderr
    assert "2 rank(s) verified, no problem found in it; 1 problem(s) found in other steps " \
        "(step 3)" in out.stderr  # fmt: skip
    assert "no problem found" not in out.stdout

    doc = as_json(cli("verify", url, "--json"))
    assert not doc["ok"] and doc["results"][0]["step"] == 2
    assert [r["ok"] for r in doc["results"][0]["ranks"]] == [True, True]
    [problem] = doc["results"][0]["problems"]
    assert problem["kind"] == "stale-step" and problem["step"] == 3
    assert problem["generation"] == 0 and problem["missing_ranks"] == [1]
    assert "rank" not in problem

    # Retention goes on ignoring it: it keeps a step newer than the newest committed one.
    gc = cli("gc", url, "--keep-last", "1", "--dry-run", "--json")
    assert gc.returncode == 0, gc.stderr
    assert [s["step"] for s in json.loads(gc.stdout)["removed"]] == [1]


def test_a_stray_step_is_reported_whichever_step_is_verified_and_gc_removes_it(tmp_path):
    root = tmp_path / "tier"
    url = f"file://{root}"
    store(url, JOB, [1, 3])
    commit(url, 2, "node7", [0, 1])  # markers alone: no rank of step 2 was ever stored
    said = (f"{url}/{layout.step_prefix(JOB, 2)}: step 2: its commit markers name ranks 0-1, "
            "and no manifest of any of them is stored there; it looks like a stray, not a copy "
            "flashckpt's agent wrote")  # fmt: skip
    newest = as_json(cli("verify", url, "--json"))
    assert not newest["ok"] and newest["results"][0]["step"] == 3
    [problem] = only(newest)
    assert problem["kind"] == "stray-step" and problem["message"].startswith(said)
    out = cli("verify", url, "--step", "1")  # reported whichever step is verified
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 1 rank 0: " in out.stdout and said in out.stderr
    assert f"retention removes it with {OLDER}" in out.stderr
    assert f"`flashckpt gc {url} --job job --keep-last K`" in out.stderr
    assert "1 problem(s) found in other steps (step 2)" in out.stderr

    # What the message says to do: retention removes it, and verify passes again.
    gc = cli("gc", url, "--keep-last", "5", "--json")
    assert gc.returncode == 0, gc.stderr
    assert [s["step"] for s in json.loads(gc.stdout)["removed"]] == [2]
    again = cli("verify", url)
    assert again.returncode == 0, again.stderr
    assert "step 3 in " in again.stdout and "2 rank(s) verified, no problem found" in again.stdout


def test_verify_of_the_cut_short_step_itself_says_it_once(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    store(url, JOB, [1])
    store(url, JOB, [3], ranks=[0], commit=False)
    commit(url, 3, "node0", [0, 1])
    out = cli("verify", url, "--step", "3", "--json")
    assert out.returncode == 1
    doc = as_json(out)
    [result] = doc["results"]
    assert result["step"] == 3 and [(r["rank"], r["ok"]) for r in result["ranks"]] == [(0, True)]
    assert sorted(p["kind"] for p in result["problems"]) == ["commit", "stale-step"]
    [commit_problem] = only(doc, kind="commit")
    assert "only ranks [0] of 2 are committed" in commit_problem["message"]
    [stale] = only(doc, kind="stale-step")
    assert stale["step"] == 3 and stale["missing_ranks"] == [1]
    text = cli("verify", url, "--step", "3")
    assert "step 3 in " in text.stderr and ": 2 problem(s) found" in text.stderr
    assert "other steps" not in text.stderr
    # A step older than the newest committed one is one retention removes.
    store(url, JOB, [4])
    older = cli("verify", url)
    assert older.returncode == 1 and "step 4 rank 1: " in older.stdout
    assert f"retention removes it with {OLDER}" in older.stderr


def test_markers_of_an_earlier_run_make_it_a_stale_writers_step(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    store(url, JOB, [1, 2])
    # Step 3: run 2 names ranks none of whose manifests exist, beside a marker of run 1.
    commit(url, 3, "node0", [0, 1], incarnation=2)
    commit(url, 3, "node1", [0, 1], incarnation=1)
    out = cli("verify", url, "--json")
    assert out.returncode == 1
    [problem] = only(as_json(out))
    assert problem["kind"] == "stale-step" and problem["step"] == 3, problem
    assert "node1" in problem["message"] and "stale writer's leftover" in problem["message"]


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_a_stale_writers_step_a_newer_run_fenced_out_fails_verify(kind, tmp_path, request):
    fence = pytest.importorskip("flashckpt.format.fence")  # the fence of issue 51
    url = tier_url(kind, tmp_path, request)
    store(url, JOB, [1, 2, 3])  # run 0 wrote step 3 ...

    async def claim() -> None:  # ... after run 1 claimed the job, having seen step 2
        tier = open_tier(url)
        try:
            assert await fence.claim([tier], JOB, 1, 2, "node1") == 1
        finally:
            await tier.close()

    asyncio.run(claim())
    assert committed(url) == [1, 2]
    out = cli("verify", url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 2 rank 0: " in out.stdout
    said = (f"/{layout.step_prefix(JOB, 3)}: step 3: commit markers there do not count, a "
            "newer run of the job having fenced their writer out: ")  # fmt: skip
    assert said in out.stderr and "the commit marker of node node0" in out.stderr
    assert "it looks like a stale writer's leftover; restore and retention" in out.stderr
    assert "by hand once no writer of job job is at work there" in out.stderr
    assert "1 problem(s) found in other steps (step 3)" in out.stderr
    itself = as_json(cli("verify", url, "--step", "3", "--json"))
    kinds = sorted(p["kind"] for p in itself["results"][0]["problems"])
    assert kinds == ["missing", "stale-step"], itself  # not committed, and why
    assert itself["results"][0]["problems"][0]["kind"] == "missing"


def _with_fenced(monkeypatch, fenced: dict[tuple[int, int], tuple[str, ...]],
                 only: set[tuple[int, int]]) -> None:  # fmt: skip
    """Give ``list_steps``'s answer the ``fenced`` markers another change of issue 51 makes it
    find (set here whether or not ``CommittedStep`` has the field yet); in the steps of
    ``only`` the fenced markers are the only ones, so no rank counts."""
    real = tier_io.list_steps
    has_field = "fenced" in {f.name for f in dataclasses.fields(tier_io.CommittedStep)}

    async def listing(tier, job):
        out = await real(tier, job)
        for key, said in fenced.items():
            c = out[key]
            if key in only:
                c = dataclasses.replace(c, ranks=frozenset())
            if has_field:
                out[key] = dataclasses.replace(c, fenced=said)
            else:
                object.__setattr__(c, "fenced", said)
        return out

    monkeypatch.setattr(tier_io, "list_steps", listing)


def test_fenced_markers_make_a_step_a_stale_writers(tmp_path, monkeypatch, capsys):
    from flashckpt.cli import main

    url = f"file://{tmp_path / 'tier'}"
    store(url, JOB, [1, 2])
    store(url, JOB, [3], ranks=[0], commit=False)
    commit(url, 3, "node5", [0])  # the only marker of step 3: fenced, it commits nothing
    marker = f"{url}/{layout.commit_key(JOB, 2, 'node9')}: written by run 1, fenced by run 2"
    fenced = {(0, 2): (marker,), (0, 3): ("node5's marker of run 1",)}
    _with_fenced(monkeypatch, fenced, only={(0, 3)})

    def verify(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exited:
            main(["verify", url, *args])
        return exited.value.code, capsys.readouterr().err

    code, err = verify()
    assert code == 1, err
    assert f"{url}/{layout.step_prefix(JOB, 2)}: step 2: commit markers there do not count, " \
        f"a newer run of the job having fenced their writer out: {marker}" in err  # fmt: skip
    assert "it looks like a stale writer's leftover" in err
    assert "the step counts only run 0's markers, which commit it; remove the stale markers " \
        f"in {url}/{layout.step_prefix(JOB, 2)} by hand once their writer is stopped" in err  # fmt: skip
    assert "node5's marker of run 1" in err and "retention keeps it" in err
    assert "step 2 in " in err and ": 2 problem(s) found, 1 of them in other steps (step 3)" in err

    code, err = verify("--step", "1")  # step 2 is checked only when verified itself
    assert code == 1 and "check it with `verify --step 2`, and remove the stale markers" in err
    assert "2 rank(s) verified, no problem found in it; 2 problem(s) found in other steps " \
        "(step 2, step 3)" in err  # fmt: skip
