"""MXLinear / MXGroupedLinear against an independent emulation of the same MX numerics.

The emulation is built from zrw.reference only (the pure-PyTorch spec, no compiled op):

    forward  y  = dq(Q_K(x)) @ dq(W_fwd).T (+ b)
    dgrad    dx = dq(Q_N(dy)) @ dq(W_bwd)
    wgrad    dW = dq(Q_M(dy)).T @ dq(Q_M(x))
    bias     db = dy.sum(tokens)

where Q_d quantizes along d (K: features in, N: features out, M: tokens), W_fwd / W_bwd are the
weight's planes of the recipe ("mxfp8": two 1x32 planes; "mxfp8-32x32": one 32x32-tile copy) and
dq dequantizes. What is bitwise (quantized planes, fp8 operands, saved tensors) is compared
bitwise; the GEMMs are compared with the exact (float64) product of the dequantized operands,
allowing only FP32 accumulation error plus the final rounding to the output dtype — a bound
tight enough that a plain BF16 GEMM (no MX) fails it, which the tests check too.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zrw
from helpers.bitwise import assert_bitwise, same_bits
from zrw import cache
from zrw import reference as ref
from zrw.nn import MXGroupedLinear, MXLinear

pytestmark = pytest.mark.usefixtures("clean_cache")

RECIPES = ["mxfp8", "mxfp8-32x32"]
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
# The layers quantize with their recipe's scale rule (the same for both built-in recipes); the
# emulation quantizes with it too.
SCALE_MODE = zrw.get_recipe("mxfp8").scale_mode
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
FP32_U = 2.0**-24

# (leading token dims, in_features, out_features): unaligned 2-D and 3-D, and an aligned one.
SHAPES = [((45,), 70, 33), ((3, 15), 70, 33), ((64,), 96, 64)]
SHAPE_IDS = ["2d-45x70->33", "3d-3x15x70->33", "2d-64x96->64"]


# ------------------------------------------------------------------------------------------------
# helpers: data, the reference planes, the emulation and its error bound


def _data(*shape, seed, dtype=BF16):
    """Normal values with a different power-of-two magnitude per row, so the blocks get varied
    MX scales (and some rows are tiny relative to others)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float32)
    rows = torch.randint(-6, 7, (*shape[:-1], 1), generator=g).to(torch.float32)
    return (x * torch.exp2(rows)).to(dtype)


def ref_weight_planes(w, recipe):
    """(fwd data, fwd scale, bwd data, bwd scale) of W (N, K) or (E, N, K) per the spec."""
    if recipe == "mxfp8":
        return ref.mx_quantize_dual(w, E4M3, SCALE_MODE)
    data, block = ref.mx_quantize_block(w, E4M3, SCALE_MODE)
    return (
        data,
        ref.expand_block_scale(block, w.shape, -1),
        data,
        ref.expand_block_scale(block, w.shape, -2),
    )


def dq(data, scale, dim):
    return ref.mx_dequantize(data, scale, dim, torch.float32)


def emulate(x2d, w, dy2d, recipe):
    """The dequantized fp32 operands of the three GEMMs, as (a, b) pairs with result a @ b."""
    wf, sf, wb, sb = ref_weight_planes(w, recipe)
    xk = dq(*ref.mx_quantize(x2d, -1, E4M3, SCALE_MODE), -1)
    xm = dq(*ref.mx_quantize(x2d, 0, E4M3, SCALE_MODE), 0)
    dyn = dq(*ref.mx_quantize(dy2d, -1, E4M3, SCALE_MODE), -1)
    dym = dq(*ref.mx_quantize(dy2d, 0, E4M3, SCALE_MODE), 0)
    return {
        "y": (xk, dq(wf, sf, -1).T),
        "dx": (dyn, dq(wb, sb, -2)),
        "dW": (dym.T, xm),
    }


