"""The native weight cache (docs/design.md §5): quant_and_release, the release guard,
restore and its fills, the step lifecycle, frozen weights, weak entries, and thread safety.

Memory is measured with zrw.memory's counting allocator, installed when this module is imported
(before any measured tensor exists). A released weight keeps its storage's logical nbytes on
purpose (a 0-byte storage breaks view creation with an unrelated message); the bytes are freed all
the same, which is what the allocator and cache_stats()["released_bytes"] show.
"""

import contextlib
import gc
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import zrw
from helpers.bitwise import same_bits
from helpers.mx_layer import BF16, MXLinearFn, param
from zrw import cache, ops
from zrw.optim import MasterWeights, attach

pytestmark = pytest.mark.usefixtures("clean_cache")

zrw.memory.install()

E4M3 = torch.float8_e4m3fn
RELEASE_MSG = r"is released \(zero-redundancy weights"


def q_tensors(q):
    """The distinct tensors of an MXWeight (the 32x32 data tensor once)."""
    ts = [q.fwd.data, q.fwd.scale]
    if q.bwd.data is not q.fwd.data:
        ts.append(q.bwd.data)
    ts.append(q.bwd.scale)
    if q.block_scale is not None:
        ts.append(q.block_scale)
    return ts


def q_nbytes(q):
    """The bytes an MXWeight's tensors really hold: their storages (each once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in q_tensors(q)}
    return sum(storages.values())


def check_fresh(q, ref, recipe):
    """q (from the cache) equals a fresh quantization of `ref` (the weight's original values)."""
    assert q.recipe == recipe
    if recipe == "mxfp8":
        df, sf, db, sb = ops.mx_quantize_dual(ref)
        assert same_bits(q.fwd.data, df) and same_bits(q.fwd.scale, sf)
        assert same_bits(q.bwd.data, db) and same_bits(q.bwd.scale, sb)
        assert q.block_scale is None
    else:
        data, block = ops.mx_quantize_block(ref)
        assert q.fwd.data is q.bwd.data
        assert same_bits(q.fwd.data, data) and same_bits(q.block_scale, block)
        assert same_bits(q.fwd.scale, ops.expand_block_scale(block, ref.shape, -1))
        assert same_bits(q.bwd.scale, ops.expand_block_scale(block, ref.shape, -2))


def assert_raises_released(w, name):
    with pytest.raises(RuntimeError, match=RELEASE_MSG) as ei:
        w.sum()
    assert f"'{name}'" in str(ei.value) and "zrw.cache.restore" in str(ei.value)


def mx_linear(x, w, recipe="mxfp8", name=""):
    return MXLinearFn.apply(x, w, cache.quant_and_release(w, recipe, name=name))


RECIPES = list(cache.RECIPES)


# ------------------------------------------------------------------------------------------------
# Release frees exactly the weight's bytes; restore brings back exactly that many.


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fill", ["empty", "zeros", "dequant"])
@pytest.mark.parametrize("shape", [(96, 64), (72, 40)])
def test_release_frees_exact_bytes_and_restore_returns_them(recipe, fill, shape):
    w = param(*shape)
    nbytes = w.numel() * w.element_size()
    before = zrw.memory.current()
    q = cache.quant_and_release(w, recipe, name="w")
    after = zrw.memory.current()
    fp8 = q_nbytes(q)
    # The BF16 storage went (-nbytes), the FP8 copy came (+fp8): nothing else was kept.
    assert after - before == fp8 - nbytes
    st = cache.cache_stats()
    assert st["released"] == 1 and st["released_bytes"] == nbytes
    assert st["entries"] == 1 and st["misses"] == 1
    # fp8_bytes is the bytes the FP8 copy holds (its storages), as the allocator sees them.
    assert st["fp8_bytes"] == fp8, "cache_stats()['fp8_bytes'] != bytes held by the FP8 tensors"
    assert cache.is_released(w) and cache.is_cached(w)
    assert cache.cache_entries() == [
        dict(name="w", status="released", hits=0, misses=1, storage_bytes=nbytes)
    ]
    assert_raises_released(w, "w")
    with pytest.raises(RuntimeError, match=RELEASE_MSG):
        w.untyped_storage().data_ptr()
    # The design decision: logical nbytes stays (views keep working), the bytes are gone.
    assert w.untyped_storage().nbytes() == nbytes

    del q
    assert zrw.memory.current() == before - nbytes + fp8  # q's tensors still in the cache
    cache.restore(w, fill)
    assert zrw.memory.current() == before  # exact: BF16 back, FP8 entry freed
    st = cache.cache_stats()
    assert st["released"] == 0 and st["released_bytes"] == 0 and st["entries"] == 0
    assert st["fp8_bytes"] == 0
    assert not cache.is_released(w) and not cache.is_cached(w)
    assert w.untyped_storage().nbytes() == nbytes
    w.sum()  # readable again
    with torch.no_grad():
        w.add_(1)  # and writable


@pytest.mark.parametrize("recipe", RECIPES)
def test_restore_all_returns_exact_bytes(recipe):
    ws = [param(64, 64, seed=i) for i in range(3)]
    total = sum(w.numel() * w.element_size() for w in ws)
    before = zrw.memory.current()
    for i, w in enumerate(ws):
        cache.quant_and_release(w, recipe, name=f"w{i}")
    st = cache.cache_stats()
    assert st["released"] == 3 and st["released_bytes"] == total
    assert zrw.memory.current() == before - total + st["fp8_bytes"]
    assert cache.restore_all("zeros") == 3
    assert zrw.memory.current() == before
    assert cache.cache_stats()["entries"] == 0
    for w in ws:
        assert not cache.is_released(w) and torch.count_nonzero(w) == 0
    assert cache.restore_all() == 0  # nothing left to restore


# ------------------------------------------------------------------------------------------------
# Every access to a released weight raises zrw's error (in a subprocess: a segfault fails too).

_ACCESS_SCRIPT = textwrap.dedent(r"""
    import copy, io, sys
    import torch
    import torch.nn.functional as F
    import zrw
    from zrw import cache, ops
    zrw.memory.install()
    torch.manual_seed(0)

    def check(recipe):
        lin = torch.nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
        w = lin.weight
        ref = w.detach().clone()
        cache.quant_and_release(w, recipe, name="layer.weight")
        assert cache.is_released(w)
        x = torch.randn(4, 64, dtype=torch.bfloat16)

        def inplace_nograd():
            with torch.no_grad():
                w.add_(1)

        def save_state_dict():
            buf = io.BytesIO()
            torch.save(lin.state_dict(), buf)
            return buf.getvalue()

        accesses = {
            "sum": lambda: w.sum(),
            "add": lambda: w + 1,
            "inplace_add_nograd": inplace_nograd,
            "inplace_add_data": lambda: w.data.add_(1),
            "clone": lambda: w.clone(),
            "detach_clone": lambda: w.detach().clone(),
            "to_float": lambda: w.float(),
            "item": lambda: w[0, 0].item(),
            "tolist": lambda: w.tolist(),
            "numpy": lambda: w.detach().view(torch.int16).numpy(),
            "repr": lambda: repr(w),
            "str": lambda: str(w),
            "print": lambda: print(w),
            "save_state_dict": save_state_dict,
            "save_tensor": lambda: torch.save(w, io.BytesIO()),
            "deepcopy_module": lambda: copy.deepcopy(lin),
            "F.linear": lambda: F.linear(x, w),
            "module_call": lambda: lin(x),
            "matmul": lambda: x @ w.t(),
            "copy_out": lambda: torch.empty_like(w).copy_(w),
            "copy_in": lambda: w.detach().copy_(ref),
        }
        for key, fn in accesses.items():
            try:
                fn()
            except RuntimeError as e:
                msg = str(e)
                ok = ("'layer.weight'" in msg and "is released" in msg
                      and "zrw.cache.restore" in msg and "zrw.optim.attach" in msg
                      and "state_dict()" in msg
                      and "zrw.no_release()" in msg)
                print(("RAISED " if ok else "WRONG_MESSAGE ") + recipe + " " + key, flush=True)
                if not ok:
                    print(msg, flush=True)
            else:
                print("NO_ERROR " + recipe + " " + key, flush=True)
            assert cache.is_released(w), key

        # After the restore every access works again, with the dequantized values.
        cache.restore(w, "dequant")
        w.sum(); repr(w); F.linear(x, w); w.clone()
        buf = io.BytesIO()
        torch.save(lin.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf)
        assert torch.equal(sd["weight"], w.detach())
        assert sd["weight"].abs().sum() > 0
        print("RESTORED_OK " + recipe, flush=True)

    for recipe in cache.RECIPES:
        check(recipe)
    print("DONE", flush=True)
""")

_ACCESS_KEYS = [
    "sum",
    "add",
    "inplace_add_nograd",
    "inplace_add_data",
    "clone",
    "detach_clone",
    "to_float",
    "item",
    "tolist",
    "numpy",
    "repr",
    "str",
    "print",
    "save_state_dict",
    "save_tensor",
    "deepcopy_module",
    "F.linear",
    "module_call",
    "matmul",
    "copy_out",
    "copy_in",
]


def test_every_access_to_released_weight_raises_named_error():
    """sum, in-place add, clone, print/repr, torch.save of a state_dict, F.linear, ... each raise
    zrw's error naming the weight and the fix; run in a child process so that a segfault (rc -11)
    fails the test instead of killing the run."""
    r = subprocess.run(
        [sys.executable, "-c", _ACCESS_SCRIPT], capture_output=True, text=True, timeout=180
    )
    report = f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, report
    lines = set(r.stdout.splitlines())
    missing = [
        f"{rc} {k}" for rc in RECIPES for k in _ACCESS_KEYS if f"RAISED {rc} {k}" not in lines
    ]
    assert not missing, f"no zrw error for {missing}\n{report}"
    assert all(f"RESTORED_OK {rc}" in lines for rc in RECIPES) and "DONE" in lines, report


# ------------------------------------------------------------------------------------------------
# Autograd with a released leaf.


@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_accumulate_into_released_weight(recipe):
    w = param(96, 64, seed=1)
    ref_w = torch.nn.Parameter(w.detach().clone())
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 64, generator=g).to(BF16) for _ in range(2)]

    ref_grads = []
    with cache.no_release():
        for x in xs:
            ref_w.grad = None
            mx_linear(x, ref_w, recipe).float().pow(2).sum().backward()
            ref_grads.append(ref_w.grad.clone())
    assert not cache.is_released(ref_w)

    for i, x in enumerate(xs):
        y = mx_linear(x, w, recipe, name="w")
        assert cache.is_released(w)
        y.float().pow(2).sum().backward()
        assert cache.is_released(w)
        assert w.grad is not None and w.grad.shape == w.shape
        if i == 0:
            assert same_bits(w.grad, ref_grads[0])
    # bf16 accumulation: grad = g1 + g2, the same bits AccumulateGrad produces.
    assert same_bits(w.grad, ref_grads[0] + ref_grads[1])
    st = cache.cache_stats()
    # ref_w: no optimizer owns it, so each training use quantizes afresh (miss, miss); w is
    # released by the direct call (the caller's own boundary restores it): miss, hit.
    assert st["misses"] == 3 and st["hits"] == 1
    assert_raises_released(w, "w")


