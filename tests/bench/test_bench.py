"""The benchmarks run end to end at tiny sizes and print the JSON they document.

No timing is asserted (times on a shared 2-core machine say nothing in a test); what is checked
is that every figure is there, finite and positive, that exact figures (bytes, ratios built
from them) are what they must be, and that each benchmark runs in its own process as
docs/design.md §9 says (`python -m zrw.bench NAME --json`).
"""

import json
import math
import os
import subprocess
import sys

import pytest


def run_bench(*args, timeout=300, env=None):
    out = subprocess.run(
        [sys.executable, "-m", "zrw.bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_quant_json():
    r = run_bench("quant", "--n", "256", "--k", "320", "--mm", "64", "--repeat", "2")
    assert r["shape"] == [256, 320]
    assert set(r["ms"]) >= {
        "copy",
        "dual",
        "block",
        "single_dim_-1",
        "single_dim_0",
        "dual_1_thread",
        "copy_1_thread",
        "matmul_bf16",
        "mx_matmul",
    }
    for name, v in r["ms"].items():
        assert v is None or positive(v), name
    for name, v in r["ratio_to_copy"].items():
        assert positive(v) and v == pytest.approx(r["ms"][name] / r["ms"]["copy"]), name
    # The fused master ops against an fp32 copy, beside the bf16 ops against the bf16 copy.
    assert set(r["ms"]) >= {
        "copy_fp32",
        "dual_from_master",
        "block_from_master",
        "single_dim_-1_from_master",
        "cast_then_dual",
    }
    fm = r["from_master"]
    assert fm["param_dtype"] == "bfloat16"
    for name, v in fm["ratio_to_fp32_copy"].items():
        key = name if name == "cast_then_dual" else f"{name}_from_master"
        assert positive(v) and v == pytest.approx(r["ms"][key] / r["ms"]["copy_fp32"]), name
    assert set(fm["ratio_to_fp32_copy"]) == {"dual", "block", "single_dim_-1", "cast_then_dual"}
    assert fm["bf16_ratio_to_bf16_copy"] == {
        k: r["ratio_to_copy"][k] for k in ("dual", "block", "single_dim_-1")
    }
    assert r["cpu_isa"] in ("avx512", "avx2", "base")
    # Which GEMM mx_matmul ran: the process's path (bf16 where the CPU has native BF16).
    assert (
        r["gemm_path"] == ("bf16" if r["native_bf16"] else "fp32") or "ZRW_CPU_GEMM" in os.environ
    )
    assert r["mx_matmul_gemm_ran"] and set(r["mx_matmul_gemm_ran"]) <= {
        "fp32",
        "bf16",
        "bf16_to_fp32",
    }
    # glibc here: the warm-heap setting applies and the fresh-pages timing exists
    assert r["allocator"] == "glibc, freed memory kept in the heap"
    assert positive(r["ms"]["dual_fresh_output_pages"])


def test_typical_step_takes_the_saving_most_steps_measured():
    """The seed benches' per-step statistic (bench._timing.typical_step): clean steps agree to the
    byte, a gloo worker's late free moves single steps by a collective's buffer either way."""
    from zrw.bench._timing import typical_step

    t = 172032 - 16
    # what CI saw on one TP=4 rank (step 0 first; the last step is one of the two noise values):
    # 4 of 7 measured steps hit, the clean value and one noise value 3 times each
    ci = [t, t + 32768, t - 40960, t, t, t - 40960, t, t - 40960]
    assert ci[typical_step(ci)] == t
    # most steps hit, the median moved by a noise value; two clean steps still win
    hit = [t, t - 40960, t - 40960, t - 8452, t, t, t - 16660, t + 32768]
    assert sorted(hit[1:])[3] == t - 8452
    assert hit[typical_step(hit)] == t
    # step 0 never counts (it allocates what later steps reuse)
    assert typical_step([5, 7, 7, 3]) == 1
    # no value repeats: the lower middle, as the median took it
    assert typical_step([0, 30, 10, 20]) == 3
    assert typical_step([0, 9, 4]) == 2
    # a tie between two repeated values: the one nearest the median, then the smaller
    assert [9, 1, 1, 5, 8, 8][typical_step([9, 1, 1, 5, 8, 8])] == 8
    assert [0, 2, 2, 6, 6][typical_step([0, 2, 2, 6, 6])] == 2
    # one step only
    assert typical_step([42]) == 0


def test_bench_unknown_name_is_an_error():
    out = subprocess.run(
        [sys.executable, "-m", "zrw.bench", "nope"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "unknown benchmark 'nope'" in out.stderr


def test_bench_cache_json():
    r = run_bench(
        "cache",
        "--sizes",
        "64x96",
        "--repeat",
        "1",
        "--dim",
        "64",
        "--layers",
        "2",
        "--tokens",
        "8",
        "--micro",
        "1",
        "--steps",
        "1",
        "--check-params",
        "2",
        "--check-dim",
        "64",
    )
    wc = r["write_check"]
    assert (wc["params"], wc["dim"]) == (2, 64)
    for mode in ("digest", "bit comparison"):
        assert positive(wc["modes"][mode]["step_ms"]) and positive(wc["modes"][mode]["check_ms"])
    for recipe in ("mxfp8", "mxfp8-32x32"):
        op = r["op"][recipe]["64x96"]
        assert all(positive(op[k]) for k in ("bare_ms", "miss_ms", "miss_no_release_ms", "hit_us"))
        for boundary in ("bf16-free", "master", "dequant"):
            step = r["step"][recipe][boundary]
            # exact: the MLP's 2 bf16 weights of 64 x 64 are released, nothing else
            assert step["released_bytes"] == 2 * 64 * 64 * 2
            assert positive(step["step_ms"]) and positive(step["restore_ms"])


def test_bench_quant_every_kernel_build_in_its_own_process():
    from helpers.quant import ISA_REQUIREMENTS, cpu_flags

    tiny = ["quant", "--n", "64", "--k", "96", "--mm", "32", "--repeat", "1"]
    r = run_bench(*tiny, "--isa", "all", timeout=600)
    assert list(r) == ["avx512", "avx2", "base"]
    for isa, res in r.items():
        if not ISA_REQUIREMENTS[isa] <= cpu_flags():
            assert "skipped" in res and f"ZRW_CPU_ISA={isa}" in res["skipped"], res
            continue
        assert res["cpu_isa"] == isa  # the child ran the forced build
        assert positive(res["bandwidth"][str(res["threads"])]["dual"]["x_copy_time"])
    # The table ends with every build against the targets.
    out = subprocess.run(
        [sys.executable, "-m", "zrw.bench", *tiny, "--isa", "base"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "targets: time over the copy" in out.stdout and "\n  base " in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "zrw.bench", "quant", "--isa", "sse9000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "--isa: unknown kernel build(s) ['sse9000']" in bad.stderr


@pytest.fixture(scope="module")
def step_run():
    """`bench step` at a tiny size, once for the tests of its tables and of its ledger.
    torchao's low-bit steps are traced by dynamo but run by its eager backend
    (TORCH_COMPILE_OVERRIDE_BACKENDS): the live bytes the ledger checks are the same, and a
    fresh machine compiles no C++ (inductor's cold compile of the step took minutes here)."""
    return run_bench(
        "step",
        "--dim",
        "128",
        "--layers",
        "4",
        "--tokens",
        "8",
        "--micro",
        "1",
        "--steps",
        "2",
        env={"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"},
    )


def test_bench_step_json_memory_in_units_of_n(step_run):
    r = step_run
    for foreach in ("False", "True"):
        runs = r["foreach"][foreach]
        n = runs["cache"]["n"]
        assert n == 4 * 128 * 128
        # The BF16-free step's peak is cache's minus the BF16 weights (2N), within 1%; the
        # seed's restore saves less (the FP8 copies live through its inner step).
        assert abs(runs["bf16-free"]["peak_saving_vs_cache_per_n"] - 2.0) <= 0.02, runs
        assert runs["restore"]["peak_saving_vs_cache_per_n"] < 2.0 - 0.5
        # masters 4 + AdamW moments 8 + BF16 grads 2 (+ FP8 copies, + BF16 weights in cache)
        assert runs["bf16-free"]["start_per_n"] >= 14.0
        assert runs["cache"]["start_per_n"] - runs["bf16-free"]["start_per_n"] >= 2.0
        # mx_matmul's tile workspace is live in every mode, the same bytes (the same GEMMs)
        ws = {m: x["matmul_workspace_bytes"] for m, x in runs.items()}
        assert len(set(ws.values())) == 1 and ws["cache"] > 0, ws


# The ledger's measured live bytes of each phase must equal its arithmetic within this many
# bytes per converted element (a byte count, not a timing: here they agree to the byte).
LEDGER_TOLERANCE_PER_N = 0.01


def test_bench_step_ledger_rows_agree_with_their_arithmetic(step_run):
    """Every row of the memory ledger: the bytes zrw.memory counted when the optimizer
    step begins (the forward/backward window's end) and when the inner optimizer starts equal the
    arithmetic printed beside them, and that arithmetic is the terms computed here from the
    shapes: BF16 weight 2, BF16 grad 2, FP32 grad 4, FP32 master 4, AdamW's moments 8 (FP32) or
    torchao's blocks (codes, an FP32 scale per block, the 8/4-bit code table), the cache's FP8
    copy (mxfp8: two planes with a scale per 32; 32x32: one plane, the tile scales and their two
    per-axis expansions), a 4-byte step counter per weight (and torchao's lr tensor)."""
    led = step_run["ledger"]
    dim, layers = 128, 4
    numel, n = dim * dim, layers * dim * dim
    assert list(led) == [
        "bf16",
        "restore-mxfp8",
        "bf16-free-mxfp8",
        "bf16-free-32x32",
        "bf16-free-32x32-int8",
        "bf16-free-32x32-fp8",
        "bf16-free-32x32-int4",
    ]
    blocks = dim // 32
    fp8 = {
        "mxfp8": (2 * numel + 2 * dim * blocks) / numel,
        "mxfp8-32x32": (numel + 2 * dim * blocks + blocks * blocks) / numel,
    }
    moments = {
        "fp32": 8.0,
        "int8": 2 * (numel + 4 * numel // 256 + 4 * 256) / numel,
        "fp8": 2 * (numel + 4 * numel // 256) / numel,
        "int4": 2 * (numel // 2 + 4 * numel // 128 + 4 * 16) / numel,
    }
    for name, x in led.items():
        low = name.rsplit("-", 1)[1] if "32x32-" in name else "fp32"
        recipe = "mxfp8-32x32" if "32x32" in name else "mxfp8" if name != "bf16" else None
        counters = (4 * layers + (4 if low != "fp32" else 0)) / n
        common = {"FP32 masters": 4.0, f"{low} moments": moments[low], "step counters": counters}
        window = {"BF16 grads": 2.0, **common}
        step = {"FP32 grads": 4.0, **common}
        if name == "bf16":
            window["BF16 weights"] = step["BF16 weights"] = 2.0
        else:
            window["FP8 copies"] = fp8[recipe]
        if name.startswith("restore"):  # the seed's restore keeps them through the inner step
            step["FP8 copies"] = fp8[recipe]
        a = x["arithmetic"]
        assert a["window"] == pytest.approx(window, abs=1e-12), name
        assert a["step"] == pytest.approx(step, abs=1e-12), name
        assert x["n"] == n
        tol = LEDGER_TOLERANCE_PER_N
        assert abs(x["window_live_per_n"] - a["window_total"]) <= tol, (name, x)
        assert abs(x["step_live_per_n"] - a["step_total"]) <= tol, (name, x)
        assert x["window_peak_per_n"] >= x["window_live_per_n"] - tol, name
        assert x["step_peak_per_n"] >= x["step_live_per_n"] - tol, name
        # the cache held exactly the FP8 bytes counted
        assert x["fp8_bytes_per_n"] == pytest.approx(window.get("FP8 copies", 0.0), abs=1e-12)
        assert x["static_per_n"] == max(x["window_live_per_n"], x["step_live_per_n"])
    # the baseline's 18 N is its optimizer step: weight 2 + FP32 grads 4 + masters 4 + moments 8
    assert abs(led["bf16"]["static_per_n"] - 18.0) <= 0.01
    # the goal, measured: the BF16-free 32x32 step with FP8 moments at most 11 N static
    goal = led["bf16-free-32x32-fp8"]
    assert goal["static_per_n"] <= 11.0
    assert goal["static_vs_baseline"] == goal["static_per_n"] / led["bf16"]["static_per_n"]


def test_bench_step_ledger_rows_are_checked_by_name():
    out = subprocess.run(
        [sys.executable, "-m", "zrw.bench", "step", "--ledger", "bf16,fp4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--ledger: unknown row(s) ['fp4']" in out.stderr and "bf16-free-32x32-fp8" in out.stderr


def test_bench_linear_json():
    r = run_bench(
        "linear",
        "--tokens",
        "16",
        "--shapes",
        "64x96",
        "--repeat",
        "1",
        "--stack-hidden",
        "64",
        "--stack-layers",
        "2",
        "--stack-tokens",
        "32",
        "--model-hidden",
        "64",
    )
    assert r["gemm_path"] in ("fp32", "bf16") and isinstance(r["native_bf16"], bool)
    (stack,) = r["stack"]
    assert (stack["hidden"], stack["layers"]) == (64, 2)
    assert positive(stack["ms"]["bf16_step"]) and positive(stack["ms"]["mxfp8_step"])
    assert r["model"]["hidden"] == 64 and positive(r["model"]["mxfp8_over_bf16"])
    assert sum(r["mx_matmul_gemm_calls"].values()) > 0
    (shape,) = r["shapes"]
    assert (shape["out_features"], shape["in_features"]) == (64, 96)
    assert positive(shape["ms"]["bf16_linear_step"])
    for recipe in ("mxfp8", "mxfp8-32x32"):
        rec = shape["recipes"][recipe]
        for kind in ("step_hit_ms", "step_miss_ms"):
            assert positive(rec[kind]["total"]) and positive(rec[kind]["matmul_emu"])


def test_bench_fsdp_json_counts_exact_bytes():
    # 2 ranks (gloo), 2 layers of 64 x 64, one step of one micro-batch: each weight is gathered
    # for forward and again for backward. BF16: 2 bytes per element; mxfp8: one FP8 plane per
    # direction plus its scales (one per 32 elements); 32x32: one FP8 copy plus a scale per tile.
    dim, layers = 64, 2
    r = run_bench(
        "fsdp",
        "--dim",
        str(dim),
        "--layers",
        str(layers),
        "--tokens",
        "32",
        "--micro-batches",
        "1",
        "--steps",
        "1",
    )
    gathers = 2 * layers
    # The RFC's original MXFP8 scheme (mxfp8-both-planes) sends both planes in every gather.
    expected = {
        "bf16": gathers * dim * dim * 2,
        "mxfp8-both-planes": gathers * 2 * (dim * dim + dim * dim // 32),
        "mxfp8": gathers * (dim * dim + dim * dim // 32),
        "mxfp8-32x32": gathers * (dim * dim + (dim // 32) ** 2),
    }
    assert set(r["recipes"]) == set(expected)
    for recipe, nbytes in expected.items():
        assert r["recipes"][recipe]["gather_bytes_per_step"] == nbytes, recipe
        assert r["ratio_to_bf16"][recipe]["gather_bytes"] == nbytes / expected["bf16"]
        assert (
            r["ratio_to_original_mxfp8"][recipe]["gather_bytes"]
            == nbytes / expected["mxfp8-both-planes"]
        )
        for key in ("gather_ms_per_step", "step_ms"):  # times: there, never asserted
            assert positive(r["recipes"][recipe][key]), (recipe, key)
    assert r["rfc_target_gather_time_reduction"] == [0.2, 0.3]


# -m slow: the frozen base released for good (FP8 only, release on = off) is tested in the
# default run by tests/hf/test_peft.py (test_frozen_base_released_for_good,
# test_lora_under_trainer_checkpoints); this runs the benchmark's three modes under Trainer.
@pytest.mark.slow
def test_bench_hf_lora_frozen_base_holds_only_its_fp8_copy():
    """bench hf (PEFT LoRA under Trainer, a tiny Qwen3, mxfp8-32x32): between steps the frozen
    base released for good holds exactly its FP8 copy instead of its 2 bytes per weight (a
    base that keeps its BF16 is quantized at each use and holds no copy then), it saves in
    the forward/backward window too, and the losses are the same bits."""
    r = run_bench(
        "hf",
        "--jobs",
        "lora",
        "--hidden",
        "128",
        "--layers",
        "1",
        "--steps",
        "3",
        "--recipe",
        "mxfp8-32x32",
    )
    on, off = r["lora/on"], r["lora/off"]
    two_n = 2 * on["converted"]
    assert on["converted"] > 0 and off["fp8_bytes"] == 0
    assert off["optimizer"] - on["optimizer"] == two_n - on["fp8_bytes"]
    assert 0 < off["window"] - on["window"] <= two_n
    assert on["losses"] == off["losses"]
