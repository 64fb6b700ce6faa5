"""A module behind ``torch.compile``'s wrapper (``_orig_mod.``) or DDP's (``module.``) is the
same state as the module: saved from either, restored into either, in both directions, with its
optimizer; and a snapshot whose keys carry the prefixes (a wrapped module's state dict saved as a
plain dict) restores into the unwrapped module's, and the reverse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from states import same, tiny_model, train

from flashckpt import Checkpointer
from flashckpt.snapshot.state_dicts import unwrapped, wrapper_free


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")  # the wrapper, without a code generator


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model)


def save_then_restore(saved: torch.nn.Module, into: torch.nn.Module) -> None:
    opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    train(saved, opt, range(2))
    fresh_opt = torch.optim.AdamW(into.parameters(), lr=1e-2)
    with Checkpointer(job="wrapped") as ck:
        ck.save(2, {"model": saved, "optim": opt})
        ck.wait(2, timeout=10)
        assert ck.restore({"model": into, "optim": fresh_opt}) == 2
    assert same(unwrapped(saved).state_dict(), unwrapped(into).state_dict())
    for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values(),
                    strict=True):  # fmt: skip
        assert a.keys() == b.keys() and all(same(a[k].reshape(-1), b[k].reshape(-1)) for k in a)
    # Trained on, both take the same steps.
    assert train(saved, opt, range(2, 4)) == train(into, fresh_opt, range(2, 4))


@pytest.mark.parametrize("direction", ["compiled-to-plain", "plain-to-compiled",
                                       "compiled-to-compiled"])  # fmt: skip
def test_a_compiled_module_is_its_modules_state(shm_dir, direction):
    source, target = direction.split("-to-")
    saved, into = tiny_model(), tiny_model(seed=7)
    saved = compiled(saved) if source == "compiled" else saved
    into = compiled(into) if target == "compiled" else into
    save_then_restore(saved, into)


@pytest.mark.parametrize("direction", ["ddp-to-plain", "plain-to-ddp", "ddp-to-compiled"])
def test_a_ddp_wrapped_module_is_its_modules_state(shm_dir, one_rank_group, direction):
    source, target = direction.split("-to-")
    wrap = {"ddp": ddp, "plain": lambda m: m, "compiled": compiled}
    save_then_restore(wrap[source](tiny_model()), wrap[target](tiny_model(seed=7)))


@pytest.mark.parametrize("saved_wrapped", [True, False])
def test_keys_with_the_wrappers_prefixes_restore_either_way(shm_dir, saved_wrapped):
    """A plain dict of a compiled module's state (``_orig_mod.`` keys) restores into the plain
    module's state dict, and the plain module's into a compiled module's (whose tensors are
    the module's: the copies land in it)."""
    model, other = tiny_model(), tiny_model(seed=7)
    source = compiled(model) if saved_wrapped else model
    with Checkpointer(job="prefixed") as ck:
        ck.save(1, {"model": source.state_dict()})
        ck.wait(1, timeout=10)
        target = other.state_dict() if saved_wrapped else compiled(other).state_dict()
        assert ck.restore({"model": target}) == 1
    assert same(model.state_dict(), other.state_dict())


def test_wrapper_free_keys():
    assert wrapper_free("module._orig_mod.0.weight") == "0.weight"
    assert wrapper_free("_orig_mod.module.0.weight") == "0.weight"
    assert wrapper_free("layers.0._orig_mod.w") == "layers.0.w"  # a compiled submodule
    assert wrapper_free("a_orig_mod.b") == "a_orig_mod.b"  # not a segment of its own
