"""The device path: page-locked slots, side-stream copies, blocking and overlapped modes."""

from __future__ import annotations

import pytest
import torch

from flashckpt import Checkpointer

pytestmark = pytest.mark.gpu


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model, opt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    model(torch.randn(64, 256, device="cuda", generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_snapshot_is_the_state_at_save_time(shm_dir, overlap):
    model, opt = _model()
    _step(model, opt, 0)
    with Checkpointer(job=f"cuda-{overlap}", overlap=overlap) as ck:
        ck.restore({"model": model, "optim": opt})
        ck.save(1, {"model": model, "optim": opt})
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        _step(model, opt, 1)  # forward changes BatchNorm stats, step() changes the weights
        assert ck.wait(1, timeout=30) == 1
        fresh, fresh_opt = _model()
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 1
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.cpu(), expected[k]), k


def test_slots_are_page_locked(shm_dir):
    model, opt = _model()
    with Checkpointer(job="pinned") as ck:
        ck.restore({"model": model})
        ck.save(1, {"model": model})
        ck.wait(1, timeout=30)
        assert ck._prep.pinned, "no slot was registered with cudaHostRegister"
        assert all(s.buf.is_pinned() for s in ck._pair.slots if s is not None)
