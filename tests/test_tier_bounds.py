"""What a tier holds is read within bounds: metadata objects larger than any flashckpt writes,
and sizes a manifest claims for bytes that do not exist, are corrupt copies (the restore falls
back), never a read or an allocation that exhausts the machine."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli_commands import store

from flashckpt import Checkpointer, ManifestError
from flashckpt.format import layout, tier_io
from flashckpt.restore.sources import run_with_tier


def test_a_manifest_or_marker_larger_than_the_bound_is_a_corrupt_copy(tmp_path, monkeypatch):
    url = f"pfs://{tmp_path / 'pfs'}"
    dirs = {"shm_dir": tmp_path / "shm", "run_dir": tmp_path / "run"}
    with Checkpointer(url, job="big", **dirs) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"t": torch.full((256,), float(step))})
            ck.wait(step, tier=url, timeout=60)
    root = tmp_path / "pfs"
    monkeypatch.setattr(tier_io, "MAX_MANIFEST_BYTES", 64 * 1024)
    monkeypatch.setattr(tier_io, "MAX_MARKER_BYTES", 64 * 1024)
    manifest = root / layout.manifest_key("big", 3, 0)
    manifest.write_bytes(manifest.read_bytes() + b" " * (100 * 1024))  # still valid JSON
    (marker,) = (root / "big" / "step-000000000002").glob("commit-*.json")
    marker.write_bytes(marker.read_bytes() + b" " * (100 * 1024))
    with pytest.raises(ManifestError, match="larger than 65536 bytes"):
        run_with_tier(url, lambda t: tier_io.read_manifest(t, "big", 3, 0))
    listing = run_with_tier(url, lambda t: tier_io.list_steps(t, "big"))
    assert not listing[0, 2].complete and "larger than" in listing[0, 2].problems[0]
    restored = {"t": torch.zeros(256)}
    with Checkpointer(url, job="big", shm_dir=tmp_path / "shm2", run_dir=tmp_path / "run2") as ck:
        assert ck.restore(restored) == 1  # 3's manifest and 2's marker are corrupt copies
    assert float(restored["t"][0]) == 1.0


def test_a_size_claimed_for_bytes_another_rank_stores_is_checked_before_it_is_allocated(tmp_path):
    """Rank 1 stores its replicated model at rank 0; a corrupt manifest claiming that entry is a
    terabyte would once size a buffer for it before comparing it with rank 0's copy."""
    url = f"pfs://{tmp_path / 'pfs'}"
    store(url, "huge", [1], world=2)
    path = tmp_path / "pfs" / layout.manifest_key("huge", 1, 1)
    doc = json.loads(path.read_bytes())
    doc["chunk_size"] = 2**40  # one chunk per entry, so the checksums stay few
    for i, e in enumerate(doc["entries"]):
        e["first_chunk"], e["checksums"] = i, [0]
        if e.get("stored_at") is not None:
            e["shape"], e["nbytes"] = [2**38], 2**40  # float32: one TiB
    path.write_bytes(json.dumps(doc).encode())
    with pytest.raises(ManifestError, match=r"whose copy has float32 \[3000\]"):
        run_with_tier(url, lambda t: tier_io.read_rank(t, "huge", 1, 1))


def test_memory_that_cannot_be_had_for_tier_metadata_is_a_corrupt_copy():
    with pytest.raises(ManifestError, match="cannot be allocated"):
        tier_io.allocate(2**62, "somewhere")
