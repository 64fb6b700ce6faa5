"""The installed ``flashckpt`` console script against real tiers (directories, moto S3) and
this node's shared memory: ``ls``, ``verify``, ``restore``, ``gc``, ``status``, ``--json``, exit
codes, and credentials in tier URLs never shown.

Steps are stored with the tier API as the agent stores them (``tier_io.write_rank`` and
``commit_step``), so each test knows which bytes a tier holds; the restore into shared memory
starts from a step a real ``Checkpointer`` persisted through its agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import S3, run_python
from flashckpt.storage_tiers import open_tier

from flashckpt.cli import build_parser
from flashckpt.cli.common import Progress, Secrets
from flashckpt.config import replicas_dir
from flashckpt.format import layout, tier_io
from flashckpt.format.checksum import chunk_checksums
from flashckpt.format.manifest import Manifest
from flashckpt.format.slot import align
from flashckpt.snapshot.flatten import Leaf, plan_layout

FLASHCKPT = Path(sys.executable).parent / "flashckpt"
CHUNK = 4096
KEY_ID, SEKRET = "AKIAFLASHCKPTKEYID42", "sEkReT-do-not-show-9f8e7d"


@pytest.fixture(autouse=True)
def no_job_from_env(monkeypatch):
    monkeypatch.delenv("FLASHCKPT_JOB", raising=False)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(FLASHCKPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)  # fmt: skip
    assert "Traceback" not in proc.stderr or "--debug" in args, proc.stderr
    return proc


def as_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout)


# ---- stored steps, as the agent stores them ------------------------------------------------


def values(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state at ``step``: a replicated model (the same on every rank, stored
    once in a shared tier) and bytes of its own."""
    return {"model": torch.arange(3000, dtype=torch.float32) + step,
            "own": torch.arange(2000, dtype=torch.float32) * (rank + 1) + step}  # fmt: skip


def shard(job: str, step: int, rank: int, world: int) -> tuple[Manifest, bytearray]:
    state = values(step, rank)
    leaves = [Leaf("model", "tensor", state["model"], replicated=True),
              Leaf("own", "tensor", state["own"])]  # fmt: skip
    lay = plan_layout(leaves, CHUNK)
    data = bytearray(lay.data_len)
    for e, lf in zip(lay.entries, leaves, strict=True):
        data[e.offset : e.offset + e.nbytes] = lf.tensor.view(torch.uint8).numpy().tobytes()
    tree = {
        "t": "dict",
        "items": [[lf.path, {"t": "tensor", "i": i}] for i, lf in enumerate(leaves)],
    }
    m = Manifest(job, rank, step, tree, lay.entries, lay.data_len, chunk_size=CHUNK,
                 created_at=time.time(), world_size=world, replicas=(0, world, 1))  # fmt: skip
    return m.with_checksums(chunk_checksums(memoryview(data), m.entries, CHUNK)), data


def store(url: str, job: str, steps, world: int = 2, ranks=None, commit: bool = True) -> None:
    """Put ``steps`` of ``job`` in ``url``: rank 0 stores the replicated model for all."""
    ranks = range(world) if ranks is None else ranks

    async def go():
        tier = open_tier(url)
        try:
            for step in steps:
                for r in ranks:
                    m, data = shard(job, step, r, world)
                    await tier_io.write_rank(tier, m, memoryview(data), primary=0)
                if commit:
                    await tier_io.commit_step(tier, job, step, "node0", list(ranks), world)
        finally:
            await tier.close()

    asyncio.run(go())


def flip(root: Path, key: str, at: int) -> None:
    path = root / key
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def entry_of(job: str, step: int, rank: int, path: str):
    m, _ = shard(job, step, rank, 2)
    return next(e for e in m.entries if e.path == path)


# ---- the command line itself -------------------------------------------------------------


def test_every_option_has_help_text():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    assert {"ls", "verify", "restore", "gc", "status", "report", "list"} <= set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"flashckpt {name} {action.option_strings or action.dest}"


