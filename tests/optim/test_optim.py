"""The optimizer boundary (docs/design.md §5/§9): zrw.optim.attach and MasterWeights, and
the zero-redundancy training loop: bitwise identical with release on and off, the released bytes are
the BF16 bytes of the weights, and the peak between the first forward and the optimizer pre-hook
drops by exactly those bytes (zrw.memory, installed when this module is imported, before any
measured tensor exists)."""

import gc
import io

import pytest
import torch

import zrw
from helpers.bitwise import same_bits
from helpers.mx_layer import BF16, MXLinearFn, assert_step_refused, param, value
from zrw import cache, ops
from zrw.optim import MasterWeights, attach, detach

pytestmark = pytest.mark.usefixtures("clean_cache")

zrw.memory.install()


class MLP(torch.nn.Module):
    """nn.Linear weights used through quant_and_release + MXLinearFn. Layer `skip` is quantized
    (and released) in every microbatch, like an MoE expert, but in odd steps no token reaches
    it: a released weight that gets no gradient."""

    def __init__(self, dim, layers, skip):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(dim, dim, bias=False, dtype=BF16) for _ in range(layers)
        )
        self.skip = skip

    def forward(self, x, recipe, step):
        qs = [
            cache.quant_and_release(l.weight, recipe, name=f"layers.{i}.weight")
            for i, l in enumerate(self.layers)
        ]
        for i, (l, q) in enumerate(zip(self.layers, qs)):
            if i == self.skip and step % 2 == 1:
                continue
            x = MXLinearFn.apply(x, l.weight, q)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


DIM, LAYERS, SKIP, STEPS, MICRO, BATCH = 256, 4, 2, 5, 4, 4


def train(recipe, release, keep_released=True, steps=STEPS):
    """4 microbatches x `steps` steps with MasterWeights(AdamW) attached (keep_released: the
    BF16-free step, or the seed's restore at the step). Returns losses, final
    weights, and per step what a pre-hook registered BEFORE attach's hook saw: the allocator's
    peak since the first forward, its current bytes (both counted from the live bytes at the
    start of the run), cache_stats, and which weights were released."""
    cache.cache_clear()  # counters from zero
    # mx_matmul's tile workspace persists between calls (its size depends on the kernel
    # build: on an AVX-512 machine the first run grew it and the second reused it): each run
    # starts without it, so both count their own.
    ops.free_matmul_workspace()
    base = zrw.memory.current()  # whatever earlier runs left alive is not this run's
    torch.manual_seed(0)
    model = MLP(DIM, LAYERS, SKIP)
    ws = [l.weight for l in model.layers]
    opt = MasterWeights(
        torch.optim.AdamW,
        model.parameters(),
        lr=1e-2,
        weight_decay=0.01,
        keep_released=keep_released,
    )
    seen = []

    def record(o, args, kwargs):  # runs before attach's pre-hook: weights still released
        seen.append(
            dict(
                peak=zrw.memory.peak() - base,
                current=zrw.memory.current() - base,
                stats=cache.cache_stats(),
                released=[cache.is_released(w) for w in ws],
            )
        )

    opt.register_step_pre_hook(record)
    attach(opt)
    g = torch.Generator().manual_seed(1)
    data = [
        [torch.randn(BATCH, DIM, generator=g).to(BF16) for _ in range(MICRO)] for _ in range(steps)
    ]
    losses = []
    for step in range(steps):
        zrw.memory.reset_peak()  # the window: first forward .. optimizer pre-hook
        for x in data[step]:
            if release:
                y = model(x, recipe, step)
            else:
                with cache.no_release():
                    y = model(x, recipe, step)
            loss = y.float().pow(2).mean() / MICRO
            loss.backward()
            losses.append(loss.item())
            del y, loss
        if step % 2 == 1:
            assert ws[SKIP].grad is None  # no gradient for that weight in this step
        opt.step()
        opt.zero_grad()
        # The seed's boundary restores every weight; the BF16-free step keeps them released.
        assert [cache.is_released(w) for w in ws] == [release and keep_released] * LAYERS
    return dict(
        losses=losses,
        weights=[value(w) for w in ws],
        seen=seen,
        bf16_bytes=[w.numel() * w.element_size() for w in ws],
    )


@pytest.fixture(
    scope="module",
    params=[(r, keep) for r in cache.RECIPES for keep in (True, False)],
    ids=lambda p: f"{p[0]}-{'bf16_free' if p[1] else 'restore'}",
)
def runs(request):
    """The same training run with release on and off (module-scoped: run once per recipe and
    boundary mode)."""
    recipe, keep = request.param
    cache.cache_clear()
    gc.collect()
    gc.disable()
    try:
        off = train(recipe, release=False, keep_released=keep)
        gc.collect()
        on = train(recipe, release=True, keep_released=keep)
    finally:
        gc.enable()
        cache.cache_clear()
    return recipe, on, off