@pytest.mark.parametrize("recipe", RECIPES)
def test_dgrad_flows_through_released_weight(recipe):
    w1, w2 = param(64, 64, seed=3), param(32, 64, seed=4)
    r1, r2 = (torch.nn.Parameter(w.detach().clone()) for w in (w1, w2))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(BF16)
    with cache.no_release():
        mx_linear(mx_linear(x, r1, recipe), r2, recipe).float().sum().backward()
    mx_linear(mx_linear(x, w1, recipe, "w1"), w2, recipe, "w2").float().sum().backward()
    assert cache.is_released(w1) and cache.is_released(w2)
    assert same_bits(w1.grad, r1.grad) and same_bits(w2.grad, r2.grad)


# ------------------------------------------------------------------------------------------------
# Hits, misses and the step lifecycle.


@pytest.mark.parametrize("recipe", RECIPES)
def test_second_call_in_step_is_hit_with_same_tensors(recipe):
    w = param(64, 96)
    ref = w.detach().clone()
    q1 = cache.quant_and_release(w, recipe, name="w")
    mem = zrw.memory.current()
    q2 = cache.quant_and_release(w, recipe, name="w")
    q3 = cache.quant_and_release(w, recipe, name="w")
    assert zrw.memory.current() == mem  # a hit allocates nothing
    st = cache.cache_stats()
    assert st["misses"] == 1 and st["hits"] == 2 and st["entries"] == 1
    assert cache.cache_entries()[0]["hits"] == 2 and cache.cache_entries()[0]["misses"] == 1
    for q in (q2, q3):
        for a, b in zip(q_tensors(q1), q_tensors(q)):
            assert a.data_ptr() == b.data_ptr()
    check_fresh(q3, ref, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(64, 64), (72, 40), (3, 64, 96), (33, 31)])
