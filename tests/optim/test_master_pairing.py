"""MasterWeights pairs masters with parameters by identity, as torch's optimizers key their
state by parameter: a parameter replaced in or appended to a param group gets a fresh master
and fresh moments, a removed one gives them up, and `opt.state[p]` is p's state (popping it or
setting it to {} resets p's moments). Checked against torch.optim.AdamW's own step on the same
FP32 values and gradients."""

import pytest
import torch

import zrw
from helpers.bitwise import assert_bitwise

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    ).to(torch.bfloat16)
    zrw.convert(model, recipe="mxfp8")
    opt = zrw.optim.AdamW(model.parameters(), **HP)
    return model, opt


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()


def grads(opt):
    return {
        id(p): p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None
    }


def torch_step(value, grad, state=None):
    """torch.optim.AdamW's step of an FP32 tensor from `value` with `grad` (state: its
    moments, or None for fresh ones). Returns the new value and state."""
    p = torch.nn.Parameter(value.detach().float().clone())
    ref = torch.optim.AdamW([p], **HP)
    if state is not None:
        ref.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    p.grad = grad.float()
    ref.step()
    return p.detach(), ref.state[p]


def test_a_replaced_parameter_gets_its_own_master_and_fresh_moments():
    model, opt = build()
    backward(model, 1)
    opt.step()
    opt.zero_grad()
    p0 = opt.param_groups[0]["params"][0]
    q = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    q_before = q.detach().clone()
    opt.param_groups[0]["params"][0] = q
    q.grad = torch.randn(64, 64).to(torch.bfloat16)
    want, _ = torch_step(q_before, q.grad)
    backward(model, 2)
    opt.step()
    # q: one fresh AdamW step from its own value (not p0's master written into it)
    assert opt.state[q]["step"] == 1
    assert_bitwise(opt.masters[0][0], want)
    assert_bitwise(q.detach(), want.to(torch.bfloat16))
    # p0: out of the optimizer, as in torch: neither stepped nor owned any more
    assert p0 not in opt.state
    assert not zrw.cache.is_owned(p0)
    p1 = opt.param_groups[0]["params"][1]
    assert opt.state[p1]["step"] == 2


def test_an_appended_parameter_is_stepped_from_its_value():
    model, opt = build()
    backward(model, 1)
    opt.step()
    opt.zero_grad()
    q = torch.nn.Parameter(torch.randn(16, 16).to(torch.bfloat16))
    q.grad = torch.randn(16, 16).to(torch.bfloat16)
    want, _ = torch_step(q.detach(), q.grad)
    opt.param_groups[0]["params"].append(q)
    backward(model, 2)
    opt.step()
    assert opt.state[q]["step"] == 1
    assert_bitwise(q.detach(), want.to(torch.bfloat16))


@pytest.mark.parametrize("how", ["pop", "empty", "del"])
def test_resetting_opt_state_of_a_parameter_resets_its_moments(how):
    model, opt = build()
    backward(model, 1)
    opt.step()
    opt.zero_grad()
    p = opt.param_groups[0]["params"][1]
    other = opt.param_groups[0]["params"][0]
    kept = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[other].items()}
    if how == "pop":
        opt.state.pop(p)
    elif how == "empty":
        opt.state[p] = {}
    else:
        del opt.state[p]
    assert p not in opt.state or not opt.state[p]
    master_before = opt.masters[0][1].clone()
    other_before = opt.masters[0][0].clone()
    backward(model, 2)
    g = grads(opt)
    want, _ = torch_step(master_before, g[id(p)])
    want_other, _ = torch_step(other_before, g[id(other)], kept)
    opt.step()
    assert opt.state[p]["step"] == 1
    assert_bitwise(opt.masters[0][1], want)
    assert_bitwise(opt.masters[0][0], want_other)  # the other's moments were kept


def test_a_duplicate_appended_to_a_group_is_refused_before_anything_changes():
    model, opt = build()
    backward(model, 1)
    p = opt.param_groups[0]["params"][0]
    opt.param_groups[0]["params"].append(p)
    before = [m.clone() for m in opt.masters[0]]
    g = grads(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\].*same parameter"):
        opt.step()
    for m, b in zip(opt.masters[0], before):
        assert_bitwise(m, b)
    assert_bitwise(p.grad, g[id(p)])  # the gradients were not consumed
    opt.param_groups[0]["params"].pop()
    opt.step()  # fixed: the step runs


def test_state_of_a_tensor_outside_the_optimizer_is_its_own():
    _, opt = build()
    t = torch.zeros(3)
    opt.state[t]["x"] = 1
    assert opt.state[t] == {"x": 1}
    assert t in opt.state