def mx_error_ratio(got, a, b, add=None):
    """max |got - exact| / bound, for got = round(a @ b [+ add]) computed with FP32 accumulation.

    exact is the float64 product of the (exact) dequantized operands. The bound is the FP32
    accumulation error R * 2^-24 * (|a| @ |b|) plus one rounding to got.dtype (and a second one
    for the bias add, which the layer does in the output dtype). <= 1 passes.
    """
    mm = a.double() @ b.double()
    acc = a.shape[1] * FP32_U * (a.abs().double() @ b.abs().double())
    u = UNIT_ROUNDOFF[got.dtype]
    tol = acc + u * (mm.abs() + acc)
    exact = mm
    if add is not None:
        exact = mm + add.double()
        tol = tol + u * (exact.abs() + tol)
    tol = tol + 2.0**-126  # the one absolute term: FP32's smallest normal
    return ((got.double() - exact).abs() / tol).max().item()


def assert_mx_close(got, a, b, what, add=None):
    r = mx_error_ratio(got, a, b, add)
    assert r <= 1.0, f"{what}: error {r:.3g}x the FP32-rounding bound of the MX emulation"


def assert_sum_close(got, t, dim, what):
    exact = t.double().sum(dim)
    acc = t.shape[dim] * FP32_U * t.double().abs().sum(dim)
    tol = acc + UNIT_ROUNDOFF[got.dtype] * (exact.abs() + acc) + 2.0**-126
    r = ((got.double() - exact).abs() / tol).max().item()
    assert r <= 1.0, f"{what}: error {r:.3g}x the FP32-rounding bound"


# Optimizers with the zrw boundary that own the test layers' weights: a zrw layer releases a
# trainable weight only when an optimizer with the boundary (or an FP32 master) owns it.
_OWNERS = []


def _owned(module):
    """module, its parameters owned by an optimizer with the zrw boundary (kept alive here)."""
    _OWNERS.append(zrw.optim.attach(torch.optim.SGD(module.parameters(), lr=0.0), fill="dequant"))
    return module


def _mxlinear(in_f, out_f, bias, recipe, seed, **kw):
    layer = MXLinear(in_f, out_f, bias=bias, recipe=recipe, dtype=BF16, **kw)
    with torch.no_grad():
        layer.weight.copy_(_data(out_f, in_f, seed=seed))
        if bias:
            layer.bias.copy_(_data(out_f, seed=seed + 1))
    return _owned(layer)


def _run(layer, x, dy):
    """One forward + backward; returns y (detached) and x.grad."""
    x = x.detach().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad


# ------------------------------------------------------------------------------------------------
# MXLinear numerics


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_mxlinear_matches_mx_emulation(recipe, bias, shape):
    lead, in_f, out_f = shape
    layer = _mxlinear(in_f, out_f, bias, recipe, seed=1)
    w = layer.weight.detach().clone()
    b = layer.bias.detach().clone() if bias else None
    x = _data(*lead, in_f, seed=2)
    dy = _data(*lead, out_f, seed=3)

    y, dx = _run(layer, x, dy)
    assert cache.is_released(layer.weight), "a training forward must release the BF16 weight"
    assert y.shape == (*lead, out_f) and y.dtype == BF16
    assert dx.shape == x.shape and dx.dtype == BF16
    dw = layer.weight.grad
    assert dw.shape == w.shape and dw.dtype == BF16

    x2d, dy2d = x.reshape(-1, in_f), dy.reshape(-1, out_f)
    em = emulate(x2d, w, dy2d, recipe)
    assert_mx_close(y.reshape(-1, out_f), *em["y"], "y", add=b)
    assert_mx_close(dx.reshape(-1, in_f), *em["dx"], "dx")
    assert_mx_close(dw, *em["dW"], "dW")
    if bias:
        assert layer.bias.grad.dtype == BF16
        assert_sum_close(layer.bias.grad, dy2d, 0, "db")
        assert not cache.is_cached(layer.bias), "the bias is not an MX operand"

    # The bound is meaningful: unquantized BF16 GEMMs are far outside it.
    y_bf16 = F.linear(x2d, w)
    assert mx_error_ratio(y_bf16, *em["y"]) > 4
    assert mx_error_ratio(dy2d @ w, *em["dx"]) > 4
    assert mx_error_ratio(dy2d.T @ x2d, *em["dW"]) > 4


