"""The contract of zero-redundancy weights at the edges where users live: whatever a
user does through PyTorch's public API to a converted model or its optimizer, training with
release on gives bit for bit what release off gives, or the call raises an error in both.

A differential harness: the same tiny model (embedding, norm and head outside zrw, two
converted linears) is trained with release on and off under zrw.optim.MasterWeights(AdamW),
with a scripted sequence of user actions between and inside steps (loads, casts, applies,
evals under no_grad and inference_mode, zero_grad variants, optimizer state round trips,
injected allocation failures and retried steps). Hypothesis draws the sequences. A second
harness checks MasterWeights against torch's AdamW on FP32 parameters directly (the numbers
must be the same bits there: MasterWeights' masters are the FP32 parameters).
"""

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zrw
import zrw.testing
from helpers.bitwise import assert_bitwise_dicts, same_bits
from helpers.user_actions import (
    BETWEEN,
    BF16,
    INSIDE,
    Tiny,
    assert_step_fails_inside,
    build,
    loss_of,
    snapshot,
)
from zrw import cache
from zrw.optim import MasterWeights, attach


def run(release, script, recipe="mxfp8", steps=4, micro=2):
    """Train with `script`: a list of (step, where, action) with where "between" (before that
    step's first micro-batch) or "inside" (after its first micro-batch). Returns the losses,
    the final state dict and what each action raised (its type name, or None)."""
    model, opt = build(release, recipe)
    ctx = {}
    losses, raised = [], []
    for s in range(steps):
        fault = False
        for at, where, name in script:
            if at == s and where == "between":
                if name == "fault_step":
                    fault = True
                    continue
                raised.append(_do(BETWEEN[name], model, opt, ctx))
        for i in range(micro):
            loss = loss_of(model, 100 * s + i)
            (loss / micro).backward()
            losses.append(loss.detach())
            if i == 0:
                for at, where, name in script:
                    if at == s and where == "inside":
                        raised.append(_do(INSIDE[name], model, opt, ctx))
        if fault:
            # An exception inside the inner step: the step can be retried and gives what an
            # undisturbed step gives.
            assert_step_fails_inside(opt)
        opt.step()
        opt.zero_grad()
        if s == 0:
            ctx["saved"] = snapshot(model)
    return torch.stack(losses), snapshot(model), raised


def _do(fn, model, opt, ctx):
    try:
        fn(model, opt, ctx)
        return None
    except Exception as e:  # compared between the two runs
        return type(e).__name__


def assert_same_run(script, recipe="mxfp8"):
    cache.cache_clear()
    on = run(True, script, recipe)
    cache.cache_clear()
    off = run(False, script, recipe)
    cache.cache_clear()
    assert on[2] == off[2], f"{script}: errors differ: on {on[2]}, off {off[2]}"
    assert same_bits(on[0], off[0]), (
        f"{script}: losses differ: {on[0].tolist()} vs {off[0].tolist()}"
    )
    for k in off[1]:
        a, b = on[1][k], off[1][k]
        assert a.dtype == b.dtype and torch.equal(a, b), f"{script}: final {k} differs"
    return on


@pytest.mark.parametrize("name", sorted(BETWEEN))
def test_each_action_between_steps(name):
    losses, _, raised = assert_same_run([(2, "between", name)])
    assert torch.isfinite(losses).all()
    expected_errors = {"load_bad_shape", "load_not_a_tensor"}
    assert any(raised) == (name in expected_errors), (name, raised)


@pytest.mark.parametrize("name", sorted(INSIDE))
def test_each_action_inside_a_step(name):
    _, _, raised = assert_same_run([(1, "inside", name)])
    assert raised == [None], (name, raised)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_load_between_steps_is_not_undone_by_the_next_step(recipe):
    """model.load_state_dict(sd) then training: the loaded values are what the next step
    starts from, for the parameters outside zrw's layers too (their FP32 masters follow)."""
    model, opt = build(True, recipe)
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
        if s == 0:
            saved = snapshot(model)
    model.load_state_dict(saved)
    # a fresh optimizer over the loaded model is the reference
    cache.cache_clear()
    ref, ref_opt = build(True, recipe, seed=1)
    ref.load_state_dict(saved)
    ref_opt = attach(MasterWeights(torch.optim.AdamW, ref.parameters(), lr=1e-2))
    for m, o in ((model, opt), (ref, ref_opt)):
        o.inner.state.clear()  # same optimizer state (none) in both: only the values differ
        loss_of(m, 5).backward()
        o.step()
        o.zero_grad()
    a, b = snapshot(model), snapshot(ref)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ZRW_ACTION_EXAMPLES / ZRW_ACTION_RANDOM=1: a longer, randomized sweep by hand.
