"""zrw.testing: the test instruments (fault injection, GEMM counters, all-gather byte counts) live
there, opt-in, and no longer in the shipped modules; their argument errors name the argument,
what was expected and what was found. zrw.fsdp keeps one documented statistic, stats()."""

import subprocess
import sys
import textwrap

import pytest
import torch

import zrw
import zrw.fsdp
import zrw.testing
from zrw import memory, ops


def run_child(code):
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_import_zrw_does_not_load_it_and_the_shipped_modules_hold_none_of_it():
    out = run_child("""
        import sys
        import zrw, zrw.fsdp
        print("zrw.testing" in sys.modules)
        print([n for n in ("fail_allocations", "pending_failures") if hasattr(zrw.memory, n)])
        print([n for n in ("count_all_gather_bytes", "shard_quantizations")
               if hasattr(zrw.fsdp, n) or n in zrw.fsdp.__all__])
    """)
    assert out.split("\n")[:3] == ["False", "[]", "[]"]


@pytest.mark.parametrize("arg", ["min_bytes", "count", "after"])
def test_fail_allocations_argument_errors(arg):
    with pytest.raises(
        ValueError,
        match=rf"^zrw\.testing\.fail_allocations: {arg} must be an "
        rf"int >= 0, got -1$",
    ):
        with zrw.testing.fail_allocations(**{arg: -1}):
            pass
    with pytest.raises(
        TypeError,
        match=rf"^zrw\.testing\.fail_allocations: {arg} must be an "
        rf"int >= 0, got float 2\.0$",
    ):
        with zrw.testing.fail_allocations(**{arg: 2.0}):
            pass
    with pytest.raises(TypeError, match=rf"{arg} must be an int >= 0, got NoneType None$"):
        with zrw.testing.fail_allocations(**{arg: None}):
            pass
    assert zrw.testing.pending_failures() == 0


def test_this_test_build_has_fault_injection():
    # ZRW_TEST_OPS=ON (the default) compiles it into _C; a packaged build (OFF) does not, and
    # fail_allocations then says so.
    assert zrw._C.fault_injection_built() is True


def test_fail_allocations_needs_the_counting_allocator():
    out = run_child("""
        import zrw.testing
        try:
            with zrw.testing.fail_allocations():
                pass
        except RuntimeError as e:
            print(e)
        print(zrw.testing.pending_failures())
    """)
    assert out.split("\n")[:2] == [
        "zrw.testing.fail_allocations: the counting allocator is not installed: call "
        "zrw.memory.install() before building the tensors whose allocations should fail",
        "0",
    ]


def test_fail_allocations_fails_the_planned_allocations_and_cancels_the_rest():
    memory.install()
    big = 1 << 20
    with zrw.testing.fail_allocations(min_bytes=big, count=2, after=1):
        assert zrw.testing.pending_failures() == 2
        torch.empty(big // 2, dtype=torch.uint8)  # below min_bytes: not counted
        torch.empty(big, dtype=torch.uint8)  # the one that succeeds (after=1)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            torch.empty(big, dtype=torch.uint8)
        assert zrw.testing.pending_failures() == 1
    assert zrw.testing.pending_failures() == 0
    torch.empty(big, dtype=torch.uint8)


def test_gemm_counts_count_mx_matmul_calls_until_reset():
    a, sa = ops.mx_quantize(torch.randn(32, 64), -1)
    b, sb = ops.mx_quantize(torch.randn(48, 64), -1)
    zrw.testing.reset_gemm_counts()
    assert set(zrw.testing.gemm_counts()) == {"fp32", "bf16", "bf16_to_fp32"}
    assert sum(zrw.testing.gemm_counts().values()) == 0
    ops.mx_matmul(a, sa, b, sb, torch.float32)
    ops.mx_matmul(a, sa, b, sb, torch.bfloat16)
    counts = zrw.testing.gemm_counts()
    assert counts["fp32"] + counts["bf16"] == 2
    zrw.testing.reset_gemm_counts()
    assert sum(zrw.testing.gemm_counts().values()) == 0


def test_count_all_gather_bytes_counts_and_puts_the_methods_back():
    # One gloo rank in a child: the process group does not outlive the test.
    out = run_child("""
        import os, torch, torch.distributed as dist
        from torch.distributed import ProcessGroup
        import zrw.testing
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        methods = ("all_gather_single", "_allgather_base")
        before = {m: getattr(ProcessGroup, m, None) for m in methods}
        with zrw.testing.count_all_gather_bytes() as counts:
            out = torch.empty(10)
            dist.all_gather_into_tensor(out, torch.arange(10.0))
        after = {m: getattr(ProcessGroup, m, None) for m in before}
        print(counts["bytes"], counts["calls"], before == after)
        dist.destroy_process_group()
    """)
    assert out.split("\n")[0] == "40 1 True"


def test_shard_quantizations_live_in_testing_not_in_fsdp():
    import zrw.fsdp

    assert isinstance(zrw.testing.shard_quantizations(), int)
    assert not hasattr(zrw.fsdp, "stats")  # an instrument, not the FSDP2 API
