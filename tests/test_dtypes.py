"""The format's table of dtypes, which the node agent checks manifests with, without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from flashckpt.format import dtypes


def test_the_table_is_the_installed_torchs_dtypes_and_item_sizes():
    ours = {
        str(v).removeprefix("torch."): v.itemsize
        for v in vars(torch).values()
        if isinstance(v, torch.dtype)
    }
    assert ours == dtypes.ITEMSIZE


def test_the_numpy_set_is_what_numpy_views_of_tensors_take():
    viewable = set()
    for name, dtype in dtypes.torch_dtypes().items():
        try:
            torch.empty(0, dtype=dtype).numpy()
        except (TypeError, RuntimeError):
            continue
        viewable.add(name)
    assert viewable == dtypes.NUMPY


def test_the_agent_reads_a_manifest_with_dtype_leaves_without_loading_torch(
    shm_dir, run_dir, tmp_path
):
    """A step whose state holds a dtype and a device among its leaves is persisted by the
    node agent, and its manifest read back by a process that never imports torch."""
    from flashckpt import Checkpointer
    from flashckpt.format import layout

    url = f"file://{tmp_path / 'tier'}"
    state = {"w": torch.ones(3), "dt": torch.bfloat16, "dev": torch.device("cpu")}
    with Checkpointer(url, job="dt") as ck:
        ck.save(1, state)
        assert ck.wait(1, tier=url, timeout=60) == 1
        agent = int((run_dir / "dt.pid").read_text())
        maps = Path(f"/proc/{agent}/maps").read_text()
        assert "libtorch" not in maps  # the agent that persisted it never loaded torch
    path = tmp_path / "tier" / layout.manifest_key("dt", 1, 0)
    code = (
        "import sys\n"
        "from flashckpt.format.manifest import Manifest\n"
        f"m = Manifest.from_json(open({str(path)!r}, 'rb').read())\n"
        "print(len(m.entries), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]
    restored = {"w": torch.zeros(3), "dt": None, "dev": None}
    with Checkpointer(url, job="dt", shm_dir=shm_dir / "fresh", run_dir=run_dir / "fresh") as ck:
        assert ck.restore(restored) == 1
    assert restored["dt"] is torch.bfloat16 and restored["dev"] == torch.device("cpu")
