"""`python -m zrw.bench report`: the benchmarks' JSON made into docs/benchmarks.md's stamped tables.

The renderers are checked on small hand-made objects (what they print is decided by the JSON,
not by a timing); one run of the real `quant --json` at a tiny size checks that a benchmark
stamps its JSON and that `--update` rewrites only its own region of a page.
"""

import json
import os
import subprocess
import sys

import pytest

from zrw.bench import report

STAMP = {
    "cpu_model": "Test CPU",
    "cpu_flags": ["avx2", "avx512f", "avx512_bf16"],
    "cpu_isa": "avx512",
    "gemm_path": "bf16",
    "native_bf16": True,
    "threads": 2,
    "torch": "2.13.0+cpu",
    "zrw": "0.1.0",
    "commit": "abc1234",
    "dirty": [],
    "argv": ["quant", "--json", "--repeat", "3"],
    "load_1min": 0.5,
}


def quant_run(isa="avx512", x=0.9):
    kernels = ["copy", "copy_fp32", *report.QUANT_KERNELS, "cast_then_dual"]
    bw = {
        nt: {k: {"x_copy_time": x if k != "dual" else 1.5, "gb_per_s": 20.0} for k in kernels}
        for nt in ("1", "2")
    }
    return {
        "bench": "quant",
        "stamp": {**STAMP, "cpu_isa": isa},
        "cpu_isa": isa,
        "shape": [4096, 4096],
        "matmul_shape": [2048, 2048, 2048],
        "threads": 2,
        "bandwidth": bw,
        "ms": {"copy": 2.0, "dual_fresh_output_pages": 2.5},
        "speedup_vs_torchao": {"dual": 100.0, "single_dim_-1": 80.0},
        "mx_matmul_over_bf16_matmul": 1.05,
        "mx_matmul_gemm_ran": ["bf16"],
        "mx_matmul_fp32_gemm_over_fp32_matmul": 1.01,
    }


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


