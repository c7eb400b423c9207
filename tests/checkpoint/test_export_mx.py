"""The training grid exported exactly: zrw.checkpoint.export_mx hands each converted
weight's forward MXFP8 plane, E4M3 codes and E8M0 block scales, to torchao's MX inference tensor
(MXTensor) byte for byte, the rest of the state dict as it is (BF16).

Checked here, for both recipes, after a few BF16-free steps (zrw.optim.AdamW):
  (a) the exported codes and scales are the cache's bytes (the copy the forwards used, read as a
      cache hit), equal to zrw.reference's quantization of the FP32 master rounded to BF16; a
      weight with no cached plane (after the step) exports the bytes its next forward uses;
      the export changes nothing in the cache;
  (b) the file reloads into a fresh unconverted model (load_mx, and transformers'
      from_pretrained of save_mx_pretrained's directory), byte for byte, and generate() runs;
  (c) the exported model's logits against zrw's eval forward (the measured difference printed);
  (d) torchao's dequantization of the exported weights equals zrw.reference's of the cached
      plane, bitwise;
  (e) torchao's own to_mx of the weight (master rounded to BF16) gives the same bytes, for
      both scale rules;
and the refusals, each naming what it refuses, before anything is written."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao")
safetensors = pytest.importorskip("safetensors.torch")

from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402

import zrw  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw import cache, memory, reference  # noqa: E402
from zrw.checkpoint import export_mx, iter_mx_state_dict, load_mx, save_mx_pretrained  # noqa: E402
from zrw.planes import is_zrw_layer  # noqa: E402

BF16 = torch.bfloat16
RECIPES = ["mxfp8", "mxfp8-32x32"]


def u8(t):
    return t.contiguous().view(torch.uint8)


def trained(recipe, steps=3, seed=0):
    """A tiny Qwen3 converted with `recipe`, `steps` BF16-free AdamW steps; returns the model,
    its optimizer, the token ids and {state-dict name: (layer, weight)} of the converted."""
    model = make_model(seed=seed, **HF_QWEN3)
    zrw.convert(model, recipe=recipe)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    layers = {f"{n}.weight": (m, m.weight) for n, m in model.named_modules() if is_zrw_layer(m)}
    return model, opt, ids, layers


def cached_planes(layer, w):
    """The cache's copy of `w` as the layer's next training use reads it."""
    r = layer.recipe
    return cache.quant_and_release(
        w,
        r.cache_layout,
        elem_dtype=r.elem_dtype,
        scale_mode=r.scale_mode,
        require_owner=True,
    )


def reference_plane(recipe, master):
    """zrw.reference's forward plane of the weight whose FP32 master is `master`."""
    r = zrw.get_recipe(recipe)
    if r.block_32x32:
        data, block = reference.mx_quantize_block_from_master(
            master, BF16, r.elem_dtype, r.scale_mode
        )
        return data, reference.expand_block_scale(block, master.shape, -1), block
    data, scale = reference.mx_quantize_from_master(master, -1, BF16, r.elem_dtype, r.scale_mode)
    return data, scale, None