def test_release_on_off_bitwise_identical(runs):
    recipe, on, off = runs
    assert len(on["losses"]) == STEPS * MICRO
    assert on["losses"] == off["losses"]
    for a, b in zip(on["weights"], off["weights"]):
        assert same_bits(a, b)
    # The weights did train (a no-op loop would pass the comparison trivially).
    torch.manual_seed(0)
    init = [l.weight.detach() for l in MLP(DIM, LAYERS, SKIP).layers]
    assert all(not same_bits(a, b) for a, b in zip(on["weights"], init))


def test_bytes_released_are_the_bf16_bytes_of_the_weights(runs):
    recipe, on, off = runs
    total = sum(on["bf16_bytes"])
    assert total == LAYERS * DIM * DIM * 2
    assert len(on["seen"]) == STEPS
    for step, (s_on, s_off) in enumerate(zip(on["seen"], off["seen"])):
        # Every weight is released in every step (the skipped layer too: it was quantized).
        assert s_on["released"] == [True] * LAYERS
        assert s_on["stats"]["released"] == LAYERS
        assert s_on["stats"]["released_bytes"] == total
        assert s_off["released"] == [False] * LAYERS
        assert s_off["stats"]["released_bytes"] == 0
        assert s_off["stats"]["skip_release_false"] == LAYERS * (step + 1)  # one miss per step
        assert s_on["stats"]["misses"] == LAYERS * (step + 1)
        # The allocator agrees: at the pre-hook the two runs hold the same tensors but the
        # released BF16 storages.
        assert s_off["current"] - s_on["current"] == total


def test_peak_drops_by_released_bf16_bytes(runs):
    recipe, on, off = runs
    total = sum(on["bf16_bytes"])
    for step, (s_on, s_off) in enumerate(zip(on["seen"], off["seen"])):
        saved = s_off["peak"] - s_on["peak"]
        assert abs(saved - total) <= 0.02 * total, (
            f"step {step}: peak {s_off['peak']} (release off) - {s_on['peak']} (on) = {saved}, "
            f"expected the released BF16 bytes {total} within 2%"
        )
    # The weights dominate the window (otherwise 2% would say little): BF16 weights are a
    # sizable share of the peak.
    assert total > 0.15 * off["seen"][0]["peak"]


def test_step_counter_and_cache_emptied_at_boundary():
    w = param(64, 64, seed=1)
    opt = attach(MasterWeights(torch.optim.AdamW, [w], lr=1e-3, keep_released=False))
    after = []
    opt.register_step_post_hook(lambda o, a, k: after.append(cache.cache_stats()))
    step0 = cache.cache_stats()["step"]
    for _ in range(2):
        x = torch.randn(4, 64).to(BF16)
        MXLinearFn.apply(x, w, cache.quant_and_release(w, name="w")).sum().backward()
        assert cache.is_released(w)
        opt.step()
        opt.zero_grad()
        assert not cache.is_released(w) and not cache.is_cached(w)
        w.sum()
    assert cache.cache_stats()["step"] == step0 + 2
    assert [a["entries"] for a in after] == [0, 0]  # the boundary dropped the FP8 entry
    assert [a["step"] for a in after] == [step0 + 1, step0 + 2]  # post-hook: next_step


def test_bf16_free_boundary_keeps_the_weight_released_with_its_master_only():
    w = param(64, 64, seed=1)
    opt = attach(MasterWeights(torch.optim.AdamW, [w], lr=1e-3))
    for step in range(2):
        x = torch.randn(4, 64).to(BF16)
        MXLinearFn.apply(x, w, cache.quant_and_release(w, name="w")).sum().backward()
        st = cache.cache_stats()
        assert st["misses"] == step + 1 and st["fp8_bytes"] > 0 and st["pending"] == 0
        opt.step()
        opt.zero_grad()
        st = cache.cache_stats()
        # Released, no FP8 bytes: the master is the copy until the next use quantizes it.
        assert cache.is_released(w) and st["fp8_bytes"] == 0 and st["pending"] == 1
        assert cache.master_of(w) is opt.masters[0][0]
        assert st["restored"] == 0
    cache.restore(w, "master")
    assert same_bits(w, opt.masters[0][0].to(BF16))


