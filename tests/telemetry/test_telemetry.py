"""zrw.telemetry: per-layer SQNR, saturation and underflow of MX quantization, against a direct
computation with zrw.reference (the plain-PyTorch spec of the ops), and on a training model."""

import math

import pytest
import torch
from torch import nn

import zrw
import zrw.telemetry as telemetry
from zrw import reference

E4M3 = torch.float8_e4m3fn


def known_tensor() -> torch.Tensor:
    """(4, 64) bf16: one block whose amax 480 has a mantissa above 1.75 (floor saturates it,
    rceil does not), tiny elements beside it that underflow, a zero block, ordinary values."""
    # Every block of the ramp has amax 1 times a power of two: no rule saturates it.
    x = torch.linspace(-1, 1, 64).repeat(4, 1) * torch.tensor([[1.0], [4.0], [0.25], [2.0]])
    x[0, 3] = 480.0  # floor: e = 8 - 8 = 0, 480 > 448 -> clamped; rceil: e = 1
    x[0, 4] = 2.0**-20  # far below the smallest E4M3 subnormal at either scale
    x[0, 5] = -(2.0**-21)
    x[1, 32:] = 0.0  # an all-zero block
    x[2, 40] = 300.0
    return x.to(torch.bfloat16)


def direct(x, dim, scale_mode, block=False):
    """SQNR (dB), saturated and flushed counts, computed from zrw.reference alone."""
    xf = x.double()
    if block:
        data, bs = reference.mx_quantize_block(x, E4M3, scale_mode)
        scale = reference.expand_block_scale(bs, x.shape, -1)
        dim = -1
    else:
        data, scale = reference.mx_quantize(x, dim, E4M3, scale_mode)
    deq = reference.mx_dequantize(data, scale, dim, torch.float32).double()
    s = reference._e8m0_value(scale.view(torch.uint8))
    s = s.repeat_interleave(32, dim).narrow(dim, 0, x.shape[dim])
    sqnr = 10 * math.log10(float(xf.pow(2).sum()) / float((xf - deq).pow(2).sum()))
    saturated = int((xf.abs() > 448.0 * s).sum())
    flushed = int(((xf != 0) & (deq == 0)).sum())
    return sqnr, saturated, flushed


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("dim,block", [(-1, False), (0, False), (-1, True)])
def test_quant_stats_equal_a_direct_computation(scale_mode, dim, block):
    x = known_tensor()
    s = telemetry.quant_stats(x, dim, E4M3, scale_mode, block_32x32=block)
    sqnr, saturated, flushed = direct(x, dim, scale_mode, block)
    assert s.elements == x.numel() and s.nonzero == int((x != 0).sum())
    assert s.saturated == saturated and s.flushed == flushed
    assert s.sqnr_db == pytest.approx(sqnr, rel=1e-9)
    assert s.saturated_fraction == saturated / x.numel()
    assert s.flushed_fraction == flushed / x.numel()


def test_quant_stats_known_counts():
    x = known_tensor()
    floor = telemetry.quant_stats(x, -1, E4M3, "floor")
    rceil = telemetry.quant_stats(x, -1, E4M3, "rceil")
    # 480 is clamped to 448 by floor only; 300 (mantissa 1.17) fits under both rules.
    assert floor.saturated == 1 and rceil.saturated == 0
    # 2^-20 and 2^-21 beside 480 flush to zero under both rules (smallest subnormal 2^-9 * 2^e).
    assert floor.flushed == 2 and rceil.flushed == 2
    assert floor.elements == rceil.elements == 256 and floor.nonzero == 224
    exact = telemetry.quant_stats(torch.full((2, 32), 0.5, dtype=torch.bfloat16))
    assert exact.sqnr_db == math.inf and exact.saturated == 0 and exact.flushed == 0
    zeros = telemetry.quant_stats(torch.zeros(3, 40))
    assert math.isnan(zeros.sqnr_db) and zeros.elements == 120 and zeros.nonzero == 0


def test_quant_stats_skips_nonfinite_blocks():
    x = torch.ones(2, 64)
    x[0, 1] = float("nan")
    s = telemetry.quant_stats(x)
    assert s.elements == 96  # the NaN block (32 elements) is left out
    assert s.sqnr_db == math.inf


