"""No crash, no lost weight (docs/design.md §5 "Safety invariants"): misuse, faults and
threads around release and restore.

Crash-prone cases run in a child process, so that a regression (a segfault, a heap corruption
abort) fails one test instead of killing the suite. Out-of-memory is injected with
zrw.testing.fail_allocations (the counting allocator, installed before any weight is built).
"""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import zrw
import zrw.testing
from helpers.bitwise import same_bits
from helpers.mx_layer import BF16, MXLinearFn, assert_step_refused, param, value
from zrw import cache, ops
from zrw.optim import MasterWeights, attach

pytestmark = pytest.mark.usefixtures("clean_cache")

zrw.memory.install()


def dequant_of(q):
    return ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16)


def run_child(code: str) -> str:
    """Run `code` in a fresh interpreter; fail with its output unless it exits 0."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


# ------------------------------------------------------------------------------------------------
# Misuse that could crash the process: each in a child process.


def test_replaced_data_is_never_written_and_the_weight_stays_restorable():
    out = run_child("""
        import torch, zrw
        from zrw import cache
        BF16 = torch.bfloat16
        for new in ("same", "float32", "bigger", "smaller_view"):
            w = torch.nn.Parameter(torch.randn(64, 64).to(BF16))
            keep = torch.nn.Parameter(torch.randn(64, 64).to(BF16))
            q = cache.quant_and_release(w, name="w")
            cache.quant_and_release(keep, name="keep")
            t = {"same": torch.randn(64, 64).to(BF16), "float32": torch.randn(64, 64),
                 "bigger": torch.randn(128, 128).to(BF16),
                 "smaller_view": torch.randn(8, 8).to(BF16)}[new]
            t_ref = t.clone()
            w.data = t
            for fill in ("empty", "zeros", "dequant"):
                try:
                    cache.restore(w, fill)
                except RuntimeError as e:
                    assert "'w' cannot be restored" in str(e) and "cache_invalidate" in str(e), e
                else:
                    raise AssertionError("restore into replaced data did not raise")
                assert torch.equal(t, t_ref)  # nothing was written into the new data
                assert cache.cache_state(w) == "released"  # still released, entry and FP8 copy kept
            try:
                cache.restore_all("dequant")
            except RuntimeError as e:
                assert "1 weight could not be restored" in str(e) and "'w'" in str(e), e
            else:
                raise AssertionError("restore_all did not raise")
            assert not cache.is_released(keep)  # the other weight was restored anyway
            keep.sum()
            assert torch.equal(t, t_ref) and cache.cache_state(w) == "released"
            # The user's choice stands: invalidate drops the stale copy, the new data stays.
            assert cache.cache_invalidate(w) is True and cache.cache_state(w) == "none"
            assert torch.equal(w.detach(), t_ref)
            print("OK", new, flush=True)
    """)
    assert out.count("OK") == 4, out


def test_replaced_data_is_requantized_at_the_next_use():
    w = param(64, 64, seed=1)
    cache.quant_and_release(w, name="w")
    t = torch.randn(64, 64).to(BF16)
    df, sf, _, _ = ops.mx_quantize_dual(t)
    w.data = t
    del t  # the weight alone owns its new storage, so it can be released in its turn
    q = cache.quant_and_release(w, name="w")  # not the stale copy of the released values
    assert same_bits(q.fwd.data, df) and same_bits(q.fwd.scale, sf)
    assert cache.is_released(w)  # the new storage was released in its turn
    cache.restore(w, "dequant")


def test_failed_allocation_in_restore_changes_nothing():
    out = run_child("""
        import torch, zrw, zrw.testing
        from zrw import cache, ops
        zrw.memory.install()
        w = torch.nn.Parameter(torch.randn(96, 64).to(torch.bfloat16))
        q = cache.quant_and_release(w, name="w")
        expected = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, torch.bfloat16)
        for fill in ("empty", "zeros", "dequant"):
            # The bytes of the weight itself fail (after=0); for dequant also its fill's buffer.
            for after in ((0, 1) if fill == "dequant" else (0,)):
                with zrw.testing.fail_allocations(min_bytes=96 * 64 * 2, after=after):
                    try:
                        cache.restore(w, fill)
                    except torch.OutOfMemoryError as e:
                        assert "injected" in str(e)
                    else:
                        raise AssertionError("no OOM")
                assert cache.cache_state(w) == "released"
                try:
                    w.sum()  # the poison is still there: an error, not a null-pointer read
                except RuntimeError as e:
                    assert "is released" in str(e)
                else:
                    raise AssertionError("released weight readable")
        cache.restore(w, "dequant")
        assert torch.equal(w.detach(), expected)
        print("OK", flush=True)
    """)
    assert "OK" in out


def test_threads_releasing_and_restoring_the_same_weights():
    out = run_child("""
        import threading, torch, zrw
        from zrw import cache
        from zrw.optim import MasterWeights
        ws = [torch.nn.Parameter(torch.randn(128, 96).to(torch.bfloat16)) for _ in range(4)]
        opt = MasterWeights(torch.optim.AdamW, ws, lr=1e-3)
        masters = [m for ms in opt.masters for m in ms]
        errors = []

        def work(seed):
            g = torch.Generator().manual_seed(seed)
            try:
                for i in range(300):
                    w = ws[int(torch.randint(0, 4, (1,), generator=g))]
                    if i % 2:
                        cache.quant_and_release(w, name="w")
                    else:
                        try:
                            cache.restore(w, "master")
                        except ValueError:
                            pass  # not released right now: another thread restored it
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors
        cache.restore_all("master")
        for w, m in zip(ws, masters):
            assert torch.equal(w.detach(), m.to(torch.bfloat16))
        print("OK", flush=True)
    """)
    assert "OK" in out


# ------------------------------------------------------------------------------------------------
# Batch restores are all-or-nothing per weight, under injected faults.

SHAPES = [(64, 64), (96, 32), (32, 128), (64, 96)]


@pytest.mark.parametrize("after", range(len(SHAPES)))
def test_restore_all_fault_keeps_the_failed_weight_and_restores_the_rest(after):
    ws = [param(*s, seed=i) for i, s in enumerate(SHAPES)]
    for i, w in enumerate(ws):
        cache.set_weight_name(w, f"w{i}")
    expected = [dequant_of(cache.quant_and_release(w)) for w in ws]
    # Every weight is at least 2 * 32 * 64 bytes; the fill buffers of "zeros" are none.
    with zrw.testing.fail_allocations(min_bytes=4096, after=after):
        with pytest.raises(torch.OutOfMemoryError, match=r"1 weight could not be restored") as ei:
            cache.restore_all("zeros")
    failed = [i for i, w in enumerate(ws) if cache.is_released(w)]
    assert len(failed) == 1 and f"'w{failed[0]}'" in str(ei.value)
    for i, w in enumerate(ws):
        if i not in failed:
            assert torch.count_nonzero(w) == 0
    # The failed one kept its FP8 copy: restored by dequant it is exactly its copy.
    assert cache.restore_all("dequant") == 1
    assert same_bits(ws[failed[0]].detach(), expected[failed[0]])


@pytest.mark.parametrize("after", range(len(SHAPES)))
def test_assign_weights_fault_keeps_the_weight_restorable(after):
    # MasterWeights' write-back (assign_weights) under an out-of-memory on one weight's bytes.
    ws = [param(*s, seed=i) for i, s in enumerate(SHAPES)]
    masters = [torch.randn(s) for s in SHAPES]
    for w in ws:
        cache.quant_and_release(w)
    with zrw.testing.fail_allocations(min_bytes=4096, after=after):
        with pytest.raises(
            torch.OutOfMemoryError, match="1 weight could not be written; each is left as it was"
        ):
            cache.assign_weights(ws, masters)
    released = [cache.is_released(w) for w in ws]
    assert released == [i == after for i in range(len(ws))]
    for w, m in zip(ws, masters):
        if not cache.is_released(w):
            assert same_bits(w.detach(), m.to(BF16))
    assert cache.assign_weights(ws, masters) == 1  # the retry restores the one left
    for w, m in zip(ws, masters):
        assert same_bits(w.detach(), m.to(BF16))


class _FailingSGD(torch.optim.SGD):
    """An inner optimizer that fails half-way through its step (after updating one master)."""

    def step(self, closure=None):
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)
        raise RuntimeError("inner step failed")


@pytest.mark.parametrize("keep_released", [False, True])
def test_master_weights_write_back_runs_even_when_the_inner_step_fails(keep_released):
    ws = [param(64, 64, seed=i) for i in range(3)]
    opt = attach(MasterWeights(_FailingSGD, ws, lr=0.1, keep_released=keep_released))
    for w in ws:
        cache.quant_and_release(w)
        w.grad = torch.ones_like(w)
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    # Every weight holds bf16 of its master (the first one's moved): never garbage, never lost.
    if keep_released:  # released, their values the masters': no FP8 copy of the old values
        assert cache.cache_stats()["pending"] == 3
    for w, m in zip(ws, opt.masters[0]):
        if keep_released:
            assert cache.is_released(w) and cache.master_of(w) is m
            cache.restore(w, "master")
        assert not cache.is_released(w) and same_bits(w.detach(), m.to(BF16))


# ------------------------------------------------------------------------------------------------
# A boundary restores exactly its own optimizer's weights; no fill hands out garbage.


def test_boundary_restores_only_the_parameters_its_optimizer_owns():
    a, b, c = param(64, 64, seed=1), param(64, 64, seed=2), param(64, 64, seed=3)
    opt_a = attach(MasterWeights(torch.optim.AdamW, [a], lr=1e-2, keep_released=False))
    opt_b = attach(torch.optim.SGD([b], lr=0.1), fill="dequant")
    qc = cache.quant_and_release(c, name="c")  # in no optimizer
    for w in (a, b):
        cache.quant_and_release(w)
        w.grad = torch.ones_like(w)
    opt_a.step()
    assert not cache.is_released(a)
    assert cache.is_released(b) and cache.is_released(c)  # other optimizers' / nobody's
    opt_b.step()
    assert not cache.is_released(b) and cache.is_released(c)
    # c's FP8 copy is still its values (a released weight cannot change): the next step hits it.
    assert cache.quant_and_release(c, name="c").fwd.data is qc.fwd.data
    cache.restore(c, "dequant")
    assert same_bits(c.detach(), dequant_of(qc))


def test_restore_all_default_is_exact_or_dequant_never_uninitialized():
    a, b = param(64, 64, seed=4), param(64, 64, seed=5)
    opt = MasterWeights(torch.optim.AdamW, [a], lr=1e-3)
    with torch.no_grad():
        opt.masters[0][0].mul_(-3)
    cache.quant_and_release(a)
    qb = cache.quant_and_release(b)
    assert cache.restore_all() == 2
    assert same_bits(a.detach(), opt.masters[0][0].to(BF16))  # from its master
    assert same_bits(b.detach(), dequant_of(qb))  # no master: its FP8 copy


def test_an_unattached_optimizer_refuses_a_released_weight_before_its_state_moves():
    w = param(64, 64, seed=6)
    cache.set_weight_name(w, "layer.weight")
    opt = torch.optim.AdamW([w], lr=1e-3)
    cache.quant_and_release(w)
    released = r"would update 1 weight\(s\) whose BF16 storage is released: 'layer\.weight'"
    assert_step_refused(opt, w, r"AdamW\.step\(\) " + released)
    assert len(opt.state) == 0  # no step count, no moments: nothing advanced
    cache.restore(w, "dequant")
    opt.step()
    assert int(opt.state[w]["step"]) == 1


# ------------------------------------------------------------------------------------------------
# Named errors of the cache API.


@pytest.mark.parametrize(
    "call",
    [
        lambda: cache.restore(None),
        lambda: cache.cache_state(None),
        lambda: cache.is_released(3),
        lambda: cache.cache_invalidate("w"),
        lambda: cache.quant_and_release(None),
        lambda: cache.restore_weights(torch.zeros(2, 2)),
        lambda: cache.restore_weights([torch.zeros(2, 2), None]),
        lambda: cache.assign_weights([torch.zeros(2, 2)], [None]),
    ],
)
def test_none_and_non_tensor_arguments_get_type_errors(call):
    with pytest.raises(TypeError, match=r"zrw\.cache\.\w+: \w+(\[\d\])? must be"):
        call()


@pytest.mark.parametrize("shape", [(), (64,), (2, 2, 2, 2)])
def test_weights_of_the_wrong_rank_are_refused_by_name(shape):
    with pytest.raises(
        ValueError,
        match=r"zrw\.cache\.quant_and_release: w must be a 2-d .* got "
        r"shape",
    ):
        cache.quant_and_release(torch.zeros(shape, dtype=BF16))


def test_assign_weights_checks_shapes_and_lengths():
    w = param(64, 64)
    with pytest.raises(ValueError, match="same length"):
        cache.assign_weights([w], [])
    cache.quant_and_release(w, name="w")
    with pytest.raises(RuntimeError, match=r"'w'.*source 0 must have the weight's shape"):
        cache.assign_weights([w], [torch.zeros(32, 64)])
    assert cache.is_released(w)
    cache.assign_weights([w], [torch.full((64, 64), 0.5)])
    assert torch.equal(w.detach(), torch.full((64, 64), 0.5, dtype=BF16))


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (lambda b: b.view(torch.uint8), TypeError, "must be torch.float8_e8m0fnu"),
        (lambda b: b[:1], ValueError, r"must end in \(2, 3\)"),
        (lambda b: b.unsqueeze(0).unsqueeze(0), ValueError, "shape"),
    ],
)
def test_expand_block_scale_refuses_wrong_shapes_and_dtypes(bad, exc, match):
    _, block = ops.mx_quantize_block(torch.randn(64, 96).to(BF16))
    with pytest.raises(exc, match=match):
        ops.expand_block_scale(bad(block), (64, 96), -1)
    with pytest.raises(ValueError, match="shape"):
        ops.expand_block_scale(block, (64, 128), -1)
    with pytest.raises(IndexError, match="dim must be -1"):
        ops.expand_block_scale(block, (64, 96), -3)


def test_expand_block_scale_op_matches_the_reference():
    from zrw import reference as ref

    for shape in [(64, 96), (70, 33), (3, 40, 65)]:
        _, block = ops.mx_quantize_block(torch.randn(*shape).to(BF16))
        for dim in (-1, -2):
            assert same_bits(
                ops.mx_expand_block_scale(block, shape[-2], shape[-1], dim),
                ref.mx_expand_block_scale(block, shape[-2], shape[-1], dim),
            )


def test_concurrent_zrw_calls_on_other_threads_keep_entries_consistent():
    # Many threads, each training its own weights through the cache and restoring them with
    # their own MasterWeights: the table stays consistent and every weight ends exact.
    errors = []

    def work(seed):
        try:
            ws = [param(64, 64, seed=seed * 10 + i) for i in range(3)]
            opt = attach(MasterWeights(torch.optim.SGD, ws, lr=0.1))
            for _ in range(5):
                x = torch.randn(4, 64).to(BF16)
                for w in ws:
                    x = MXLinearFn.apply(x, w, cache.quant_and_release(w))
                x.float().sum().backward()
                opt.step()
                opt.zero_grad()
            for w, m in zip(ws, opt.masters[0]):
                assert same_bits(value(w), m.to(BF16))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_saving_a_state_dict_with_released_weights_leaves_the_old_checkpoint_intact(
    tmp_path, recipe
):
    # state_dict() of a converted layer refuses while its weight is released, before torch.save
    # opens (and truncates) the file: the previous checkpoint stays as it was.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, dtype=BF16), torch.nn.Linear(64, 32, dtype=BF16)
    )
    zrw.convert(model, recipe, skip=())
    # An optimizer with the boundary and no masters owns the weights (mid-step: no master).
    opt = zrw.optim.attach(torch.optim.SGD(model.parameters(), lr=0.1), fill="dequant")  # noqa: F841
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    old = path.read_bytes()
    model(torch.randn(4, 64).to(BF16)).float().sum().backward()
    assert cache.is_released(model[0].weight)
    with pytest.raises(
        RuntimeError,
        match=r"state_dict\(\) of '0': weight\(s\) '0\.weight' are "
        r"released.*nothing was returned or written",
    ):
        torch.save(model.state_dict(), path)
    assert path.read_bytes() == old
    cache.restore_all("dequant")
    torch.save(model.state_dict(), path)  # restored: an ordinary state dict again
    assert path.read_bytes() != old


def test_cache_invalidate_with_master_fill():
    w, v, u = param(64, 64, seed=7), param(64, 64, seed=8), param(64, 64, seed=9)
    opt = MasterWeights(torch.optim.SGD, [w], lr=0.1)
    with torch.no_grad():
        opt.masters[0][0].mul_(-1)
    assert cache.cache_invalidate(w, "master") is False  # no entry
    cache.quant_and_release(u, release=False)
    assert cache.cache_invalidate(u, "master") is True and not cache.is_cached(u)
    cache.quant_and_release(w)
    assert cache.cache_invalidate(w, "master") is True
    assert not cache.is_cached(w) and same_bits(w.detach(), opt.masters[0][0].to(BF16))
    cache.quant_and_release(v, name="v")
    with pytest.raises(ValueError, match="needs the FP32 master of weight 'v'"):
        cache.cache_invalidate(v, "master")
    assert cache.is_released(v)
    cache.restore(v, "dequant")


def test_restore_all_master_never_falls_back_to_dequant_for_a_weight_with_a_master():
    # The restore from the master fails (out of memory): the weight stays released with its
    # FP8 copy, rather than being handed to the dequantizing pass for the master-less weights
    # (lossy); a retry restores it exactly.
    w = param(256, 256, seed=7)
    opt = MasterWeights(torch.optim.AdamW, [w], lr=1e-3, keep_released=False)
    with torch.no_grad():
        opt.masters[0][0].add_(1e-3)  # so that the dequantized copy and the master differ
    cache.quant_and_release(w, name="w")
    with zrw.testing.fail_allocations(min_bytes=256 * 256, count=1):
        with pytest.raises(RuntimeError, match="'w': .*injected allocation failure"):
            cache.restore_all("master")
    assert cache.is_released(w) and cache.cache_stats()["fp8_bytes"] > 0
    assert cache.restore_all("master") == 1
    assert same_bits(w.detach(), opt.masters[0][0].to(BF16))
