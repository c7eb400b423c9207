"""`python -m zrw.bench report`: docs/benchmarks.md's tables, made from the benchmarks' JSON.

    python -m zrw.bench quant --isa all --json > quant.json
    python -m zrw.bench report quant.json                              # print the tables
    python -m zrw.bench report --update docs/benchmarks.md quant.json  # rewrite their regions

Each benchmark's --json object carries a stamp (zrw.bench._timing.stamp: the CPU model and
features, the kernel ISA, torch's version, the commit); the report prints it over the tables it
makes, so every table says what it was measured on. A table belongs to the region of the page
named after its benchmark and the machine's class,

    <!-- bench:quant:amx -->
    ...
    <!-- /bench -->

and `--update PAGE` replaces what lies between the two markers, leaving the rest of the page as
it is. The classes come from the stamp's CPU features: `amx` (AMX-BF16), `avx512` (AVX-512 with
avx512_bf16), `avx512f` (AVX-512 without it), `avx2`, `base`; `--machine` overrides it. Renders
`quant` (one run, or `--isa` runs of several kernel builds), `linear` and `fsdp`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

BENCHES = ("quant", "linear", "fsdp")
CLASSES = ("amx", "avx512", "avx512f", "avx2", "base")
END = "<!-- /bench -->"

# quant: the kernels of the table, in the order the page reads them, with their targets (time
# over the copy of the same dtype on all threads; zrw.bench.quant.TARGETS)
QUANT_KERNELS = {
    "single_dim_-1": ("dim -1", 1.0),
    "single_dim_0": ("dim 0", 1.0),
    "dual": ("dual", 1.3),
    "block": ("32x32", 1.1),
    "dual_from_master": ("dual, FP32 master", 1.2),
    "block_from_master": ("32x32, FP32 master", None),
    "single_dim_-1_from_master": ("dim -1, FP32 master", None),
}


def machine_class(st: dict) -> str:
    """The page's machine class of a stamp, from its CPU features."""
    flags = set(st.get("cpu_flags") or ())
    for flag, name in (
        ("amx_bf16", "amx"),
        ("avx512_bf16", "avx512"),
        ("avx512f", "avx512f"),
        ("avx2", "avx2"),
    ):
        if flag in flags:
            return name
    return "base"


