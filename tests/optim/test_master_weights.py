"""MasterWeights as a drop-in torch optimizer: LR schedulers, manual hyper-parameter
changes, add_param_group, step(closure) (LBFGS too), atomic state_dict / load_state_dict.

The reference for every comparison is the plain torch optimizer stepping FP32 copies of the
parameters with the same gradients and the same schedule: MasterWeights' masters must equal its
parameters bit for bit, step for step, and the BF16 parameters must be bf16 of them.
"""

import copy

import pytest
import torch
from torch.optim import lr_scheduler

from helpers.bitwise import same_bits
from helpers.mx_layer import BF16, MXLinearFn, value
from zrw import cache
from zrw.optim import MasterWeights, attach

pytestmark = pytest.mark.usefixtures("clean_cache")

SHAPES = [(64, 32), (32, 64)]


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(BF16)) for s in SHAPES]


def grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(*s, generator=g).to(BF16) for s in SHAPES]


SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 0.9**s),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-4),
}


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_match_the_plain_fp32_optimizer_step_for_step(name, release):
    ps = params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in ps]
    opt = attach(MasterWeights(torch.optim.AdamW, ps, lr=0.01, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref_opt)
    lrs = []
    for step in range(6):
        if release:
            for p in ps:
                cache.quant_and_release(p)
            assert all(cache.is_released(p) for p in ps)
        for p, r, g in zip(ps, ref, grads(step)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        lrs.append(opt.param_groups[0]["lr"])
        for p, m, r in zip(ps, opt.masters[0], ref):
            assert torch.equal(m, r.detach()), f"step {step}"
            assert same_bits(value(p), r.detach().to(BF16))
    assert len(set(lrs)) > 1  # the schedule did change the learning rate
    if name == "OneCycleLR":  # it cycles Adam's beta1 through the groups too
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]


def test_manual_lr_change_reaches_the_inner_optimizer():
    ps = params(1)
    opt = MasterWeights(torch.optim.SGD, ps, lr=0.5)
    before = [m.clone() for m in opt.masters[0]]
    opt.param_groups[0]["lr"] = 0.0
    for p, g in zip(ps, grads(0)):
        p.grad = g
    opt.step()
    for m, b in zip(opt.masters[0], before):
        assert torch.equal(m, b)  # lr 0: nothing moved
    opt.param_groups[0]["lr"] = 0.25
    for p, g in zip(ps, grads(1)):
        p.grad = g
    opt.step()
    for m, b, g in zip(opt.masters[0], before, grads(1)):
        assert torch.equal(m, b - 0.25 * g.float())


def test_param_groups_carry_the_inner_hyperparameters():
    ps = params(2)
    opt = MasterWeights(
        torch.optim.AdamW,
        [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 5e-3}],
        lr=1e-2,
        betas=(0.8, 0.9),
    )
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[1]["lr"] == 5e-3
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert opt.defaults["betas"] == (0.8, 0.9) and "weight_decay" in opt.param_groups[0]
    assert opt.param_groups[0]["params"] == [ps[0]]  # the model's parameters, not the masters


def test_add_param_group_is_stepped_with_its_own_hyperparameters():
    ps = params(3)
    extra = torch.nn.Parameter(torch.randn(16, 32).to(BF16))
    opt = attach(MasterWeights(torch.optim.SGD, ps, lr=0.1))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert len(opt.masters) == 2 and len(opt.inner.param_groups) == 2
    assert opt.inner.param_groups[1]["lr"] == 0.5
    m0 = opt.masters[1][0].clone()
    cache.quant_and_release(extra)
    extra.grad = torch.ones_like(extra)
    opt.step()
    assert torch.equal(opt.masters[1][0], m0 - 0.5)
    assert same_bits(value(extra), opt.masters[1][0].to(BF16))
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.masters) == 2 and len(opt.inner.param_groups) == 2


def _regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    return x, y


def test_step_with_closure_on_an_attached_optimizer():
    # The closure re-runs forward and backward inside step(): under attach it runs with
    # release off, so the step can write the weights; the result equals the closure-less step.
    ws = [torch.nn.Parameter(torch.randn(64, 64).to(BF16)) for _ in range(2)]
    twin = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    x = torch.randn(8, 64).to(BF16)

    def loss_of(params):
        h = x
        for w in params:
            h = MXLinearFn.apply(h, w, cache.quant_and_release(w))
        return h.float().square().mean()

    opt = attach(MasterWeights(torch.optim.AdamW, ws, lr=1e-2))
    opt_twin = attach(MasterWeights(torch.optim.AdamW, twin, lr=1e-2))
    for _ in range(3):

        def closure():
            opt.zero_grad()
            loss = loss_of(ws)
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
        opt_twin.zero_grad()
        loss_twin = loss_of(twin)
        loss_twin.backward()
        opt_twin.step()
        assert torch.equal(loss.detach(), loss_twin.detach())
    for w, t in zip(ws, twin):
        assert same_bits(value(w), value(t))


