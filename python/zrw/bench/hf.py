"""`python -m zrw.bench hf`: memory of Hugging Face training with zrw, per phase.

Two jobs on a small Qwen3 (transformers model class, config, random init, bf16), each in three
modes run in their own processes (zrw.memory's counting allocator is process-wide):

  trainer   full fine-tuning with transformers' Trainer (GA=2, max_grad_norm=1.0):
            "bf16"  plain BF16 training, Trainer's own default optimizer (torch AdamW on the
                    BF16 parameters);
            "off"   zrw, MXFP8 with the FP8 cache, no release, optimizer_cls_and_kwargs=
                    (zrw.optim.AdamW, ...) (FP32 masters);
            "on"    the same with zero-redundancy weights (BF16-free step).
  lora      PEFT LoRA (r=8 on every linear) on a frozen base, zrw.optim.AdamW over the adapters:
            "bf16"  plain BF16 base;
            "off"   zrw, base converted with release=False;
            "on"    zrw, frozen base released for good (release_frozen=True: FP8 only).

Per phase, the peak of live CPU bytes: the forward/backward window (from a step's start to the
optimizer step: Trainer's on_step_begin to on_pre_optimizer_step) and the optimizer step
(on_pre_optimizer_step to on_optimizer_step), the medians over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import median

import zrw
from zrw import memory

MODES = ("bf16", "off", "on")


def _child(job: str, mode: str, hidden: int, layers: int, steps: int, recipe: str) -> dict:
    import logging
    import warnings

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import torch

    memory.install()
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    kw = {}
    if job == "trainer":
        if mode != "bf16":
            zrw.convert(model, recipe, release=(mode == "on"))
            kw["optimizer_cls_and_kwargs"] = (zrw.optim.AdamW, {"lr": 1e-4})
    else:
        from peft import LoraConfig, get_peft_model

        if mode != "bf16":
            zrw.convert(model, recipe, release=(mode == "on"), release_frozen=(mode == "on"))
        model = get_peft_model(
            model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)
        )
        kw["optimizer_cls_and_kwargs"] = (zrw.optim.AdamW, {"lr": 1e-4})
        if mode == "bf16":
            kw["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 1e-4})

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, 256, (64, 64), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    window, optimizer = [], []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **k):
            memory.reset_peak()

        def on_pre_optimizer_step(self, args, state, control, **k):
            window.append(memory.peak())
            memory.reset_peak()

        def on_optimizer_step(self, args, state, control, **k):
            optimizer.append(memory.peak())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=steps,
            max_grad_norm=1.0,
            learning_rate=1e-4,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Probe()], **kw)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    n_conv = sum(m.weight.numel() for m in model.modules() if isinstance(m, zrw.nn.MXLinear))
    return {
        "window": median(window[1:]),
        "optimizer": median(optimizer[1:]),
        "losses": losses,
        "converted": n_conv,
        "fp8_bytes": zrw.cache.cache_stats()["fp8_bytes"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--jobs", default="trainer,lora")
    p.add_argument("--recipe", default="mxfp8", choices=["mxfp8", "mxfp8-32x32"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.hidden, a.layers, a.steps, a.recipe)))
        return
    results = {}
    for job in a.jobs.split(","):
        for mode in MODES:
            cmd = [
                sys.executable,
                "-m",
                "zrw.bench",
                "hf",
                "--child",
                job,
                mode,
                "--hidden",
                str(a.hidden),
                "--layers",
                str(a.layers),
                "--steps",
                str(a.steps),
                "--recipe",
                a.recipe,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if out.returncode != 0:
                raise RuntimeError(f"zrw.bench hf {job}/{mode} failed:\n{out.stderr[-3000:]}")
            results[f"{job}/{mode}"] = json.loads(out.stdout.strip().splitlines()[-1])
    if a.json:
        print(json.dumps(results))
        return
    mib = 2**20
    print(
        f"zrw: Hugging Face Trainer memory per phase (CPU, zrw.memory), recipe {a.recipe}, "
        f"Qwen3 hidden {a.hidden}, {a.layers} layers, {a.steps} steps x GA 2, medians of "
        f"steps 2-{a.steps}"
    )
    for job in a.jobs.split(","):
        r = {m: results[f"{job}/{m}"] for m in MODES}
        two_n = 2 * r["on"]["converted"] / mib
        print(f"\n{job}: converted weights {r['on']['converted']:,} (2N = {two_n:.2f} MiB)")
        print(
            f"  {'mode':<6} {'fwd/bwd peak MiB':>17} {'optimizer peak MiB':>19} {'final loss':>11}"
        )
        for m in MODES:
            print(
                f"  {m:<6} {r[m]['window'] / mib:>17.2f} {r[m]['optimizer'] / mib:>19.2f} "
                f"{r[m]['losses'][-1]:>11.4f}"
            )
        for ph in ("window", "optimizer"):
            d_off = (r["off"][ph] - r["on"][ph]) / mib
            d_bf = (r["bf16"][ph] - r["on"][ph]) / mib
            print(
                f"  {ph}: on saves {d_off:.2f} MiB vs off (= {d_off / two_n:.3f} x 2N) and "
                f"{d_bf:.2f} MiB vs plain BF16"
            )
        same = r["on"]["losses"] == r["off"]["losses"]
        print(f"  losses, release on vs off: {'bit for bit' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