def test_hit_equals_fresh_quantization_of_original(recipe, shape):
    w = param(*shape, seed=7)
    ref = w.detach().clone()
    cache.quant_and_release(w, recipe, name="w")
    assert cache.is_released(w)
    q = cache.quant_and_release(w, recipe, name="w")  # a hit: w's storage holds nothing now
    assert cache.cache_stats()["hits"] == 1
    check_fresh(q, ref, recipe)


@pytest.mark.parametrize("elem_dtype,scale_mode", [(torch.float8_e5m2, "floor"), (E4M3, "rceil")])
def test_hit_equals_fresh_quantization_other_formats(elem_dtype, scale_mode):
    w = param(64, 96, seed=8)
    ref = w.detach().clone()
    cache.quant_and_release(w, elem_dtype=elem_dtype, scale_mode=scale_mode)
    q = cache.quant_and_release(w, elem_dtype=elem_dtype, scale_mode=scale_mode)
    df, sf, db, sb = ops.mx_quantize_dual(ref, elem_dtype, scale_mode)
    assert q.fwd.data.dtype == elem_dtype
    assert same_bits(q.fwd.data, df) and same_bits(q.fwd.scale, sf)
    assert same_bits(q.bwd.data, db) and same_bits(q.bwd.scale, sb)


@pytest.mark.parametrize("recipe", RECIPES)
def test_next_step_requantizes_new_values(recipe):
    w = param(64, 64, seed=9)
    old = w.detach().clone()
    q0 = cache.quant_and_release(w, recipe, name="w")
    check_fresh(q0, old, recipe)
    # The optimizer boundary: restore, the optimizer writes new values, next step.
    assert cache.restore_all("empty") == 1
    new = (old.float() * -3 + 1).to(BF16)
    with torch.no_grad():
        w.copy_(new)
    step = cache.cache_stats()["step"]
    cache.next_step()
    assert cache.cache_stats()["step"] == step + 1
    q1 = cache.quant_and_release(w, recipe, name="w")
    st = cache.cache_stats()
    assert st["misses"] == 2 and st["hits"] == 0 and st["released"] == 1
    check_fresh(q1, new, recipe)
    assert not same_bits(q1.fwd.data, q0.fwd.data)


