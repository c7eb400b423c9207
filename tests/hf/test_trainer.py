"""zrw inside Hugging Face's Trainer: a converted tiny Qwen3 trained by
transformers' own Trainer, with the optimizer built by the Trainer from
`optimizer_cls_and_kwargs=(zrw.optim.AdamW, ...)` or given as `optimizers=`, gradient
accumulation 2, clipping at max_grad_norm=1.0, a checkpoint and a resume: release on gives bit
for bit what release off gives (losses, gradient norms, final weights, the checkpoint), and the
checkpoint loads into a plain (unconverted) model. With the Trainer's own default optimizer
zrw releases nothing (no optimizer with the zrw boundary owns the weights), warns once naming
the fix, and trains exactly as release off. With convert(..., main_grad=True) the Trainer's own
clipping (max_grad_norm > 0, over .grad only) is refused by zrw.optim.AdamW at the first step,
before anything changes; clipping in the optimizer (TrainingArguments(max_grad_norm=0) +
zrw.optim.AdamW(max_grad_norm=...)) covers every FP32 gradient, main_grad included."""

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3ForCausalLM, Trainer, TrainingArguments  # noqa: E402

import zrw  # noqa: E402
from helpers.bitwise import assert_bitwise_dicts  # noqa: E402
from helpers.hf import Tokens, final_weights, losses_and_norms, trainer_args  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw import cache  # noqa: E402

BF16 = torch.bfloat16


# This file's runs: 4 steps, clipped at 1.0, a linear schedule, a checkpoint every 2 steps.
RUN = dict(
    max_steps=4,
    max_grad_norm=1.0,
    learning_rate=1e-3,
    weight_decay=0.1,
    save_strategy="steps",
    save_steps=2,
    data_seed=0,
    dataloader_num_workers=0,
    lr_scheduler_type="linear",
)


def args(out, **kw):
    return TrainingArguments(**trainer_args(out, **{**RUN, **kw}))


def train(out, release, how="cls", resume=None, max_steps=4, recipe="mxfp8"):
    cache.cache_clear()
    model = make_model(**HF_QWEN3)
    zrw.convert(model, recipe, release=release, main_grad=(how == "main_grad"))
    kw = {}
    extra = {}
    if how == "cls":
        kw["optimizer_cls_and_kwargs"] = (zrw.optim.AdamW, {"lr": 1e-3})
    elif how == "main_grad":
        # main_grad: clipped in the optimizer on the FP32 gradients (Trainer clips .grad only)
        kw["optimizer_cls_and_kwargs"] = (zrw.optim.AdamW, {"lr": 1e-3, "max_grad_norm": 1.0})
        extra["max_grad_norm"] = 0.0
    elif how == "instance":
        kw["optimizers"] = (zrw.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), None)
    trainer = Trainer(
        model=model, args=args(out, max_steps=max_steps, **extra), train_dataset=Tokens(), **kw
    )
    trainer.train(resume_from_checkpoint=resume)
    logs = losses_and_norms(trainer)
    if how == "main_grad":
        logs.append(trainer.optimizer.optimizer.last_grad_norm)
    return logs, final_weights(model), cache.cache_stats()["released"], trainer


def assert_same(a, b, what):
    assert a[0] == b[0], f"{what}: losses / grad norms differ: {a[0]} vs {b[0]}"
    assert_bitwise_dicts(a[1], b[1], what)


