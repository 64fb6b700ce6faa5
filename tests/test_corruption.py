"""Everything read back is untrusted: every corrupt copy falls back to a good one.

A corruption matrix over shared memory (a slot file), a ``file://`` tier and S3 (a real moto
server). Each case corrupts the newest step (2) of one copy and restores with a real
Checkpointer: the restore must land on a good copy (the older step 1, or step 2 from another
source) with exactly its bytes, and reading the corrupt copy directly must raise a flashckpt
error that names it, never another exception type and never wrong data.

The snapshots come from one real Checkpointer run (two sealed slots); the tier copies are
written from them with the tier API, as the agent would. One real agent serves the module
(a Checkpointer with tiers registers with it); memory holds nothing while tiers are tested, so
it has nothing to persist behind the test's back.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT, wait_for
from flashckpt.storage_tiers import open_tier

from flashckpt import Checkpointer
from flashckpt.errors import CheckpointNotFoundError, FlashCkptError, ManifestError
from flashckpt.format import layout, tier_io
from flashckpt.format.checksum import verify_entry
from flashckpt.format.manifest import Manifest
from flashckpt.format.slot import HEADER_SIZE, Slot, align
from flashckpt.snapshot.slots import read_locked, slot_path

JOB = "corrupt"
CHUNK = 64 * 1024  # several chunks per tensor: a flipped byte lands in one of many
STEP_OLD, STEP_NEW = 1, 2


def snapshot_state(step: int) -> dict:
    return {
        "w": torch.arange(100_000, dtype=torch.float32) + 1000 * step,  # 400 KB, 7 chunks
        "b": torch.full((3000,), step, dtype=torch.int64),
        "nested": {"k": [torch.full((3,), float(step), dtype=torch.float64), step]},
        "name": f"s{step}",
        "step": step,
    }


def blank() -> dict:
    return {
        "w": torch.zeros(100_000),
        "b": torch.zeros(3000, dtype=torch.int64),
        "nested": {"k": [torch.zeros(3, dtype=torch.float64), None]},
        "name": None,
        "step": None,
    }


def assert_holds(state: dict, step: int) -> None:
    want = snapshot_state(step)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
    assert torch.equal(state["nested"]["k"][0], want["nested"]["k"][0])
    assert state["nested"]["k"][1] == step and state["name"] == f"s{step}"
    assert state["step"] == step


def run(coro):
    return asyncio.run(coro)


# ---- the good copies, made once -------------------------------------------------------


class Template:
    """Two sealed slot files (steps 1 and 2) and each step's manifest and data bytes."""

    def __init__(self, root: Path):
        shm = Path("/dev/shm") / f"flashckpt-test-{uuid.uuid4().hex[:10]}"
        try:
            ck = Checkpointer(job=JOB, shm_dir=str(shm), chunk_size=CHUNK)
            for step in (STEP_OLD, STEP_NEW):
                ck.save(step, snapshot_state(step))
            paths = [slot_path(shm, JOB, 0, i) for i in range(2)]
            wait_for(lambda: all(_sealed(p) for p in paths), 30, 0.01, "slots sealed")
            self.files: dict[int, bytes] = {}  # step -> slot file bytes
            self.copies: dict[int, tuple[Manifest, bytes]] = {}
            for p in paths:
                saved = root / p.name
                shutil.copyfile(p, saved)
                slot = Slot.open_readonly(saved)
                with read_locked(slot) as snap:
                    self.files[snap.step] = saved.read_bytes()
                    self.copies[snap.step] = (snap.manifest, bytes(slot.data(snap.header)))
                slot.close()
            ck.close()
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    def put_memory(self, shm: Path, steps: tuple[int, ...]) -> dict[int, Path]:
        """Lay the slots of ``steps`` down as a crashed trainer leaves them; step -> file."""
        d = shm / JOB
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        out = {}
        for i, step in enumerate(steps):
            path = slot_path(shm, JOB, 0, i)
            path.write_bytes(self.files[step])
            path.chmod(0o600)
            out[step] = path
        return out

    async def put_tier(self, tier, steps: tuple[int, ...]) -> None:
        for step in steps:
            manifest, data = self.copies[step]
            await tier_io.write_rank(tier, manifest, memoryview(data))
            await tier_io.commit_step(tier, JOB, step, "node0", [0], 1)