def test_step_boundary_rule_for_unreleased_weight():
    # Writes through .data do not bump the version counter. For a weight an optimizer with the
    # zrw boundary owns, within a step the cached copy is served (the step boundary is the
    # rule); next_step re-quantizes.
    w = param(64, 64, seed=10)
    opt = attach(torch.optim.SGD([w], lr=0.1), fill="dequant")
    old = w.detach().clone()
    cache.quant_and_release(w, release=False)
    w.data.mul_(2)
    q = cache.quant_and_release(w, release=False)
    assert cache.cache_stats()["hits"] == 1
    check_fresh(q, old, "mxfp8")
    cache.next_step()
    q = cache.quant_and_release(w, release=False)
    assert cache.cache_stats()["misses"] == 2
    check_fresh(q, w.detach(), "mxfp8")
    del opt


def test_a_weight_no_optimizer_owns_is_quantized_afresh_at_every_training_use():
    # Nothing starts a new step for it: a write through .data between two uses is
    # seen by the next one.
    w = param(64, 64, seed=10)
    cache.quant_and_release(w, release=False)
    w.data.mul_(2)
    q = cache.quant_and_release(w, release=False)
    st = cache.cache_stats()
    assert st["hits"] == 0 and st["misses"] == 2
    check_fresh(q, w.detach(), "mxfp8")


def test_version_bump_invalidates_unreleased_entry_within_step():
    w = param(64, 64, seed=11)
    cache.quant_and_release(w, release=False)
    with torch.no_grad():
        w.add_(1)  # bumps the version counter
    q = cache.quant_and_release(w, release=False)
    st = cache.cache_stats()
    assert st["misses"] == 2 and st["hits"] == 0 and st["entries"] == 1
    check_fresh(q, w.detach(), "mxfp8")


def test_requantize_with_other_recipe_when_not_released():
    w = param(64, 64, seed=12)
    cache.quant_and_release(w, "mxfp8", release=False)
    q = cache.quant_and_release(w, "mxfp8-32x32", release=False)
    assert cache.cache_stats()["misses"] == 2 and cache.cache_stats()["entries"] == 1
    check_fresh(q, w.detach(), "mxfp8-32x32")


@pytest.mark.parametrize("recipe,other", [("mxfp8", "mxfp8-32x32"), ("mxfp8-32x32", "mxfp8")])
def test_recipe_mismatch_on_released_weight_raises(recipe, other):
    w = param(64, 64, seed=13)
    ref = w.detach().clone()
    cache.quant_and_release(w, recipe, name="proj.weight")
    with pytest.raises(RuntimeError, match="restore it first") as ei:
        cache.quant_and_release(w, other, name="proj.weight")
    assert "'proj.weight'" in str(ei.value) and f'"{other}"' in str(ei.value)
    with pytest.raises(RuntimeError, match="restore it first"):
        cache.quant_and_release(w, recipe, elem_dtype=torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="restore it first"):
        cache.quant_and_release(w, recipe, scale_mode="rceil")
    # The entry is intact: still released, the right recipe is a hit.
    assert cache.is_released(w)
    check_fresh(cache.quant_and_release(w, recipe), ref, recipe)
    assert cache.cache_stats()["hits"] == 1


def test_bad_arguments_raise_clear_errors():
    w = param(64, 64)
    with pytest.raises(ValueError, match='recipe must be "mxfp8" or "mxfp8-32x32"'):
        cache.quant_and_release(w, "fp8")
    with pytest.raises(ValueError, match="2-d"):
        cache.quant_and_release(torch.nn.Parameter(torch.randn(64, dtype=BF16)))
    assert cache.cache_stats()["entries"] == 0
    assert not cache.is_released(w)


# ------------------------------------------------------------------------------------------------
# The release guard: each skip has its reason, and the storage is untouched.


