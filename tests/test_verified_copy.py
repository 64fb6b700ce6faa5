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
from conftest import in_forked_child

from flashckpt.restore import entry_copy

native = entry_copy._native


def test_the_compiled_copy_is_built_where_it_can_be():
    """On x86-64 with a compiler the set-up builds it: a restore there never falls back to
    the slower copy from Python without anyone noticing."""
    if platform.machine() != "x86_64" or shutil.which("cc") is None:
        pytest.skip("no compiler or not x86-64: the restore copies from Python here")
    assert native is not None, "flashckpt/_verified_copy.c was not built: run `make setup`"


needs_native = pytest.mark.skipif(native is None, reason="the compiled verified copy is not built")


@pytest.fixture(params=native.kernels() if native is not None else [])
def kernel(request):
    """Each crc32c kernel this CPU runs, in turn (the fastest is the one used)."""
    used = native.kernel()
    native.kernel(request.param)
    yield request.param
    native.kernel(used)


@needs_native
def test_the_fastest_kernel_this_cpu_has_is_used():
    assert native.kernel() == native.kernels()[0]
    with pytest.raises(ValueError, match="no crc32c kernel 'nonesuch'"):
        native.kernel("nonesuch")


@needs_native
@pytest.mark.parametrize(
    "n",
    [0, 1, 7, 8, 9, 255, 256, 511, 512, 513, 767, 768, 769, 4095, 12287, 12288, 12289,
     3 * 12288 + 13, (1 << 20) - 1, 1 << 20, (1 << 20) + 321],
)  # fmt: skip
def test_its_crc32c_is_the_one_manifests_record(n, kernel):
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
@pytest.mark.parametrize("aligned", [False, True])
def test_every_chunk_lands_whole_and_a_bad_one_is_named(kernel, aligned):
    """Unaligned sources and targets, and targets aligned as a tensor's (large chunks are
    then stored past the caches)."""
    rng = random.Random(7)
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    dst = torch.zeros(8 << 20, dtype=torch.uint8)
    spans, at = [], 0
    for n in [0, 1, 5, 8, 4096, 12288 * 3 + 3, 1 << 20, (2 << 20) + 1, 333, 700, 1 << 20]:
        offset = rng.randrange(0, 64)
        skew = 64 - (dst.data_ptr() + at + offset) % 64 if aligned else 7
        spans.append((at + offset, at + offset + skew, n))
        at += offset + n + 128
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
@pytest.mark.parametrize("threads", [2, 3, 64, 1000])
def test_a_run_shared_over_threads_lands_whole_and_names_its_first_bad_chunk(kernel, threads):
    """Rows shared out over threads (torch's OpenMP team where there is one): every chunk
    lands, and of two bad chunks in different shares the first in row order is named."""
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    dst = torch.zeros(8 << 20, dtype=torch.uint8)
    sizes = [70_000, 3, 1 << 20, 0, 5000, 600_000, 12_289, 1 << 20, 999, 250_000] * 2
    spans, at = [], 0
    for n in sizes:
        spans.append((at, at, n))
        at += n
    to, frm, size, want = _rows(src, dst, spans)
    args = (to, frm, size, want, 0, len(spans))
    assert native.copy_checked(*args, src.data_ptr(), threads) == (-1, 0)
    assert torch.equal(dst[:at], src[:at])
    assert native.checked_at(*args, threads) == (-1, 0)
    for j in (17, 2):  # the later one first: a share of its own whatever the threads
        f, _, n = spans[j]
        src[f + n - 1] ^= 0x01
    found = crc32c.crc32c(memoryview(src.numpy())[spans[2][0] : spans[2][0] + spans[2][2]])
    assert native.copy_checked(*args, src.data_ptr(), threads) == (2, found)
    assert native.checked_at(*args, threads) == (2, found)
    assert native.copy_checked(to, frm, size, want, 3, 18, src.data_ptr(), threads)[0] == 17
    with pytest.raises(ValueError, match="threads must be at least 1"):
        native.checked_at(*args, 0)
    with pytest.raises(TypeError, match="takes 6 or 7 arguments"):
        native.checked_at(*args, 2, 3)


@needs_native
def test_shares_run_on_torchs_openmp_team_but_never_in_a_forked_child():
    """torch's OpenMP runtime is in the process: shared runs use its team. A forked child
    does not (its parent's team threads stayed behind) and still copies, on one thread."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not compute with OpenMP")
    assert native.team()
    torch.ones(1 << 20).add_(1)  # the team has run in this process
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    cols = _rows(src, dst, [(0, 0, 2 << 20), (2 << 20, 2 << 20, 2 << 20)])

    def child() -> bool:  # no torch op here (libgomp's own would hang)
        copied = native.copy_checked(*cols, 0, 2, src.data_ptr(), 2)
        return (not native.team() and copied == (-1, 0)
                and dst.numpy().tobytes() == src.numpy().tobytes())  # fmt: skip

    assert in_forked_child(child, timeout=120), "the forked child's copy failed"


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
        for threads in (1, 2, 5):
            dst.zero_()
            assert native.read_checked(to, frm, size, want, 0, len(spans), fd, threads) == (
                -1, 0, 0)  # fmt: skip
            for f, t, n in spans:
                assert torch.equal(dst[t : t + n], src[f : f + n])
        want[9] ^= 1
        assert native.read_checked(to, frm, size, want, 0, len(spans), fd)[:2] == (9, want[9] ^ 1)
        assert native.read_checked(to, frm, size, want, 0, len(spans), fd, 3)[:2] == (
            9, want[9] ^ 1)  # fmt: skip
        os.truncate(path, spans[-2][0] + 10)  # ends inside the chunk before the last
        assert native.read_checked(to, frm, size, want, 10, len(spans), fd)[2] == 1
        assert native.read_checked(to, frm, size, want, 10, len(spans), fd, 2)[2] == 1
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.read_checked(to, frm, size, want, 0, 1, 10_000)  # not an open file
    with pytest.raises(OSError):
        native.read_checked(to, frm, size, want, 0, len(spans), 10_000, 2)