@pytest.mark.parametrize("attached", [False, True])
def test_lbfgs_inside_master_weights_matches_plain_lbfgs(attached):
    # FP32 parameters: the masters are exact copies, so MasterWeights(LBFGS) must follow plain
    # LBFGS bit for bit (its closure is evaluated at the masters' values, several times a step).
    x, y = _regression()
    w = torch.nn.Parameter(torch.randn(8, 32))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = MasterWeights(torch.optim.LBFGS, [w], lr=0.5, max_iter=4)
    if attached:
        attach(opt)
    ref_opt = torch.optim.LBFGS([ref], lr=0.5, max_iter=4)

    def closure_for(p, o):
        def closure():
            o.zero_grad()
            loss = (x @ p.t() - y).square().mean()
            loss.backward()
            return loss

        return closure

    for _ in range(3):
        loss = opt.step(closure_for(w, opt))
        ref_loss = ref_opt.step(closure_for(ref, ref_opt))
        assert torch.equal(loss, ref_loss)
        assert torch.equal(value(w), ref.detach())
        assert torch.equal(opt.masters[0][0], ref.detach())


def test_failing_load_state_dict_changes_nothing():
    ps = params(4)
    opt = MasterWeights(torch.optim.AdamW, ps, lr=1e-2)
    for s in range(2):
        for p, g in zip(ps, grads(s)):
            p.grad = g
        opt.step()
    good = opt.state_dict()
    masters = [m.clone() for m in opt.masters[0]]
    inner = copy.deepcopy(opt.inner.state_dict())

    def unchanged():
        assert all(torch.equal(m, c) for m, c in zip(opt.masters[0], masters))
        now = opt.inner.state_dict()
        for k, st in inner["state"].items():
            assert all(torch.equal(now["state"][k][n], v) for n, v in st.items())
        assert now["param_groups"][0]["lr"] == inner["param_groups"][0]["lr"]

    bad_masters = copy.deepcopy(good)
    bad_masters["masters"][0][1] = torch.zeros(3, 3)
    bad_inner = copy.deepcopy(good)
    bad_inner["inner"]["param_groups"].append(dict(bad_inner["inner"]["param_groups"][0]))
    fresh = copy.deepcopy(good)
    fresh["masters"][0][0].add_(1.0)
    fresh["inner"]["param_groups"][0]["lr"] = 123.0
    fresh["inner"]["state"] = {0: {"step": torch.tensor(1.0)}}  # Adam state missing its moments
    for bad, match in [
        (bad_masters, "shape"),
        (bad_inner, "per group"),
        ({"masters": []}, "expected a dict"),
    ]:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        unchanged()
    # A load that passes the checks and then fails inside the inner optimizer's own load:
    # still nothing changed (the masters are copied only after it succeeded).
    try:
        opt.load_state_dict(fresh)
    except Exception:  # noqa: BLE001 - whichever error torch raises for the broken state
        unchanged()
    opt.load_state_dict(good)
    unchanged()


def test_state_dict_round_trip_keeps_scheduled_hyperparameters():
    ps = params(5)
    opt = MasterWeights(torch.optim.AdamW, ps, lr=1e-2)
    sched = lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for s in range(3):
        for p, g in zip(ps, grads(s)):
            p.grad = g
        opt.step()
        sched.step()
    sd = opt.state_dict()
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = MasterWeights(torch.optim.AdamW, ps2, lr=1e-2)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5**3
    for m, m2 in zip(opt.masters[0], opt2.masters[0]):
        assert torch.equal(m, m2)


def test_the_write_digest_sees_every_kind_of_change():
    """zrw.cache.weight_digest (MasterWeights' check for writes through `.data`): equal bytes
    give equal digests; one flipped bit, two swapped elements, a shifted tensor, and a tail
    byte past the last 8-byte word each change it."""
    from zrw import cache

    g = torch.Generator().manual_seed(0)
    t = torch.randn(1001, generator=g).to(torch.bfloat16)  # 2002 bytes: a 2-byte tail
    d = cache.weight_digest(t)
    assert d == cache.weight_digest(t.clone())
    flipped = t.clone()
    flipped.view(torch.int16)[500] ^= 1
    swapped = t.clone()
    swapped[[3, 700]] = t[[700, 3]]
    tail = t.clone()
    tail[-1] = -tail[-1]
    shifted = torch.roll(t, 1)
    for other in (flipped, swapped, tail, shifted):
        assert cache.weight_digest(other) != d
    assert cache.weight_digest(t[::2]) is None  # not contiguous: the caller compares the bits


