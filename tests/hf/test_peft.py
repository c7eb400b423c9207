"""PEFT / LoRA on converted models: adapters stay in high precision in either order
of zrw.convert and get_peft_model; training with release on equals release off bit for bit;
the adapter saves and reloads; a frozen base released for good (release_frozen=True, FP8 only)
still gives a state dict (its dequantized FP8 values, with a warning, or a named error when
asked) and merges (as PEFT merges a quantized base, from its dequantized FP8 copy
with one warning, the same bits as after zrw.cache.restore_frozen; refused by name under
frozen_values("raise")); and merge_and_unload never leaves a stale FP8 copy in use."""

import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

import zrw  # noqa: E402
from helpers.hf import trainer_args  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw import cache  # noqa: E402
from zrw.nn import MXLinear  # noqa: E402

BF16 = torch.bfloat16
TARGETS = ["q_proj", "v_proj", "up_proj"]


def lora(model):
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False
    )  # random B: the adapter changes the output
    return get_peft_model(model, cfg)


def batches(n=3):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def build(order, release, recipe="mxfp8", release_frozen=False):
    cache.cache_clear()
    model = make_model(**HF_QWEN3)
    if order == "convert-first":
        zrw.convert(model, recipe, release=release, release_frozen=release_frozen)
        model = lora(model)
    else:
        model = lora(model)
        zrw.convert(model, recipe, release=release, release_frozen=release_frozen)
    return model


def train(model, steps=3):
    opt = zrw.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), opt


def adapter(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


@pytest.mark.parametrize("order", ["convert-first", "peft-first"])
def test_adapters_stay_high_precision_and_release_on_equals_off(order, tmp_path):
    on = build(order, True)
    lora_layers = [n for n, m in on.named_modules() if ".lora_" in n and isinstance(m, MXLinear)]
    assert not lora_layers, f"LoRA layers converted: {lora_layers}"
    bases = [n for n, m in on.named_modules() if n.endswith("base_layer")]
    assert bases and all(isinstance(on.get_submodule(n), MXLinear) for n in bases)
    l_on, _ = train(on)
    a_on = adapter(on)
    off = build(order, False)
    l_off, _ = train(off)
    assert torch.equal(l_on, l_off)
    for k, v in adapter(off).items():
        assert torch.equal(a_on[k], v), k
    # The adapter saves and loads into a fresh (plain) base: the same adapter weights.
    on.save_pretrained(str(tmp_path / "adapter"))
    fresh = PeftModel.from_pretrained(make_model(**HF_QWEN3), str(tmp_path / "adapter"))
    got = adapter(fresh)
    assert set(got) == set(a_on)
    for k, v in got.items():
        assert torch.equal(v, a_on[k]), k


def test_merge_and_unload_never_uses_a_stale_fp8_copy():
    """release_frozen=False (the frozen base keeps its BF16): merge_and_unload writes the
    deltas into the base weights through `.data`; the merged model must compute with them."""
    model = build("convert-first", True)
    train(model)
    ids = batches(1)[0]
    with torch.no_grad():
        before = model(input_ids=ids).logits  # base + adapter, unmerged
        base_only = model.get_base_model()
    merged = model.merge_and_unload()
    with torch.no_grad():
        after = merged(input_ids=ids).logits
    # Merged equals unmerged up to the MX quantization of the merged weights (not exactly:
    # the LoRA path ran unquantized before) and is far from the base without the adapter.
    with torch.no_grad(), zrw.no_release():
        for m in merged.modules():
            if isinstance(m, MXLinear):
                assert not cache.is_released(m.weight)
    assert (after - before).abs().max() < 0.25 * (before.abs().max())
    del base_only
    # The merged weights, loaded into a fresh model and converted: the same logits exactly
    # (a stale FP8 copy of the unmerged base would give the base model's logits).
    check = make_model(**HF_QWEN3)
    check.load_state_dict(merged.state_dict())
    zrw.convert(check, release=False)
    with torch.no_grad():
        assert torch.equal(check(input_ids=ids).logits, after)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_frozen_base_released_for_good(recipe, tmp_path):
    """QLoRA-style: the frozen base is FP8 only. Training works and equals release off; the
    adapter saves (state_dict gives the base as its dequantized FP8 copy, with one warning, or
    a named error under frozen_values('raise')); merging needs restore_frozen first (the
    error says so) and then computes with the merged weights."""
    off = build("convert-first", False, recipe, release_frozen=True)
    l_off, _ = train(off)
    on = build("convert-first", True, recipe, release_frozen=True)  # (clears the cache)
    l_on, _ = train(on)
    frozen = [
        m.weight
        for n, m in on.named_modules()
        if isinstance(m, MXLinear) and not m.weight.requires_grad
    ]
    assert frozen and all(cache.cache_state(w) == "released_for_good" for w in frozen)
    assert torch.equal(l_on, l_off)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        on.save_pretrained(str(tmp_path / "adapter"))
        sd = on.state_dict()
    key = next(k for k in sd if k.endswith("q_proj.base_layer.weight"))
    w = on.get_submodule(key[: -len(".weight")]).weight
    assert cache.cache_state(w) == "released_for_good", "saving leaves the base released"
    with zrw.checkpoint.frozen_values("raise"):
        with pytest.raises(RuntimeError, match=r"released for good.*frozen_values"):
            on.state_dict()
    got = PeftModel.from_pretrained(make_model(**HF_QWEN3), str(tmp_path / "adapter"))
    for k, v in adapter(got).items():
        assert torch.equal(v, adapter(on)[k]), k
    # merge: under frozen_values("raise") refused with the fix named; after restore_frozen it
    # works (without it too: test_merge_on_a_base_released_for_good)
    with zrw.checkpoint.frozen_values("raise"):
        with pytest.raises(RuntimeError, match=r"restore_frozen"):
            on.merge_and_unload()
    assert zrw.cache.restore_frozen(on) == len(frozen)
    assert torch.equal(w.detach(), sd[key]), "restored to the dequantized copy state_dict gave"
    merged = on.merge_and_unload()
    ids = batches(1)[0]
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    # save_pretrained of the merged model reloads into a plain model, which converted
    # computes the same logits
    merged.save_pretrained(str(tmp_path / "merged"))
    reloaded = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=BF16)
    for k, v in merged.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k
    check = make_model(**HF_QWEN3)  # the same config as the merged model (from_pretrained may pick
    check.load_state_dict(reloaded.state_dict())  # another attention implementation)
    zrw.convert(check, recipe, release=False)
    with torch.no_grad():
        assert torch.equal(check(input_ids=ids).logits, out)