def _sealed(path: Path) -> bool:
    if not path.exists():
        return False
    slot = Slot.open_readonly(path)
    try:
        return slot.header().sealed
    finally:
        slot.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Template:
    return Template(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def agent_dirs():
    """One real agent for the module's job: the Checkpointers with tiers register with it."""
    shm = Path("/dev/shm") / f"flashckpt-test-{uuid.uuid4().hex[:10]}"
    run_dir = Path(tempfile.mkdtemp(prefix="fc-run-", dir="/tmp"))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashckpt.agent.cli", "serve", "--job", JOB, "--shm-dir",
         str(shm), "--run-dir", str(run_dir), "--log-level", "ERROR",
         "--exit-when-idle", "300"],  # gone by itself too if the test process is killed
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: (run_dir / f"{JOB}.sock").exists(), 60, 0.05, "the agent's socket")
        yield shm, run_dir
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def shm(agent_dirs, monkeypatch) -> Path:
    """The module's shared-memory directory, this job's part empty before and after a test."""
    shm_dir, run_dir = agent_dirs
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", str(shm_dir))
    monkeypatch.setenv("FLASHCKPT_RUN_DIR", str(run_dir))
    shutil.rmtree(shm_dir / JOB, ignore_errors=True)
    yield shm_dir
    shutil.rmtree(shm_dir / JOB, ignore_errors=True)


def restore(*tiers: str) -> tuple[int | None, dict]:
    state = blank()
    with Checkpointer(*tiers, job=JOB, chunk_size=CHUNK) as ck:
        step = ck.restore(state)
    return step, state


# ---- corruptions ----------------------------------------------------------------------
# A manifest or marker corruption maps the stored bytes to new bytes.

Corrupt = Callable[[bytes], bytes]


def edit(fn: Callable[[dict], object]) -> Corrupt:
    def apply(raw: bytes) -> bytes:
        doc = json.loads(raw)
        fn(doc)
        return json.dumps(doc).encode()

    return apply


def deep_tree(levels: int) -> Corrupt:
    def apply(raw: bytes) -> bytes:
        doc = json.loads(raw)
        doc["tree"]["items"].append(["deep", "HERE"])
        nested = '{"t": "list", "items": [' * levels + "1" + "]}" * levels
        return json.dumps(doc).replace('"HERE"', nested).encode()

    return apply


def entry(i: int, **fields: object) -> Corrupt:
    return edit(lambda d: d["entries"][i].update(fields))


def add_node(node: object) -> Corrupt:
    return edit(lambda d: d["tree"]["items"].append(["extra", node]))