def load(path: str):
    """One benchmark's --json output (the whole file, or its last line when other output came
    first)."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [x for x in text.splitlines() if x.strip()]
        if not lines:
            raise ValueError(f"{path}: empty") from None
        return json.loads(lines[-1])


def bench_of(r: dict) -> str:
    """Which benchmark wrote `r` ("quant-isa" for `quant --isa`'s object of one run per build)."""
    if r.get("bench") in BENCHES:
        return r["bench"]
    if r and all(isinstance(v, dict) and ("skipped" in v or "bandwidth" in v) for v in r.values()):
        return "quant-isa"
    for key, name in (("bandwidth", "quant"), ("stack", "linear"), ("ratio_to_bf16", "fsdp")):
        if key in r:
            return name
    raise ValueError("not the --json output of " + ", ".join(BENCHES))


def _f(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def _ms(x) -> str:
    return "–" if x is None else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def stamp_line(st: dict | None, isas: list[str] | None = None) -> str:
    """One line saying what the figures were measured on."""
    if not st:
        return "*Measured on: not recorded (a JSON object without a stamp).*"
    flags = ", ".join(st.get("cpu_flags") or []) or "none listed"
    isa = (
        f"kernel builds {', '.join(isas)} (each forced with `ZRW_CPU_ISA`)"
        if isas
        else f"kernel ISA {st['cpu_isa']}"
    )
    commit = st.get("commit") or "not a git checkout"
    if st.get("dirty"):
        commit += f" with {len(st['dirty'])} uncommitted file(s) under csrc/ and python/"
    argv = [a for a in st.get("argv") or [] if a != "--json"]
    if isas and argv and "--isa" not in argv:
        argv[1:1] = ["--isa", ",".join(isas)]
    cmd = f"; `python -m zrw.bench {' '.join(argv)}`" if argv else ""
    load = st.get("load_1min")
    load = f", load average {load:g}" if load is not None else ""
    return (
        f"*Measured on: {st['cpu_model']} ({flags}), {st.get('threads', '?')} threads{load}; "
        f"{isa}, GEMM {st.get('gemm_path', '?')}; torch {st['torch']}; commit {commit}{cmd}.*"
    )


def render_quant(runs: dict) -> str:
    """`quant`: one row per build, each kernel's time over a copy on 1 thread / all threads, then
    torchao's and mx_matmul's figures."""
    done = {isa: r for isa, r in runs.items() if "skipped" not in r}
    if not done:
        raise ValueError("quant: every kernel build was skipped")
    first = next(iter(done.values()))
    multi = len(runs) > 1 or "bench" not in first
    mm = first["matmul_shape"][0]
    header = ["build"]
    header += [
        name if limit is None else f"{name} (≤ {limit:g})" for name, limit in QUANT_KERNELS.values()
    ]
    header += [
        "torchao `to_mx` / zrw (dual)",
        f"`mx_matmul` {mm}³ / bf16 matmul",
        "on the FP32 GEMM / fp32 matmul",
    ]
    rows = []
    for isa, r in done.items():
        counts = sorted(r["bandwidth"], key=int)
        row = [isa]
        for key, (_, limit) in QUANT_KERNELS.items():
            cells = []
            for nt in counts:
                x = r["bandwidth"][nt][key]["x_copy_time"]
                missed = limit is not None and nt == str(r["threads"]) and x > limit
                cells.append(f"**{x:.2f}**" if missed else f"{x:.2f}")
            row.append(" / ".join(cells))
        sp = r["speedup_vs_torchao"]["dual"]
        row += [
            "–" if sp is None else f"{sp:.0f}x",
            f"{r['mx_matmul_over_bf16_matmul']:.2f} ({'/'.join(r['mx_matmul_gemm_ran'])})",
            _f(r.get("mx_matmul_fp32_gemm_over_fp32_matmul")),
        ]
        rows.append(row)
    n, k = first["shape"]
    threads = " / ".join(sorted(first["bandwidth"], key=int))
    return "\n".join(
        [
            stamp_line(first.get("stamp"), list(runs) if multi else None),
            f"Time over a `copy_` of the same {n}x{k} tensor (bf16; FP32 for the master "
            f"columns) in the same rounds, on {threads} threads; bold: over its target.",
            "",
            md_table(header, rows),
        ]
    )


def render_linear(r: dict) -> str:
    """`linear`: host time per layer, each shape's step, the layer stacks and the demo model."""
    parts = [stamp_line(r.get("stamp")), ""]
    h = r.get("host")
    if h:
        rows = [["BF16 nn.Linear", f"{h['us']['bf16']:.0f}", "1.00"]]
        rows += [
            [f"MXLinear `{rc}`", f"{h['us'][rc]:.0f}", f"{x:.2f}"]
            for rc, x in h["over_linear"].items()
        ]
        parts += [
            f"Host time per layer: a {h['weight'][0]}x{h['weight'][1]} weight, {h['tokens']} "
            "tokens, 1 thread, forward + backward (MX: a cache hit; goal: at most 2.5x).",
            "",
            md_table(["layer", "µs", "x nn.Linear"], rows),
            "",
        ]
    rows = []
    for s in r.get("shapes") or []:
        bf16 = s["ms"]["bf16_linear_step"]
        for recipe, rr in s["recipes"].items():
            hit, miss = rr["step_hit_ms"], rr["step_miss_ms"]
            rows.append(
                [
                    f"{s['out_features']}x{s['in_features']}, {s['tokens']} tokens",
                    f"`{recipe}`",
                    _ms(bf16),
                    f"{_ms(hit['total'])} ({hit['total'] / bf16:.2f}x)",
                    f"{_ms(miss['total'])} ({miss['total'] / bf16:.2f}x)",
                    f"{hit['matmul_emu'] / hit['total']:.0%}",
                    f"{hit['act_quant'] / hit['total']:.0%}",
                    f"{miss['weight'] / miss['total']:.1%}",
                ]
            )
    if rows:
        parts += [
            "One layer's training step (forward + backward) against nn.Linear's:",
            "",
            md_table(
                [
                    "weight (out x in)",
                    "recipe",
                    "BF16 ms",
                    "MX, weight hit ms",
                    "MX, weight miss ms",
                    "hit: MX GEMMs",
                    "hit: activation quant",
                    "miss: quant_and_release",
                ],
                rows,
            ),
            "",
        ]
    rows = [
        [
            f"{s['layers']} x {s['hidden']}x{s['hidden']}, {s['tokens']} tokens, fwd + bwd",
            _ms(s["ms"]["bf16_step"]),
            _ms(s["ms"]["mxfp8_step"]),
            f"{s['mxfp8_over_bf16']:.2f}",
        ]
        for s in r.get("stack") or []
    ]
    m = r.get("model")
    if m:
        rows.append(
            [
                f"demo's dense Qwen3, hidden {m['hidden']}, {m['layers']} layers, "
                f"{m['tokens']} tokens: fwd + bwd + MasterWeights(AdamW) step",
                _ms(m["ms"]["bf16_step"]),
                _ms(m["ms"]["mxfp8_step"]),
                f"{m['mxfp8_over_bf16']:.2f}",
            ]
        )
    if rows:
        parts += [md_table(["workload", "BF16 ms", "mxfp8 ms", "mxfp8 / BF16"], rows), ""]
    return "\n".join(parts).rstrip("\n")


def render_fsdp(r: dict) -> str:
    """`fsdp`: bytes and time of the all-gathers per step, each scheme against BF16."""
    low = r["rfc_target_gather_time_reduction"][0]
    rows = []
    for name, v in r["recipes"].items():
        q, o = r["ratio_to_bf16"][name], r["ratio_to_original_mxfp8"][name]
        less = 1 - o["gather_time"]
        original = name in ("bf16", "mxfp8-both-planes")
        rows.append(
            [
                f"`{name}`",
                f"{v['gather_bytes_per_step'] / 2**20:.1f}",
                f"{q['gather_bytes']:.3f}",
                _ms(v["gather_ms_per_step"]),
                f"{q['gather_time']:.2f}",
                "–" if original else f"{less:.0%} ({'met' if less >= low else 'not met'})",
                _ms(v["step_ms"]),
                f"{q['step_time']:.2f}",
            ]
        )
    d = r["shape"][0]
    return "\n".join(
        [
            stamp_line(r.get("stamp")),
            f"{r['world']} ranks ({r['backend']}), {r['layers']} x MXLinear {d}x{d}, "
            f"{r['micro_batches']} micro-batches of {r['tokens_per_rank']} tokens per rank; "
            "times: the best step after the first, the slower rank's.",
            "",
            md_table(
                [
                    "scheme",
                    "gathered MiB/step",
                    "x bf16",
                    "gather ms/step",
                    "x bf16",
                    "less gather time than both planes (RFC: 20-30%)",
                    "step ms",
                    "x bf16",
                ],
                rows,
            ),
        ]
    )


def blocks(paths: list[str], machine: str | None = None) -> dict[str, str]:
    """{region name: its markdown} for every JSON file, in the order given (a later file of the
    same region replaces an earlier one)."""
    out = {}
    for path in paths:
        r = load(path)
        kind = bench_of(r)
        if kind == "quant-isa":
            kind, text = "quant", render_quant(r)
            st = next((v.get("stamp") for v in r.values() if "skipped" not in v), None)
        else:
            render = {"quant": lambda x: render_quant({x["cpu_isa"]: x})}.get(kind)
            text = (render or {"linear": render_linear, "fsdp": render_fsdp}[kind])(r)
            st = r.get("stamp")
        cls = machine or (machine_class(st) if st else None)
        if cls is None:
            raise ValueError(f"{path}: no stamp to tell the machine's class: pass --machine")
        out[f"bench:{kind}:{cls}"] = text
    return out


def update(page: str, new: dict[str, str]) -> str:
    """`page` with each region's content replaced; a region missing from the page is an error."""
    missing = [name for name in new if f"<!-- {name} -->" not in page]
    if missing:
        raise KeyError(
            f"no region {missing} in the page: add `<!-- {missing[0]} -->` and `{END}` "
            "where the table goes"
        )
    for name, text in new.items():
        pat = re.compile(rf"(<!-- {re.escape(name)} -->\n).*?({re.escape(END)})", re.S)
        if not pat.search(page):
            raise KeyError(f"region {name!r} has no `{END}` after it")
        page = pat.sub(lambda m: m.group(1) + text + "\n" + m.group(2), page, count=1)
    return page


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("json", nargs="+", help="files written by `python -m zrw.bench NAME --json`")
    p.add_argument("--update", metavar="PAGE", help="rewrite the regions of this markdown page")
    p.add_argument("--machine", choices=CLASSES, help="the machine class, over the stamp's")
    a = p.parse_args(argv)
    try:
        new = blocks(a.json, a.machine)
        if a.update:
            with open(a.update) as f:
                page = f.read()
            page = update(page, new)
            with open(a.update, "w") as f:
                f.write(page)
            print(f"updated {', '.join(new)} in {a.update}")
            return
    except (OSError, ValueError, KeyError) as e:
        print(f"zrw.bench report: {e}", file=sys.stderr)
        sys.exit(2)
    for name, text in new.items():
        print(f"<!-- {name} -->\n{text}\n{END}\n")


if __name__ == "__main__":
    main()
