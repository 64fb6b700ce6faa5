"""Replicas stored once and DTensor shards resharded, against real tiers (a directory, moto S3).

Manifests are built here as the trainer builds them (leaves laid out, checksummed) and stored
with the tier API as the agent stores them, so every case can say exactly which bytes a tier
holds and which a restore reads. The multi-process paths (DDP restarted at other world sizes,
FSDP2 restored at one and four ranks) are in ``test_distributed.py`` and ``test_fsdp2.py``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from flashckpt.errors import CheckpointNotFoundError, ChecksumError, ManifestError
from flashckpt.format import layout, tier_io
from flashckpt.format.checksum import chunk_checksums
from flashckpt.format.manifest import Manifest, ShardInfo
from flashckpt.format.slot import align
from flashckpt.restore.into_state import Source, plan, run
from flashckpt.restore.reshard import Resharder, per_rank, portable
from flashckpt.restore.sources import run_with_tier
from flashckpt.snapshot.flatten import Leaf, plan_layout

JOB, STEP = "rep", 7
FULL = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)


def manifest_of(rank: int, leaves: list[Leaf], world: int, chunk: int = 64,
                replicas: tuple[int, int, int] | None = None) -> tuple[Manifest, bytearray]:  # fmt: skip
    """A sealed manifest and data for ``leaves``, as a trainer would publish them."""
    lay = plan_layout(leaves, chunk)
    data = bytearray(lay.data_len)
    for e, lf in zip(lay.entries, leaves, strict=True):
        data[e.offset : e.offset + e.nbytes] = (
            lf.tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        )
    tree = {
        "t": "dict",
        "items": [[lf.path, {"t": "tensor", "i": i}] for i, lf in enumerate(leaves)],
    }
    m = Manifest(JOB, rank, STEP, tree, lay.entries, lay.data_len, chunk_size=chunk,
                 world_size=world, replicas=replicas)  # fmt: skip
    return m.with_checksums(chunk_checksums(memoryview(data), m.entries, chunk)), data


def shard_of(rows: slice, world: int) -> Leaf:
    info = ShardInfo((10, 6), (rows.start, 0), ("Shard(dim=0)",), (world,))
    return Leaf("w", "tensor", FULL[rows].clone(), info)


@pytest.fixture(params=["file", "s3"])
def url(request, tmp_path) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/ckpt"
    return f"file://{tmp_path / 'tier'}"


def ddp_ranks(world: int) -> list[tuple[Manifest, bytearray]]:
    """Each rank: the replicated model weight (the same everywhere) and its own RNG bytes."""
    out = []
    for r in range(world):
        own = torch.full((5,), r, dtype=torch.uint8)
        leaves = [Leaf("model", "tensor", FULL.clone(), replicated=True),
                  Leaf("rng", "tensor", own)]  # fmt: skip
        out.append(manifest_of(r, leaves, world, replicas=(0, world, 1)))
    return out


def restore(manifest: Manifest, data, where: str = "test") -> dict:
    state = {"model": torch.zeros(10, 6), "rng": torch.zeros(5, dtype=torch.uint8)}
    run(plan(manifest, state, False), Source(torch.as_tensor(data), where))
    return state


def test_a_replica_is_stored_once_and_every_rank_reads_it_back(url):
    ranks = ddp_ranks(3)

    async def go(tier):
        for m, d in ranks:
            await tier_io.write_rank(tier, m, memoryview(d), primary=0)
        sizes = [len(await tier.get(layout.data_key(JOB, STEP, r))) for r in range(3)]
        return sizes, [await tier_io.read_rank(tier, JOB, STEP, r) for r in range(3)]

    sizes, back = run_with_tier(url, go)
    # The primary stores everything; the others only their 5 own bytes (aligned).
    assert sizes == [len(ranks[0][1]), align(5), align(5)], sizes
    for r, (m, data) in enumerate(back):
        state = restore(m, data)
        assert torch.equal(state["model"], FULL)
        assert state["rng"].tolist() == [r] * 5


def test_a_node_local_copy_is_complete_without_a_primary(url):
    """``primary`` None (or the rank itself) stores the whole shard: nothing points away."""
    m, d = ddp_ranks(2)[1]

    async def go(tier):
        await tier_io.write_rank(tier, m, memoryview(d), primary=1)
        return await tier.get(layout.manifest_key(JOB, STEP, 1))

    stored = json.loads(run_with_tier(url, go))
    assert all("stored_at" not in e for e in stored["entries"])


def test_entries_with_groups_of_their_own_are_stored_by_each_groups_rank(url):
    """Megatron's shape: each entry replicated across its own ranks. Of four ranks, "a" is
    held by ranks 0 and 2, "b" by all four; ``primary`` names the rank storing each entry,
    and each rank's data holds only what it stores itself (rank 0, storing all of its own,
    is stored whole). Every rank reads all of its entries back."""

    def leaves(r: int) -> list[Leaf]:
        a = Leaf("a", "tensor", FULL[:5].clone() + r % 2, replicated=True, replicas=(r % 2, 4, 2))
        b = Leaf("b", "tensor", FULL[5:].clone(), replicated=True, replicas=(0, 4, 1))
        return [a, b, Leaf("own", "tensor", torch.full((5,), r, dtype=torch.uint8))]

    ranks = [manifest_of(r, leaves(r), 4) for r in range(4)]
    stores = [{"a": 0, "b": 0}, {"a": 1, "b": 0}, {"a": 0, "b": 0}, {"a": 1, "b": 0}]

    async def go(tier):
        for (m, d), where in zip(ranks, stores, strict=True):
            await tier_io.write_rank(tier, m, memoryview(d), primary=where)
        docs = [json.loads(await tier.get(layout.manifest_key(JOB, STEP, r))) for r in range(4)]
        return docs, [await tier_io.read_rank(tier, JOB, STEP, r) for r in range(4)]

    docs, back = run_with_tier(url, go)
    assert [{e["path"]: e.get("stored_at") for e in d["entries"]} for d in docs] == [
        {"a": None, "b": None, "own": None}, {"a": None, "b": 0, "own": None},
        {"a": 0, "b": 0, "own": None}, {"a": 1, "b": 0, "own": None},
    ]  # fmt: skip
    assert docs[0]["data_len"] == len(ranks[0][1])  # nothing of rank 0's points away
    for r, (m, data) in enumerate(back):
        assert [e.stored_at for e in m.entries] == [None] * 3
        saved, original = {e.path: e for e in ranks[r][0].entries}, ranks[r][1]
        raw = bytes(data.numpy()) if isinstance(data, torch.Tensor) else bytes(data)
        for e in m.entries:
            o = saved[e.path]
            assert raw[e.offset : e.offset + e.nbytes] == original[o.offset : o.offset + o.nbytes]


def test_a_bad_or_missing_primary_copy_is_a_corrupt_copy(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    ranks = ddp_ranks(2)
    run_with_tier(url, lambda t: asyncio.gather(
        *(tier_io.write_rank(t, m, memoryview(d), primary=0) for m, d in ranks)))  # fmt: skip
    data0 = tmp_path / "tier" / layout.data_key(JOB, STEP, 0)
    good = data0.read_bytes()
    data0.write_bytes(b"\xff" + good[1:])  # the replicated weight of rank 0, flipped
    m, d = run_with_tier(url, lambda t: tier_io.read_rank(t, JOB, STEP, 1))
    with pytest.raises(ChecksumError, match="'model'"):
        restore(m, d, "rank 1")
    data0.write_bytes(good[:100])
    with pytest.raises(ManifestError, match="truncated|fewer"):
        run_with_tier(url, lambda t: tier_io.read_rank(t, JOB, STEP, 1))
    (tmp_path / "tier" / layout.manifest_key(JOB, STEP, 0)).unlink()
    with pytest.raises(CheckpointNotFoundError):
        run_with_tier(url, lambda t: tier_io.read_rank(t, JOB, STEP, 1))


def test_stored_at_is_checked_like_every_other_field():
    m, _ = ddp_ranks(2)[1]
    doc = json.loads(m.to_json())
    for bad in ({"stored_at": -1, "replicated": True}, {"stored_at": 0},
                {"stored_at": 0, "replicated": True, "offset": 8}, {"replicated": 1}):  # fmt: skip
        broken = json.loads(json.dumps(doc))
        broken["entries"][1].update(bad)  # "rng": not replicated
        with pytest.raises(ManifestError, match="corrupt"):
            Manifest.from_json(json.dumps(broken), "test")
    broken = {**doc, "replicas": [2, 1, 1]}
    with pytest.raises(ManifestError, match="replicas"):
        Manifest.from_json(json.dumps(broken), "test")


def store_shards(url: str, rows: list[slice], chunk: int = 64) -> None:
    world = len(rows)
    shards = [manifest_of(r, [shard_of(s, world)], world, chunk) for r, s in enumerate(rows)]
    run_with_tier(url, lambda t: asyncio.gather(*(tier_io.write_rank(t, m, memoryview(d))
                                            for m, d in shards)))  # fmt: skip


def fetch(url: str, world: int, offset: tuple[int, int], shape: tuple[int, int]) -> tuple:
    """The block at ``offset``/``shape``, and the bytes read from the tier for it."""
    saved = run_with_tier(url, lambda t: tier_io.read_manifest(t, JOB, STEP, 0)).entries[0]
    target = ShardInfo((10, 6), offset, ("Shard(dim=0)",), (1,))
    resharder = Resharder()
    assert resharder.want("w", saved, target, shape) == ""
    read = []

    async def go(tier):
        inner = tier.get_into

        async def counted(key, out, start=0):
            read.append(len(out))
            await inner(key, out, start)

        tier.get_into = counted
        await resharder.fetch(tier, JOB, STEP, 0, world)

    run_with_tier(url, go)
    return resharder.block("w"), sum(read)


@pytest.mark.parametrize(
    "offset,shape",
    [((0, 0), (10, 6)), ((3, 0), (3, 6)), ((8, 0), (2, 6)), ((0, 2), (10, 2)), ((4, 0), (0, 6))],
)
def test_a_block_is_assembled_from_the_shards_that_overlap_it(url, offset, shape):
    store_shards(url, [slice(0, 5), slice(5, 10)])
    block, _ = fetch(url, 2, offset, shape)
    assert torch.equal(
        block, FULL[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
    )


def test_only_the_chunks_holding_the_rows_asked_for_are_read(tmp_path):
    """Rows 3-5 of ten 24-byte rows in 64-byte chunks: rank 0's chunk 1 (rows 3-4 live in
    bytes 72-120) and rank 1's chunk 0, not the 240 bytes of both shards."""
    url = f"file://{tmp_path / 'tier'}"
    store_shards(url, [slice(0, 5), slice(5, 10)])
    block, read = fetch(url, 2, (3, 0), (3, 6))
    assert torch.equal(block, FULL[3:6])
    assert read == 56 + 64, read  # rank 0: bytes 64-120 (its last chunk); rank 1: bytes 0-64


