"""Everything users checkpoint comes back bit-exact, with its Python types."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import run_python
from states import ALL_DTYPES, rng_state, same, tensor_of, tiny_model, train

from flashckpt import Checkpointer


def roundtrip(state: dict, target: dict, **kw) -> int | None:
    with Checkpointer(job="rt", **kw) as ck:
        ck.save(5, state)
        ck.wait(5, timeout=10)
        return ck.restore(target)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_bit_exact(shm_dir, dtype):
    src = tensor_of(dtype)
    dst = torch.zeros_like(src)
    assert roundtrip({"t": src}, {"t": dst}) == 5
    assert same(src, dst)


def test_views_scalars_and_empty(shm_dir):
    base = torch.arange(60, dtype=torch.float64).view(6, 10)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 7),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
    }
    expected = {k: v.clone() for k, v in state.items()}
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    assert roundtrip(state, target) == 5
    for k in state:
        assert torch.equal(target[k].resolve_conj(), expected[k].resolve_conj()), k


def test_containers_and_leaf_types_are_kept(shm_dir):
    leaves = {
        "int": 7, "big": 2**100, "float": 0.1, "nan": math.nan, "inf": -math.inf,
        "bool": True, "none": None, "str": "héllo", "bytes": b"\x00\xff",
        "tuple": (1, (2.0, "x"), []), "list": [1, [2, (3,)]],
        "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "int_keys": {0: "a", (1, 2): "b", None: "c"},
        "nested": {"t": torch.ones(2), "l": [torch.zeros(3, dtype=torch.int8)]},
    }  # fmt: skip
    target = {"leaves": {k: None for k in leaves}}
    target["leaves"]["nested"] = {"t": torch.empty(2), "l": [torch.empty(3, dtype=torch.int8)]}
    assert roundtrip({"leaves": leaves}, target) == 5
    assert same(target["leaves"], leaves)


def test_rng_states_roundtrip(shm_dir):
    saved = rng_state()
    target = {"rng": {k: None for k in saved}}
    assert roundtrip({"rng": saved}, target) == 5
    assert same(target["rng"], saved)
    random.setstate(target["rng"]["python"])
    np.random.set_state(target["rng"]["numpy_legacy"])
    torch.set_rng_state(target["rng"]["torch"])
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    rng_state()
    assert draws == (random.random(), np.random.rand(), torch.rand(1).item())


class Counter:
    """A user object that is not a Stateful and not JSON: it must be pickled."""

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Counter) and other.n == self.n


def test_pickled_leaves_need_allow_pickle(shm_dir):
    from flashckpt import PickleNotAllowedError

    with Checkpointer(job="pk") as ck:
        ck.save(1, {"obj": Counter(3)})
        target = {"obj": None}
        with pytest.raises(PickleNotAllowedError, match="'obj'.*allow_pickle=True"):
            ck.restore(target)
        assert target["obj"] is None  # nothing loaded
        assert ck.restore(target, allow_pickle=True) == 1
        assert target["obj"] == Counter(3)


def test_model_and_adamw_in_a_new_process(shm_dir, tmp_path):
    """Save after real steps, kill nothing: a new process restores and trains identically."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, range(3))
    sched.step()
    ck = Checkpointer(job="model")
    ck.save(3, {"model": model, "optim": opt, "sched": sched, "rng": torch.get_rng_state()})
    ck.wait(3, timeout=10)
    ck._sealer.drain(10)
    ck._pair.release()  # hand the rank over to the child without removing the slots
    expected = train(model, opt, range(3, 6))
    torch.save(model.state_dict(), tmp_path / "after.pt")

    code = f"""
import torch
from states import tiny_model, train, same
from flashckpt import Checkpointer
model = tiny_model(seed=123)
opt = torch.optim.AdamW(model.parameters(), lr=0.5)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
ck = Checkpointer(job="model")
assert ck.restore({{"model": model, "optim": opt, "sched": sched, "rng": torch.get_rng_state()}}) == 3
assert opt.param_groups[0]["betas"] == (0.8, 0.95) and type(opt.param_groups[0]["betas"]) is tuple
assert sched.last_epoch == 1
print(repr(train(model, opt, range(3, 6))))
after = torch.load({str(tmp_path / "after.pt")!r})
assert all(same(after[k], v) for k, v in model.state_dict().items())
ck.close()
"""
    out = run_python(code)
    assert eval(out.stdout.strip().splitlines()[-1]) == expected