@pytest.mark.parametrize("recipe", RECIPES)
def test_exported_bytes_are_the_cache_bytes(recipe):
    """(a) mid-step (after a training forward and backward, before the step): the exported
    codes and scales are the bytes the cache holds and the forward used, which are zrw's
    reference quantization of the FP32 master (never of another BF16 copy); 32x32: the codes
    are the one FP8 copy and each tile's scale is repeated for its 32 rows. The export files,
    releases and restores nothing."""
    model, opt, ids, layers = trained(recipe)
    model(input_ids=ids, labels=ids).loss.backward()  # the step's forward: files the copies
    assert all(cache.is_released(w) for _, w in layers.values())
    before = cache.cache_stats()
    exported = export_mx(model)
    assert cache.cache_stats() == before  # no entry, state or counter changed
    assert list(exported) == list(model.state_dict())
    for name, (layer, w) in layers.items():
        mx = exported[name]
        assert isinstance(mx, MXTensor) and mx.block_size == 32 and mx.orig_dtype == BF16
        assert mx.qdata.dtype == torch.float8_e4m3fn and mx.scale.dtype == torch.float8_e8m0fnu
        assert not mx.is_swizzled_scales
        hits = cache.cache_stats()["hits"]
        q = cached_planes(layer, w)
        assert cache.cache_stats()["hits"] == hits + 1  # the cached copy, not a new one
        assert torch.equal(u8(mx.qdata), u8(q.fwd.data)), name
        assert torch.equal(u8(mx.scale), u8(q.fwd.scale)), name
        data, scale, block = reference_plane(recipe, cache.master_of(w))
        assert torch.equal(u8(mx.qdata), u8(data)), name
        assert torch.equal(u8(mx.scale), u8(scale)), name
        if block is not None:
            assert torch.equal(u8(q.block_scale), u8(block))
            rows = q.block_scale.view(torch.uint8).repeat_interleave(32, dim=-2)[: w.shape[0]]
            assert torch.equal(u8(mx.scale), rows), name
            assert q.fwd.data.data_ptr() == q.bwd.data.data_ptr()  # one FP8 copy
    # The BF16 entries are the state dict's, exactly.
    sd = model.state_dict()
    for name, t in exported.items():
        if name not in layers:
            assert type(t) is torch.Tensor and t.dtype == sd[name].dtype
            assert torch.equal(t, sd[name]), name
    del opt


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_without_a_cached_plane_exports_what_its_next_forward_uses(recipe):
    """(a) after the optimizer step the BF16-free step leaves every weight released with no
    FP8 copy (pending: its next use quantizes from the master). The export quantizes each from
    its master with zrw's op, without filing it; the next training forward then uses exactly
    the exported bytes."""
    model, opt, ids, layers = trained(recipe)
    stats = cache.cache_stats()
    assert stats["pending"] == len(layers)
    exported = export_mx(model)
    assert cache.cache_stats() == stats  # still pending: nothing filed
    model(input_ids=ids, labels=ids).loss.backward()  # the next forward quantizes them
    for name, (layer, w) in layers.items():
        q = cached_planes(layer, w)
        assert torch.equal(u8(exported[name].qdata), u8(q.fwd.data)), name
        assert torch.equal(u8(exported[name].scale), u8(q.fwd.scale)), name
    del opt