@pytest.mark.parametrize("recipe", RECIPES)
def test_mxlinear_gemm_operands_are_the_reference_planes(recipe, monkeypatch):
    """Bitwise: every fp8 operand the three GEMMs get is the spec's quantization of the right
    tensor along the right axis (strided .t() views included), and the weight's cached planes
    are the spec's planes of the BF16 weight."""
    lead, in_f, out_f = (3, 15), 70, 33
    layer = _mxlinear(in_f, out_f, True, recipe, seed=4)
    w = layer.weight.detach().clone()
    x, dy = _data(*lead, in_f, seed=5), _data(*lead, out_f, seed=6)

    calls = []
    from zrw.nn import functional

    real = functional._matmul  # the op overload the layer's autograd function calls

    def spy(a, a_scale, b, b_scale, out_dtype=BF16):
        calls.append((a, a_scale, b, b_scale, out_dtype))
        return real(a, a_scale, b, b_scale, out_dtype)

    monkeypatch.setattr(functional, "_matmul", spy)
    _run(layer, x, dy)
    monkeypatch.undo()
    assert len(calls) == 3, "one GEMM each for forward, dgrad and wgrad"
    fwd, dgrad, wgrad = calls

    x2d, dy2d = x.reshape(-1, in_f), dy.reshape(-1, out_f)
    wf, sf, wb, sb = ref_weight_planes(w, recipe)
    qxk, sxk = ref.mx_quantize(x2d, -1, E4M3, SCALE_MODE)
    qxm, sxm = ref.mx_quantize(x2d, 0, E4M3, SCALE_MODE)
    qdn, sdn = ref.mx_quantize(dy2d, -1, E4M3, SCALE_MODE)
    qdm, sdm = ref.mx_quantize(dy2d, 0, E4M3, SCALE_MODE)
    expected = {
        "forward": (fwd, (qxk, sxk, wf, sf)),
        "dgrad": (dgrad, (qdn, sdn, wb.t(), sb.t())),
        "wgrad": (wgrad, (qdm.t(), sdm.t(), qxm.t(), sxm.t())),
    }
    for gemm, (call, want) in expected.items():
        for i, (got_t, want_t) in enumerate(zip(call[:4], want)):
            assert_bitwise(got_t, want_t, f"{gemm} operand {i}")
    assert fwd[4] == BF16 and dgrad[4] == BF16 and wgrad[4] == BF16

    q = cache.quant_and_release(
        layer.weight, recipe, name="probe", scale_mode=SCALE_MODE
    )  # a hit: the cached copy
    assert_bitwise(q.fwd.data, wf, "cached fwd data")
    assert_bitwise(q.fwd.scale, sf, "cached fwd scale")
    assert_bitwise(q.bwd.data, wb, "cached bwd data")
    assert_bitwise(q.bwd.scale, sb, "cached bwd scale")
    # the GEMMs read the cached planes themselves (dgrad a .t() view), not copies
    assert fwd[2].data_ptr() == q.fwd.data.data_ptr()
    assert dgrad[2].data_ptr() == q.bwd.data.data_ptr() and not dgrad[2].is_contiguous()
    assert not wgrad[0].is_contiguous() and not wgrad[2].is_contiguous()
    if recipe == "mxfp8-32x32":
        assert q.fwd.data is q.bwd.data or q.fwd.data.data_ptr() == q.bwd.data.data_ptr(), (
            "the 32x32 recipe keeps one FP8 copy for both directions"
        )
        assert_bitwise(
            q.block_scale, ref.mx_quantize_block(w, E4M3, SCALE_MODE)[1], "cached block scale"
        )


@pytest.mark.parametrize("recipe", RECIPES)
def test_mxlinear_saves_fp8_not_bf16(recipe):
    """What autograd keeps for backward: the FP8 M-plane of x and the weight's backward plane
    (bitwise the spec's), never the BF16 weight or the BF16 activation."""
    layer = _mxlinear(70, 33, False, recipe, seed=7)
    w = layer.weight.detach().clone()
    x = _data(45, 70, seed=8).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert saved, "nothing saved for backward?"
    for t in saved:
        assert t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu), (
            f"a {t.dtype} tensor of shape {tuple(t.shape)} was saved for backward"
        )
    qxm, sxm = ref.mx_quantize(x.detach(), 0, E4M3, SCALE_MODE)
    _, _, wb, sb = ref_weight_planes(w, recipe)
    # Q_M(x)'s scale and W_bwd's scale are both (2, 70) here: match them as a multiset.
    left = list(saved)
    for name, want in [("Q_M(x)", qxm), ("Q_M(x) scale", sxm), ("W_bwd", wb), ("W_bwd scale", sb)]:
        match = [t for t in left if same_bits(t, want)]
        assert match, f"{name} (bitwise the spec's) is not among the saved tensors"
        left.remove(match[0])
    assert not left, f"unexpected saved tensors: {[(t.dtype, tuple(t.shape)) for t in left]}"
    y.sum().backward()


