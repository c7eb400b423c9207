"""Sequences that once served a stale FP8 copy or let release on diverge from release off, each
replayed action by action on the state machine of test_stateful.py (release on and off side
by side, both invariants checked after every action), and the single cases behind them."""

import pytest
import torch
from test_stateful import ReleaseOnEqualsOff

import zrw
from helpers.bitwise import assert_bitwise, assert_bitwise_dicts
from zrw import cache

SEQUENCES = {
    # apply_init inside a step holds a weight; frozen then, its release for good must let the
    # master take what apply wrote first
    "release_for_good_after_apply": (
        dict(recipe="mxfp8", keep_released=False, release_frozen=True, main_grad=True),
        [("data_write", "head", "add_"), ("between_action", "load_not_a_tensor"),
         ("micro_batch", 0), ("inside_action", "eval_inference"), ("inside_action", "eval_no_grad"),
         ("inside_action", "apply_init"), ("micro_batch", 1), ("inside_action", "state_dict"),
         ("freeze", "up", True), ("micro_batch", 2), ("freeze", "up", False), ("micro_batch", 3)],
    ),
    # an eval's copy after `.data = t`: the training use that releases it syncs the master
    "eval_copy_then_release": (
        dict(recipe="mxfp8-32x32", keep_released=False, release_frozen=True, main_grad=True),
        [("zero_grad", True), ("step",), ("data_write", "up", "add_"), ("model_zero_grad",),
         ("second_optimizer",), ("deepcopy_all",), ("data_write", "down", "assign"),
         ("between_action", "eval_no_grad"), ("micro_batch", 0)],
    ),
    # release off: an eval's copy filed under no_grad, then `.data = t`
    "eval_copy_then_data_assign": (
        dict(recipe="mxfp8-32x32", keep_released=False, release_frozen=False, main_grad=True),
        [("micro_batch", 0), ("step",), ("data_write", "down", "add_"),
         ("between_action", "eval_no_grad"), ("second_optimizer",), ("model_zero_grad",),
         ("data_write", "down", "assign")],
    ),
    # a weight frozen after its backward, released for good, then stepped: its copy must go
    "frozen_after_backward_then_stepped": (
        dict(recipe="mxfp8-32x32", keep_released=False, release_frozen=True, main_grad=False),
        [("step",), ("micro_batch", 0), ("freeze", "down", False), ("failing_step",),
         ("micro_batch", 1), ("deepcopy_optimizer",), ("step",)],
    ),
    # cache_clear("master") restored a frozen weight released for good from its FP8 copy
    "cache_clear_of_a_frozen_weight": (
        dict(recipe="mxfp8", keep_released=False, release_frozen=True, main_grad=True),
        [("data_write", "head", "assign"), ("keep_vars", True), ("deepcopy_optimizer",),
         ("zero_grad", False), ("data_write", "head", "add_"), ("load_held_keep_vars",),
         ("micro_batch", 0), ("zero_grad", True), ("freeze", "head", False),
         ("restore_weights", "restore"), ("micro_batch", 2), ("deepcopy_optimizer",),
         ("restore_weights", "cache_clear")],
    ),
}  # fmt: skip


def _run(machine, rule):
    name, *args = rule
    if name == "data_write":
        return machine.data_write(which=args[0], how=args[1])
    if name == "freeze":
        return machine.freeze(which=args[0], trainable=args[1])
    return getattr(machine, name)(*args)


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_sequence_keeps_release_on_equal_to_off_and_copies_current(name):
    cfg, rules = SEQUENCES[name]
    machine = ReleaseOnEqualsOff()
    try:
        with cache.verify():
            machine.build(max_grad_norm=0.5, **cfg)
            for rule in rules:
                _run(machine, rule)
                machine.release_on_equals_off()
                machine.cached_copies_are_current()
    finally:
        machine.teardown()


def _flat_model(buf):
    """A Megatron-style layer: its weight a view of one flat buffer (`p.data = buf[...]`)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    zrw.convert(model, recipe="mxfp8")
    model[0].weight.data = buf[: 32 * 64].view(32, 64)
    return model


def test_a_write_to_the_flat_buffer_between_micro_batches_is_seen():
    torch.manual_seed(0)
    buf = torch.randn(32 * 64 + 64).to(torch.bfloat16)
    model = _flat_model(buf)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 64).to(torch.bfloat16)
    model(x).float().sum().backward()
    assert not cache.is_released(model[0].weight)  # the guard keeps a view of a buffer
    buf.mul_(3)  # through the buffer: the weight's own version counter does not move
    with cache.verify():
        got = model(x)
    ref = zrw.nn.functional.mx_linear(
        x, model[0].weight.detach().clone(), None, zrw.get_recipe("mxfp8"), release=False
    )
    assert_bitwise(got, ref)
    opt.zero_grad()


def test_a_refused_use_changes_nothing():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    cache.quant_and_release(w, "mxfp8", release=False, scale_mode="rceil")
    cache.cache_clear()
    with pytest.raises(ValueError, match="scale_mode must be"):
        cache.quant_and_release(w, "mxfp8", scale_mode="nearest")
    with pytest.raises(ValueError, match="recipe must be"):
        cache.quant_and_release(w, "fp8")
    rec = zrw.record.find_record(w)
    assert rec.quantized_as == ("mxfp8", zrw.ops.E4M3, "rceil")
    assert cache.cache_state(w) == "none"


def test_loading_a_detached_keep_vars_dict_after_the_step_changes_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    zrw.convert(model, recipe="mxfp8")
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    held = model.state_dict(keep_vars=True)
    model(torch.randn(8, 64).to(torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.detach() for k, v in held.items()})
    assert cache.is_released(model[0].weight)
    assert_bitwise_dicts(before, model.state_dict(), "after loading the detached dict")


def test_cache_clear_from_the_masters_restores_frozen_weights_exactly():
    """cache_clear("master") restores a frozen weight released for good from its master too,
    not from its FP8 copy (lossy)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    zrw.convert(model, recipe="mxfp8", release_frozen=True)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    want = model[0].weight.detach().clone()
    model[0].weight.requires_grad_(False)
    model(torch.randn(4, 64).to(torch.bfloat16))
    assert cache.cache_state(model[0].weight) == "released_for_good"
    cache.cache_clear("master")
    assert cache.cache_state(model[0].weight) == "none"
    assert_bitwise(model[0].weight.detach(), want)
    del opt