def test_frozen_weight_released_for_good_exports_its_only_copy():
    """(a) a frozen base released for good (release_frozen, as under LoRA): its FP8 copy is its
    only value, and the export is that copy, byte for byte."""
    model = make_model(**HF_QWEN3)
    zrw.convert(model, recipe="mxfp8-32x32", release_frozen=True)
    model.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # something to backpropagate into
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    layers = {f"{n}.weight": m for n, m in model.named_modules() if is_zrw_layer(m)}
    states = cache.cache_states([m.weight for m in layers.values()])
    assert all(s is cache.CacheState.RELEASED_FOR_GOOD for s in states)
    exported = export_mx(model)
    for name, layer in layers.items():
        q = cached_planes(layer, layer.weight)
        assert torch.equal(u8(exported[name].qdata), u8(q.fwd.data)), name
        assert torch.equal(u8(exported[name].scale), u8(q.fwd.scale)), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_dequantized_export_equals_reference_dequantization(recipe):
    """(d) torchao's dequantization of each exported weight is, bit for bit, zrw.reference's
    dequantization of the cached plane (32x32: of the one copy with the row-expanded tile
    scales), so the exported weight has exactly the values zrw trained with."""
    model, opt, ids, layers = trained(recipe)
    model(input_ids=ids, labels=ids).loss.backward()
    for name, t in iter_mx_state_dict(model):
        if name not in layers:
            continue
        layer, w = layers[name]
        q = cached_planes(layer, w)
        ours = reference.mx_dequantize(q.fwd.data, q.fwd.scale, -1, BF16)
        assert torch.equal(t.dequantize(BF16), ours), name
        if q.block_scale is not None:
            expanded = reference.expand_block_scale(q.block_scale, w.shape, -1)
            assert torch.equal(ours, reference.mx_dequantize(q.fwd.data, expanded, -1, BF16))
    del opt


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_export_matches_torchao_to_mx(scale_mode):
    """(e) an independent check: torchao's own to_mx of the BF16 weight (the FP32 master
    rounded to BF16) with the same scale rule gives the exported bytes, and the exported
    MXTensor quantizes activations with that rule."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    model, opt, ids, layers = trained(zrw.get_recipe("mxfp8", scale_mode=scale_mode))
    mode = ScaleCalculationMode.RCEIL if scale_mode == "rceil" else ScaleCalculationMode.FLOOR
    exported = export_mx(model)
    for name, (layer, w) in layers.items():
        scale, data = to_mx(cache.master_of(w).to(BF16), torch.float8_e4m3fn, 32, mode)
        assert torch.equal(u8(exported[name].qdata), u8(data)), name
        assert torch.equal(u8(exported[name].scale), u8(scale)), name
        assert exported[name].act_quant_kwargs.scaling_mode == mode
    del opt


def test_floor_and_rceil_exports_differ():
    """The export carries the recipe's scale rule: the same weights exported under "floor"
    and "rceil" differ in some scale bytes (so the check above can tell the rules apart)."""
    model, opt, _, layers = trained("mxfp8", steps=1)
    a = export_mx(model)
    for layer, _ in layers.values():
        layer.recipe = zrw.get_recipe("mxfp8", scale_mode="floor")
    cache.restore_all("master")
    b = export_mx(model)
    assert any(not torch.equal(u8(a[n].scale), u8(b[n].scale)) for n in layers)
    del opt


@pytest.mark.parametrize("recipe", RECIPES)
def test_exported_file_reloads_and_generates(recipe, tmp_path):
    """(b, c) the file export_mx writes loads into a fresh, unconverted model of the same
    architecture (other weights) byte for byte; its logits match zrw's eval forward of the
    trained model (the measured max abs difference is printed; docs/export.md), and
    generate() runs."""
    model, opt, ids, layers = trained(recipe)
    path = tmp_path / "model.safetensors"
    export_mx(model, path)
    exported = export_mx(model)
    # torchao's format: <module>._weight_qdata / _weight_scale, metadata per tensor name.
    raw = safetensors.load_file(str(path))
    some = next(iter(layers))
    prefix = some.rsplit(".", 1)[0]
    assert raw[f"{prefix}._weight_qdata"].dtype == torch.float8_e4m3fn
    assert raw[f"{prefix}._weight_scale"].dtype == torch.float8_e8m0fnu
    fresh = load_mx(make_model(seed=7, **HF_QWEN3), path)
    params = dict(fresh.named_parameters())
    for name, t in exported.items():
        got = params.get(name)
        if name in layers:
            assert isinstance(got, MXTensor) and not got.requires_grad
            assert torch.equal(u8(got.qdata), u8(t.qdata)), name
            assert torch.equal(u8(got.scale), u8(t.scale)), name
        else:
            assert torch.equal(fresh.state_dict()[name], t), name
    model.eval()
    fresh.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        out = fresh(input_ids=ids).logits.float()
    diff = (out - ref).abs().max().item()
    print(
        f"{recipe}: max |logits(exported) - logits(zrw eval)| = {diff} (max |logit| "
        f"{ref.abs().max().item():.3f})"
    )
    assert diff <= 0.02 * ref.abs().max().item(), diff
    gen = fresh.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 8) and torch.equal(gen[:, :4], ids[:1, :4])
    del opt


def test_save_mx_pretrained_loads_with_from_pretrained(tmp_path):
    """(b) save_mx_pretrained writes a directory transformers' from_pretrained loads as a
    torchao MX model (TorchAoConfig in config.json): the same bytes, and generate() runs. The
    model's own config is left unchanged."""
    from transformers import AutoModelForCausalLM

    model, opt, ids, layers = trained("mxfp8-32x32")
    save_mx_pretrained(model, tmp_path / "mx")
    assert getattr(model.config, "quantization_config", None) is None
    cfg = json.loads((tmp_path / "mx" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "torchao"
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mx"))
    exported = export_mx(model)
    params = dict(again.named_parameters())
    for name in layers:
        assert isinstance(params[name], MXTensor)
        assert torch.equal(u8(params[name].qdata), u8(exported[name].qdata)), name
        assert torch.equal(u8(params[name].scale), u8(exported[name].scale)), name
    gen = again.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 8)
    del opt


def test_export_streams_one_weight_at_a_time(tmp_path):
    """export_mx(model, path) writes tensor by tensor: it never holds more than one weight's
    planes (the pending weights are quantized from their masters one at a time), and it
    leaves nothing behind; the dict of every exported weight would exceed that bound."""
    memory.install()
    model, opt, ids, layers = trained("mxfp8")
    numels = [w.numel() for _, w in layers.values()]
    bound = 4 * max(numels)  # its two planes, the copy of one, and their scales
    assert sum(numels) > bound
    # A first export lets the cache sweep the entries of weights that died since (earlier
    # tests' models): their frees inside the window would hide the export's own bytes.
    export_mx(model, tmp_path / "m.safetensors")
    assert cache.cache_stats()["pending"] == len(layers)  # still quantized from the masters
    with memory.window() as m:
        export_mx(model, tmp_path / "m.safetensors")
    print(
        f"export_mx(model, path): peak {m['peak'] - m['start']} bytes, largest weight "
        f"{max(numels)} elements, all {sum(numels)}"
    )
    assert m["peak"] - m["start"] >= max(numels)  # it did copy a weight's codes in the window
    assert m["peak"] - m["start"] <= bound + 4096, (m["peak"] - m["start"], bound)
    assert memory.current() - m["start"] <= 4096
    del opt


# ---- refusals ----------------------------------------------------------------------------


def test_refuses_a_model_without_converted_weights(tmp_path):
    path = tmp_path / "old.safetensors"
    path.write_bytes(b"the old file")
    with pytest.raises(ValueError, match=r"export_mx: model has no converted weights"):
        export_mx(make_model(**HF_QWEN3), path)
    assert path.read_bytes() == b"the old file"
    with pytest.raises(TypeError, match=r"export_mx: model must be a torch\.nn\.Module, got dict"):
        export_mx({})


def test_kernel_auto_is_recorded_for_weights_and_activations():
    """kernel="auto" asks torchao for its real MX GEMM (a GPU that has one; not run here): the
    weights and the activation kwargs carry KernelPreference.AUTO, the bytes are the same."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    model, opt, _, layers = trained("mxfp8", steps=1)
    emulated, auto = export_mx(model), export_mx(model, kernel="auto")
    for name in layers:
        assert emulated[name].kernel_preference == KernelPreference.EMULATED
        assert auto[name].kernel_preference == KernelPreference.AUTO
        assert auto[name].act_quant_kwargs.kernel_preference == KernelPreference.AUTO
        assert torch.equal(u8(auto[name].qdata), u8(emulated[name].qdata))
        assert torch.equal(u8(auto[name].scale), u8(emulated[name].scale))
    del opt


def test_refuses_bad_arguments(tmp_path):
    model, opt, _, _ = trained("mxfp8", steps=1)
    with pytest.raises(ValueError, match=r"export_mx: kernel must be one of .*got 'cuda'"):
        export_mx(model, kernel="cuda")
    with pytest.raises(ValueError, match=r"iter_mx_state_dict: experts must be one of"):
        iter_mx_state_dict(model, experts="mx")
    with pytest.raises(ValueError, match=r"export_mx: path must name a file, got the directory"):
        export_mx(model, tmp_path)
    del opt


def test_refuses_k_not_a_multiple_of_32():
    """torchao's MXTensor holds whole 32-blocks along K: a weight with K = 48 is named."""
    model = torch.nn.Sequential(torch.nn.Linear(48, 64, dtype=BF16))
    zrw.convert(model)
    with pytest.raises(ValueError, match=r"weight '0\.weight' has K = 48 .* not a multiple of 32"):
        export_mx(model)


def test_refuses_a_tied_converted_weight():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=BF16), torch.nn.Linear(64, 64))
    model[1].weight = model[0].weight
    model[1].bias.data = model[1].bias.data.to(BF16)
    zrw.convert(model)
    with pytest.raises(ValueError, match=r"weight '1\.weight' is the same tensor as '0\.weight'"):
        export_mx(model)


