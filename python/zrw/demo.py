"""The main job: train small models with and without zero-redundancy weights, show the saving.

`zrw-demo` / `python -m zrw.demo` reproduces, on a CPU in a few minutes, the experiment of the
seed document (zero_redundancy_weight_design.txt §5): a tiny Qwen3 (dense) and a tiny Qwen3-MoE,
built from transformers configs with random init (nothing is downloaded), each trained in four
modes on the same data:
  bf16         plain BF16 nn.Linear / experts (the baseline)
  cache        zrw MXFP8 layers, FP8 weights cached once per step, BF16 weights kept
  zrw-restore  zero-redundancy as the seed designs it: BF16 weights released from the first
               forward of a step, restored from the FP32 masters at the optimizer step
               (MasterWeights(..., keep_released=False))
  zrw          the BF16-free step (the default): BF16 weights released at the first forward and
               never restored; each step's first use quantizes straight from the FP32 master
All four use the same optimizer: zrw.optim.MasterWeights(AdamW) with FP32 masters.

Memory is measured with zrw.memory's counting allocator, installed before any model exists: the
peak live bytes of the forward/backward window (first forward to the optimizer pre-hook) and of
the optimizer step, per mode. The zero-redundancy saving is the window peak of `cache` minus that
of `zrw`; it should equal the BF16 bytes released (the theoretical 2 bytes per converted weight).
The step's global peak is the larger of the two; the BF16-free step saves 2N there too, also
when the optimizer step is the peak.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import zrw
from zrw import cache, memory
from zrw.optim import MasterWeights, attach

MODES = ("bf16", "cache", "zrw-restore", "zrw")
MODE_LABELS = {
    "bf16": "BF16",
    "cache": "MXFP8 cache, no release",
    "zrw-restore": "zero-redundancy, restore at step (seed)",
    "zrw": "zero-redundancy, BF16-free step",
}


@dataclass
class DemoConfig:
    model: str = "both"
    recipe: str = "mxfp8"
    steps: int = 12
    micro_batches: int = 4
    batch: int = 4
    seq: int = 64
    hidden: int = 256
    layers: int = 2
    vocab: int = 512
    experts: int = 4
    lr: float = 3e-3
    seed: int = 0
    out: str = "zrw_demo_out"
    progress: bool = True


def build_model(kind: str, c: DemoConfig) -> torch.nn.Module:
    """A tiny Qwen3 / Qwen3-MoE from a config (seeded random init, bf16)."""
    # Import-time chatter of what transformers pulls in (torchao's CUDA-only libraries on a
    # CPU machine, torch's pytree deprecations for torchao's Enums) does not concern the demo.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(c.seed)
    heads = max(1, c.hidden // 32)
    common = dict(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=max(256, c.seq),
        tie_word_embeddings=False,
        intermediate_size=3 * c.hidden,
    )
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "moe":
        moe = dict(num_experts=c.experts, num_experts_per_tok=2, decoder_sparse_step=1)
        cfg = Qwen3MoeConfig(**common, **moe, moe_intermediate_size=c.hidden, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(f"zrw.demo: model must be 'dense' or 'moe', got {kind!r}")
    return model.to(torch.bfloat16)


def make_batches(c: DemoConfig, n: int) -> List[torch.Tensor]:
    """A learnable synthetic language: each sequence follows one of a few fixed random
    permutations of the vocabulary (next = perm[cur]), so the model can learn to predict it."""
    g = torch.Generator().manual_seed(c.seed + 1)
    perms = torch.stack([torch.randperm(c.vocab, generator=g) for _ in range(4)])
    out = []
    for _ in range(n):
        which = torch.randint(0, 4, (c.batch,), generator=g)
        ids = torch.empty(c.batch, c.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, c.vocab, (c.batch,), generator=g)
        for t in range(1, c.seq):
            ids[:, t] = perms[which, ids[:, t - 1]]
        out.append(ids)
    return out


@dataclass
class RunResult:
    mode: str
    losses: List[float] = field(default_factory=list)
    window_peak: int = 0  # peak live bytes, first forward -> optimizer pre-hook (max)
    optimizer_peak: int = 0  # peak live bytes during the optimizer step (max)
    step_start: int = 0  # live bytes before the first forward of the last step
    released_bytes: int = 0  # BF16 bytes released during the window (cache_stats)
    converted_bf16_bytes: int = 0  # 2 bytes per converted weight element (the theory's 2N)
    seconds_per_step: float = 0.0
    # (label, live bytes, FP8 cache bytes, BF16 bytes released) through the last step
    timeline: List[tuple] = field(default_factory=list)
    final_weights_digest: float = 0.0


def run_mode(
    kind: str, mode: str, c: DemoConfig, batches: List[torch.Tensor], progress=None
) -> RunResult:
    model = build_model(kind, c)
    res = RunResult(mode)
    if mode != "bf16":
        summary = zrw.convert(model, c.recipe, release=(mode != "cache"))
        res.converted_bf16_bytes = sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if any(n.startswith(m + ".") for m in summary.converted)
        )
    model.train()
    keep = mode != "zrw-restore"
    opt = MasterWeights(
        torch.optim.AdamW, model.parameters(), lr=c.lr, weight_decay=0.0, keep_released=keep
    )

    marks: Dict[str, int] = {}
    timeline: List[tuple] = []
    recording = {"on": False}

    def mark(label: str) -> None:
        if recording["on"]:
            st = cache.cache_stats()
            timeline.append((label, memory.current(), st["fp8_bytes"], st["released_bytes"]))

    # Read the window peak before zrw's boundary hook restores anything (hooks run in
    # registration order), then measure the optimizer step on its own.
    def window_end(o, args, kwargs):
        marks["window_peak"] = memory.peak()
        mark("optimizer pre-hook")
        marks["released"] = cache.cache_stats()["released_bytes"]

    opt.register_step_pre_hook(window_end)
    attach(opt)  # bf16 mode: nothing is cached, the hooks are no-ops

    # MasterWeights restores released weights when it writes the masters back (after the
    # inner step), so the optimizer step is measured from here to its post-hook.
    def step_start(o, args, kwargs):
        mark("optimizer step start")
        memory.reset_peak()

    opt.register_step_pre_hook(step_start)
    opt.register_step_post_hook(
        lambda o, a, k: (mark("optimizer step"), marks.__setitem__("opt_peak", memory.peak()))
    )
    layers = model.model.layers
    hooks = [
        layer.register_forward_hook(lambda m, i, o, idx=idx: mark(f"fwd layer {idx}"))
        for idx, layer in enumerate(layers)
    ]

    t_total = 0.0
    bi = 0
    for step in range(c.steps):
        last = step == c.steps - 1
        recording["on"] = last
        t0 = time.perf_counter()
        memory.reset_peak()
        if last:
            res.step_start = memory.current()
            mark("step start")
        for mb in range(c.micro_batches):
            ids = batches[bi % len(batches)]
            bi += 1
            loss = model(input_ids=ids, labels=ids).loss / c.micro_batches
            mark(f"mb {mb} forward")
            loss.backward()
            mark(f"mb {mb} backward")
            res.losses.append(loss.item() * c.micro_batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        t_total += time.perf_counter() - t0
        res.window_peak = max(res.window_peak, marks.get("window_peak", 0))
        res.optimizer_peak = max(res.optimizer_peak, marks.get("opt_peak", 0))
        res.released_bytes = max(res.released_bytes, marks.get("released", 0))
        if progress is not None:
            progress.set_postfix_str(f"{kind}/{mode} loss {res.losses[-1]:.3f}")
            progress.update(1)
    for h in hooks:
        h.remove()
    res.seconds_per_step = t_total / max(1, c.steps)
    res.timeline = timeline
    with torch.no_grad():
        # Through state_dict: the BF16-free step keeps the converted weights released, and
        # state_dict materializes them from their FP32 masters.
        res.final_weights_digest = float(sum(v.double().sum() for v in model.state_dict().values()))
    del model, opt
    cache.cache_clear()
    return res


def summarize(kind: str, runs: Dict[str, RunResult], c: DemoConfig) -> dict:
    cache, zr = runs["cache"], runs["zrw"]
    saving = cache.window_peak - zr.window_peak
    theory = zr.converted_bf16_bytes
    final = {m: sum(r.losses[-c.micro_batches :]) / c.micro_batches for m, r in runs.items()}
    released_modes = [m for m in MODES if m.startswith("zrw")]
    same = all(cache.losses == runs[m].losses for m in released_modes)
    max_diff = max(
        (abs(a - b) for m in released_modes for a, b in zip(cache.losses, runs[m].losses)),
        default=0.0,
    )
    global_peak = {}
    for m, r in runs.items():
        where = "optimizer step" if r.optimizer_peak > r.window_peak else "forward/backward"
        global_peak[m] = {"bytes": max(r.window_peak, r.optimizer_peak), "phase": where}
    n_conv = theory // 2  # converted weight elements (BF16: 2 bytes each)
    return {
        "model": kind,
        "recipe": c.recipe,
        "steps": c.steps,
        "micro_batches": c.micro_batches,
        "final_loss": final,
        "loss_diff_to_bf16": {m: final[m] - final["bf16"] for m in MODES},
        "loss_diff_release_on_off": max_diff,
        "losses_bitwise_equal_release_on_off": same,
        "weights_equal_release_on_off": all(
            cache.final_weights_digest == runs[m].final_weights_digest for m in released_modes
        ),
        "window_peak_bytes": {m: r.window_peak for m, r in runs.items()},
        "optimizer_peak_bytes": {m: r.optimizer_peak for m, r in runs.items()},
        "global_peak": global_peak,
        "bf16_bytes_released": zr.released_bytes,
        "theoretical_saving_2N_bytes": theory,
        "measured_saving_bytes": saving,
        "saving_vs_released": saving / zr.released_bytes if zr.released_bytes else None,
        "saving_vs_theory": saving / theory if theory else None,
        # Against cache-only, per zero-redundancy mode: the optimizer step's peak and the
        # step's global peak (the larger of window and optimizer step).
        "optimizer_peak_saving_bytes": {
            m: cache.optimizer_peak - runs[m].optimizer_peak for m in released_modes
        },
        "global_peak_saving_bytes": {
            m: global_peak["cache"]["bytes"] - global_peak[m]["bytes"] for m in released_modes
        },
        "converted_elements": n_conv,
        "seconds_per_step": {m: r.seconds_per_step for m, r in runs.items()},
        "losses": {m: r.losses for m, r in runs.items()},
        "timeline": {m: r.timeline for m, r in runs.items()},
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def print_report(s: dict) -> None:
    print(
        f"\n{s['model']} ({s['recipe']}, {s['steps']} steps x {s['micro_batches']} micro-batches)"
    )
    header = ["mode", "final loss", "vs BF16", "fwd/bwd peak", "optimizer peak"]
    header += ["global peak", "global saving", "s/step"]
    rows = []
    for m in MODES:
        gsave = s["global_peak_saving_bytes"].get(m)
        row = [MODE_LABELS[m], f"{s['final_loss'][m]:.4f}", f"{s['loss_diff_to_bf16'][m]:+.4f}"]
        row += [_mib(s[k][m]) for k in ("window_peak_bytes", "optimizer_peak_bytes")]
        row += [_mib(s["global_peak"][m]["bytes"]), "–" if gsave is None else _mib(gsave)]
        rows.append(row + [f"{s['seconds_per_step'][m]:.2f}"])
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for r in rows:
        print("  " + "  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    eq = "bit for bit" if s["losses_bitwise_equal_release_on_off"] else "DIFFERENT"
    print(f"  loss, release on vs off: max |diff| = {s['loss_diff_release_on_off']:.3g} ({eq})")
    print(
        f"  BF16 bytes released: {_mib(s['bf16_bytes_released'])}; theory 2N: "
        f"{_mib(s['theoretical_saving_2N_bytes'])}"
    )
    ratio = s["saving_vs_released"]
    print(
        f"  measured fwd/bwd-window saving (cache - zrw): {_mib(s['measured_saving_bytes'])} "
        f"= {100 * ratio:.2f}% of the bytes released"
        if ratio is not None
        else "  nothing released"
    )
    gp = s["global_peak"]
    print(
        "  the step's global peak lies in the "
        + "; ".join(f"{v['phase']} ({m})" for m, v in gp.items())
    )
    theory = s["theoretical_saving_2N_bytes"]
    if theory:
        for m, v in s["global_peak_saving_bytes"].items():
            o = s["optimizer_peak_saving_bytes"][m]
            print(
                f"  vs cache, {MODE_LABELS[m]}: global-peak saving {_mib(v)} = "
                f"{v / theory:.3f} x 2N; optimizer-step saving {_mib(o)} = "
                f"{o / theory:.3f} x 2N"
            )


def plot(summaries: List[dict], path) -> None:
    """Loss curves of the modes; live memory through one step; and, for the BF16-free step, the
    weight lifecycle (BF16 bytes resident vs FP8 bytes cached), as a PNG to `path` (a file name
    or a binary file object)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summaries)
    fig, axes = plt.subplots(3, n, figsize=(7.5 * n, 12), squeeze=False)
    colors = dict(zip(MODES, ("tab:gray", "tab:blue", "tab:orange", "tab:red")))
    for j, s in enumerate(summaries):
        ax = axes[0][j]
        for m in MODES:
            style = dict(color=colors[m], linestyle="--" if m == "zrw" else "-", linewidth=1.2)
            ax.plot(s["losses"][m], label=MODE_LABELS[m], **style)
        ax.set_title(f"{s['model']} ({s['recipe']}): loss per micro-batch")
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("loss")
        ax.legend()

        tl = s["timeline"]["zrw"]
        labels = [t[0] for t in tl]
        ticks = [
            i
            for i, lab in enumerate(labels)
            if not lab.startswith("fwd layer") or lab.endswith(" 0")
        ]

        def xlabels(ax):
            ax.set_xticks(ticks)
            ax.set_xticklabels([labels[i] for i in ticks], rotation=60, ha="right", fontsize=7)

        ax = axes[1][j]
        for m in MODES:
            t = s["timeline"][m]
            if t:
                mib = [x[1] / 2**20 for x in t]
                ax.step(range(len(t)), mib, where="post", label=MODE_LABELS[m], color=colors[m])
        xlabels(ax)
        ax.set_title(
            f"{s['model']}: live CPU memory through one step (zrw.memory)\n"
            f"fwd/bwd window saving {_mib(s['measured_saving_bytes'])}, global-peak "
            f"saving {_mib(s['global_peak_saving_bytes']['zrw'])}, "
            f"BF16 released {_mib(s['bf16_bytes_released'])}",
            fontsize=10,
        )
        ax.set_ylabel("MiB live")
        ax.legend(fontsize=8)

        ax = axes[2][j]
        total = s["theoretical_saving_2N_bytes"]
        bf16_resident = [(total - x[3]) / 2**20 for x in tl]
        fp8 = [x[2] / 2**20 for x in tl]
        label = "BF16 weights resident"
        ax.step(range(len(tl)), bf16_resident, where="post", color="tab:green", label=label)
        ax.step(range(len(tl)), fp8, where="post", color="tab:purple", label="FP8 cache")
        xlabels(ax)
        ax.set_title(
            f"{s['model']}: weight lifecycle, BF16-free step\n(released at the first "
            "use, never restored; FP8 copies dropped at the optimizer step)",
            fontsize=10,
        )
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def run(c: DemoConfig) -> List[dict]:
    memory.install()  # before any model exists, so every weight and activation is counted
    kinds = ["dense", "moe"] if c.model == "both" else [c.model]
    batches = make_batches(c, c.micro_batches * c.steps)
    progress = None
    if c.progress:
        try:
            from tqdm import tqdm

            total = len(kinds) * len(MODES) * c.steps
            progress = tqdm(total=total, desc="zrw demo", unit="step", file=sys.stderr)
        except ImportError:
            pass
    summaries = []
    for kind in kinds:
        runs = {m: run_mode(kind, m, c, batches, progress) for m in MODES}
        summaries.append(summarize(kind, runs, c))
    if progress is not None:
        progress.close()
    return summaries