def _lora_layers(model):
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def _frozen_bases(model):
    return [
        m.weight for m in model.modules() if isinstance(m, MXLinear) and not m.weight.requires_grad
    ]


def _sd(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen bases: their dequantized FP8 values
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "recipe, safe", [("mxfp8", False), ("mxfp8-32x32", False), ("mxfp8-32x32", True)]
)
def test_merge_on_a_base_released_for_good(recipe, safe, tmp_path, monkeypatch):
    """merge_and_unload on a frozen base released for good (FP8 only), as PEFT merges a
    quantized base: each merged base weight is filled from its dequantized FP8 copy, the delta
    added, with one warning that names a weight and says it rounds. The merged model equals,
    bit for bit, the merge after zrw.cache.restore_frozen and PEFT's own merge on a plain
    model holding the dequantized base; it saves (save_pretrained, save_safetensors) and
    reloads with the same bits. Under frozen_values("raise") the merge is refused by name and
    nothing changes (the merge afterwards gives the same bits). The same with PEFT's
    safe_merge=True (it copies the base through `.data` first)."""
    # The same run twice (build() clears the cache: the first model is restored before the
    # second is built).
    restored = build("convert-first", True, recipe, release_frozen=True)
    train(restored)
    assert zrw.cache.restore_frozen(restored) > 0
    direct = build("convert-first", True, recipe, release_frozen=True)
    train(direct)
    frozen = _frozen_bases(direct)
    assert frozen and all(cache.cache_state(w) == "released_for_good" for w in frozen)
    before = _sd(direct)  # the base as its dequantized FP8 values, the adapters exact

    # strict: refused by name, nothing changed
    with zrw.checkpoint.frozen_values("raise"):
        with pytest.raises(
            RuntimeError,
            match=r"write through `\.data` to frozen weight 'model\.layers\.0\.self_attn\.q_proj"
            r"\.weight'.*frozen_values\('raise'\).*Nothing was changed",
        ):
            direct.merge_and_unload(safe_merge=safe)
    assert all(cache.cache_state(w) == "released_for_good" for w in frozen)
    assert not any(m.merged for m in _lora_layers(direct)) and _lora_layers(direct)
    for k, v in _sd(direct).items():
        assert torch.equal(v, before[k]), k

    # the merge on the base released for good: one warning, naming a weight, saying it rounds
    monkeypatch.setattr(zrw.frozen, "_frozen_write_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        merged = direct.merge_and_unload(safe_merge=safe)
    msgs = [str(w.message) for w in seen if "filled it from its dequantized" in str(w.message)]
    assert (
        len(msgs) == 1
        and "'model.layers.0.self_attn.q_proj.weight'" in msgs[0]
        and "rounds" in msgs[0]
    )
    assert not _lora_layers(merged)
    got = _sd(merged)

    # = the merge after restore_frozen
    for k, v in _sd(restored.merge_and_unload(safe_merge=safe)).items():
        assert torch.equal(got[k], v), k

    # = PEFT's merge on a plain (unconverted) model holding the dequantized base
    plain = lora(make_model(**HF_QWEN3))
    plain.load_state_dict(before)
    expect = _sd(plain.merge_and_unload(safe_merge=safe))
    assert set(expect) == set(got)
    for k, v in expect.items():
        assert torch.equal(got[k], v), k
    base_keys = {k.replace("base_model.model.", "").replace(".base_layer", ""): k for k in before}
    q = [k for k in got if k.endswith("q_proj.weight")]
    assert q and all(not torch.equal(got[k], before[base_keys[k]]) for k in q), "merged"

    # saves and reloads with the same bits
    merged.save_pretrained(str(tmp_path / "merged"))
    reloaded = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=BF16)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, got[k]), k
    from safetensors.torch import load_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zrw.checkpoint.save_safetensors(merged, str(tmp_path / "merged.safetensors"))
    for k, v in load_file(str(tmp_path / "merged.safetensors")).items():
        assert torch.equal(v, got[k]), k


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_lora_under_trainer_checkpoints(recipe, tmp_path):
    """LoRA on a base released for good, under Trainer with zrw.optim.AdamW: release on = off
    bit for bit, and the Trainer's checkpoint holds the adapter, which loads into a plain
    base."""
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = batches(8)[i // 2][i % 2]
            return {"input_ids": ids, "labels": ids}

    runs = {}
    for release in (False, True):
        model = build("convert-first", release, recipe, release_frozen=True)
        args = TrainingArguments(
            **trainer_args(tmp_path / str(release), max_steps=2, save_steps=2, max_grad_norm=1.0)
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Data(),
            optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": 1e-2}),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[release] = (
            [h["loss"] for h in trainer.state.log_history if "loss" in h],
            adapter(model),
        )
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert torch.equal(runs[True][1][k], v), k
    got = PeftModel.from_pretrained(make_model(**HF_QWEN3), str(tmp_path / "True" / "checkpoint-2"))
    for k, v in adapter(got).items():
        assert torch.equal(v, runs[True][1][k]), k


def test_parametrized_experts_warn():
    model = make_model("moe", layers=1, moe_ffn=32, **HF_QWEN3)
    cfg = LoraConfig(
        r=4,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(model, cfg)
    with pytest.warns(
        UserWarning,
        match=r"fused-experts module\(s\) under PEFT's LoRA on "
        r"parameters.*cannot release",
    ):
        summary = zrw.convert(model)
    assert any("target_parameters" in why for why in summary.skipped.values())


def test_writes_to_an_fp8_only_weight(monkeypatch):
    """The transition behind the merge, write by write, on a frozen base released for good
    without a master: `w.data.add_(d)` and an in-place write under no_grad fill it from its
    dequantized FP8 copy first (the restore_frozen bytes), then apply; `w.data = t` takes t;
    reads of the weight itself still raise the named release error, and requires_grad_ is
    not a write (unfreezing without a master stays refused at the next use); a load restores
    it with the loaded values."""
    monkeypatch.setattr(zrw.frozen, "_frozen_write_warned", False)
    model = build("convert-first", True, "mxfp8-32x32", release_frozen=True)
    train(model, steps=1)
    ws = {n: m.weight for n, m in model.named_modules() if n.endswith("base_layer")}
    ws.update({n: m.weight for n, m in model.named_modules() if n.endswith("k_proj")})
    assert all(cache.cache_state(w) == "released_for_good" for w in ws.values())
    assert all(type(w) is cache.FP8OnlyParameter for w in ws.values())
    sd = _sd(model)
    key = {id(p): k for k, p in model.named_parameters()}
    a, b, c, d, e, f = list(ws.values())[:6]
    with pytest.raises(RuntimeError, match=r"is released"):
        a.sum()  # a read: the release poison, as before
    a.requires_grad_(False)  # not a write
    assert type(a) is cache.FP8OnlyParameter and cache.is_released(a)
    with pytest.warns(UserWarning, match=r"filled it from its dequantized MXFP8 copy"):
        a.data.add_(1.0)
    assert type(a) is torch.nn.Parameter and not cache.is_cached(a)
    assert torch.equal(a.detach(), sd[key[id(a)]] + 1.0)
    with torch.no_grad():
        b.mul_(2.0)
    assert torch.equal(b.detach(), sd[key[id(b)]] * 2.0)
    with torch.no_grad():
        f[0, :3] = 1.0  # __setitem__
    expect = sd[key[id(f)]].clone()
    expect[0, :3] = 1.0
    assert torch.equal(f.detach(), expect) and type(f) is torch.nn.Parameter
    t = torch.zeros_like(sd[key[id(c)]])
    c.data = t
    assert c.data_ptr() == t.data_ptr() and not cache.is_cached(c)
    assert type(c) is torch.nn.Parameter
    # A load restores it with the loaded values (no fill, no warning): an ordinary Parameter.
    new = dict(sd, **{key[id(e)]: torch.full_like(sd[key[id(e)]], 0.5)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict({k: v for k, v in new.items() if k in {key[id(e)]}}, strict=False)
    assert type(e) is torch.nn.Parameter and torch.equal(e.detach(), new[key[id(e)]])
    # The next training forward quantizes the written values and releases them again.
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert cache.cache_state(a) == "released_for_good" and type(a) is cache.FP8OnlyParameter
    # Unfreezing without a master is still refused by name at the next use.
    d.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"released for good while frozen"):
        model(input_ids=ids, labels=ids)