def test_mxlinear_is_a_drop_in_for_nn_linear():
    lin = torch.nn.Linear(70, 33, dtype=BF16)
    w, b = lin.weight, lin.bias
    mx = MXLinear.from_linear(lin, "mxfp8", name="lin.weight")
    assert mx.weight is w and mx.bias is b
    assert list(mx.state_dict()) == ["weight", "bias"]
    assert isinstance(mx, torch.nn.Linear)
    y = mx(_data(4, 70, seed=9))
    assert y.shape == (4, 33)
    with pytest.raises(ValueError, match="in_features"):
        mx(_data(4, 71, seed=9))


@pytest.mark.parametrize("shape", [(40, 0), (0, 33)], ids=["no_out_features", "no_in_features"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_mxlinear_with_an_empty_weight_trains(recipe, shape):
    """A layer with no output (or no input) features trains like nn.Linear does, in both
    recipes (the 32x32 entry's per-axis scales of an empty weight are empty too)."""
    in_f, out_f = shape
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, dtype=BF16))
    zrw.convert(model, recipe)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2))
    for _ in range(2):
        x = _data(3, in_f, seed=1).requires_grad_(True)
        y = model(x)
        assert y.shape == (3, out_f)
        (y.float().sum() + x.float().sum()).backward()
        assert x.grad.shape == x.shape
        opt.step()
        opt.zero_grad()
    assert model.state_dict()["0.weight"].shape == (out_f, in_f)


# ------------------------------------------------------------------------------------------------
# MXGroupedLinear


def _grouped_case(recipe, counts, seed):
    E, in_f, out_f = len(counts), 70, 33
    layer = MXGroupedLinear(E, in_f, out_f, recipe=recipe, dtype=BF16)
    with torch.no_grad():
        layer.weight.copy_(_data(E, out_f, in_f, seed=seed))
    T = sum(counts)
    return _owned(layer), _data(T, in_f, seed=seed + 1), _data(T, out_f, seed=seed + 2)


COUNTS = [[10, 0, 23, 12], [0, 45, 0, 0], [1, 31, 33, 0]]