@settings(
    max_examples=int(os.environ.get("ZRW_ACTION_EXAMPLES", "50")),
    deadline=None,
    derandomize=os.environ.get("ZRW_ACTION_RANDOM") is None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(1, 3), st.just("between"), st.sampled_from(sorted(BETWEEN))),
            st.tuples(st.integers(0, 3), st.just("inside"), st.sampled_from(sorted(INSIDE))),
        ),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from(["mxfp8", "mxfp8-32x32"]),
)
def test_random_sequences_release_on_equals_off(script, recipe):
    assert_same_run(script, recipe)


@pytest.mark.parametrize("bad", ["shape", "not_a_tensor", "scalar_shape"])
def test_a_failed_load_changes_nothing(bad):
    """A state dict with one bad value: the load raises before anything is written (torch
    alone would write every valid key first), with release on and off."""
    for release in (True, False):
        cache.cache_clear()
        model, opt = build(release)
        loss_of(model, 0).backward()
        opt.step()
        opt.zero_grad()
        before = snapshot(model)
        sd = {k: v + 1 for k, v in before.items()}
        key = {"shape": "norm.bias", "not_a_tensor": "up.weight", "scalar_shape": "head.weight"}[
            bad
        ]
        sd[key] = {"shape": torch.zeros(3), "not_a_tensor": "x", "scalar_shape": torch.zeros(())}[
            bad
        ]
        with pytest.raises(RuntimeError, match=rf"{key}.*|.*{key}"):
            model.load_state_dict(sd)
        after = snapshot(model)
        for k in before:
            assert torch.equal(before[k], after[k]), (release, k)
        loss_of(model, 1).backward()
        opt.step()  # and the masters were not touched either: the step is the undisturbed one
        cache.cache_clear()


# --- MasterWeights against torch's own optimizer on FP32 parameters -----------------------------


def _fp32_pair():
    torch.manual_seed(3)
    a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    b = copy.deepcopy(a)
    ours = MasterWeights(torch.optim.AdamW, a.parameters(), lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    return a, ours, b, plain


def assert_same_parameters(a, b):
    assert_bitwise_dicts(dict(a.named_parameters()), dict(b.named_parameters()), "parameter")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_masters_follow_torch_adamw_with_a_parameter_without_gradient(set_to_none):
    """zero_grad(set_to_none=False) then a step where one layer gets no gradient: torch steps
    it with its zero gradient (decay and moments move it); MasterWeights must do the same."""
    a, ours, b, plain = _fp32_pair()
    x = torch.randn(4, 16)
    for s in range(4):
        for m, o in ((a, ours), (b, plain)):
            o.zero_grad(set_to_none=set_to_none)
            if s == 2:  # only the last layer gets a gradient
                m[2](torch.relu(m[0](x)).detach()).sum().backward()
            else:
                m(x).sum().backward()
            o.step()
        assert_same_parameters(a, b)


def test_masters_follow_writes_between_steps_as_torch_does():
    """load_state_dict, apply(init) and writes through .data between steps: the next step
    starts from the written values, as torch's optimizer on the parameters does."""
    a, ours, b, plain = _fp32_pair()
    x = torch.randn(4, 16)
    saved = copy.deepcopy(a.state_dict())
    writes = [
        lambda m: m.load_state_dict(saved),
        lambda m: m.apply(
            lambda mod: nn.init.constant_(mod.bias, 0.5) if isinstance(mod, nn.Linear) else None
        ),
        lambda m: m[0].weight.data.mul_(0.5),
    ]
    for s in range(4):
        for m, o in ((a, ours), (b, plain)):
            if s:
                writes[s - 1](m)
            m(x).sum().backward()
            o.step()
            o.zero_grad()
        assert_same_parameters(a, b)


def test_a_failed_inner_step_can_be_retried():
    a, ours, b, plain = _fp32_pair()
    x = torch.randn(4, 16)
    for m in (a, b):
        m(x).sum().backward()

    assert_step_fails_inside(ours)
    assert all(p.grad is not None for p in a.parameters()), "the gradients are kept"
    ours.step()
    plain.step()
    assert_same_parameters(a, b)


def test_out_of_memory_while_converting_gradients_can_be_retried():
    zrw.memory.install()
    torch.manual_seed(5)
    a = nn.Linear(256, 256).to(BF16)
    b = copy.deepcopy(a)
    ours = MasterWeights(torch.optim.SGD, a.parameters(), lr=0.1)
    ref = MasterWeights(torch.optim.SGD, b.parameters(), lr=0.1)
    x = torch.randn(8, 256).to(BF16)
    for m in (a, b):
        m(x).float().sum().backward()
    # the second FP32 gradient of at least 256 KiB (the weight's) fails to allocate
    with zrw.testing.fail_allocations(min_bytes=256 * 256 * 4, count=1):
        with pytest.raises(torch.OutOfMemoryError):
            ours.step()
    assert a.weight.grad is not None and a.bias.grad is not None
    ours.step()
    ref.step()
    assert_same_parameters(a, b)


def test_duplicate_parameters_are_refused():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"params'\]\[1\].*same parameter.*listed once"):
        MasterWeights(torch.optim.SGD, [lin.weight, lin.weight], lr=0.1)
    opt = MasterWeights(torch.optim.SGD, [lin.weight], lr=0.1)
    with pytest.raises(ValueError, match="listed once"):
        opt.add_param_group({"params": [lin.bias, lin.bias]})
    assert len(opt.param_groups) == 1