def _guard_cases():
    n, k = 64, 64

    def release_false():
        w = param(n, k)
        return w, w, lambda: cache.quant_and_release(w, release=False, name="g")

    def no_grad():
        w = param(n, k)

        def call():
            with torch.no_grad():
                return cache.quant_and_release(w, name="g")

        return w, w, call

    def no_release_ctx():
        w = param(n, k)

        def call():
            with cache.no_release():
                return cache.quant_and_release(w, name="g")

        return w, w, call

    def non_leaf():
        w = param(n, k)
        t = w * 1
        return w, t, lambda: cache.quant_and_release(t, name="g")

    def frozen():
        w = param(n, k, requires_grad=False)
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def flat_offset():
        buf = torch.randn(2 * n * k).to(BF16)
        w = torch.nn.Parameter(buf[n * k :].view(n, k))
        del buf  # the parameter alone holds the storage: only the flat-buffer check can catch it
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def flat_prefix():
        buf = torch.randn(n * k + 32).to(BF16)
        w = torch.nn.Parameter(buf[: n * k].view(n, k))
        del buf
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def flat_shared():
        buf = torch.randn(2 * n * k).to(BF16)
        w = torch.nn.Parameter(buf[: n * k].view(n, k))
        w._buf = buf  # the flat buffer lives on
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def aliased():
        t = torch.randn(n, k).to(BF16)
        w = torch.nn.Parameter(t)
        w._t = t  # t lives
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def aliased_detached_view():
        w = param(n, k)
        w._alias = w.detach()
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def aliased_with_storage_object():
        t = torch.randn(n, k).to(BF16)
        w = torch.nn.Parameter(t)
        w._t, w._s = t, w.untyped_storage()  # t lives, and so does a Python storage object
        return w, w, lambda: cache.quant_and_release(w, name="g")

    def aliased_temporary_storage_object():
        t = torch.randn(n, k).to(BF16)
        w = torch.nn.Parameter(t)
        w._t = t
        w.untyped_storage()  # a storage object that dies at once must not hide the alias
        return w, w, lambda: cache.quant_and_release(w, name="g")

    return {
        "release_false": (release_false, "release_false"),
        "no_grad": (no_grad, "no_grad"),
        "no_release": (no_release_ctx, "release_false"),
        "non_leaf": (non_leaf, "non_leaf"),
        "frozen": (frozen, "frozen"),
        "flat_offset": (flat_offset, "flat_buffer"),
        "flat_prefix": (flat_prefix, "flat_buffer"),
        "flat_shared": (flat_shared, "flat_buffer"),
        "aliased": (aliased, "aliased"),
        "aliased_detach": (aliased_detached_view, "aliased"),
        "aliased_storage_obj": (aliased_with_storage_object, "aliased"),
        "aliased_tmp_storage_obj": (aliased_temporary_storage_object, "aliased"),
    }


_GUARDS = _guard_cases()
SKIP_KEYS = [
    "skip_release_false",
    "skip_no_grad",
    "skip_non_leaf",
    "skip_frozen",
    "skip_flat_buffer",
    "skip_aliased",
]


@pytest.mark.parametrize("case", list(_GUARDS))
def test_guard_skips_release_with_reason_and_keeps_storage(case):
    make, reason = _GUARDS[case]
    leaf, target, call = make()
    ref = target.detach().clone()
    ptr = target.untyped_storage().data_ptr()
    leaf_ptr = leaf.untyped_storage().data_ptr()
    before = zrw.memory.current()
    q = call()
    # Only the FP8 copy was allocated: nothing was freed.
    assert zrw.memory.current() - before == q_nbytes(q)
    st = cache.cache_stats()
    assert st[f"skip_{reason}"] == 1
    assert all(st[k] == 0 for k in SKIP_KEYS if k != f"skip_{reason}"), st
    assert st["released"] == 0 and st["released_bytes"] == 0
    shares_storage = reason in ("flat_buffer", "aliased")
    if reason == "frozen" or shares_storage or not target.requires_grad and reason != "no_grad":
        # A frozen weight that keeps its storage is quantized at each use, never filed; so is a
        # weight that shares its storage (a write through the buffer or the other tensor
        # bumps another version counter: a filed copy could be served stale).
        assert st["entries"] == 0 and not cache.is_cached(target)
    else:
        assert st["entries"] == 1
        assert cache.cache_entries()[0]["status"] == reason
        assert cache.is_cached(target)
    assert not cache.is_released(target)
    assert not cache.is_released(leaf)
    # Storage untouched: same memory, same values, readable and writable.
    assert target.untyped_storage().data_ptr() == ptr
    assert leaf.untyped_storage().data_ptr() == leaf_ptr
    assert same_bits(target.detach(), ref)
    target.sum()
    repr(target)
    check_fresh(q, ref, "mxfp8")
    # A later call in the same step is a hit (nothing counted twice); a copy filed under no_grad
    # is quantized again by the next no_grad call (an eval pass never reaches a boundary), and
    # a frozen weight that keeps its storage is quantized at every use (never filed).
    filed = reason not in ("no_grad", "frozen") and not shares_storage
    with torch.no_grad() if reason == "no_grad" else contextlib.nullcontext():
        cache.quant_and_release(target, name="g")
    st = cache.cache_stats()
    assert st[f"skip_{reason}"] == (1 if filed else 2)
    assert (st["hits"], st["misses"]) == ((1, 1) if filed else (0, 2))
    assert not cache.is_released(target)
    # restore of a weight that is not released raises (docs/design.md §8) and changes nothing.
    with pytest.raises(ValueError, match="not released|never released"):
        cache.restore(target, "zeros")
    assert same_bits(target.detach(), ref)


def test_python_storage_object_alone_does_not_block_release():
    # Hugging Face's init calls untyped_storage(): the Python storage object is not another
    # tensor. The weight is released, and reading through that storage object raises too.
    w = param(64, 64)
    st = w.untyped_storage()
    before = zrw.memory.current()
    q = cache.quant_and_release(w, name="hf.weight")
    assert cache.is_released(w)
    assert zrw.memory.current() - before == q_nbytes(q) - 64 * 64 * 2
    with pytest.raises(RuntimeError, match=RELEASE_MSG):
        st.data_ptr()
    with pytest.raises(RuntimeError, match=RELEASE_MSG):
        torch.empty(0, dtype=BF16).set_(st).sum()
    cache.restore(w, "zeros")
    assert torch.count_nonzero(torch.empty(0, dtype=BF16).set_(st)) == 0


