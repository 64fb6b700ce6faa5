"""The compiled verified copy (``flashckpt/_verified_copy.c``): its crc32c is the one the
manifests record, every chunk lands whole whatever its length or alignment, and
a chunk whose bytes do not match is named, never passed. Speed is measured in
``benchmarks/snapshot.py --case many-tensors``, never here."""

from __future__ import annotations

import os
import platform
import random
import shutil

import crc32c
import numpy as np
import pytest
import torch

from flashckpt.restore import entry_copy

native = entry_copy._native


def test_the_compiled_copy_is_built_where_it_can_be():
    """On x86-64 with a compiler the set-up builds it: a restore there never falls back to
    the slower copy from Python without anyone noticing."""
    if platform.machine() != "x86_64" or shutil.which("cc") is None:
        pytest.skip("no compiler or not x86-64: the restore copies from Python here")
    assert native is not None, "flashckpt/_verified_copy.c was not built: run `make setup`"


needs_native = pytest.mark.skipif(native is None, reason="the compiled verified copy is not built")


@needs_native
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 12287, 12288, 12289, 3 * 12288 + 13, 1 << 20])
def test_its_crc32c_is_the_one_manifests_record(n):
    data = os.urandom(n)
    for value in (0, 0xDEADBEEF):
        assert native.crc32c(data, value) == crc32c.crc32c(data, value)
    cut = n // 3  # continued over a split, as a chunk is checked piece by piece
    assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == crc32c.crc32c(data)


def _rows(src: torch.Tensor, dst: torch.Tensor, spans: list[tuple[int, int, int]]):
    """The int64 columns of chunks (source offset, target offset, bytes), with the crc32c
    each one's source bytes have."""
    raw = memoryview(src.numpy())
    to = np.array([dst.data_ptr() + t for _, t, _ in spans], dtype=np.int64)
    frm = np.array([f for f, _, _ in spans], dtype=np.int64)
    size = np.array([n for _, _, n in spans], dtype=np.int64)
    want = np.array([crc32c.crc32c(raw[f : f + n]) for f, _, n in spans], dtype=np.int64)
    return to, frm, size, want


@needs_native
def test_every_chunk_lands_whole_and_a_bad_one_is_named():
    rng = random.Random(7)
    src = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8)
    dst = torch.zeros(6 << 20, dtype=torch.uint8)
    spans, at = [], 0
    for n in [0, 1, 5, 8, 4096, 12288 * 3 + 3, 1 << 20, (2 << 20) + 1, 333]:
        offset = rng.randrange(0, 64)  # unaligned sources and targets
        spans.append((at + offset, at + offset + 7, n))
        at += offset + n + 64
    to, frm, size, want = _rows(src, dst, spans)
    assert native.copy_checked(to, frm, size, want, 0, len(spans), src.data_ptr()) == (
        -1,
        0,
    )
    for f, t, n in spans:
        assert torch.equal(dst[t : t + n], src[f : f + n])
    assert native.checked_at(to, frm, size, want, 0, len(spans)) == (-1, 0)
    # A flipped byte in the source of chunk 6: copied, found, named with the crc it has.
    f, t, n = spans[6]
    src[f + n // 2] ^= 0xFF
    found = crc32c.crc32c(memoryview(src.numpy())[f : f + n])
    assert native.copy_checked(to, frm, size, want, 0, len(spans), src.data_ptr()) == (
        6,
        found,
    )
    assert native.checked_at(to, frm, size, want, 0, len(spans)) == (6, found)
    # Unchecked chunks (-1) are copied and never judged; a share of the rows is just those.
    unchecked = want.copy()
    unchecked[6] = -1
    assert native.copy_checked(to, frm, size, unchecked, 4, 8, src.data_ptr()) == (-1, 0)


@needs_native
def test_columns_that_are_not_int64_or_too_short_are_refused():
    col = np.zeros(4, dtype=np.int64)
    with pytest.raises(TypeError, match="int64"):
        native.checked_at(np.zeros(4, dtype=np.int32), col, col, col, 0, 4)
    with pytest.raises(ValueError, match="holds 4 rows, 5 are asked for"):
        native.checked_at(col, col, col, col, 0, 5)
    with pytest.raises(ValueError, match="rows out of order"):
        native.checked_at(col, col, col, col, 3, 2)


@needs_native
def test_copy_crc_continues_a_chunk_piece_by_piece():
    src = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    value = native.copy_crc(dst.data_ptr(), src.data_ptr(), 40_000, 0)
    value = native.copy_crc(dst.data_ptr() + 40_000, src.data_ptr() + 40_000, 60_003, value)
    assert torch.equal(dst, src) and value == crc32c.crc32c(src.numpy().tobytes())


@needs_native
def test_a_files_chunks_are_read_into_their_targets_checked_and_a_cut_file_is_said(tmp_path):
    """Chunks read straight from a tier's file: gaps between them read past, batches cut
    where a gap is large, a chunk that reads wrong named, a file that ends early said."""
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    path = tmp_path / "data"
    path.write_bytes(src.numpy().tobytes())
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    spans, at = [], 0
    for i, n in enumerate([100, 5000, 1 << 20, 8, 0, 300_000, 64] * 2):
        at += 10_000 if i == 5 else 64  # one gap too large to read past in a batch
        spans.append((at, at, n))
        at += n
    to, frm, size, want = _rows(src, dst, spans)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert native.read_checked(to, frm, size, want, 0, len(spans), fd) == (-1, 0, 0)
        for f, t, n in spans:
            assert torch.equal(dst[t : t + n], src[f : f + n])
        want[9] ^= 1
        assert native.read_checked(to, frm, size, want, 0, len(spans), fd)[:2] == (9, want[9] ^ 1)
        os.truncate(path, spans[-2][0] + 10)  # ends inside the chunk before the last
        assert native.read_checked(to, frm, size, want, 10, len(spans), fd)[2] == 1
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.read_checked(to, frm, size, want, 0, 1, 10_000)  # not an open file