@pytest.mark.parametrize("how", ["cls", "instance"])
def test_trainer_release_on_equals_off(tmp_path, how):
    on = train(tmp_path / "on", True, how)
    off = train(tmp_path / "off", False, how)
    assert on[2] > 0, "the converted weights are released between steps (BF16-free step)"
    assert off[2] == 0
    assert_same(on, off, how)
    assert len(on[0]) == 4 and all(n > 0 for _, n in on[0])
    # The checkpoint is an ordinary one: it loads into a plain model, and equals release off's.
    ck_on, ck_off = tmp_path / "on" / "checkpoint-4", tmp_path / "off" / "checkpoint-4"
    plain = Qwen3ForCausalLM.from_pretrained(str(ck_on), dtype=BF16)
    again = Qwen3ForCausalLM.from_pretrained(str(ck_off), dtype=BF16)
    for (k, a), b in zip(plain.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
        if k in on[1]:
            assert torch.equal(a, on[1][k]), k


def test_trainer_with_main_grad_release_on_equals_off(tmp_path):
    """convert(..., main_grad=True) under Trainer: clipping in zrw.optim.AdamW(max_grad_norm)
    on the FP32 gradients; release on = off bitwise, and the gradients were really clipped."""
    on = train(tmp_path / "on", True, "main_grad")
    off = train(tmp_path / "off", False, "main_grad")
    assert_same(on, off, "main_grad")
    assert on[0][-1] is not None and on[0][-1] > 1.0, "the norm before clipping exceeds 1"


@pytest.mark.parametrize("how", ["cls", "main_grad"])
def test_trainer_resume_is_bitwise_the_uninterrupted_run(tmp_path, how):
    full = train(tmp_path / "full", True, how)
    # A fresh process's view: a new model, converted, resumed from the run's step-2 checkpoint.
    resumed = train(tmp_path / "resumed", True, how, resume=str(tmp_path / "full" / "checkpoint-2"))
    for k in full[1]:
        assert torch.equal(resumed[1][k], full[1][k]), k
    assert resumed[0][:4] == full[0][:4]  # the history carries over from the checkpoint


def test_trainer_default_optimizer_trains_exactly_and_warns(tmp_path, monkeypatch):
    """No optimizer with the zrw boundary: nothing is released (no saving, and nothing lost),
    one warning names the fix, and the run is release off's."""
    monkeypatch.setattr(zrw.lifecycle, "_unowned_warned", False)  # once per process: not yet here
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on = train(tmp_path / "on", True, how="default")
    assert on[2] == 0
    msgs = [str(w.message) for w in seen if "zrw" in str(w.message)]
    assert any("optimizer_cls_and_kwargs=(zrw.optim.AdamW" in m for m in msgs), msgs
    off = train(tmp_path / "off", False, how="default")
    assert_same(on, off, "default optimizer")


def test_main_grad_under_trainer_is_consumed_each_step(tmp_path):
    """convert(..., main_grad=True) with zrw.optim.AdamW under Trainer: the FP32 main_grad is
    consumed by every step (it used to pile up across steps: Trainer clears only .grad)."""
    cache.cache_clear()
    model = make_model(**HF_QWEN3)
    zrw.convert(model, main_grad=True)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_grad_norm=0.0, save_strategy="no"),
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": 1e-3}),
    )
    seen = []

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen.append([getattr(p, "main_grad", None) for p in model.parameters()])

    trainer.add_callback(Probe())
    trainer.train()
    assert len(seen) == 4
    assert all(g is None for step in seen for g in step), "main_grad is empty at each step start"
    json.dumps(trainer.state.log_history)  # the logs are plain numbers