def test_no_grad_and_no_release_count_each_skip():
    ws = [param(64, 64, seed=i) for i in range(3)]
    with torch.no_grad():
        cache.quant_and_release(ws[0])
    with cache.no_release():
        assert not cache.release_enabled()
        with cache.no_release():
            cache.quant_and_release(ws[1])
        assert not cache.release_enabled()  # nesting restores the outer state
        cache.quant_and_release(ws[2], "mxfp8-32x32")
    assert cache.release_enabled()
    st = cache.cache_stats()
    assert st["entries"] == 3 and st["released"] == 0
    assert st["skip_no_grad"] == 1 and st["skip_release_false"] == 2
    assert st["fp8_bytes"] > 0
    for w in ws:
        assert cache.is_cached(w) and not cache.is_released(w)
        w.sum()


def test_no_release_is_thread_local():
    a, b = param(64, 64, seed=1), param(64, 64, seed=2)
    out = {}

    def other():
        cache.quant_and_release(b, name="b")
        out["released"] = cache.is_released(b)

    with cache.no_release():
        cache.quant_and_release(a, name="a")
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert not cache.is_released(a)
    assert out["released"] is True


def test_cached_under_no_release_stays_unreleased_on_later_hit():
    w = param(64, 64)
    with cache.no_release():
        cache.quant_and_release(w)
    cache.quant_and_release(w)  # same step, a hit: returns the copy, does not touch w
    assert cache.cache_stats()["hits"] == 1 and not cache.is_released(w)
    w.sum()


# ------------------------------------------------------------------------------------------------
# Frozen weights released with release_frozen=True.


@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_weight_stays_released_through_boundaries(recipe):
    f = param(64, 96, seed=20, requires_grad=False)
    ref = f.detach().clone()
    t = param(64, 64, seed=21)  # an ordinary trainable weight next to it
    nbytes = f.numel() * f.element_size()
    before = zrw.memory.current()
    q = cache.quant_and_release(f, recipe, release_frozen=True, name="base.weight")
    assert zrw.memory.current() - before == q_nbytes(q) - nbytes
    cache.quant_and_release(t, recipe, name="t")
    st = cache.cache_stats()
    assert st["frozen"] == 1 and st["released"] == 2
    assert cache.is_released(f)

    for step in range(3):
        assert cache.restore_all() == 1  # only t
        assert cache.is_released(f) and not cache.is_released(t)
        assert_raises_released(f, "base.weight")
        cache.next_step()
        st = cache.cache_stats()
        assert st["frozen"] == 1 and st["released_bytes"] == nbytes and st["entries"] == 1
        misses = st["misses"]
        q2 = cache.quant_and_release(f, recipe, release_frozen=True, name="base.weight")
        assert cache.cache_stats()["misses"] == misses  # a hit in every step
        check_fresh(q2, ref, recipe)
        cache.quant_and_release(t, recipe, name="t")
    cache.restore_all()
    assert cache.is_released(f)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("how", ["cache_clear", "cache_invalidate"])
def test_clearing_frozen_weight_restores_it_by_dequant(recipe, how):
    f = param(72, 64, seed=22, requires_grad=False)
    q = cache.quant_and_release(f, recipe, release_frozen=True, name="base.weight")
    expected = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16)
    if recipe == "mxfp8-32x32":  # the same values from the 32x32 tiles
        assert same_bits(expected, ops.mx_dequantize(q.bwd.data, q.bwd.scale, -2, BF16))
    fp8 = q_nbytes(q)
    before = zrw.memory.current()
    del q
    if how == "cache_clear":
        cache.cache_clear()
    else:
        assert cache.cache_invalidate(f) is True
    assert not cache.is_released(f) and not cache.is_cached(f)
    assert same_bits(f.detach(), expected)
    assert cache.cache_stats()["entries"] == 0 and cache.cache_stats()["fp8_bytes"] == 0
    assert zrw.memory.current() == before - fp8 + f.numel() * 2  # BF16 back, FP8 gone


def test_cache_invalidate_of_unreleased_entry_keeps_values():
    w = param(64, 64)
    ref = w.detach().clone()
    assert cache.cache_invalidate(w) is False  # no entry
    cache.quant_and_release(w, release=False)
    assert cache.cache_invalidate(w) is True
    assert not cache.is_cached(w) and same_bits(w.detach(), ref)


# ------------------------------------------------------------------------------------------------
# Weak entries.


@pytest.mark.parametrize("released", [True, False])
def test_entry_disappears_when_parameter_is_collected(released):
    keep = param(64, 64, seed=30)
    cache.quant_and_release(keep, name="keep")
    w = param(96, 64, seed=31)
    q = cache.quant_and_release(w, release=released, name="w")
    fp8_w = q_nbytes(q)
    st = cache.cache_stats()
    assert st["entries"] == 2
    fp8_all = st["fp8_bytes"]
    del q
    gc.collect()  # earlier garbage goes now, not inside the measurement
    mem = zrw.memory.current()
    del w  # the last reference: freed by refcount
    st = cache.cache_stats()  # sweeps dead entries
    assert st["entries"] == 1
    assert st["fp8_bytes"] == fp8_all - fp8_w
    freed = mem - zrw.memory.current()
    # The FP8 copy went with the entry; an unreleased weight's BF16 storage went with it too.
    assert freed == fp8_w + (0 if released else 96 * 64 * 2)
    assert [e["name"] for e in cache.cache_entries()] == ["keep"]
    assert cache.restore_all() == 1  # the dead weight is not restored (no crash)