def test_refuses_expert_stacks_unless_asked_for_bf16(tmp_path):
    """torchao 0.18's MXTensor cannot run transformers' fused experts: a 3-d stack is refused
    by name; experts='bf16' exports it as its exact BF16 value (from the master), the linear
    weights as MX, and the reloaded model runs."""
    model = make_model("moe", layers=1)
    zrw.convert(model)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj' is a 3-d"):
        export_mx(model)
    path = tmp_path / "moe.safetensors"
    export_mx(model, path, experts="bf16")
    stacks = {k: v for k, v in model.state_dict().items() if "experts" in k}
    fresh = load_mx(make_model("moe", seed=1, layers=1), path)
    for k, v in stacks.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert isinstance(fresh.model.layers[0].self_attn.q_proj.weight, MXTensor)
    assert fresh.generate(ids[:, :4], max_new_tokens=2, do_sample=False).shape == (1, 6)


def test_load_mx_refuses_a_converted_model_and_a_plain_file(tmp_path):
    model, opt, _, _ = trained("mxfp8", steps=1)
    path = tmp_path / "mx.safetensors"
    export_mx(model, path)
    with pytest.raises(ValueError, match=r"load_mx: model has zrw layers \(model\.layers\.0"):
        load_mx(model, path)
    plain = tmp_path / "plain.safetensors"
    zrw.checkpoint.save_safetensors(model, plain)
    with pytest.raises(ValueError, match=r"load_mx: .*plain\.safetensors' holds no torchao"):
        load_mx(make_model(**HF_QWEN3), plain)
    other = make_model(**dict(HF_QWEN3, ffn=96))
    with pytest.raises(ValueError, match=r"MX weight 'model\.layers\.0\.mlp\.gate_proj\.weight'"):
        load_mx(other, path)
    del opt