def test_no_command_prints_help_and_usage_errors_exit_2(tmp_path):
    bare = cli()
    assert bare.returncode == 2 and "usage: flashckpt" in bare.stderr
    assert "restore" in bare.stderr and "exit codes" in bare.stderr.lower()
    from importlib.metadata import version

    shown = cli("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"flashckpt {version('flashckpt')}"
    bad = cli("verify", f"file://{tmp_path}", "--step", "soon")
    assert bad.returncode == 2 and "'soon' is not a step number" in bad.stderr


def test_progress_shows_only_on_a_terminal_after_its_delay(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the fallback line
    with Progress("verifying", total=4 * 2**20, delay=0.0, enabled=True) as bar:
        bar.update(2**20)
    assert "verifying: 1.0 MiB of 4.0 MiB (25%)" in capsys.readouterr().err
    with Progress("verifying", total=10, unit="ranks", delay=0.0, enabled=False) as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""


def test_secrets_are_learnt_from_urls_and_masked():
    s = Secrets()
    s.learn(f"s3://b/p?key={KEY_ID}&secret={SEKRET}&endpoint_url=http://u:pa55word@h:9")
    text = s.scrub(f"denied for {KEY_ID} with {SEKRET} at http://u:pa55word@h:9")
    assert KEY_ID not in text and SEKRET not in text and "pa55word" not in text


# ---- ls ------------------------------------------------------------------------------------


def test_ls_lists_jobs_then_a_jobs_steps_and_says_what_is_missing(tmp_path):
    root = tmp_path / "tier"
    url = f"pfs://{root}"  # shared: a step is committed once every rank of the job is
    store(url, "alpha", [1, 2])
    store(url, "alpha", [3], ranks=[0])  # one rank of two committed
    store(url, "alpha", [4], commit=False)  # an upload in flight
    store(url, "beta", [1], world=1)
    jobs = cli("ls", url)
    assert jobs.returncode == 0, jobs.stderr
    assert "alpha  4 step(s)" in jobs.stdout and "beta  1 step(s)" in jobs.stdout
    listed = cli("ls", url, "--job", "alpha", "--json")
    assert listed.returncode == 0, listed.stderr
    doc = as_json(listed)
    states = {s["step"]: (s["state"], s["ranks"], s["committed_ranks"]) for s in doc["steps"]}
    assert states == {1: ("committed", [0, 1], [0, 1]), 2: ("committed", [0, 1], [0, 1]),
                      3: ("partial", [0], [0]), 4: ("uncommitted", [0, 1], [])}  # fmt: skip
    m0, own1 = shard("alpha", 1, 0, 2)[0], entry_of("alpha", 1, 1, "own")
    assert doc["steps"][0]["bytes"] == m0.data_len + align(own1.nbytes)  # rank 1: its own only
    assert 0 <= doc["steps"][0]["age_s"] < 600
    missing = cli("ls", url, "--job", "gamma")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"flashckpt ls: {url} has no job 'gamma' (jobs there: alpha, beta); check --job or the "
        "location"
    ]
    nowhere = cli("ls", f"file://{tmp_path / 'nope'}")
    assert nowhere.returncode == 1 and "there is no directory" in nowhere.stderr
    node = cli("ls", f"file://{root}", "--job", "alpha", "--json")  # node-local: its ranks
    assert node.returncode == 0, node.stderr
    assert as_json(node)["steps"][2]["state"] == "committed", node.stdout
    two = cli("verify", url)
    assert two.returncode == 2 and "holds 2 jobs (alpha, beta); pick one with --job" in two.stderr


# ---- verify --------------------------------------------------------------------------------


def test_verify_reports_every_bad_chunk_once_with_its_location(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    store(f"file://{a}", "job", [1, 2])
    store(f"file://{b}", "job", [1, 2])
    model = entry_of("job", 2, 0, "model")
    # Two bytes in two chunks: the model that rank 0 stores for both ranks, and rank 1's own.
    flip(a, layout.data_key("job", 2, 0), model.offset + CHUNK + 5)
    own1 = 0  # rank 1's data holds only its own entry, packed at offset 0
    flip(a, layout.data_key("job", 2, 1), own1 + CHUNK + 7)
    out = cli("verify", f"file://{a}", f"file://{b}", "--json")
    assert out.returncode == 1, out.stderr
    first, second = as_json(out)["results"]
    assert second["ok"] and second["step"] == 2 and [r["rank"] for r in second["ranks"]] == [0, 1]
    assert not first["ok"]
    found = sorted((p["key"], p["offset"], p["entry"], p["chunk"]) for p in first["problems"])
    assert found == [
        (layout.data_key("job", 2, 0), model.offset + CHUNK, "model", 1),
        (layout.data_key("job", 2, 1), own1 + CHUNK, "own", 1),
    ]  # each once, though rank 1's manifest points at rank 0's copy of the model
    text = cli("verify", f"file://{a}", "--tier", f"file://{b}")
    assert text.returncode == 1
    assert f"file://{a}/{layout.data_key('job', 2, 0)}: chunk 1 of 'model'" in text.stderr
    assert f"file://{a}/{layout.data_key('job', 2, 1)}: chunk 1 of 'own'" in text.stderr
    assert f"step 2 in file://{a}: 2 problem(s) found" in text.stderr
    assert f"step 2 in file://{b}: 2 rank(s) verified, no problem found" in text.stdout
    older = cli("verify", f"file://{a}", "--step", "1", "--rank", "1")
    assert older.returncode == 0 and "step 1 rank 1: 2 entries" in older.stdout
    absent = cli("verify", f"file://{a}", "--step", "9")
    assert absent.returncode == 1
    assert f"step 9 is not committed in file://{a} (committed: [1, 2])" in absent.stderr


def test_verify_of_a_job_with_no_committed_step_says_so(tmp_path):
    url = f"file://{tmp_path}"
    store(url, "job", [5], commit=False)
    out = cli("verify", url)
    assert out.returncode == 1 and f"job job has no committed step in {url}" in out.stderr
    assert "None" not in out.stderr


# ---- restore -------------------------------------------------------------------------------


def test_restore_takes_each_rank_from_the_first_good_copy_into_a_tier_layout(tmp_path):
    a, b, out_dir = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    store(f"file://{a}", "job", [1, 2])
    store(f"file://{b}", "job", [2])
    flip(a, layout.data_key("job", 2, 1), 100)
    out = cli("restore", f"file://{a}", f"file://{b}", "--to", str(out_dir), "--json")
    assert out.returncode == 0, out.stderr
    doc = as_json(out)
    assert doc["ok"] and doc["step"] == 2 and doc["job"] == "job"
    assert [(r["rank"], r["source"]) for r in doc["ranks"]] == [
        (0, f"file://{a}"),
        (1, f"file://{b}"),
    ]
    assert "chunk 0 of 'own'" in doc["ranks"][1]["skipped"][0]

    async def back():
        tier = open_tier(f"file://{out_dir}")
        try:
            steps = await tier_io.committed_steps(tier, "job")
            return steps, [await tier_io.read_rank(tier, "job", 2, r) for r in (0, 1)]
        finally:
            await tier.close()

    steps, ranks = asyncio.run(back())
    assert steps == [2]
    for r, (m, data) in enumerate(ranks):
        for e in m.entries:
            got = data[e.offset : e.offset + e.nbytes].view(torch.float32)
            assert torch.equal(got, values(2, r)[e.path])
    assert cli("verify", out_dir).returncode == 0


HOLD = """
import sys, torch
from flashckpt import Checkpointer
ck = Checkpointer(job={job!r})
ck.save(7, {{"t": torch.ones(8)}})
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def live_trainer(job: str):
    """A trainer of ``job`` that saved step 7 and keeps its rank until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(job=job)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


TRAIN = """
import torch
from flashckpt import Checkpointer
ck = Checkpointer({url!r}, job="mem")
for step in (1, 2, 3):  # 2 persisted for sure (the agent skips to the newest when behind)
    ck.save(step, {{"w": torch.arange(50_000, dtype=torch.float32) + step, "step": step}})
    if step > 1:
        ck.wait(step, tier={url!r}, timeout=60)
ck.close()
"""

RESUME = """
import torch
from flashckpt import Checkpointer
state = {"w": torch.zeros(50_000), "step": -1}
ck = Checkpointer(job="mem")
print(ck.restore(state), ck._restored_from, bool(torch.equal(state["w"], torch.arange(50_000,
      dtype=torch.float32) + 2)), state["step"])
ck.close()
"""


def test_restore_into_shared_memory_is_what_a_fresh_trainer_restores(shm_dir, run_dir, tmp_path):
    url = f"file://{tmp_path / 'nvme'}"
    run_python(TRAIN.format(url=url))
    with live_trainer("mem") as holder:
        busy = cli("restore", url, "--step", "2", "--to", "shm")
        assert busy.returncode == 1
        assert f"rank 0 of job 'mem' is already saving from pid {holder.pid}" in busy.stderr
        assert "stop the job's trainers" in busy.stderr
    out = cli("restore", url, "--step", "2", "--to", "shm")
    assert out.returncode == 0, out.stderr
    assert "step 2 of job mem restored into shared memory" in out.stdout
    held = as_json(cli("ls", "shm", "--json"))
    assert [(s["step"], s["state"], s["sealed"]) for s in held["steps"]] == [(2, "complete", True)]
    assert cli("verify", "shm").returncode == 0
    resumed = run_python(RESUME)
    assert resumed.stdout.split() == ["2", "shared", "memory", "True", "2"]


# ---- gc ------------------------------------------------------------------------------------


def test_gc_applies_retention_and_never_removes_the_newest_committed_step(tmp_path):
    root = tmp_path / "tier"
    url = f"file://{root}"
    store(url, "job", [1, 2, 3, 4, 5], world=1)
    store(url, "job", [6], world=1, commit=False)  # newer than any committed: an upload
    planned = cli("gc", url, "--keep-last", "2", "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    doc = as_json(planned)
    assert doc["dry_run"] and [s["step"] for s in doc["removed"]] == [1, 2, 3]
    assert doc["newest_committed"] == 5
    assert len(list(root.joinpath("job").iterdir())) == 6  # nothing went
    done = cli("gc", url, "--keep-last", "1", "--keep-every", "2")
    assert done.returncode == 0, done.stderr
    assert "removed 2 step(s), kept 4" in done.stdout
    left = sorted(p.name for p in root.joinpath("job").iterdir())
    assert left == [layout.step_prefix("job", s).split("/")[1] for s in (2, 4, 5, 6)]
    assert cli("gc", url, "--keep-last", "1").returncode == 0
    assert (root / layout.manifest_key("job", 5, 0)).exists()  # the newest stays, always
    zero = cli("gc", url, "--keep-last", "0")
    assert zero.returncode == 2 and "'0' is not a whole number of at least 1" in zero.stderr


def test_a_node_tier_of_a_multi_node_job_is_pruned_online_and_offline(tmp_path):
    """Each node's own directory holds only its ranks and its commit markers: its steps are
    committed for those ranks. Retention given only this node's view prunes them; offline,
    ``flashckpt gc`` keeps every step other nodes may need unless told ``--node-alone``."""
    root = tmp_path / "nvme1"
    url = f"file://{root}"

    async def go():
        tier = open_tier(url)
        try:
            for step in range(1, 6):
                for r in (2, 3):  # node 1 of a 4-rank job: ranks 2 and 3
                    m, data = shard("job", step, r, 4)
                    await tier_io.write_rank(tier, m, memoryview(data), primary=2)
                await tier_io.commit_step(tier, "job", step, "node1", [2, 3], 4)
            assert await tier_io.committed_steps(tier, "job") == [1, 2, 3, 4, 5]
            await tier_io.apply_retention(tier, "job", 3, None)  # what the agent runs
            return await tier_io.committed_steps(tier, "job")
        finally:
            await tier.close()

    assert asyncio.run(go()) == [3, 4, 5]
    # Offline, gc cannot know which of these steps the other nodes hold: it keeps them all
    # and says why, unless told that this node's steps alone count.
    kept = cli("gc", url, "--keep-last", "1")
    assert kept.returncode == 0, kept.stderr
    assert "kept 2 committed step(s) past --keep-last" in kept.stdout, kept.stdout
    assert "--node-alone" in kept.stdout
    assert len(list(root.joinpath("job").iterdir())) == 3
    done = cli("gc", url, "--keep-last", "1", "--node-alone")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in root.joinpath("job").iterdir()] == ["step-000000000005"]
    shared = tmp_path / "pfs"
    store(f"pfs://{shared}", "job", [1, 2], world=4, ranks=[2, 3])  # a shared tier: partial
    assert cli("gc", f"pfs://{shared}", "--keep-last", "1").returncode == 0
    assert len(list(shared.joinpath("job").iterdir())) == 2  # nothing there is committed


DEAD = """
import os, torch
from flashckpt import Checkpointer
Checkpointer(job="dead").save(3, {"t": torch.ones(8)})
os._exit(0)  # killed: its slots and heartbeat page stay
"""


def test_gc_shm_removes_only_what_dead_jobs_left(shm_dir, run_dir):
    run_python(DEAD)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is a dead agent's
    for name in ("dead.pid", "dead.sock", "dead.controller", "dead.log"):
        (run_dir / name).write_text(f"{gone.pid}\n")
    # The dead agent held another node's replica, and an upload into it crashed; the live
    # job's replicas stay.
    for job in ("dead", "live"):
        held = replicas_dir(shm_dir, job) / "node7" / job / "step-000000000003"
        held.mkdir(parents=True)
        (held / "rank-0.data").write_bytes(b"r" * 64)
        (held / ".tmp-rank-1.data-0123456789ab").write_bytes(b"half")
    with live_trainer("live"):
        planned = as_json(cli("gc", "shm", "--dry-run", "--json"))
        by_job = {j["job"]: j for j in planned["jobs"]}
        assert by_job["live"]["live"] and by_job["live"]["removed"] == []
        assert str(run_dir / "dead.pid") in by_job["dead"]["removed"]
        assert (shm_dir / "dead").is_dir() and (run_dir / "dead.pid").exists()
        done = cli("gc", "shm")
        assert done.returncode == 0, done.stderr
        assert "removed job dead:" in done.stdout and "kept job live:" in done.stdout
        assert not (shm_dir / "dead").exists()
        assert not replicas_dir(shm_dir, "dead").exists()
        assert str(replicas_dir(shm_dir, "dead")) in done.stdout
        assert any(replicas_dir(shm_dir, "live").rglob("rank-0.data"))
        assert sorted(p.name for p in run_dir.iterdir()) == ["dead.log"]
        assert any(p.name.startswith("rank-0.slot") for p in (shm_dir / "live").iterdir())


# ---- S3: credentials in the URL, a missing bucket, an endpoint that is not S3 --------------


def test_s3_commands_never_show_the_credentials_of_the_url(s3_bucket, s3_server, tmp_path):
    opts = f"key={KEY_ID}&secret={SEKRET}&endpoint_url={s3_server.endpoint_url}"
    url = f"s3://{s3_bucket}/ckpt?{opts}"
    store(url, "job", [1, 2])
    runs = [
        cli("ls", url),
        cli("verify", url, "--json"),
        cli("restore", url, "--to", tmp_path / "copy"),
        cli("gc", url, "--keep-last", "1", "--dry-run"),
        cli("ls", f"s3://{s3_bucket}-none/ckpt?{opts}", "--debug"),
    ]
    for proc in runs:
        assert KEY_ID not in proc.stdout + proc.stderr and SEKRET not in proc.stdout + proc.stderr
    listed, verified, restored, planned, missing = runs
    assert listed.returncode == 0 and f"s3://{s3_bucket}/ckpt?key=***&secret=***" in listed.stdout
    assert "0-1 of 2  committed" in listed.stdout
    assert verified.returncode == 0 and as_json(verified)["results"][0]["step"] == 2
    assert restored.returncode == 0 and "step 2 of job job restored into" in restored.stdout
    assert planned.returncode == 0 and "would remove step 1" in planned.stdout
    assert missing.returncode == 1 and f"bucket '{s3_bucket}-none' does not exist" in missing.stderr
    assert "Traceback" in missing.stderr  # --debug shows where, masked


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@S3
def test_an_endpoint_answering_404_is_one_clear_line(tmp_path):
    (tmp_path / "empty").mkdir()
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(_Quiet, directory=str(tmp_path / "empty"))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        env = {
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        out = cli("ls", f"s3://bucket/p?endpoint_url={endpoint}&retry_attempts=1", env=env)
    finally:
        server.shutdown()
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"flashckpt ls: tier s3://bucket/p: the S3 endpoint {endpoint} answered 404 Not Found to "
        "a list of bucket 'bucket'; check endpoint_url (it must point at an S3 service) and the "
        "bucket name (--debug shows where)"
    ]


# ---- status (the agent itself is in test_agent_cli.py) -------------------------------------


def test_status_without_an_agent_says_how_to_start_one(run_dir):
    out = cli("status", "--job", "nobody", "--json")
    assert out.returncode == 1
    doc = as_json(out)
    assert doc["ok"] is False and doc["exit_code"] == 1 and doc["command"] == "status"
    assert "no flashckpt agent runs for job nobody" in out.stderr
    assert "flashckpt-agent serve --job nobody" in out.stderr