def test_master_weights_restores_at_its_write_back_plain_optimizer_in_the_pre_hook():
    # MasterWeights restores a released weight when it writes its master back (after the inner
    # step: the BF16 bytes are not resident during it, and are filled before they are
    # visible); an optimizer that steps the weights itself gets them in the boundary's pre-hook.
    w = param(64, 64, seed=2)
    opt = attach(MasterWeights(torch.optim.AdamW, [w], lr=1e-3, keep_released=False))
    order = []
    opt.register_step_pre_hook(lambda o, a, k: order.append(("pre", cache.is_released(w))))
    opt.register_step_post_hook(lambda o, a, k: order.append(("post", cache.is_released(w))))
    cache.quant_and_release(w, name="w")
    opt.step()
    assert order == [("pre", True), ("post", False)]

    v = param(64, 64, seed=3)
    plain = torch.optim.AdamW([v], lr=1e-3)
    seen = []
    plain.register_step_pre_hook(lambda o, a, k: seen.append(("before", cache.is_released(v))))
    attach(plain, fill="dequant")
    plain.register_step_pre_hook(lambda o, a, k: seen.append(("after", cache.is_released(v))))
    cache.quant_and_release(v, name="v")
    v.grad = torch.ones_like(v)
    plain.step()
    assert seen == [("before", True), ("after", False)]


# ------------------------------------------------------------------------------------------------
# attach


@pytest.mark.parametrize("fill", [None, "empty", "zeros"])
def test_attach_refuses_plain_optimizer_without_safe_fill(fill):
    w = param(32, 32)
    opt = torch.optim.AdamW([w], lr=1e-3)
    kw = {} if fill is None else {"fill": fill}
    with pytest.raises(ValueError) as ei:
        attach(opt, **kw)
    msg = str(ei.value)
    assert "MasterWeights" in msg and "dequant" in msg and "AdamW" in msg
    assert not opt._optimizer_step_pre_hooks  # nothing was installed
    attach(opt, fill="dequant")  # the refusal left it attachable


def test_attach_rejects_bad_fill_and_twice():
    w = param(32, 32)
    with pytest.raises(ValueError, match="fill must be one of"):
        attach(MasterWeights(torch.optim.AdamW, [w], lr=1e-3), fill="bogus")
    opt = attach(MasterWeights(torch.optim.AdamW, [param(32, 32)], lr=1e-3))
    with pytest.raises(RuntimeError, match="already has the zrw boundary"):
        attach(opt)
    detach(opt)
    detach(opt)  # idempotent
    attach(opt)  # and attachable again


def test_attach_dequant_with_plain_adamw():
    w = param(64, 64, seed=3)
    ref = torch.nn.Parameter(w.detach().clone())
    opt = attach(torch.optim.AdamW([w], lr=1e-2), fill="dequant")
    q = cache.quant_and_release(w, name="w")
    deq = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16)
    grad = torch.randn(64, 64).to(BF16)
    w.grad = grad.clone()
    opt.step()
    assert not cache.is_released(w)
    # The weight AdamW stepped is the dequantized FP8 copy (lossy, as documented).
    with torch.no_grad():
        ref.copy_(deq)
    ref.grad = grad.clone()
    torch.optim.AdamW([ref], lr=1e-2).step()
    assert same_bits(w, ref)


def test_detach_removes_boundary():
    w = param(32, 32)
    opt = attach(MasterWeights(torch.optim.AdamW, [w], lr=1e-3, keep_released=False))
    detach(opt)
    assert not zrw.optim.has_boundary(opt)
    cache.quant_and_release(w, name="w")
    step = cache.cache_stats()["step"]
    # Without the boundary nothing calls next_step; MasterWeights' write-back still restores
    # its released weights from their masters (it never writes into a released storage).
    opt.step()
    assert cache.cache_stats()["step"] == step
    assert not cache.is_released(w) and same_bits(w, opt.masters[0][0].to(BF16))
    v = param(32, 32, seed=1)
    plain = attach(torch.optim.SGD([v], lr=0.1), fill="dequant")
    detach(plain)
    cache.quant_and_release(v, name="v")
    released = r"would update 1 weight\(s\) whose BF16 storage is released: 'v'"
    assert_step_refused(plain, v, released + r"\. Nothing was stepped")
    assert cache.is_released(v)
    cache.restore(v, "zeros")


# ------------------------------------------------------------------------------------------------
# MasterWeights


def test_master_weights_writes_params_without_grad_after_empty_restore():
    a, b = param(64, 64, seed=4), param(64, 64, seed=5)
    opt = attach(MasterWeights(torch.optim.AdamW, [a, b], lr=1e-2, keep_released=False))
    # Masters that differ from the BF16 values, so stale bytes cannot pass for the write.
    with torch.no_grad():
        for m in (opt.masters[0][0], opt.masters[0][1]):
            m.mul_(-2).add_(0.123456)
    mb_before = opt.masters[0][1].clone()
    cache.quant_and_release(a, name="a")
    cache.quant_and_release(b, name="b")
    a.grad = torch.randn(64, 64).to(BF16)  # b gets no gradient (an expert no token chose)
    opt.step()  # the write-back restores both from their masters
    assert not cache.is_released(a) and not cache.is_released(b)
    assert torch.equal(opt.masters[0][1], mb_before)  # AdamW skipped it
    assert same_bits(b, mb_before.to(BF16))
    assert same_bits(a, opt.masters[0][0].to(BF16))


