"""`python -m zrw.bench accuracy`: does MXFP8 training with zrw learn as BF16 does?

The RFC's accuracy acceptance ("精度验收"), on real text and offline. A Qwen3 causal LM
(transformers' class, random init from a config) learns the Python standard library's own
source files, present on every machine that runs zrw: files are split into a train and a
held-out set by a hash of their path, and a byte-level BPE tokenizer is trained in memory on
train files with `tokenizers`. Nothing is downloaded.

Each seed trains the same initial model on the same data order in every mode:
  baseline            plain nn.Linear in BF16 (`--baseline fp32`: in FP32, for a CPU without
                      native BF16), FP32 masters (zrw.optim.AdamW)
  mxfp8/floor ...     zrw.convert(model, recipe) with each recipe (mxfp8, mxfp8-32x32) and each
                      scale rule (floor, rceil): zero-redundancy weights, the BF16-free step
                      (zrw.optim.AdamW: FP32 masters, released BF16 weights never restored)
Embeddings and lm_head stay in high precision in every mode (zrw.convert's default). With
`--release-off MODE` one MXFP8 mode also trains with release=False (seed of the first run):
its curves must be the release-on curves bit for bit.

Reported: train loss per step and held-out loss every `--eval-every` steps (plot and JSON), the
final held-out loss of each mode and its gap to the baseline in percent, as mean, sample
standard deviation, min and max over seeds; the paired differences floor - rceil and
mxfp8-32x32 - mxfp8 (same seed, same data); and per-layer numerics telemetry
(zrw.telemetry: SQNR dB, saturated and flushed-to-zero fractions of weights, activations and
gradients) at a few steps of every MXFP8 mode. Each difference comes with the 95% confidence
interval of its mean over the seeds (Student's t); one whose interval holds zero is reported as
within the seed spread: the seeds do not tell it from noise.

Settings: `--setting tiny` (a test: seconds), `default` (2 seeds, under 10 minutes on 2 cores),
`long` (3 seeds, 200 steps: ~3x the tokens; the figures in docs/accuracy.md, about an hour on one
core of the machine named there). Any option given overrides the setting's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import zrw
import zrw.telemetry
from zrw.config import get_recipe

RECIPES = ("mxfp8", "mxfp8-32x32")
SCALE_MODES = ("floor", "rceil")
MX_MODES = tuple(f"{r}/{s}" for r in RECIPES for s in SCALE_MODES)
BASELINE = "baseline"


@dataclass
class AccuracyConfig:
    hidden: int = 256
    layers: int = 4
    seq: int = 256
    batch: int = 8
    steps: int = 50
    seeds: List[int] = field(default_factory=lambda: [0, 1])
    vocab: int = 4096
    lr: float = 2e-3
    warmup: float = 0.1  # fraction of the steps with a linear warmup (then cosine to 10%)
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    heldout_percent: int = 10  # files whose path hashes into this percentage are held out
    tokenizer_bytes: int = 4_000_000
    heldout_bytes: int = 4_000_000  # held-out text the evaluation windows are spread over
    eval_seqs: int = 32
    eval_every: int = 25
    telemetry_at: List[int] = field(default_factory=list)  # steps; empty: first, middle, last
    baseline: str = "bf16"  # or "fp32"
    modes: List[str] = field(default_factory=lambda: list(MX_MODES))
    release_off: Optional[str] = "mxfp8-32x32/rceil"
    threads: int = 1
    out: str = "zrw_accuracy_out"


SETTINGS = {
    "tiny": dict(
        hidden=64,
        layers=1,
        seq=64,
        batch=2,
        steps=4,
        seeds=[0],
        vocab=384,
        tokenizer_bytes=150_000,
        heldout_bytes=200_000,
        eval_seqs=4,
        eval_every=2,
    ),
    "default": dict(),
    "long": dict(steps=200, seeds=[0, 1, 2], eval_every=25, eval_seqs=64, release_off=None),
}


# ---- data ------------------------------------------------------------------------------------


def stdlib_files() -> List[tuple]:
    """(relative path, path) of the standard library's .py files, site-packages excluded, in a
    fixed pseudo-random order (by a hash of the relative path): the same on every run."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                found.append((os.path.relpath(path, root), path))
    found.sort(key=lambda f: (zlib.crc32(f[0].encode()), f[0]))
    return found