@pytest.mark.parametrize(
    "flags, cls",
    [
        (["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "amx"),
        (["avx2", "avx512f", "avx512_bf16"], "avx512"),
        (["avx2", "avx512f"], "avx512f"),
        (["avx2"], "avx2"),
        ([], "base"),
    ],
)
def test_machine_class_from_the_stamps_cpu_features(flags, cls):
    assert report.machine_class({"cpu_flags": flags}) == cls


def test_quant_table_is_stamped_and_marks_missed_targets(tmp_path):
    new = report.blocks([write(tmp_path, "q.json", quant_run())])
    (name,) = new
    assert name == "bench:quant:avx512"
    text = new[name]
    first = text.splitlines()[0]
    for part in ("Test CPU", "kernel ISA avx512", "torch 2.13.0+cpu", "commit abc1234"):
        assert part in first, part
    assert "`python -m zrw.bench quant --repeat 3`" in first  # the command, without --json
    # dual (1.5) misses its 1.3 target on all threads only; the others (0.9) meet theirs
    row = next(r for r in text.splitlines() if r.startswith("| avx512 |"))
    assert "| 0.90 / 0.90 | 0.90 / 0.90 | 1.50 / **1.50** |" in row
    assert row.count("**") == 2
    assert "| 100x | 1.05 (bf16) | 1.01 |" in row


def test_quant_isa_runs_render_one_table_with_every_build(tmp_path):
    runs = {"avx512": quant_run("avx512"), "avx2": quant_run("avx2", 0.8), "base": {}}
    runs["base"] = {"skipped": "this CPU cannot run it"}
    text = report.blocks([write(tmp_path, "q.json", runs)])["bench:quant:avx512"]
    assert "kernel builds avx512, avx2, base" in text
    assert "--isa avx512,avx2,base" in text
    assert "| avx2 | 0.80 / 0.80 |" in text and "| base |" not in text


def test_linear_and_fsdp_tables(tmp_path):
    linear = {
        "bench": "linear",
        "stamp": STAMP,
        "host": {
            "weight": [64, 64],
            "tokens": 4,
            "us": {"bf16": 150.0, "mxfp8": 330.0},
            "over_linear": {"mxfp8": 2.2},
        },
        "shapes": [],
        "stack": [
            {
                "hidden": 1024,
                "layers": 4,
                "tokens": 512,
                "ms": {"bf16_step": 30.0, "mxfp8_step": 36.0},
                "mxfp8_over_bf16": 1.2,
            }
        ],
        "model": None,
    }
    fsdp = {
        "bench": "fsdp",
        "stamp": {**STAMP, "cpu_flags": ["avx2"], "cpu_isa": "avx2"},
        "world": 2,
        "backend": "gloo",
        "shape": [1024, 1024],
        "layers": 4,
        "tokens_per_rank": 64,
        "micro_batches": 2,
        "recipes": {
            "bf16": {"gather_bytes_per_step": 32 << 20, "gather_ms_per_step": 50.0, "step_ms": 1.0},
            "mxfp8-both-planes": {
                "gather_bytes_per_step": 33 << 20,
                "gather_ms_per_step": 50.0,
                "step_ms": 1.0,
            },
            "mxfp8": {
                "gather_bytes_per_step": 16 << 20,
                "gather_ms_per_step": 37.5,
                "step_ms": 1.0,
            },
        },
        "rfc_target_gather_time_reduction": [0.2, 0.3],
    }
    base = fsdp["recipes"]["bf16"]
    orig = fsdp["recipes"]["mxfp8-both-planes"]
    for key, ref in (("ratio_to_bf16", base), ("ratio_to_original_mxfp8", orig)):
        fsdp[key] = {
            r: {
                "gather_bytes": v["gather_bytes_per_step"] / ref["gather_bytes_per_step"],
                "gather_time": v["gather_ms_per_step"] / ref["gather_ms_per_step"],
                "step_time": v["step_ms"] / ref["step_ms"],
            }
            for r, v in fsdp["recipes"].items()
        }
    new = report.blocks([write(tmp_path, "l.json", linear), write(tmp_path, "f.json", fsdp)])
    assert list(new) == ["bench:linear:avx512", "bench:fsdp:avx2"]
    assert "| MXLinear `mxfp8` | 330 | 2.20 |" in new["bench:linear:avx512"]
    assert "| 4 x 1024x1024, 512 tokens, fwd + bwd | 30 | 36 | 1.20 |" in new["bench:linear:avx512"]
    assert "| `mxfp8` | 16.0 | 0.500 | 37.5 | 0.75 | 25% (met) |" in new["bench:fsdp:avx2"]


def test_update_rewrites_only_its_region_and_names_a_missing_one():
    page = (
        "intro\n<!-- bench:quant:amx -->\nold\n<!-- /bench -->\n"
        "middle\n<!-- bench:fsdp:amx -->\nkept\n<!-- /bench -->\n"
    )
    out = report.update(page, {"bench:quant:amx": "new table"})
    assert out == page.replace("old", "new table")
    assert report.update(out, {"bench:quant:amx": "new table"}) == out  # idempotent
    with pytest.raises(KeyError, match="bench:linear:amx"):
        report.update(page, {"bench:linear:amx": "x"})


def test_an_unstamped_object_needs_the_machine_named(tmp_path):
    old = quant_run()
    del old["stamp"], old["bench"]
    path = write(tmp_path, "old.json", old)
    with pytest.raises(ValueError, match="--machine"):
        report.blocks([path])
    text = report.blocks([path], machine="avx2")["bench:quant:avx2"]
    assert text.startswith("*Measured on: not recorded")


def test_a_real_run_is_stamped_and_updates_the_page(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-m", "zrw.bench", "quant", "--n", "64", "--k", "64", "--mm", "32"]
        + ["--repeat", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    (tmp_path / "q.json").write_text(out.stdout)
    r = report.load(str(tmp_path / "q.json"))
    st = r["stamp"]
    assert st["cpu_isa"] == r["cpu_isa"] and st["torch"] and st["cpu_model"]
    assert st["argv"][0] == "quant" and isinstance(st["dirty"], list)
    region = f"bench:quant:{report.machine_class(st)}"
    page = tmp_path / "page.md"
    page.write_text(f"# page\n<!-- {region} -->\n<!-- /bench -->\nend\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zrw.bench",
            "report",
            "--update",
            str(page),
            str(tmp_path / "q.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert text.startswith("# page\n") and text.endswith("<!-- /bench -->\nend\n")
    assert f"kernel ISA {st['cpu_isa']}" in text and "| dim -1 (≤ 1) |" in text