def test_collected_weights_key_is_not_confused_with_new_tensor():
    for i in range(20):
        w = param(64, 64, seed=i)
        ref = w.detach().clone()
        q = cache.quant_and_release(w, name=f"w{i}")
        check_fresh(q, ref, "mxfp8")  # never a stale entry of a previous (dead) weight
        assert cache.cache_stats()["misses"] == i + 1
        del w, q  # freed by refcount; its entry is swept at the next call
    assert cache.cache_stats()["entries"] == 0


# ------------------------------------------------------------------------------------------------
# restore: no-ops, fills, master.


def test_restore_of_a_weight_that_is_not_released_raises():
    # docs/design.md §8: restoring a weight that was never released (or is not now) is an error
    # that says why; it changes nothing.
    w = param(64, 64)
    ref = w.detach().clone()
    for fill in cache.FILLS:
        with pytest.raises(ValueError, match=r"never released: it has no cache entry"):
            cache.restore(w, fill)
    cache.set_weight_name(w, "kept")
    cache.quant_and_release(w, release=False)
    for fill in cache.FILLS:
        with pytest.raises(ValueError, match=r"'kept' is not released .*release_false"):
            cache.restore(w, fill)
    assert cache.is_cached(w) and same_bits(w.detach(), ref)
    frozen = param(64, 64, requires_grad=False)
    cache.quant_and_release(frozen, name="f")  # frozen without release_frozen: not even filed
    for fill in cache.FILLS:
        with pytest.raises(ValueError, match=r"never released: it has no cache entry"):
            cache.restore(frozen, fill)
    assert cache.restore_all("zeros") == 0  # nothing released: nothing restored or zeroed
    assert same_bits(w.detach(), ref)


def test_restore_twice_and_after_invalidate_raises():
    w = param(64, 64, seed=3)
    cache.quant_and_release(w)
    cache.restore(w, "zeros")
    for fill in ("zeros", "dequant"):
        with pytest.raises(ValueError, match="never released"):
            cache.restore(w, fill)
    cache.quant_and_release(w)
    assert cache.cache_invalidate(w, "zeros") is True
    with pytest.raises(ValueError, match="never released"):
        cache.restore(w, "dequant")
    assert torch.count_nonzero(w) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_fill_zeros_and_dequant(recipe):
    a, b = param(72, 64, seed=40), param(72, 64, seed=41)
    cache.quant_and_release(a, recipe)
    qb = cache.quant_and_release(b, recipe)
    cache.restore(a, "zeros")
    assert torch.count_nonzero(a) == 0 and a.dtype == BF16
    expected = ops.mx_dequantize(qb.fwd.data, qb.fwd.scale, -1, BF16)
    cache.restore(b, "dequant")
    assert same_bits(b.detach(), expected)


def test_restore_all_dequant():
    ws = [param(64, 64, seed=i) for i in range(2)]
    qs = [cache.quant_and_release(w) for w in ws]
    expected = [ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16) for q in qs]
    assert cache.restore_all("dequant") == 2
    for w, e in zip(ws, expected):
        assert same_bits(w.detach(), e)


@pytest.mark.parametrize("bad", ["bogus", "", "Empty", "dequantize", "master "])
def test_invalid_fill_raises_and_keeps_weight_released(bad):
    w = param(64, 64)
    cache.quant_and_release(w, name="w")
    calls = [
        lambda: cache.restore(w, bad),
        lambda: cache.restore_all(bad),
        lambda: cache.cache_clear(bad),
        lambda: cache.cache_invalidate(w, bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="fill must be one of") as ei:
            call()
        assert repr(bad) in str(ei.value)
        assert cache.is_released(w) and cache.cache_stats()["entries"] == 1
    # The native op names the valid fills; "master" needs the master as its source.
    with pytest.raises(ValueError, match="fill must be one of"):
        torch.ops.zrw.restore(w, bad, None)
    with pytest.raises(ValueError, match=r'fill "master" needs the FP32 master of weight \'w\''):
        torch.ops.zrw.restore(w, "master", None)
    assert cache.is_released(w)


def test_fill_master_without_master_raises_and_keeps_weight():
    w = param(64, 64)
    q = cache.quant_and_release(w, name="w")
    with pytest.raises(ValueError, match="MasterWeights") as ei:
        cache.restore(w, "master")
    assert "dequant" in str(ei.value)
    assert cache.is_released(w)  # nothing lost: still restorable by dequant
    expected = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16)
    cache.restore(w, "dequant")
    assert same_bits(w.detach(), expected)


def _set_masters(opt, seed):
    g = torch.Generator().manual_seed(seed)
    masters = [m for ms in opt.masters for m in ms]
    with torch.no_grad():
        for m in masters:
            # Values with FP32 mantissa bits below BF16's, so the rounding is exercised.
            m.copy_(torch.randn(m.shape, generator=g) * 3 + 1e-3)
    return masters