@pytest.mark.parametrize("counts", COUNTS, ids=["10-0-23-12", "0-45-0-0", "1-31-33-0"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_equals_loop_of_mxlinear(recipe, counts):
    layer, x, dy = _grouped_case(recipe, counts, seed=20)
    W = layer.weight.detach().clone()
    xg = x.clone().requires_grad_(True)
    y = layer(xg, counts)
    y.backward(dy)
    assert cache.is_released(layer.weight)
    dW = layer.weight.grad

    off = 0
    for e, c in enumerate(counts):
        rows = slice(off, off + c)
        off += c
        if c == 0:
            assert torch.count_nonzero(dW[e]) == 0, f"expert {e} got no token: zero gradient"
            continue
        lin = _mxlinear(70, 33, False, recipe, seed=0)
        with torch.no_grad():
            lin.weight.copy_(W[e])
        y_e, dx_e = _run(lin, x[rows], dy[rows])
        assert_bitwise(y[rows].detach(), y_e, f"expert {e} y")
        assert_bitwise(xg.grad[rows], dx_e, f"expert {e} dx")
        assert_bitwise(dW[e], lin.weight.grad, f"expert {e} dW")
        # and both against the emulation, expert by expert
        em = emulate(x[rows], W[e], dy[rows], recipe)
        assert_mx_close(y_e, *em["y"], f"expert {e} y")
        assert_mx_close(dx_e, *em["dx"], f"expert {e} dx")
        assert_mx_close(dW[e], *em["dW"], f"expert {e} dW")


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_stack_planes_equal_per_expert_quantization(recipe):
    """The whole (E, N, K) stack is quantized once, per matrix: expert e's planes are exactly
    those of quantizing W[e] alone (no block crosses an expert boundary, N=33 unaligned)."""
    counts = [10, 0, 23, 12]
    layer, x, dy = _grouped_case(recipe, counts, seed=30)
    W = layer.weight.detach().clone()
    layer(x, counts).backward(dy)
    q = cache.quant_and_release(layer.weight, recipe, name="probe", scale_mode=SCALE_MODE)  # hit
    assert cache.cache_stats()["misses"] == 1
    for e in range(len(counts)):
        wf, sf, wb, sb = ref_weight_planes(W[e], recipe)
        assert_bitwise(q.fwd.data[e], wf, f"expert {e} fwd data")
        assert_bitwise(q.fwd.scale[e], sf, f"expert {e} fwd scale")
        assert_bitwise(q.bwd.data[e], wb, f"expert {e} bwd data")
        assert_bitwise(q.bwd.scale[e], sb, f"expert {e} bwd scale")


def test_grouped_rejects_bad_counts():
    layer, x, _ = _grouped_case("mxfp8", [10, 0, 23, 12], seed=40)
    with pytest.raises(ValueError, match="counts"):
        layer(x, [10, 0, 23, 11])
    with pytest.raises(ValueError, match="counts"):
        layer(x, [45, 0, 0])


# ------------------------------------------------------------------------------------------------
# activation recompute


class _Block(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.fc1 = _mxlinear(70, 96, True, recipe, seed=50)
        self.fc2 = _mxlinear(96, 33, True, recipe, seed=52)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _block_grads(block, x, dy, mode):
    x = x.clone().requires_grad_(True)
    if mode == "none":
        y = block(x)
    else:
        y = checkpoint(block, x, use_reentrant=(mode == "reentrant"))
    before = cache.cache_stats()
    y.backward(dy)
    after = cache.cache_stats()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return y.detach(), grads, before, after


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_recompute_identical_and_hits_cache(recipe, mode):
    base = _Block(recipe)
    ckpt = _owned(copy.deepcopy(base))  # before any forward: two independent sets of equal weights
    x, dy = _data(3, 15, 70, seed=54), _data(3, 15, 33, seed=55)

    y0, g0, b0, a0 = _block_grads(base, x, dy, "none")
    assert a0["hits"] == b0["hits"] and a0["misses"] == b0["misses"], (
        "without recompute the backward never looks a weight up"
    )
    y1, g1, before, after = _block_grads(ckpt, x, dy, mode)

    assert_bitwise(y1, y0, "output")
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert_bitwise(a, b, f"grad {i}")
    n_weights = 2
    assert after["misses"] == before["misses"], "recompute must not re-quantize a weight"
    assert after["hits"] - before["hits"] == n_weights, "recompute looks up each weight once"
    if mode == "non_reentrant":
        assert all(cache.is_released(m.weight) for m in (ckpt.fc1, ckpt.fc2))


@pytest.mark.parametrize("recipe", RECIPES)
def test_reentrant_checkpoint_still_releases_weights(recipe):
    """Reentrant checkpointing runs the first forward under no_grad; the recompute in backward
    then uses every weight under grad mode, in a training step. Zero redundancy must still hold:
    by the end of the first microbatch's backward the BF16 weights are released, as they are
    without checkpointing or with non-reentrant checkpointing."""
    block = _Block(recipe)
    x = _data(3, 15, 70, seed=56).requires_grad_(True)
    y = checkpoint(block, x, use_reentrant=True)
    y.backward(_data(3, 15, 33, seed=57))
    st = cache.cache_stats()
    statuses = [(e["name"], e["status"]) for e in cache.cache_entries()]
    released = all(cache.is_released(m.weight) for m in (block.fc1, block.fc2))
    assert st["released"] == 2 and released, (
        f"reentrant checkpoint released nothing in a training step: entries {statuses}, "
        f"released_bytes {st['released_bytes']} (expected {2 * (96 * 70 + 33 * 96)})"
    )


# ------------------------------------------------------------------------------------------------
# gradient accumulation while released, and main_grad


def _microbatches(n, in_f=70, out_f=33, seed=60):
    return [
        (_data(3, 15, in_f, seed=seed + 2 * i), _data(3, 15, out_f, seed=seed + 2 * i + 1))
        for i in range(n)
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_grad_accumulates_over_microbatches_while_released(recipe):
    mbs = _microbatches(3)
    layer = _mxlinear(70, 33, True, recipe, seed=70)
    singles = [copy.deepcopy(layer) for _ in mbs]  # equal weights, one microbatch each
    for i, (x, dy) in enumerate(mbs):
        _run(layer, x, dy)
        assert cache.is_released(layer.weight), f"released during microbatch {i}"
    st = cache.cache_stats()
    assert st["misses"] == 1 and st["hits"] == 2, "one quantization per step, then hits"

    want_w, want_b = None, None
    for s, (x, dy) in zip(singles, mbs):
        _run(s, x, dy)
        want_w = s.weight.grad if want_w is None else want_w + s.weight.grad
        want_b = s.bias.grad if want_b is None else want_b + s.bias.grad
    assert_bitwise(layer.weight.grad, want_w, "accumulated dW")
    assert_bitwise(layer.bias.grad, want_b, "accumulated db")


@pytest.mark.parametrize("recipe", RECIPES)
def test_main_grad_accumulates_fp32(recipe):
    mbs = _microbatches(3, seed=80)
    layer = _mxlinear(70, 33, True, recipe, seed=90, main_grad=True)
    w = layer.weight.detach().clone()
    plain = copy.deepcopy(layer)
    plain.main_grad = False
    singles = [copy.deepcopy(layer) for _ in mbs]
    for x, dy in mbs:
        _run(layer, x, dy)
    assert cache.is_released(layer.weight)
    assert layer.weight.grad is None, "with main_grad the weight's .grad stays None"
    mg = layer.weight.main_grad
    assert mg.dtype == torch.float32 and mg.shape == w.shape
    assert layer.bias.grad is not None, "the bias keeps its ordinary .grad"

    want = None
    for s, (x, dy) in zip(singles, mbs):
        _run(s, x, dy)
        want = s.weight.main_grad if want is None else want + s.weight.main_grad
    assert_bitwise(mg, want, "main_grad = FP32 sum of the microbatches' FP32 wgrads")

    # one microbatch: the FP32 wgrad is the BF16 one before its final rounding, and it is the
    # emulation within FP32 accumulation
    x, dy = mbs[0]
    _run(plain, x, dy)
    assert_bitwise(singles[0].weight.main_grad.to(BF16), plain.weight.grad, "fp32 vs bf16 wgrad")
    em = emulate(x.reshape(-1, 70), w, dy.reshape(-1, 33), recipe)
    assert_mx_close(singles[0].weight.main_grad, *em["dW"], "main_grad dW")


def test_master_weights_steps_on_main_grad():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(70, 96, dtype=BF16), torch.nn.GELU(), torch.nn.Linear(96, 33, dtype=BF16)
    )
    summary = zrw.convert(model, "mxfp8", main_grad=True)
    assert summary.converted == ["0", "2"] and all(model[i].main_grad for i in (0, 2))
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.SGD, model.parameters(), lr=1.0))
    m0 = [m.clone() for m in opt.masters[0]]
    for x, dy in _microbatches(2, seed=100):
        model(x).backward(_data(3, 15, 33, seed=101))
    weights = [model[0].weight, model[2].weight]
    main = [w.main_grad.clone() for w in weights]
    assert all(w.grad is None for w in weights)
    params = list(model.parameters())
    grads = [
        p.main_grad if getattr(p, "main_grad", None) is not None else p.grad.float() for p in params
    ]
    opt.step()
    assert all(p.grad is None for p in params), "the step consumes the BF16 gradients"
    sd = model.state_dict()  # the released weights materialized from their masters
    for (name, p), m, m_init, g in zip(model.named_parameters(), opt.masters[0], m0, grads):
        assert_bitwise(m, m_init - g, "SGD(lr=1) master update from main_grad / grad")
        assert_bitwise(sd[name], m.to(BF16), "parameter written from its master")
    assert_bitwise(opt.masters[0][0], m0[0] - main[0], "fc1 master")
    assert_bitwise(opt.masters[0][2], m0[2] - main[1], "fc2 master")
    opt.zero_grad()
    assert all(getattr(w, "main_grad", None) is None for w in weights)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # materialized from the masters: readable
