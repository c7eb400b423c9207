"""Verify mode (zrw.cache.verify, or ZRW_VERIFY=1 for a whole run): every use of a cached weight
re-quantizes the weight's current value and compares the bytes with the copy it is served; a
stale copy raises StaleCopyError naming the weight and the last lifecycle event that touched
it. A clean run is unchanged by it, bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

import zrw
from helpers.bitwise import assert_bitwise
from zrw import cache

BF16 = torch.bfloat16


def _layer(recipe="mxfp8", release=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(BF16)
    zrw.convert(model, recipe=recipe, release=release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _plant_stale_copy(model):
    """A cached copy, then a write through `.data` in place: no version bump, same bytes
    address, so the cache cannot see it (the step boundary is its rule)."""
    x = torch.randn(4, 64).to(BF16)
    model(x).float().sum().backward()
    assert cache.cache_state(model[0].weight) == "cached"
    model[0].weight.data.mul_(2)
    return x


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_a_planted_stale_copy_is_caught_by_name(recipe):
    model, _ = _layer(recipe)
    x = _plant_stale_copy(model)
    model(x)  # verify off: served as the cache's rule allows
    with cache.verify(), pytest.raises(cache.StaleCopyError, match=r"'0\.weight'.*last lifecycle"):
        model(x)


def test_verify_can_be_turned_off_inside():
    model, _ = _layer()
    x = _plant_stale_copy(model)
    with cache.verify(), cache.verify(False):
        model(x)


def test_the_environment_variable_turns_it_on_for_a_run():
    code = (
        "import torch, zrw\n"
        "from zrw import cache\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)\n"
        "zrw.convert(m, release=False)\n"
        "opt = zrw.optim.AdamW(m.parameters())\n"
        "x = torch.randn(4, 64).to(torch.bfloat16)\n"
        "m(x).float().sum().backward()\n"
        "m[0].weight.data.mul_(2)\n"
        "try:\n"
        "    m(x)\n"
        "except cache.StaleCopyError as e:\n"
        "    print('caught', e)\n"
    )
    env = {**os.environ, "ZRW_VERIFY": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "caught" in out.stdout and "0.weight" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_a_clean_run_is_the_same_with_verify_on(recipe):
    def train(verify):
        model, opt = _layer(recipe, release=True)
        losses = []
        with cache.verify(verify):
            for step in range(3):
                for mb in range(2):
                    g = torch.Generator().manual_seed(10 * step + mb)
                    loss = model(torch.randn(4, 64, generator=g).to(BF16)).float().pow(2).mean()
                    loss.backward()
                    losses.append(loss.detach())
                opt.step()
                opt.zero_grad()
        return torch.stack(losses), model.state_dict()

    (a, sa), (b, sb) = train(False), train(True)
    assert_bitwise(a, b)
    for k in sa:
        assert_bitwise(sa[k], sb[k], k)


def test_verify_refuses_a_non_bool():
    with pytest.raises(TypeError, match=r"zrw\.cache\.verify: enabled must be a bool, got str"):
        with cache.verify("yes"):
            pass
