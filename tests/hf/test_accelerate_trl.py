"""zrw with accelerate (prepare, accumulate, clipping, save_state / load_state) and TRL's
SFTTrainer (its own optimizer path, through optimizer_cls_and_kwargs): release on equals
release off bit for bit. Tiny Qwen3 from a config, a word-level tokenizer built in
memory: nothing is downloaded."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")

import zrw  # noqa: E402
from helpers.hf import final_weights, losses_and_norms, trainer_args  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw import cache  # noqa: E402

BF16 = torch.bfloat16


def tiny_qwen3(seed=0):
    return make_model(seed=seed, pad_token_id=126, eos_token_id=127, **HF_QWEN3)


def data(n=8, seq=16):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 120, (n, seq), generator=g)


def accelerate_run(release, tmp_path, save_at=None, resume=None, steps=4):
    from accelerate import Accelerator

    cache.cache_clear()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_qwen3()
    zrw.convert(model, release=release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = acc.prepare(model, opt)
    if resume is not None:
        acc.load_state(str(resume))
    losses = []
    batches = data(2 * steps)
    start = 0 if resume is None else save_at
    for s in range(start, steps):
        for i in range(2):
            ids = batches[2 * s + i][None]
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        if save_at is not None and s + 1 == save_at and resume is None:
            acc.save_state(str(tmp_path / "state"))
    weights = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return torch.stack(losses), weights, cache.cache_stats()["released"]


def test_accelerate_release_on_equals_off(tmp_path):
    on = accelerate_run(True, tmp_path / "on")
    off = accelerate_run(False, tmp_path / "off")
    assert on[2] > 0 and off[2] == 0
    assert torch.equal(on[0], off[0])
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k


def test_accelerate_save_state_and_load_state_resume_bitwise(tmp_path):
    full = accelerate_run(True, tmp_path, save_at=2)
    resumed = accelerate_run(True, tmp_path, save_at=2, resume=tmp_path / "state")
    assert torch.equal(resumed[0], full[0][4:])
    for k in full[1]:
        assert torch.equal(resumed[1][k], full[1][k]), k


def tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(126)}
    vocab.update({"[PAD]": 126, "[EOS]": 127})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="t0"
    )


def sft_run(release, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cache.cache_clear()
    model = tiny_qwen3()
    zrw.convert(model, release=release)
    ds = Dataset.from_dict({"input_ids": data(8).tolist()})
    cfg = SFTConfig(
        **trainer_args(
            tmp_path,
            max_steps=3,
            max_grad_norm=1.0,
            learning_rate=1e-3,
            save_strategy="no",
            data_seed=0,
            dataloader_num_workers=0,
            bf16=False,
        )
    )
    trainer = SFTTrainer(
        model=model,
        args=cfg,
        train_dataset=ds,
        processing_class=tokenizer(),
        optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": 1e-3}),
    )
    trainer.train()
    return losses_and_norms(trainer), final_weights(model)


def test_sft_trainer_release_on_equals_off(tmp_path):
    on = sft_run(True, tmp_path / "on")
    off = sft_run(False, tmp_path / "off")
    assert len(on[0]) == 3
    assert on[0] == off[0]
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k