MANIFESTS: dict[str, Corrupt] = {
    "not_json": lambda raw: b"{this is not json",
    "not_utf8": lambda raw: b"\xff\xfe" + raw[2:],
    "cut_in_half": lambda raw: raw[: len(raw) // 2],
    "not_an_object": lambda raw: b"[1, 2, 3]",
    "deep_json": lambda raw: b"[" * 100_000 + b"]" * 100_000,
    "deep_tree_100000": deep_tree(100_000),
    "deep_tree_150": deep_tree(150),
    "chunk_size_zero": edit(lambda d: d.update(chunk_size=0)),
    "chunk_size_string": edit(lambda d: d.update(chunk_size="64")),
    "data_len_negative": edit(lambda d: d.update(data_len=-1)),
    "entries_missing": edit(lambda d: d.pop("entries")),
    "entry_not_object": edit(lambda d: d["entries"].__setitem__(0, 5)),
    "entry_field_missing": edit(lambda d: d["entries"][0].pop("nbytes")),
    "offset_negative": entry(0, offset=-64),
    "offset_unaligned": entry(0, offset=2),
    "offset_past_data": entry(1, offset=2**40),
    "nbytes_huge": entry(0, nbytes=2**62),
    "nbytes_not_numel": entry(0, nbytes=400_004),
    "shape_huge": entry(0, shape=[2**40, 2**40]),
    "shape_negative": entry(0, shape=[-100_000]),
    "shape_not_ints": entry(0, shape=["100000"]),
    "dtype_unknown": entry(0, dtype="float99"),
    "dtype_not_string": entry(0, dtype=7),
    "kind_unknown": entry(0, kind="sparse"),
    "first_chunk_off": entry(1, first_chunk=99),
    "shard_malformed": entry(0, shard={"global_shape": "x"}),
    "replicas_malformed": entry(0, replicated=True, replicas=[2, 1, 1]),
    "replicas_unreplicated": entry(0, replicas=[0, 2, 1]),
    "tree_names_no_entry": add_node({"t": "tensor", "i": 99}),
    "tree_wrong_kind": add_node({"t": "pickle", "i": 0}),
    "tree_unknown_tag": add_node({"t": "frobnicate"}),
    "tree_bad_float": add_node({"t": "float", "v": "abc"}),
    "tree_bad_device": add_node({"t": "device", "v": "nonsense:9"}),
    "tree_bad_bytes": add_node({"t": "bytes", "v": "zz"}),
    "tree_root_not_dict": edit(lambda d: d.update(tree=[1, 2])),
    "tree_list_key": add_node({"t": "dict", "items": [[{"t": "list", "items": []}, 1]]}),
}
# Shared memory stores checksums next to the manifest (sealing), never inside it.
CHECKSUM_MANIFESTS: dict[str, Corrupt] = {
    "checksums_null": edit(lambda d: [e.update(checksums=None) for e in d["entries"]]),
    "checksums_short": edit(lambda d: d["entries"][0]["checksums"].pop()),
    "checksums_not_u32": edit(lambda d: d["entries"][0]["checksums"].__setitem__(0, 2**40)),
    "checksums_string": entry(0, checksums="abc"),
}
MARKERS: dict[str, Corrupt] = {
    "garbage": lambda raw: b"\x00\x01garbage",
    "incomplete": lambda raw: raw[: len(raw) // 2],
    "not_utf8": lambda raw: b"\xff" + raw,
    "deep": lambda raw: b"[" * 100_000,
    "ranks_string": edit(lambda d: d.update(ranks="0")),
    "ranks_nested": edit(lambda d: d.update(ranks=[[0]])),
    "ranks_bool": edit(lambda d: d.update(ranks=[False])),
    "world_string": edit(lambda d: d.update(world_size="1")),
    "world_zero": edit(lambda d: d.update(world_size=0)),
    "world_huge": edit(lambda d: d.update(world_size=10**12)),
    "rank_outside_world": edit(lambda d: d.update(ranks=[0, 3])),
    "node_missing": edit(lambda d: d.pop("node")),
}


def flip(raw: bytes, at: int) -> bytes:
    out = bytearray(raw)
    out[at] ^= 0x40
    return bytes(out)


def in_chunk(manifest: Manifest, path: str, chunk: int, at: int = 123) -> int:
    """A byte offset in the data region: byte ``at`` of chunk ``chunk`` of entry ``path``."""
    e = next(e for e in manifest.entries if e.path == path)
    return e.offset + chunk * manifest.chunk_size + at


# ---- tiers ----------------------------------------------------------------------------
# Every case runs against file://; S3 runs every data case (its ranged reads are its own) and
# a few of each other kind (parsing is shared by all tiers). Each test stages its copies,
# corrupts one and reads it back in one tier session (an S3 session costs most of a test).

S3_CASES = {"not_json", "checksums_null", "deep_tree_100000", "chunk_size_zero", "incomplete",
            "world_huge", "ranks_string"}  # fmt: skip


def on_tiers(cases: list[str], s3_too: set[str] | None = None) -> list:
    return [pytest.param("file", c, id=f"file-{c}") for c in cases] + [
        pytest.param("s3", c, id=f"s3-{c}") for c in cases if s3_too is None or c in s3_too
    ]


@pytest.fixture
def tier_url(request, tmp_path) -> Callable[[str], str]:
    """``url(kind)``: a fresh tier of that kind ("file" or "s3") for this test."""

    def url(kind: str) -> str:
        if kind == "file":
            return f"file://{tmp_path / 'nvme'}"
        bucket = request.getfixturevalue("s3_bucket")
        server = request.getfixturevalue("s3_server")
        return f"s3://{bucket}/ckpt?endpoint_url={server.endpoint_url}"

    return url


async def _read_back(tier, step: int) -> None:
    """What restore and verify read: the commit markers, the manifest, sizes, every chunk."""
    listing = await tier_io.list_steps(tier, JOB)
    c = listing[0, step]
    if c is None or c.problems or not c.complete:
        raise ManifestError("; ".join(c.problems if c else ()) or f"step {step} incomplete")
    manifest, data = await tier_io.read_rank(tier, JOB, step, 0)
    where = f"{tier.spec.url}/{layout.data_key(JOB, step, 0)}"
    for e in manifest.entries:
        verify_entry(memoryview(data.numpy()), e, manifest.chunk_size, where)


def stage(template: Template, url: str, steps: tuple[int, ...], key: str | None = None,
          corrupt: Corrupt | None = None, delete: bool = False) -> Exception | None:  # fmt: skip
    """Put ``steps`` in the tier, corrupt (or delete) ``key``, and read step 2 back
    directly: the error that raised, or None."""

    async def go() -> Exception | None:
        tier = open_tier(url)
        try:
            await template.put_tier(tier, steps)
            if key is None:
                return None
            if delete:
                await tier.delete(key)
            else:
                raw = corrupt(await tier.get(key))
                await tier.put(key, [memoryview(raw)], len(raw))
            try:
                await _read_back(tier, STEP_NEW)
            except Exception as exc:
                return exc
            return None
        finally:
            await tier.close()

    return run(go())


def assert_refused(err: Exception | None) -> None:
    """Reading the corrupt copy directly gave a flashckpt error naming the step's objects."""
    assert isinstance(err, FlashCkptError), f"not refused with a flashckpt error: {err!r}"
    assert layout.step_prefix(JOB, STEP_NEW) in str(err)


def manifest_key(step: int = STEP_NEW) -> str:
    return layout.manifest_key(JOB, step, 0)


def data_key(step: int = STEP_NEW) -> str:
    return layout.data_key(JOB, step, 0)


ALL_MANIFESTS = {**MANIFESTS, **CHECKSUM_MANIFESTS}


@pytest.mark.parametrize(("kind", "case"), on_tiers(sorted(ALL_MANIFESTS), S3_CASES))
def test_tier_manifest_corruption_falls_back_to_the_older_step(shm, template, tier_url, kind, case):
    url = tier_url(kind)
    assert_refused(stage(template, url, (STEP_OLD, STEP_NEW), manifest_key(), ALL_MANIFESTS[case]))
    step, state = restore(url)
    assert step == STEP_OLD
    assert_holds(state, STEP_OLD)


@pytest.mark.parametrize(("kind", "case"), on_tiers(sorted(MARKERS), S3_CASES))
def test_tier_commit_marker_corruption_falls_back_to_the_older_step(
    shm, template, tier_url, kind, case
):
    url = tier_url(kind)
    key = layout.commit_key(JOB, STEP_NEW, "node0")
    err = stage(template, url, (STEP_OLD, STEP_NEW), key, MARKERS[case])
    assert_refused(err)
    assert key in str(err)  # the listing names the marker it could not read
    step, state = restore(url)
    assert step == STEP_OLD
    assert_holds(state, STEP_OLD)


def _data_cases(template: Template) -> dict[str, Corrupt | None]:
    manifest = template.copies[STEP_NEW][0]
    return {
        "truncated": lambda raw: raw[: len(raw) // 2],
        "one_byte_short": lambda raw: raw[:-1],
        "empty": lambda raw: b"",
        "longer": lambda raw: raw + b"\x00" * 100,
        "missing": None,
        "flipped_chunk": lambda raw: flip(raw, in_chunk(manifest, "w", 3)),
        "flipped_last_entry": lambda raw: flip(raw, in_chunk(manifest, "nested/k/0", 0, 3)),
    }


DATA_CASES = ["truncated", "one_byte_short", "empty", "longer", "missing", "flipped_chunk",
              "flipped_last_entry"]  # fmt: skip


@pytest.mark.parametrize(("kind", "case"), on_tiers(DATA_CASES))
def test_tier_data_corruption_falls_back_to_the_older_step(shm, template, tier_url, kind, case):
    url = tier_url(kind)
    corrupt = _data_cases(template)[case]
    err = stage(template, url, (STEP_OLD, STEP_NEW), data_key(), corrupt, delete=corrupt is None)
    assert_refused(err)
    step, state = restore(url)
    assert step == STEP_OLD
    assert_holds(state, STEP_OLD)


@pytest.mark.parametrize("case", ["deep_tree_100000", "checksums_null"])
def test_a_corrupt_tier_falls_back_to_the_next_tier_at_the_same_step(shm, template, tier_url, case):
    nvme, s3 = tier_url("file"), tier_url("s3")
    stage(template, s3, (STEP_OLD, STEP_NEW))
    assert_refused(stage(template, nvme, (STEP_OLD, STEP_NEW), manifest_key(), ALL_MANIFESTS[case]))
    step, state = restore(nvme, s3)
    assert step == STEP_NEW
    assert_holds(state, STEP_NEW)


def test_corrupt_s3_data_falls_back_to_the_tier_after_it(shm, template, tier_url):
    nvme, s3 = tier_url("file"), tier_url("s3")
    stage(template, nvme, (STEP_NEW,))
    corrupt = _data_cases(template)["truncated"]
    assert_refused(stage(template, s3, (STEP_NEW,), data_key(), corrupt))
    step, state = restore(s3, nvme)
    assert step == STEP_NEW
    assert_holds(state, STEP_NEW)


# ---- shared memory --------------------------------------------------------------------
# Header fields, by offset (see slot.py): state u32 @12, seq i64 @16, step @24, data_len @32,
# manifest_off @40, manifest_len @48, capacity @56, writer_pid u32 @64, sealed u32 @68,
# published_at f64 @72, checksum_off @80, n_chunks @88.


def poke(fmt: str, at: int, value: object) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(struct.pack(fmt, value))

    return apply


def truncate(size: int | None) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        h = _raw_header(path)
        os.truncate(path, size if size is not None else h["manifest_off"] - 100)

    return apply


def _raw_header(path: Path) -> dict:
    names = ["state", "seq", "step", "data_len", "manifest_off", "manifest_len", "capacity",
             "pid", "sealed", "published_at", "checksum_off", "n_chunks"]  # fmt: skip
    with open(path, "rb") as f:
        values = struct.unpack("<8sIIqqqqqqIIdqq", f.read(96))
    return dict(zip(names, values[2:], strict=True))


def slot_manifest(corrupt: Corrupt) -> Callable[[Path], None]:
    """Rewrite the slot's manifest, moving the checksums after it, as a writer would lay it."""

    def apply(path: Path) -> None:
        h = _raw_header(path)
        raw = path.read_bytes()
        manifest = raw[h["manifest_off"] : h["manifest_off"] + h["manifest_len"]]
        sums = raw[h["checksum_off"] : h["checksum_off"] + 4 * h["n_chunks"]]
        new = corrupt(manifest)
        checksum_off = align(h["manifest_off"] + len(new), 8)
        end = checksum_off + len(sums)
        with open(path, "r+b") as f:
            if end > len(raw):
                f.truncate(align(end, 4096))
            f.seek(h["manifest_off"])
            f.write(new)
            f.seek(checksum_off)
            f.write(sums)
            f.seek(48)
            f.write(struct.pack("<q", len(new)))
            f.seek(80)
            f.write(struct.pack("<q", checksum_off))

    return apply


def flip_data(chunk: int) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        raw, h = path.read_bytes(), _raw_header(path)
        manifest = Manifest.from_json(
            raw[h["manifest_off"] : h["manifest_off"] + h["manifest_len"]]
        )
        path.write_bytes(flip(raw, HEADER_SIZE + in_chunk(manifest, "w", chunk)))

    return apply


SLOTS: dict[str, Callable[[Path], None]] = {
    "state_invalid": poke("<I", 12, 7),
    "magic_zeroed": poke("<Q", 0, 0),
    "layout_zero": poke("<I", 8, 0),
    "seq_negative": poke("<q", 16, -2),
    "step_negative": poke("<q", 24, -5),
    "data_len_negative": poke("<q", 32, -8),
    "data_len_huge": poke("<q", 32, 2**50),
    "manifest_off_in_data": poke("<q", 40, HEADER_SIZE),
    "manifest_len_huge": poke("<q", 48, 2**40),
    "manifest_len_negative": poke("<q", 48, -1),
    "sealed_garbage": poke("<I", 68, 5),
    "published_at_nan": poke("<d", 72, float("nan")),
    "checksum_off_past_end": poke("<q", 80, 2**45),
    "n_chunks_huge": poke("<q", 88, 2**40),
    "n_chunks_negative": poke("<q", 88, -3),
    "n_chunks_wrong": poke("<q", 88, 3),
    "step_not_the_manifests": poke("<q", 24, 7),
    "file_cut_before_manifest": truncate(None),
    "file_cut_to_header": truncate(HEADER_SIZE + 100),
    "file_cut_inside_header": truncate(50),
    "file_emptied": truncate(0),
    "flipped_chunk": flip_data(2),
    **{f"manifest_{name}": slot_manifest(fn) for name, fn in MANIFESTS.items()},
}


@pytest.mark.parametrize("case", sorted(SLOTS))
def test_slot_corruption_falls_back_to_the_older_step(shm, template, case):
    files = template.put_memory(shm, (STEP_OLD, STEP_NEW))
    SLOTS[case](files[STEP_NEW])
    _assert_slot_refused(files[STEP_NEW])
    step, state = restore()
    assert step == STEP_OLD
    assert_holds(state, STEP_OLD)


def _assert_slot_refused(path: Path) -> None:
    """A reader (the agent, the CLI) gets a flashckpt error naming the slot file."""
    with pytest.raises(FlashCkptError) as err:
        slot = Slot.open_readonly(path)
        try:
            with read_locked(slot) as snap:
                assert snap is not None, "a corrupt slot read as holding nothing"
                for e in snap.manifest.entries:
                    verify_entry(
                        slot.data(snap.header), e, snap.manifest.chunk_size, str(slot.path)
                    )
        finally:
            slot.close()
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "case", ["state_invalid", "manifest_len_huge", "manifest_chunk_size_zero", "flipped_chunk"]
)
def test_a_corrupt_slot_falls_back_to_a_tier_at_the_same_step(shm, template, tmp_path, case):
    nvme = f"file://{tmp_path / 'nvme'}"
    stage(template, nvme, (STEP_NEW,))
    files = template.put_memory(shm, (STEP_OLD, STEP_NEW))
    SLOTS[case](files[STEP_NEW])
    step, state = restore(nvme)
    assert step == STEP_NEW
    assert_holds(state, STEP_NEW)


@pytest.mark.parametrize("case", ["state_invalid", "n_chunks_huge", "file_cut_before_manifest"])
def test_a_slot_corrupted_after_it_was_mapped_is_skipped_then_rewritten(shm, template, case):
    """The owner has the slots mapped (it restored before); a later corruption of one is
    skipped by the next restore, and the owner's next save overwrites it."""
    files = template.put_memory(shm, (STEP_OLD, STEP_NEW))
    with Checkpointer(job=JOB, chunk_size=CHUNK) as ck:
        state = blank()
        assert ck.restore(state) == STEP_NEW
        SLOTS[case](files[STEP_NEW])
        state = blank()
        assert ck.restore(state) == STEP_OLD
        assert_holds(state, STEP_OLD)
        for step in (3, 4):  # two saves: both slots rewritten, the corrupt one first
            ck.save(step, snapshot_state(step))
        state = blank()
        assert ck.restore(state) == 4
        assert_holds(state, 4)


def test_every_slot_corrupt_and_no_tier_restores_nothing(shm, template):
    files = template.put_memory(shm, (STEP_OLD, STEP_NEW))
    SLOTS["state_invalid"](files[STEP_OLD])
    SLOTS["manifest_not_json"](files[STEP_NEW])
    step, state = restore()
    assert step is None and state["step"] is None


def test_asking_for_a_corrupt_step_names_it_as_not_restorable(shm, template):
    files = template.put_memory(shm, (STEP_OLD, STEP_NEW))
    SLOTS["flipped_chunk"](files[STEP_NEW])
    with (
        Checkpointer(job=JOB, chunk_size=CHUNK) as ck,
        pytest.raises(
            CheckpointNotFoundError,
            match=f"step {STEP_NEW} was not restored, and the state holds part",
        ),
    ):
        ck.restore(blank(), step=STEP_NEW)


def test_a_manifest_error_names_its_source_and_what_was_expected():
    m = Manifest("j", 0, 1, {"t": "dict", "items": []}, (), 8)
    doc = json.loads(m.to_json())
    doc["entries"] = [
        {"path": "w", "kind": "tensor", "dtype": "float32", "shape": [2], "offset": 0,
         "nbytes": 4, "first_chunk": 0, "checksums": None}
    ]  # fmt: skip
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(json.dumps(doc), source="s3://b/k")
    assert str(err.value) == (
        "s3://b/k: entry 0 ('w'): nbytes must be numel x itemsize = 2 x 4 for shape [2] "
        "float32, found 4; the copy is corrupt, restore from another tier or an older step"
    )