def _mlp(recipe, release=True):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).to(torch.bfloat16)
    zrw.convert(m, recipe, release=release)
    return m


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_telemetry_on_a_training_model_matches_quant_stats(recipe):
    model = _mlp(recipe)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    grads = {}
    model[2].register_full_backward_hook(lambda m, gi, go: grads.__setitem__("dy", go[0]))
    for step in range(2):  # the second step reads the released weights through their masters
        with telemetry.collect(model) as tel:
            h = model[1](model[0](x))
            model[2](h).float().pow(2).mean().backward()
        assert not model[0]._forward_pre_hooks and not model[2]._forward_hooks  # removed
        stats = tel.stats()
        rcp = model[2].recipe
        w = zrw.cache.master_of(model[2].weight).to(torch.bfloat16)
        expect_w = telemetry.quant_stats(w, -1, E4M3, rcp.scale_mode, rcp.block_32x32)
        got_w = stats[("2", "weight", rcp.scale_mode)]
        assert got_w.sqnr_db == expect_w.sqnr_db and got_w.saturated == expect_w.saturated
        assert (("2", "weight_bwd", rcp.scale_mode) in stats) == (recipe == "mxfp8")
        got_a = stats[("2", "activation", rcp.scale_mode)]
        expect_a = telemetry.quant_stats(h, -1, E4M3, rcp.scale_mode)
        assert got_a.sqnr_db == expect_a.sqnr_db and got_a.elements == h.numel()
        got_g = stats[("2", "gradient", rcp.scale_mode)]
        expect_g = telemetry.quant_stats(grads["dy"], -1, E4M3, rcp.scale_mode)
        assert got_g.sqnr_db == expect_g.sqnr_db and got_g.flushed == expect_g.flushed
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert zrw.cache.is_released(model[2].weight)
    rows = tel.records()
    assert {r["layer"] for r in rows} == {"0", "2"}
    assert all(r["recipe"] == recipe and r["calls"] == 1 for r in rows)
    pooled = tel.summary()
    assert {r["tensor"] for r in pooled} >= {"weight", "activation", "gradient"}
    assert "SQNR dB" in tel.table() and "SQNR dB" in tel.table(pooled=True)
    zrw.cache.cache_clear()


def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_telemetry_changes_nothing_and_costs_nothing_when_off():
    """Training with telemetry gives the same bits as without; after the block no hook is left
    (off, nothing of it runs)."""

    def train(with_telemetry):
        model = _mlp("mxfp8")
        opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        losses = []
        before = hook_count(model)
        for _ in range(3):
            tel = telemetry.collect(model) if with_telemetry else None
            if tel:
                tel.start()
            loss = model(x).float().pow(2).mean()
            loss.backward()
            if tel:
                tel.stop()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        added = hook_count(model) - before
        zrw.cache.cache_clear()
        return losses, added

    on, hooks_on = train(True)
    off, hooks_off = train(False)
    assert on == off and hooks_on == hooks_off == 0


def test_telemetry_options():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with telemetry.collect(
        plain,
        recipe="mxfp8-32x32",
        scale_modes=("floor", "rceil"),
        tensors=("weight", "activation"),
        layers=["2"],
    ) as tel:
        plain(x)
    keys = set(tel.stats())
    assert keys == {("2", t, m) for t in ("weight", "activation") for m in ("floor", "rceil")}
    floor_w = tel.stats()[("2", "weight", "floor")]
    assert (
        floor_w.sqnr_db
        == telemetry.quant_stats(plain[2].weight, -1, E4M3, "floor", block_32x32=True).sqnr_db
    )
    tel.reset()
    assert tel.stats() == {}
    with telemetry.collect(plain) as none:  # no zrw layer, no recipe: nothing to measure
        plain(x)
    assert none.records() == []
    with pytest.raises(ValueError, match="tensors"):
        telemetry.collect(plain, tensors=("bias",))
    with pytest.raises(ValueError, match="scale_modes"):
        telemetry.collect(plain, scale_modes=("round",))
    with pytest.raises(TypeError, match="model"):
        telemetry.collect("model")