def split_files(files, heldout_percent: int):
    """Train and held-out files: a file is held out when its path's hash falls in the first
    `heldout_percent` of 100 buckets (a split by file, independent of the seed)."""
    heldout = [f for f in files if zlib.crc32(f[0].encode()[::-1]) % 100 < heldout_percent]
    held = {f[0] for f in heldout}
    return [f for f in files if f[0] not in held], heldout


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def train_tokenizer(train_files, vocab: int, max_bytes: int):
    """A byte-level BPE tokenizer trained in memory on the first train files (up to max_bytes)."""
    from tokenizers import ByteLevelBPETokenizer

    texts, total = [], 0
    for _, path in train_files:
        if total >= max_bytes:
            break
        text = _read(path)
        texts.append(text)
        total += len(text)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        texts,
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    return tok


def token_windows(tok, files, n_windows: int, seq: int) -> torch.Tensor:
    """(n_windows, seq) token ids: the files' tokens, one file after the other with an
    end-of-text token between them, cut into consecutive windows; stops once enough."""
    eot = tok.token_to_id("<|endoftext|>")
    need = n_windows * seq
    ids: List[int] = []
    for _, path in files:
        if len(ids) >= need:
            break
        ids.extend(tok.encode(_read(path)).ids)
        ids.append(eot)
    if len(ids) < need:
        raise ValueError(
            f"zrw.bench.accuracy: the files hold {len(ids)} tokens, fewer than the "
            f"{need} asked for ({n_windows} windows of {seq})"
        )
    return torch.tensor(ids[:need], dtype=torch.long).view(n_windows, seq)


def spread_windows(tok, files, n_windows: int, seq: int, max_bytes: int) -> tuple:
    """(n_windows, seq) token ids taken at evenly spaced places of the files' token stream (the
    files up to max_bytes of text), so that a held-out set of a few windows still spans many
    files; and the number of files read."""
    eot = tok.token_to_id("<|endoftext|>")
    ids: List[int] = []
    used, total = 0, 0
    for _, path in files:
        if total >= max_bytes:
            break
        text = _read(path)
        total += len(text)
        used += 1
        ids.extend(tok.encode(text).ids)
        ids.append(eot)
    available = len(ids) // seq
    if available < n_windows:
        raise ValueError(
            f"zrw.bench.accuracy: the held-out files hold {available} windows of "
            f"{seq} tokens, fewer than the {n_windows} asked for"
        )
    stream = torch.tensor(ids[: available * seq], dtype=torch.long).view(available, seq)
    picks = torch.linspace(0, available - 1, n_windows).round().long()
    return stream[picks], used


@dataclass
class Corpus:
    train: torch.Tensor  # (steps * batch, seq), in file order; each seed permutes it
    heldout: torch.Tensor  # (eval_seqs, seq)
    info: dict


def build_corpus(c: AccuracyConfig) -> Corpus:
    t0 = time.perf_counter()
    files = stdlib_files()
    train_files, heldout_files = split_files(files, c.heldout_percent)
    tok = train_tokenizer(train_files, c.vocab, c.tokenizer_bytes)
    train = token_windows(tok, train_files, c.steps * c.batch, c.seq)
    heldout, heldout_used = spread_windows(tok, heldout_files, c.eval_seqs, c.seq, c.heldout_bytes)
    info = {
        "source": sysconfig.get_paths()["stdlib"],
        "files": len(files),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_bytes": sum(os.path.getsize(p) for _, p in train_files),
        "heldout_bytes": sum(os.path.getsize(p) for _, p in heldout_files),
        "heldout_files_sampled": heldout_used,
        "vocab": tok.get_vocab_size(),
        "train_tokens": train.numel(),
        "heldout_tokens": heldout.numel(),
        "seconds": time.perf_counter() - t0,
    }
    return Corpus(train, heldout, info)


# ---- model and training ----------------------------------------------------------------------