def _write_whole(path: str, data: bytes) -> None:
    """Write `data` to a temporary file beside `path` that replaces it once complete: `path`
    is never left truncated or half written."""
    tmp = f"{path}.zrw-tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="zrw-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = DemoConfig()
    p.add_argument("--model", choices=["dense", "moe", "both"], default=d.model)
    p.add_argument("--recipe", choices=["mxfp8", "mxfp8-32x32"], default=d.recipe)
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per mode")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--out", default=d.out, help="directory for demo.png and demo.json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    # Every refusal comes here, before anything runs and before anything is written.
    if a.steps < 1 or a.micro_batches < 1:
        p.error(f"--steps and --micro-batches must be >= 1, got {a.steps} and {a.micro_batches}")
    small = [
        f"--{n.replace('_', '-')} {getattr(a, n)}"
        for n in ("batch", "seq", "hidden", "layers")
        if getattr(a, n) < 1
    ]
    if small:
        p.error(f"--batch, --seq, --hidden and --layers must be >= 1, got {', '.join(small)}")
    if not a.out:
        p.error("--out must name a directory, got ''")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out must name a directory (for demo.png and demo.json), got the file {a.out!r}")
    try:
        import matplotlib  # noqa: F401  (the plot: checked before the run, not after it)
    except ImportError as e:
        p.error(f"the plot (demo.png) needs matplotlib: pip install matplotlib ({e})")
    given = {k: v for k, v in vars(a).items() if k in DemoConfig.__dataclass_fields__}
    c = DemoConfig(**given, progress=not a.no_progress)
    warnings.filterwarnings("ignore", category=UserWarning)
    summaries = run(c)
    png = os.path.join(c.out, "demo.png")
    report = {
        "config": c.__dict__,
        "models": summaries,
        "png": png,
        "torch": torch.__version__,
        "zrw": zrw.__version__,
    }
    # Both outputs are made in memory first; a failure there creates no directory and no file.
    image = io.BytesIO()
    plot(summaries, image)
    text = json.dumps(report)
    os.makedirs(c.out, exist_ok=True)
    _write_whole(png, image.getvalue())
    _write_whole(os.path.join(c.out, "demo.json"), text.encode())
    if a.json:
        print(json.dumps(report))
    else:
        for s in summaries:
            print_report(s)
        print(f"\nwrote {png} and {os.path.join(c.out, 'demo.json')}")
    ok = all(s["losses_bitwise_equal_release_on_off"] for s in summaries)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