def test_main_grad_with_a_plain_optimizer_is_refused():
    model = make_model(**HF_QWEN3)
    zrw.convert(model, main_grad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = Tokens()[0]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"main_grad.*zrw\.optim\.AdamW"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("how", ["cls", "instance", "both-clip"])
def test_main_grad_with_trainer_clipping_is_refused_before_any_step(tmp_path, how):
    """convert(..., main_grad=True) under the Trainer's default max_grad_norm=1.0: the Trainer
    clips .grad only, so the main_grad weights would go unclipped and the logged norm would
    leave them out. zrw.optim.AdamW refuses at the first step, naming both settings, before
    anything changes (also when it clips itself: the Trainer would clip .grad twice)."""
    cache.cache_clear()
    model = make_model(**HF_QWEN3)
    zrw.convert(model, main_grad=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kw = {}
    if how == "instance":
        kw["optimizers"] = (zrw.optim.AdamW(model.parameters(), lr=1e-3), None)
    else:
        extra = {"max_grad_norm": 1.0} if how == "both-clip" else {}
        kw["optimizer_cls_and_kwargs"] = (zrw.optim.AdamW, {"lr": 1e-3, **extra})
    trainer = Trainer(
        model=model, args=args(tmp_path, save_strategy="no"), train_dataset=Tokens(), **kw
    )
    with pytest.raises(
        RuntimeError,
        match=r"max_grad_norm=1\.0 over the parameters' \.grad only.*main_grad.*"
        r"'model\.layers\.0\.self_attn\.q_proj\.weight'.*Nothing was stepped.*"
        r"TrainingArguments\(max_grad_norm=0\) and zrw\.optim\.AdamW\(\.\.\., max_grad_norm=1\.0\)",
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    opt = trainer.optimizer.optimizer
    assert not opt.inner.state, "the inner AdamW took no step"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _fp32_grads(opt):
    """Each parameter's gradient in FP32, in the optimizer's order: main_grad, else .grad."""
    out = []
    for p in _params(opt):
        mg = getattr(p, "main_grad", None)
        out.append(mg.clone() if mg is not None else p.grad.float())
    return out


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _values(model, opt):
    """The model's weights (state_dict: exact, also for released ones), in the optimizer's
    order."""
    sd = model.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    return [sd[names[id(p)]].clone() for p in _params(opt)]


def test_main_grad_opt_out_clips_every_fp32_gradient(tmp_path):
    """The opt-out path: TrainingArguments(max_grad_norm=0) + zrw.optim.AdamW(max_grad_norm=1)
    clips over every FP32 gradient, main_grad included, with torch.nn.utils.clip_grad_norm_'s
    numbers: its norm and its first update equal clip_grad_norm_ + torch.optim.AdamW on FP32
    copies of the same weights and gradients, bit for bit. Against the `.grad` run that the
    Trainer clips itself (max_grad_norm=1.0) the norm agrees up to the BF16 gradients'
    rounding (the Trainer's own norm over .grad only leaves the main_grad weights out). One
    warning says that the Trainer's logged grad_norm covers .grad only."""
    cache.cache_clear()
    model = make_model(**HF_QWEN3)
    zrw.convert(model, main_grad=True)
    seen = {}

    class Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            if state.global_step == 0:
                opt = optimizer.optimizer
                seen["grads"] = _fp32_grads(opt)
                seen["weights"] = [w.float() for w in _values(model, opt)]
                seen["groups"] = [
                    ({k: v for k, v in g.items() if k != "params"}, len(g["params"]))
                    for g in opt.param_groups
                ]
                seen["logged"] = None

        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            if state.global_step == 0:
                opt = optimizer.optimizer
                seen["norm"] = opt.last_grad_norm
                seen["masters"] = [m.clone() for ms in opt.masters for m in ms]
                seen["after"] = _values(model, opt)

    trainer = Trainer(
        model=model,
        args=args(tmp_path / "mg", max_grad_norm=0.0, save_strategy="no"),
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": 1e-3, "max_grad_norm": 1.0}),
        callbacks=[Probe()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    msgs = [str(w.message) for w in caught if "Trainer logs is the norm" in str(w.message)]
    assert len(msgs) == 1 and "last_grad_norm" in msgs[0], msgs
    assert "'model.layers.0.self_attn.q_proj.weight'" in msgs[0]
    # An independent step on FP32 copies: torch's clip_grad_norm_, then torch's AdamW.
    ref = [w.clone().requires_grad_() for w in seen["weights"]]
    for r, g in zip(ref, seen["grads"]):
        r.grad = g
    norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert float(norm) == seen["norm"] and seen["norm"] > 1.0, "clipped, main_grad included"
    groups, i = [], 0
    for hyper, n in seen["groups"]:
        groups.append({**hyper, "params": ref[i : i + n]})
        i += n
    assert i == len(ref)
    torch.optim.AdamW(groups).step()
    for r, m, got in zip(ref, seen["masters"], seen["after"]):
        assert torch.equal(r.detach(), m)
        assert torch.equal(r.detach().to(BF16), got)
    # The `.grad` run, clipped by the Trainer: the same norm up to the BF16 gradients.
    logs = train(tmp_path / "grad", True, "cls")[0]
    assert abs(logs[0][1] - seen["norm"]) < 0.02 * seen["norm"], (logs[0][1], seen["norm"])
    # ... while the Trainer's own log of the main_grad run covers .grad only (the warning).
    assert trainer.state.log_history[0]["grad_norm"] < 0.9 * seen["norm"]