def test_master_weights_matches_fp32_adamw():
    w = param(64, 32, seed=6)
    master = torch.nn.Parameter(w.detach().float())
    opt = MasterWeights(torch.optim.AdamW, [w], lr=1e-2, betas=(0.8, 0.9))
    ref = torch.optim.AdamW([master], lr=1e-2, betas=(0.8, 0.9))
    assert opt.inner.param_groups[0]["betas"] == (0.8, 0.9)
    for i in range(3):
        g = torch.randn(64, 32, generator=torch.Generator().manual_seed(i)).to(BF16)
        w.grad = g.clone()
        master.grad = g.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        assert w.grad is None
        assert torch.equal(opt.masters[0][0], master.detach())
        assert same_bits(w, master.detach().to(BF16))


def test_master_weights_uses_main_grad():
    w = param(32, 32, seed=7)
    opt = MasterWeights(torch.optim.SGD, [w], lr=0.5)
    w.main_grad = torch.full((32, 32), 0.25)
    w.grad = torch.full((32, 32), 100.0).to(BF16)  # ignored: main_grad wins
    m0 = opt.masters[0][0].clone()
    opt.step()
    assert torch.equal(opt.masters[0][0], m0 - 0.125)
    opt.zero_grad()
    assert w.main_grad is None and w.grad is None


def test_master_weights_rejects_integer_params():
    with pytest.raises(TypeError, match="floating point"):
        MasterWeights(torch.optim.SGD, [torch.zeros(4, dtype=torch.int32)], lr=0.1)


def test_master_weights_twice_over_same_params():
    # Rebuilding the optimizer (e.g. after loading a checkpoint) registers new masters for the
    # same parameters; the newest one is what fill="master" must restore.
    w = param(64, 64, seed=8)
    MasterWeights(torch.optim.AdamW, [w], lr=1e-3)
    opt2 = MasterWeights(torch.optim.AdamW, [w], lr=1e-3)
    with torch.no_grad():
        opt2.masters[0][0].add_(1.0)
    cache.quant_and_release(w, name="w")
    cache.restore(w, "master")
    assert same_bits(w, opt2.masters[0][0].to(BF16))


def _step(opt, ws, seed):
    g = torch.Generator().manual_seed(seed)
    for w in ws:
        w.grad = torch.randn(w.shape, generator=g).to(BF16)
    opt.step()
    opt.zero_grad()


def test_master_weights_state_dict_round_trip():
    ws = [param(64, 32, seed=9), param(16, 64, seed=10)]
    opt = MasterWeights(
        torch.optim.AdamW, [{"params": [ws[0]]}, {"params": [ws[1]], "lr": 5e-3}], lr=1e-2
    )
    for s in range(2):
        _step(opt, ws, s)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)

    ws2 = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    opt2 = MasterWeights(
        torch.optim.AdamW, [{"params": [ws2[0]]}, {"params": [ws2[1]], "lr": 5e-3}], lr=1e-2
    )
    with torch.no_grad():
        for m in opt2.masters[0] + opt2.masters[1]:
            m.zero_()  # must come back from the checkpoint
    opt2.load_state_dict(saved)
    for ms, ms2 in zip(opt.masters, opt2.masters):
        for m, m2 in zip(ms, ms2):
            assert torch.equal(m, m2)
    assert opt2.inner.param_groups[1]["lr"] == 5e-3
    # Both continue identically (Adam moments and step counts came back too).
    for s in range(2, 4):
        _step(opt, ws, s)
        _step(opt2, ws2, s)
    for w, w2 in zip(ws, ws2):
        assert same_bits(w, w2)
    for ms, ms2 in zip(opt.masters, opt2.masters):
        for m, m2 in zip(ms, ms2):
            assert torch.equal(m, m2)
    # The saved masters are copies, not the live tensors.
    assert saved["masters"][0][0].data_ptr() != opt.masters[0][0].data_ptr()


def test_master_weights_load_state_dict_rejects_mismatch():
    opt = MasterWeights(torch.optim.AdamW, [param(8, 8)], lr=1e-3)
    sd = opt.state_dict()
    other = MasterWeights(torch.optim.AdamW, [param(8, 8), param(8, 8)], lr=1e-3)
    with pytest.raises(ValueError, match="masters per group"):
        other.load_state_dict(sd)
    wrong = MasterWeights(torch.optim.AdamW, [param(4, 8)], lr=1e-3)
    with pytest.raises(ValueError, match="shape"):
        wrong.load_state_dict(sd)