def test_weights_no_optimizer_owns_are_never_released():
    """A trainable weight that no optimizer with the zrw boundary (or master) owns keeps its
    BF16 storage: state_dict() reads it and nothing is lost to a lossy restore."""
    torch.manual_seed(0)
    model = Tiny().to(BF16)
    zrw.convert(model)
    loss_of(model, 0).backward()
    assert not cache.is_released(model.up.weight)
    before = model.up.weight.detach().clone()
    assert torch.equal(model.state_dict()["up.weight"], before)
    opt = attach(MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2))
    cache.next_step()
    loss_of(model, 1).backward()
    assert cache.is_released(model.up.weight)
    del opt


def test_load_state_dict_assign_keeps_the_weight_names():
    model, opt = build(True)
    loss_of(model, 0).backward()
    opt.step()
    saved = snapshot(model)
    model.load_state_dict(saved, assign=True)
    assert cache.weight_name(model.up.weight) == "up.weight"


def test_a_write_through_data_to_a_frozen_weight_is_seen_by_the_next_training_use():
    """A frozen weight that keeps its storage (release_frozen=False), written through `.data`
    between two training uses of one step (PEFT's merge, a hand-written update): the second
    use computes with the written values, never with a copy of the old ones."""
    torch.manual_seed(0)
    lin = zrw.nn.MXLinear(64, 64, bias=False, dtype=BF16)
    lin.weight.requires_grad_(False)
    x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
    lin(x).float().sum().backward()
    lin.weight.data += 0.5
    y = lin(x)
    fresh = zrw.nn.MXLinear(64, 64, bias=False, dtype=BF16)
    with torch.no_grad():
        fresh.weight.copy_(lin.weight)
    fresh.weight.requires_grad_(False)
    assert torch.equal(y, fresh(x))


def test_error_paths_name_what_was_expected():
    lin = nn.Linear(4, 4)
    with pytest.raises(
        ValueError,
        match=r"max_grad_norm must be a positive number or None, "
        r"got -1",
    ):
        MasterWeights(torch.optim.SGD, lin.parameters(), lr=0.1, max_grad_norm=-1)
    with pytest.raises(ValueError, match=r"restore_frozen: fill must be 'dequant'.*got 'zeros'"):
        cache.restore_frozen(lin, "zeros")
    with pytest.raises(ValueError, match=r"frozen_values: mode must be one of .*got 'exact'"):
        with zrw.checkpoint.frozen_values("exact"):
            pass
    # a parameter whose shape changed under the optimizer (p.data = a tensor of another shape)
    opt = MasterWeights(torch.optim.SGD, lin.parameters(), lr=0.1)
    lin.weight.data = torch.zeros(2, 4)
    lin.weight.grad = torch.zeros(2, 4)
    with pytest.raises(
        RuntimeError,
        match=r"changed shape from \(4, 4\) to \(2, 4\).*new "
        r"optimizer",
    ):
        opt.step()