def test_refuses_a_weight_whose_recipe_changed_while_released(tmp_path):
    """The layer's recipe changed while its weight is released with a copy of the old one:
    named before the file is opened (an existing file survives)."""
    model, opt, ids, layers = trained("mxfp8", steps=1)
    model(input_ids=ids, labels=ids).loss.backward()  # released, with their copies
    layer = next(iter(layers.values()))[0]
    layer.recipe = zrw.get_recipe("mxfp8", scale_mode="floor")
    path = tmp_path / "old.safetensors"
    path.write_bytes(b"the old file")
    with pytest.raises(
        ValueError,
        match=r"weight 'model\.layers\.0\.self_attn\.q_proj\.weight' "
        r"is released with its FP8 copy made as",
    ):
        export_mx(model, path)
    assert path.read_bytes() == b"the old file"
    del opt


def test_exports_a_released_weight_without_a_master():
    """Mid-step under a plain optimizer (restore by dequantization at its step, no FP32 master):
    save_safetensors cannot materialize the released BF16 weights, but their FP8 copy is what
    the export needs, and it is exported."""
    model = make_model(**HF_QWEN3)
    zrw.convert(model)
    opt = zrw.optim.attach(torch.optim.SGD(model.parameters(), lr=0.1), fill="dequant")
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    layers = {f"{n}.weight": m for n, m in model.named_modules() if is_zrw_layer(m)}
    assert all(cache.is_released(m.weight) for m in layers.values())
    assert all(cache.master_of(m.weight) is None for m in layers.values())
    exported = export_mx(model)
    for name, layer in layers.items():
        q = cached_planes(layer, layer.weight)
        assert torch.equal(u8(exported[name].qdata), u8(q.fwd.data)), name
        assert torch.equal(u8(exported[name].scale), u8(q.fwd.scale)), name
    del opt
