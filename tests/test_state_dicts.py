"""What the walks take of a module's or an optimizer's ``state_dict()``: the same dict torch's
makes (keys, order, groups), a module's tensors undetached where no hook could mind, and
torch's own wherever the faster way does not apply."""

from __future__ import annotations

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.snapshot.state_dicts import state_dict_of


def _stepped(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def _same(ours: dict, torchs: dict) -> None:
    assert list(ours) == list(torchs)
    assert list(ours["state"]) == list(torchs["state"])
    for k, v in torchs["state"].items():
        assert ours["state"][k] is v  # the optimizer's own per-parameter dicts, as torch's
    assert ours["param_groups"] == torchs["param_groups"]
    for a, b in zip(ours["param_groups"], torchs["param_groups"], strict=True):
        assert list(a) == list(b)  # the same keys in the same order ("params" last)


def test_an_optimizers_state_dict_is_torchs_own_dict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = list(model.named_parameters())
    adamw = torch.optim.AdamW(
        [{"params": [p for _, p in named[:2]], "lr": 0.1},
         {"params": [p for _, p in named[2:]], "weight_decay": 0.0}],
        lr=1e-3,
    )  # fmt: skip
    _stepped(adamw, list(model.parameters()))
    _same(state_dict_of(adamw), adamw.state_dict())
    # Named parameter groups keep their names; a momentum-less SGD has no state at all, and
    # one with momentum a state for the parameters that had gradients only.
    by_name = torch.optim.Adam(model.named_parameters())
    _stepped(by_name, list(model.parameters()))
    _same(state_dict_of(by_name), by_name.state_dict())
    assert "param_names" in state_dict_of(by_name)["param_groups"][0]
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    _stepped(plain, list(model.parameters()))
    _same(state_dict_of(plain), plain.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.zero_grad(set_to_none=True)
    first = model[0].weight
    first.grad = torch.randn_like(first)
    sgd.step()
    assert len(sgd.state) == 1
    _same(state_dict_of(sgd), sgd.state_dict())
    # Loaded from a state dict, the state is new dicts: still torch's numbering.
    again = torch.optim.AdamW(model.parameters())
    again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    _stepped(again, list(model.parameters()))
    _same(state_dict_of(again), again.state_dict())


def test_an_optimizer_torchs_walk_must_see_gets_torchs_state_dict():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    hooked = torch.optim.AdamW(params)
    _stepped(hooked, params)
    hooked.register_state_dict_post_hook(lambda opt, sd: {**sd, "mark": 1})
    assert state_dict_of(hooked)["mark"] == 1
    before = torch.optim.AdamW(params)
    seen = []
    before.register_state_dict_pre_hook(seen.append)
    state_dict_of(before)
    assert seen == [before]

    class Own(torch.optim.SGD):
        def state_dict(self):
            return {"own": True}

    assert state_dict_of(Own(params, lr=0.1)) == {"own": True}
    # A parameter in two groups (a list edited after the fact): torch numbers it once.
    twice = torch.optim.SGD(params[:2], lr=0.1)
    twice.param_groups.append({**twice.param_groups[0], "params": [params[1], params[2]]})
    _same(state_dict_of(twice), twice.state_dict())
    # A state keyed by something other than a parameter: what torch makes of it.
    odd = torch.optim.SGD(params, lr=0.1)
    odd.state["note"] = {"x": 1}
    _same(state_dict_of(odd), odd.state_dict())


def test_a_modules_tensors_are_its_own_unless_a_hook_could_mind():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    ours, torchs = state_dict_of(model), model.state_dict()
    assert list(ours) == list(torchs)  # the same keys (no non-persistent buffer), in order
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(ours[k] is own[k] for k in ours)
    assert ours["0.weight"].requires_grad  # the parameter itself, not a detached alias
    # A hook anywhere in the tree gets torch's detached values, as it would without flashckpt.
    seen = []
    model[1].register_state_dict_post_hook(lambda m, sd, prefix, meta: seen.append(sd))
    hooked = state_dict_of(model)
    assert (
        seen and not hooked["0.weight"].requires_grad and hooked["0.weight"] is not own["0.weight"]
    )
    plain = torch.nn.Linear(2, 2)
    plain.register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append(keep_vars))
    assert not state_dict_of(plain)["weight"].requires_grad and seen[-1] is False


def test_parameters_saved_and_restored_as_themselves_stay_leaves_and_walks_stay_steady(shm_dir):
    """The walks hold the parameters themselves: a restore writes into them without making an
    autograd graph, a parameter frozen mid-run keeps the walk steady (the compiled check is
    made again after two saves), and both come back exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    _stepped(opt, list(model.parameters()))
    state = {"model": model, "optim": opt}
    with Checkpointer(job="keep-vars") as ck:
        walker = ck._walker
        for step in range(3):
            ck.save(step, state)
        model[2].weight.requires_grad_(False)  # frozen: the compiled check refuses the walk
        for step in range(3, 6):
            ck.save(step, state)
        assert walker.full_walks == 1
        assert walker.walk(state, frozenset(), None).plain  # made again, and passing
        ck.wait(5)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()  # the grads of a step cut short
        assert ck.restore(state) == 5
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
        assert p.is_leaf and p.grad_fn is None and p.grad is None
        assert p.requires_grad == (name != "2.weight")
    loss = model(torch.randn(2, 8)).sum()
    loss.backward()  # training goes on from the restored parameters
    assert model[0].weight.grad is not None and model[2].weight.grad is None


def test_a_module_tree_is_looked_at_once_a_module_and_a_cycle_is_refused_not_walked_forever():
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)  # one module in two places
    assert state_dict_of(model)["0.weight"] is shared.weight
    looped = torch.nn.Sequential(torch.nn.Linear(2, 2))
    looped.add_module("again", looped)  # a cycle: torch's own state_dict() refuses it
    with pytest.raises(RecursionError):
        state_dict_of(looped)