def test_a_corrupt_or_missing_shard_fails_the_reshard(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    store_shards(url, [slice(0, 5), slice(5, 10)])
    data1 = tmp_path / "tier" / layout.data_key(JOB, STEP, 1)
    raw = bytearray(data1.read_bytes())
    raw[0] ^= 1
    data1.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="'w'"):
        fetch(url, 2, (0, 0), (10, 6))
    fetch(url, 2, (0, 0), (4, 6))  # rows of rank 0 only: the corrupt shard is not read
    (tmp_path / "tier" / layout.manifest_key(JOB, STEP, 1)).unlink()
    with pytest.raises(CheckpointNotFoundError):
        fetch(url, 2, (0, 0), (10, 6))


def test_shards_that_do_not_cover_the_block_are_refused(tmp_path):
    url = f"file://{tmp_path / 'tier'}"
    store_shards(url, [slice(0, 5)])  # a one-rank "job" holding only half the rows
    with pytest.raises(ManifestError, match="cover 30 of the 60 elements"):
        fetch(url, 1, (0, 0), (10, 6))


def test_which_copies_a_new_rank_may_restore_from():
    replicated, _ = ddp_ranks(2)[0]
    assert portable(replicated, 2) and not portable(replicated, 3)
    assert per_rank(replicated) == ["rng"]
    sharded, _ = manifest_of(0, [shard_of(slice(0, 5), 2)], 2)
    assert portable(sharded, 2) and per_rank(sharded) == []
    plain, _ = manifest_of(0, [Leaf("rng", "tensor", torch.zeros(3))], 2)
    assert not portable(plain, 2)
