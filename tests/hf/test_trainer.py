"""zrw inside Hugging Face's Trainer (issue 20): a converted tiny Qwen3 trained by
transformers' own Trainer, with the optimizer built by the Trainer from
`optimizer_cls_and_kwargs=(zrw.optim.AdamW, ...)` or given as `optimizers=`, gradient
accumulation 2, clipping at max_grad_norm=1.0, a checkpoint and a resume: release on gives bit
for bit what release off gives (losses, gradient norms, final weights, the checkpoint), and the
checkpoint loads into a plain (unconverted) model. With the Trainer's own default optimizer
zrw releases nothing (no optimizer with the zrw boundary owns the weights), warns once naming
the fix, and trains exactly as release off."""

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_models import tiny_qwen3  # noqa: E402
from transformers import Qwen3ForCausalLM, Trainer, TrainingArguments  # noqa: E402

import zrw  # noqa: E402
from zrw import cache  # noqa: E402

BF16 = torch.bfloat16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        lr_scheduler_type="linear",
    )
    base.update(kw)
    return TrainingArguments(**base)


def train(out, release, how="cls", resume=None, max_steps=4, recipe="mxfp8"):
    cache.cache_clear()
    model = tiny_qwen3()
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
    logs = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
    if how == "main_grad":
        logs.append(trainer.optimizer.optimizer.last_grad_norm)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    released = cache.cache_stats()["released"]
    return logs, weights, released, trainer


def assert_same(a, b, what):
    assert a[0] == b[0], f"{what}: losses / grad norms differ: {a[0]} vs {b[0]}"
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{what}: {k}"


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
    monkeypatch.setattr(cache, "_unowned_warned", False)  # once per process: not yet here
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
    model = tiny_qwen3()
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
    model = tiny_qwen3()
    zrw.convert(model, main_grad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = Tokens()[0]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"main_grad.*zrw\.optim\.AdamW"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