def test_the_digest_sees_sign_flips_that_cancel_in_a_linear_sum():
    """Two elements at the same place of two 8-byte words (bf16 elements 3 and 7: each word's
    top bit) negated in opposite directions. A sum of words mixed by fixed multiplies misses
    this about half the time (its change is +c for one word and -c for the other); the NH lanes
    (csrc/common/digest_words.h) see every case, in every ISA build this process runs."""
    from zrw import cache

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = torch.randn(64, generator=g).to(torch.bfloat16)
        t[3], t[7] = t[3].abs(), -t[7].abs()
        other = t.clone()
        other[3], other[7] = -t[3], -t[7]
        assert cache.weight_digest(other) != cache.weight_digest(t)


def test_a_data_write_of_two_opposite_sign_flips_reaches_the_master():
    """The user-level form of the case above: `.data` negates two elements of opposite signs
    (no version bump); the next step's master holds the written values."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    with torch.no_grad():
        p[0, 3], p[0, 7] = p[0, 3].abs() + 0.5, -p[0, 7].abs() - 0.5
    opt = MasterWeights(torch.optim.SGD, [p], lr=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    p.data[0, 3] = -p.data[0, 3]
    p.data[0, 7] = -p.data[0, 7]
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.masters[0][0].to(torch.bfloat16), p.detach())
    assert opt.masters[0][0][0, 3].item() < 0 < opt.masters[0][0][0, 7].item()


def test_the_digest_is_the_same_in_every_isa_build():
    """The digest loop is compiled per instruction set (csrc/common/digest_kernel.cpp): every build
    this CPU runs, forced with ZRW_CPU_ISA in its own process, gives the same digests, for
    lengths that end inside an 8-byte word and past one thread's share."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, torch, zrw\n"
        "from zrw import cache\n"
        "g = torch.Generator().manual_seed(1)\n"
        "t = torch.randint(0, 256, (3 * 2**19 + 5,), dtype=torch.uint8, generator=g)\n"
        "print(json.dumps([zrw._C.cpu_isa()] + [cache.weight_digest(t[:n]) for n in "
        "(0, 1, 7, 8, 9, 1001, 2**18 + 3, t.numel())]))\n"
    )
    seen = {}
    for isa in ("avx512", "avx2", "base"):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, ZRW_CPU_ISA=isa),
        )
        if r.returncode != 0:
            assert "ZRW_CPU_ISA" in r.stderr, r.stderr  # a build this CPU cannot run
            continue
        ran, *digests = json.loads(r.stdout.strip().splitlines()[-1])
        assert ran == isa
        seen[isa] = digests
    assert "base" in seen
    assert all(d == seen["base"] for d in seen.values()), seen


def test_the_write_back_digest_is_the_digest_of_what_it_wrote():
    """MasterWeights' write-back takes each unreleased parameter's digest as it writes it
    (cache.write_back): the same value weight_digest reads afterwards, for small and
    multi-thread-sized parameters and a length that ends inside a word."""
    from zrw import cache

    g = torch.Generator().manual_seed(0)
    ps = [torch.zeros(n, dtype=torch.bfloat16) for n in (3, 1001, 3 * 2**17 + 1)]
    ps.append(torch.zeros(8, 9, dtype=torch.float16))
    ms = [torch.randn(p.shape, generator=g) for p in ps]
    digests = cache.write_back(ps, ms, False)
    for p, m, d in zip(ps, ms, digests):
        assert torch.equal(p, m.to(p.dtype))
        assert d == cache.weight_digest(p)
    strided = torch.zeros(8, 8, dtype=torch.bfloat16).t()
    assert cache.write_back([strided], [torch.ones(8, 8)], False) == [None]
    assert torch.equal(strided, torch.ones(8, 8, dtype=torch.bfloat16))


def test_a_data_write_of_one_element_reaches_the_master():
    """MasterWeights' check (a digest after each write-back) sees a write through `.data` that
    changes one element and bumps no version counter."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    opt = MasterWeights(torch.optim.SGD, [p], lr=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    version = p._version
    p.data[7, 9] = 3.0
    assert p._version == version
    p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.masters[0][0][7, 9].item() == 3.0