def build_model(c: AccuracyConfig, vocab: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = max(1, c.hidden // 32)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        intermediate_size=3 * c.hidden,
        max_position_embeddings=c.seq,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).to(dtype)


def mode_recipe(mode: str):
    """'mxfp8/rceil' -> the mxfp8 QuantRecipe with scale_mode 'rceil'."""
    name, scale_mode = mode.split("/")
    return dataclasses.replace(get_recipe(name), scale_mode=scale_mode)


def _lr_lambda(c: AccuracyConfig):
    warm = max(1, round(c.warmup * c.steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, c.steps - warm)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


@torch.no_grad()
def heldout_loss(model, heldout: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [float(model(input_ids=chunk, labels=chunk).loss) for chunk in heldout.split(batch)]
    model.train()
    return sum(losses) / len(losses)


def telemetry_steps(c: AccuracyConfig) -> List[int]:
    if c.telemetry_at:
        return sorted({s for s in c.telemetry_at if 0 <= s < c.steps})
    return sorted({0, c.steps // 2, c.steps - 1})


def train_one(
    c: AccuracyConfig, corpus: Corpus, seed: int, mode: str, release: bool = True, progress=None
) -> dict:
    """Train one mode from `seed`; returns its curves, final held-out loss and telemetry."""
    dtype = torch.float32 if mode == BASELINE and c.baseline == "fp32" else torch.bfloat16
    model = build_model(c, corpus.info["vocab"], seed, dtype)
    if mode != BASELINE:
        zrw.convert(model, mode_recipe(mode), release=release)
    model.train()
    opt = zrw.optim.AdamW(
        model.parameters(),
        lr=c.lr,
        betas=(0.9, 0.95),
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(c))
    order = torch.randperm(corpus.train.shape[0], generator=torch.Generator().manual_seed(seed))
    tel_at = set(telemetry_steps(c)) if mode != BASELINE else set()
    train_losses, evals, telemetry = [], [], []
    t0 = time.perf_counter()
    for step in range(c.steps):
        ids = corpus.train[order[step * c.batch : (step + 1) * c.batch]]
        tel = zrw.telemetry.collect(model) if step in tel_at else None
        if tel is not None:
            tel.start()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if tel is not None:
            tel.stop()
            telemetry.append({"step": step, "summary": tel.summary(), "layers": tel.records()})
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        train_losses.append(loss.detach().item())
        if (step + 1) % c.eval_every == 0 or step + 1 == c.steps:
            evals.append((step + 1, heldout_loss(model, corpus.heldout, c.batch)))
        if progress is not None:
            progress(
                f"seed {seed} {mode}{'' if release else ' (release off)'}: step "
                f"{step + 1}/{c.steps} loss {train_losses[-1]:.3f}"
            )
    seconds = time.perf_counter() - t0
    del model, opt
    zrw.cache.cache_clear()
    return {
        "seed": seed,
        "mode": mode,
        "release": release,
        "train_loss": train_losses,
        "heldout": evals,
        "final_heldout": evals[-1][1],
        "seconds": seconds,
        "seconds_per_step": seconds / c.steps,
        "telemetry": telemetry,
    }


# ---- statistics ------------------------------------------------------------------------------

# Two-sided 95% quantiles of Student's t with 1..10 degrees of freedom (then ~2).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def spread(values: List[float]) -> dict:
    """mean, sample standard deviation (0 for one value), min, max, n, the half-width of the
    95% confidence interval of the mean (Student's t over the seeds) and `resolved`: whether
    that interval excludes zero (otherwise the difference is within the seed spread)."""
    n = len(values)
    mean = sum(values) / n
    std = statistics.stdev(values) if n > 1 else 0.0
    ci95 = (_T95[n - 2] if n - 2 < len(_T95) else 2.0) * std / math.sqrt(n) if n > 1 else math.inf
    resolved = n > 1 and abs(mean) > ci95
    return {
        "mean": mean,
        "std": std,
        "min": min(values),
        "max": max(values),
        "n": n,
        "ci95": ci95,
        "values": list(values),
        "resolved": resolved,
    }


def verdict(s: dict, what: str, unit: str = "%") -> str:
    """A plain sentence about a spread() of differences."""
    body = (
        f"{what}: {s['mean']:+.2f}{unit} (sd {s['std']:.2f}, range {s['min']:+.2f} to "
        f"{s['max']:+.2f}, {s['n']} seed{'s' if s['n'] != 1 else ''})"
    )
    if s["n"] < 2:
        return body + "; one seed decides nothing"
    ci = f"95% CI of the mean +-{s['ci95']:.2f}"
    if s["resolved"]:
        return body + f"; {'above' if s['mean'] > 0 else 'below'} beyond the seed spread ({ci})"
    return body + f"; within the seed spread ({ci} includes 0)"


def summarize(c: AccuracyConfig, runs: List[dict]) -> dict:
    final = {(r["seed"], r["mode"]): r["final_heldout"] for r in runs if r["release"]}
    seeds = sorted({s for s, _ in final})
    modes = [m for m in [BASELINE] + list(c.modes) if all((s, m) in final for s in seeds)]
    gaps = {
        m: [100.0 * (final[(s, m)] - final[(s, BASELINE)]) / final[(s, BASELINE)] for s in seeds]
        for m in modes
        if m != BASELINE
    }
    out = {
        "final_heldout": {m: spread([final[(s, m)] for s in seeds]) for m in modes},
        "gap_percent": {m: spread(v) for m, v in gaps.items()},
        "floor_minus_rceil_points": {},
        "block32x32_minus_1x32_points": {},
    }
    for r in RECIPES:
        f, rc = f"{r}/floor", f"{r}/rceil"
        if f in gaps and rc in gaps:
            out["floor_minus_rceil_points"][r] = spread([a - b for a, b in zip(gaps[f], gaps[rc])])
    for s in SCALE_MODES:
        a, b = f"mxfp8-32x32/{s}", f"mxfp8/{s}"
        if a in gaps and b in gaps:
            out["block32x32_minus_1x32_points"][s] = spread(
                [x - y for x, y in zip(gaps[a], gaps[b])]
            )
    out["sentences"] = (
        [verdict(out["gap_percent"][m], f"{m} held-out loss vs {c.baseline.upper()}") for m in gaps]
        + [
            verdict(v, f"{r}: floor minus rceil gap", " points")
            for r, v in out["floor_minus_rceil_points"].items()
        ]
        + [
            verdict(v, f"{s}: mxfp8-32x32 minus mxfp8 gap", " points")
            for s, v in out["block32x32_minus_1x32_points"].items()
        ]
    )
    # Telemetry at each checkpoint, pooled over layers, averaged over seeds.
    tel: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for r in runs:
        if not r["release"]:
            continue
        for snap in r["telemetry"]:
            for x in snap["summary"]:
                cell = (
                    tel.setdefault(r["mode"], {})
                    .setdefault(str(snap["step"]), {})
                    .setdefault(
                        x["tensor"],
                        {"sqnr_db": [], "saturated": [], "flushed": [], "min_sqnr_db": []},
                    )
                )
                for k in cell:
                    cell[k].append(x[k])
    out["telemetry"] = {
        m: {
            step: {t: {k: sum(v) / len(v) for k, v in cell.items()} for t, cell in tensors.items()}
            for step, tensors in steps.items()
        }
        for m, steps in tel.items()
    }
    offs = [r for r in runs if not r["release"]]
    checks = []
    for off in offs:
        on = next(
            r
            for r in runs
            if r["release"] and r["seed"] == off["seed"] and r["mode"] == off["mode"]
        )
        checks.append(
            {
                "seed": off["seed"],
                "mode": off["mode"],
                "train_loss_bitwise_equal": on["train_loss"] == off["train_loss"],
                "heldout_bitwise_equal": on["heldout"] == off["heldout"],
            }
        )
    out["release_off"] = checks
    return out


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    b = zrw.backends()["cpu"]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "isa": b.get("isa"),
        "native_bf16": b.get("native_bf16"),
        "gemm": b.get("gemm"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


# ---- report ----------------------------------------------------------------------------------


def _print_rows(rows: List[List[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


def print_report(r: dict) -> None:
    c, s = r["config"], r["summary"]
    tokens = c["steps"] * c["batch"] * c["seq"]
    print(
        f"zrw {r['zrw']}: held-out loss of a Qwen3 ({r['parameters'] / 1e6:.2f} M parameters, "
        f"{c['layers']} layers x {c['hidden']}) trained on {r['corpus']['train_files']} "
        f"stdlib files, {r['corpus']['heldout_files']} held out; {c['steps']} steps x "
        f"{c['batch']} x {c['seq']} tokens = {tokens} tokens per run; seeds {c['seeds']}; "
        f"baseline {c['baseline'].upper()}"
    )
    print(
        f"  machine: {r['machine']['cpu']}, {r['machine']['isa']}, "
        f"{r['machine']['torch_threads']} torch thread(s)"
    )
    per_step: Dict[str, List[float]] = {}
    for run in r["runs"]:
        per_step.setdefault(run["mode"], []).append(run["seconds_per_step"])
    rows = [["mode", "held-out loss", "sd", "gap vs baseline %", "sd", "min", "max", "s/step"]]
    for m, v in s["final_heldout"].items():
        g = s["gap_percent"].get(m)
        cells = [m, f"{v['mean']:.4f}", f"{v['std']:.4f}"]
        cells += (
            ["-", "", "", ""]
            if g is None
            else [f"{g['mean']:+.2f}", f"{g['std']:.2f}", f"{g['min']:+.2f}", f"{g['max']:+.2f}"]
        )
        cells.append(f"{sum(per_step[m]) / len(per_step[m]):.2f}")
        rows.append(cells)
    _print_rows(rows)
    for sentence in s["sentences"]:
        print("  " + sentence)
    for chk in s["release_off"]:
        same = chk["train_loss_bitwise_equal"] and chk["heldout_bitwise_equal"]
        print(
            f"  release on vs off ({chk['mode']}, seed {chk['seed']}): "
            f"{'identical, bit for bit' if same else 'DIFFERENT'}"
        )
    print(
        f"  telemetry, pooled over layers, mean over seeds {c['seeds']}: SQNR dB, saturated and "
        "flushed-to-zero fractions"
    )
    rows = [["mode", "step", "tensor", "SQNR dB", "worst layer dB", "saturated", "flushed"]]
    for m, steps in s.get("telemetry", {}).items():
        for step, tensors in steps.items():
            for t, v in tensors.items():
                rows.append(
                    [
                        m,
                        step,
                        t,
                        f"{v['sqnr_db']:.2f}",
                        f"{v['min_sqnr_db']:.2f}",
                        f"{v['saturated']:.2e}",
                        f"{v['flushed']:.2e}",
                    ]
                )
    _print_rows(rows)


def plot(r: dict, path) -> None:
    """Train loss and held-out loss against tokens seen, the held-out gap to the baseline along
    training, and the final gap per seed. `path`: a file name or a binary file object."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = r["config"]
    tokens_per_step = c["batch"] * c["seq"]
    colors = {
        BASELINE: "black",
        "mxfp8/floor": "tab:blue",
        "mxfp8/rceil": "tab:cyan",
        "mxfp8-32x32/floor": "tab:red",
        "mxfp8-32x32/rceil": "tab:orange",
    }
    runs = [x for x in r["runs"] if x["release"]]
    modes = list(r["summary"]["final_heldout"])
    seeds = sorted({x["seed"] for x in runs})
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    (ax_train, ax_held), (ax_gap, ax_final) = axes
    window = max(1, c["steps"] // 30)

    def smooth(v):
        out, acc = [], []
        for x in v:
            acc.append(x)
            acc = acc[-window:]
            out.append(sum(acc) / len(acc))
        return out

    def mean(rows):
        return [sum(v) / len(v) for v in zip(*rows)]

    by = {(x["seed"], x["mode"]): x for x in runs}
    for m in modes:
        mr = [by[(s, m)] for s in seeds]
        train = mean([smooth(x["train_loss"]) for x in mr])
        ax_train.plot(
            [(i + 1) * tokens_per_step for i in range(len(train))],
            train,
            color=colors.get(m),
            label=m,
            linewidth=1.1,
        )
        ev_x = [step * tokens_per_step for step, _ in mr[0]["heldout"]]
        ax_held.plot(
            ev_x,
            mean([[loss for _, loss in x["heldout"]] for x in mr]),
            marker="o",
            markersize=3,
            color=colors.get(m),
            label=m,
            linewidth=1.1,
        )
        if m == BASELINE:
            continue
        gaps = []
        for s in seeds:
            base = [loss for _, loss in by[(s, BASELINE)]["heldout"]]
            gap = [100 * (loss / b - 1) for (_, loss), b in zip(by[(s, m)]["heldout"], base)]
            gaps.append(gap)
            ax_gap.plot(ev_x, gap, color=colors.get(m), linewidth=0.6, alpha=0.35)
        ax_gap.plot(
            ev_x, mean(gaps), color=colors.get(m), marker="o", markersize=3, linewidth=1.6, label=m
        )
    ax_train.set_title(f"train loss (mean over seeds {seeds}, moving average of {window} steps)")
    ax_held.set_title(
        f"held-out loss ({r['corpus']['heldout_tokens']} tokens from "
        f"{r['corpus'].get('heldout_files_sampled', '?')} unseen files; mean "
        "over seeds)"
    )
    ax_gap.set_title(
        f"held-out loss vs {c['baseline'].upper()} along training (%): "
        "mean (thick), each seed (thin)"
    )
    ax_gap.axhline(0, color="black", linewidth=0.8)
    for ax in (ax_train, ax_held, ax_gap):
        ax.set_xlabel("tokens seen")
        ax.legend(fontsize=8)
    ax_train.set_ylabel("loss (nats/token)")
    ax_held.set_ylabel("loss (nats/token)")
    ax_gap.set_ylabel("%")
    gaps = r["summary"]["gap_percent"]
    for i, (m, g) in enumerate(gaps.items()):
        ax_final.scatter([i] * len(g["values"]), g["values"], color=colors.get(m), zorder=3)
        ax_final.errorbar(
            [i + 0.15],
            [g["mean"]],
            yerr=[[g["mean"] - g["min"]], [g["max"] - g["mean"]]],
            fmt="D",
            color=colors.get(m),
            capsize=4,
        )
    ax_final.axhline(0, color="black", linewidth=0.8)
    ax_final.set_xticks(range(len(gaps)))
    ax_final.set_xticklabels(list(gaps), rotation=15, fontsize=8)
    ax_final.set_ylabel(f"final held-out loss vs {c['baseline'].upper()} (%)")
    ax_final.set_title("final gap: each seed (dots), mean and range (diamond, bar)")
    fig.tight_layout()
    fig.savefig(path, dpi=80, format="png")
    plt.close(fig)


# ---- driver ----------------------------------------------------------------------------------


def run(c: AccuracyConfig, progress=None) -> dict:
    for m in c.modes:
        if m not in MX_MODES:
            raise ValueError(f"zrw.bench.accuracy: modes must be among {MX_MODES}, got {m!r}")
    if c.release_off is not None and c.release_off not in c.modes:
        raise ValueError(
            f"zrw.bench.accuracy: release_off must be one of the modes run "
            f"{c.modes} or None, got {c.release_off!r}"
        )
    if c.baseline not in ("bf16", "fp32"):
        raise ValueError(
            f"zrw.bench.accuracy: baseline must be 'bf16' or 'fp32', got {c.baseline!r}"
        )
    torch.set_num_threads(c.threads)
    corpus = build_corpus(c)
    parameters = sum(
        p.numel() for p in build_model(c, corpus.info["vocab"], 0, torch.bfloat16).parameters()
    )
    runs = []
    head = {
        "zrw": zrw.__version__,
        "config": dataclasses.asdict(c),
        "machine": machine(),
        "corpus": corpus.info,
        "parameters": parameters,
    }
    partial = os.path.join(c.out, "accuracy.partial.json")
    for seed in c.seeds:
        jobs = [(m, True) for m in [BASELINE] + list(c.modes)]
        if c.release_off is not None and seed == c.seeds[0]:
            jobs.append((c.release_off, False))
        for mode, release in jobs:
            runs.append(train_one(c, corpus, seed, mode, release, progress))
            # A long run interrupted keeps what it measured (created only once a run is done).
            os.makedirs(c.out, exist_ok=True)
            _write_whole(partial, json.dumps({**head, "runs": runs}).encode())
    os.remove(partial)
    return {**head, "runs": runs, "summary": summarize(c, runs)}


def _write_whole(path: str, data: bytes) -> None:
    """Write `data` to a temporary file beside `path` that replaces it once complete."""
    tmp = f"{path}.zrw-tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def merge_results(paths: List[str]) -> dict:
    """The results of several runs of the benchmark with the same settings but other seeds, as
    one (the first file's machine and corpus; every run's own timings)."""
    merged = None
    for path in paths:
        with open(path) as fh:
            r = json.load(fh)
        if merged is None:
            merged = r
            continue
        mine = {k: v for k, v in r["config"].items() if k not in ("seeds", "out")}
        theirs = {k: v for k, v in merged["config"].items() if k not in ("seeds", "out")}
        if mine != theirs or r["corpus"]["train_tokens"] != merged["corpus"]["train_tokens"]:
            raise ValueError(
                f"zrw.bench.accuracy: {path} was run with other settings than "
                f"{paths[0]}; only runs that differ in their seeds merge"
            )
        seen = set(merged["config"]["seeds"])
        if seen & set(r["config"]["seeds"]):
            raise ValueError(f"zrw.bench.accuracy: {path} repeats seeds of the files before it")
        merged["config"]["seeds"] = merged["config"]["seeds"] + r["config"]["seeds"]
        merged["runs"] = merged["runs"] + r["runs"]
    return merged


def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' trainer: one thread
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--setting", choices=sorted(SETTINGS), default="default")
    for f in dataclasses.fields(AccuracyConfig):
        if f.name in ("seeds", "telemetry_at", "modes", "release_off"):
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            default=None,
            help=f"default {getattr(AccuracyConfig(), f.name)!r} (or the setting's)",
        )
    p.add_argument("--seeds", type=_int_list, default=None, help="e.g. 0,1,2")
    p.add_argument(
        "--telemetry-at",
        type=_int_list,
        default=None,
        help="steps to collect telemetry at (default: first, middle, last)",
    )
    p.add_argument("--modes", default=None, help=f"comma-separated, among {','.join(MX_MODES)}")
    p.add_argument(
        "--release-off", default=None, help="an MXFP8 mode to train with release off too, or 'none'"
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="re-read accuracy.json files (comma-separated: runs of other seeds "
        "with the same settings are merged): summarize, plot and print again",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    values = dict(SETTINGS[a.setting])
    for f in dataclasses.fields(AccuracyConfig):
        given = getattr(a, f.name, None)
        if given is None:
            continue
        if f.name == "modes":
            given = [m for m in given.split(",") if m]
        elif f.name == "release_off":
            given = None if given.lower() == "none" else given
        elif f.name in ("seeds", "telemetry_at"):
            pass
        else:
            default = getattr(AccuracyConfig(), f.name)
            given = type(default)(given)
        values[f.name] = given
    c = AccuracyConfig(**values)
    # Every refusal comes here, before anything runs and before anything is written.
    if c.steps < 1 or c.eval_every < 1 or not c.seeds:
        p.error("--steps and --eval-every must be >= 1 and --seeds non-empty")
    if not c.out:
        p.error("--out must name a directory, got ''")
    if os.path.exists(c.out) and not os.path.isdir(c.out):
        p.error(f"--out must name a directory (for accuracy.json and .png), got the file {c.out!r}")
    try:
        import matplotlib  # noqa: F401  (the plot: checked before the run, not after it)
    except ImportError as e:
        p.error(f"the plot (accuracy.png) needs matplotlib: pip install matplotlib ({e})")

    def progress(msg: str) -> None:
        print("\r" + msg.ljust(70), end="", file=sys.stderr, flush=True)

    if a.from_json:
        r = merge_results(a.from_json.split(","))
        c = AccuracyConfig(**{**r["config"], "out": c.out})
        r["summary"] = summarize(c, r["runs"])
    else:
        r = run(c, None if a.no_progress or a.json else progress)
        if not (a.no_progress or a.json):
            print(file=sys.stderr)
    png = os.path.join(c.out, "accuracy.png")
    # Both outputs are made in memory first; a failure there creates no directory and no file.
    image = io.BytesIO()
    plot(r, image)
    r["png"] = png
    text = json.dumps(r)
    os.makedirs(c.out, exist_ok=True)
    _write_whole(png, image.getvalue())
    _write_whole(os.path.join(c.out, "accuracy.json"), text.encode())
    if a.json:
        print(json.dumps(r))
        return
    print_report(r)
    print(f"\nwrote {png} and {os.path.join(c.out, 'accuracy.json')}")