@pytest.mark.parametrize("recipe", RECIPES)
def test_fill_master_restores_bf16_of_master_exactly(recipe):
    ws = [param(64, 64, seed=50), param(96, 32, seed=51)]
    opt = MasterWeights(torch.optim.AdamW, ws, lr=1e-3)
    masters = _set_masters(opt, 52)
    for w in ws:
        cache.quant_and_release(w, recipe, name="w")
        assert cache.is_released(w)
    cache.restore(ws[0], "master")
    assert not cache.is_released(ws[0])
    assert same_bits(ws[0].detach(), masters[0].to(BF16))
    assert cache.is_released(ws[1])
    assert cache.restore_all("master") == 1
    assert same_bits(ws[1].detach(), masters[1].to(BF16))
    assert cache.cache_stats()["entries"] == 0


def test_restore_all_master_leaves_frozen_entries_released():
    # restore_all's contract: frozen (release_frozen) entries survive, also with fill="master"
    # and also when MasterWeights holds a master for the frozen weight.
    t = param(64, 64, seed=60)
    f = param(64, 64, seed=61, requires_grad=False)
    opt = MasterWeights(torch.optim.AdamW, [t, f], lr=1e-3)
    masters = _set_masters(opt, 62)
    cache.quant_and_release(t, name="t")
    cache.quant_and_release(f, release_frozen=True, name="f")
    assert cache.restore_all("master") == 1
    assert same_bits(t.detach(), masters[0].to(BF16))
    assert cache.is_released(f)


# ------------------------------------------------------------------------------------------------
# Thread safety.


@pytest.mark.parametrize("recipe", RECIPES)
def test_concurrent_quant_and_release_on_different_weights(recipe):
    n_threads, calls = 6, 15
    ws = [param(128, 64, seed=70 + i) for i in range(n_threads)]
    refs = [w.detach().clone() for w in ws]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    before = zrw.memory.current()
    barrier = threading.Barrier(n_threads + 1)
    results, errors = [None] * n_threads, []

    def work(i):
        try:
            barrier.wait()
            first = cache.quant_and_release(ws[i], recipe, name=f"w{i}")
            for _ in range(calls - 1):
                q = cache.quant_and_release(ws[i], recipe, name=f"w{i}")
                assert q.fwd.data.data_ptr() == first.fwd.data.data_ptr()
                cache.cache_stats()
                cache.cache_entries()
            results[i] = first
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    for _ in range(calls):
        cache.cache_stats()  # a concurrent reader
    for t in threads:
        t.join()
    assert not errors, errors
    st = cache.cache_stats()
    assert st["entries"] == n_threads and st["released"] == n_threads
    assert st["misses"] == n_threads and st["hits"] == n_threads * (calls - 1)
    assert st["released_bytes"] == nbytes
    fp8 = sum(q_nbytes(q) for q in results)
    assert st["fp8_bytes"] == fp8
    assert zrw.memory.current() - before == fp8 - nbytes
    for q, ref in zip(results, refs):
        check_fresh(q, ref, recipe)
    assert cache.restore_all("zeros") == n_threads
    results = q = None  # the last references to the FP8 copies (work() wrote into results)
    assert zrw.memory.current() == before


def test_concurrent_calls_on_the_same_weight_quantize_once():
    w = param(128, 128, seed=80)
    ref = w.detach().clone()
    n_threads = 6
    barrier = threading.Barrier(n_threads)
    ptrs, errors = [], []

    def work():
        try:
            barrier.wait()
            for _ in range(10):
                ptrs.append(cache.quant_and_release(w, name="w").fwd.data.data_ptr())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    st = cache.cache_stats()
    assert st["misses"] == 1 and st["hits"] == n_threads * 10 - 1 and st["released"] == 1
    assert len(set(ptrs)) == 1
    check_fresh(cache.quant_and_release(w), ref, "mxfp8")


def test_grad_mode_hit_releases_a_no_grad_entry():
    # A reentrant activation checkpoint runs its forward under no_grad (a miss that cannot
    # release) and the recompute under grad mode (a hit): the hit releases, or the weight would
    # stay resident for the whole step.
    w = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
    with torch.no_grad():
        cache.quant_and_release(w, name="ckpt")
    assert not cache.is_released(w) and cache.is_cached(w)
    cache.quant_and_release(w, name="ckpt")
    assert cache.is_released(w)
    st = cache.cache_stats()
    assert st["hits"] == 1 and st["misses"] == 1 and st["released_bytes"] == 64 * 96 * 2
    cache.restore_all("zeros")


def test_no_grad_sees_a_write_through_data():
    # Eval under no_grad never reaches a step boundary, and `w.data.copy_` bumps no version:
    # each no_grad call must quantize what the weight holds now.
    w = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
    with torch.no_grad():
        q1 = cache.quant_and_release(w, name="eval")
        w.data.copy_(torch.randn(64, 96, dtype=torch.bfloat16))
        q2 = cache.quant_and_release(w, name="eval")
    check_fresh(q2, w.detach().clone(), "mxfp8")
    assert not same_bits(q1.fwd.data, q2.fwd.data)
