"""End-to-end training of tiny Hugging Face models converted with zrw.convert.

Tiny Qwen3 (dense) and Qwen3-MoE models are built from configs (transformers model classes,
seeded random init, BF16 — no download), converted in place, and trained under
zrw.optim.MasterWeights(AdamW) with the optimizer boundary attached. What must hold:
zero redundancy changes nothing but memory (release on vs off: bitwise the same losses
and weights, with and without activation checkpointing); MX gradients point where BF16's do; a
learnable task trains as well as BF16; checkpoints round-trip bitwise, also mid-step; the
converted model runs under torch.compile; convert's summary matches what the cache releases.
"""

import functools
import io

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import zrw
from helpers.models import (  # (skips this module without transformers)
    BF16,
    KINDS,
    RECIPES,
    assert_same_weights,
    make_batches,
    make_model,
    setup,
    train,
    weights,
)
from zrw import cache
from zrw.nn import MXFusedExperts, MXLinear

pytestmark = pytest.mark.usefixtures("clean_cache")


def converted_weight_names(summary):
    """State-dict names of the weights convert() put on the MX path."""
    names = []
    for mod in summary.converted:
        names += (
            [f"{mod}.gate_up_proj", f"{mod}.down_proj"]
            if mod.endswith("experts")
            else [f"{mod}.weight"]
        )
    return names


# ------------------------------------------------------------------------------------------------
# release on vs off: bitwise, with and without activation checkpointing

STEPS, MICRO = 5, 4


@functools.lru_cache(maxsize=None)
def _plain_run(kind, recipe):
    """release=False, no checkpointing: the reference every other configuration must equal."""
    cache.cache_clear()
    model, opt, _ = setup(kind, recipe, release=False)
    losses = train(model, opt, make_batches(STEPS, MICRO))
    out = losses, weights(model)
    del model, opt
    cache.cache_clear()
    return out


@pytest.mark.parametrize(
    "ckpt",
    [None, "non_reentrant", "reentrant"],
    ids=["no_ckpt", "ckpt_non_reentrant", "ckpt_reentrant"],
)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_release_on_off_bitwise(kind, recipe, ckpt):
    batches = make_batches(STEPS, MICRO)
    runs = {}
    for release in (True, False):
        model, opt, summary = setup(kind, recipe, release=release, ckpt=ckpt)
        n_weights = summary.parameters
        first = {}

        def probe(step, mb):
            if (step, mb) == (0, 0):
                first.update(cache.cache_stats())

        losses = train(model, opt, batches, probe)
        runs[release] = (losses, weights(model))
        # the first microbatch: one quantization per weight; the recompute (and only it) looks
        # each weight up again — that is how we know HF's checkpointing really ran
        assert first["misses"] == n_weights
        assert first["hits"] == (0 if ckpt is None else n_weights), first
        if not release:
            assert first["released"] == 0
        elif ckpt != "reentrant":  # reentrant: see test_reentrant_checkpointing_releases_weights
            assert first["released_bytes"] == summary.release_bytes > 0
        del model, opt
        cache.cache_clear()

    (loss_on, w_on), (loss_off, w_off) = runs[True], runs[False]
    assert loss_on.shape == (STEPS * MICRO,) and torch.isfinite(loss_on).all()
    assert torch.equal(loss_on, loss_off), f"losses differ:\n{loss_on}\n{loss_off}"
    assert_same_weights(w_on, w_off, "release on vs off")
    # and activation checkpointing itself changes nothing
    loss_ref, w_ref = _plain_run(kind, recipe)
    assert torch.equal(loss_on, loss_ref), "checkpointed run differs from the plain run"
    assert_same_weights(w_on, w_ref, "checkpointed vs plain")
    assert not torch.equal(loss_on[:MICRO], loss_on[-MICRO:]), "the model did not change?"


def test_reentrant_checkpointing_releases_weights():
    """HF's use_reentrant=True checkpointing runs each layer's first forward under no_grad and
    recomputes it under grad mode in backward. It is a training step all the same: after the
    first microbatch the converted weights must be released (as with use_reentrant=False), or
    zero redundancy silently saves nothing."""
    model, opt, summary = setup("dense", "mxfp8", ckpt="reentrant")
    ids = make_batches(1, 1)[0][0]
    model(input_ids=ids, labels=ids).loss.backward()
    st = cache.cache_stats()
    assert st["released_bytes"] == summary.release_bytes, (
        f"released {st['released_bytes']} of {summary.release_bytes} bytes; skips: "
        f"no_grad={st['skip_no_grad']}"
    )


# ------------------------------------------------------------------------------------------------
# MX gradients vs BF16


def _route(model, record=None, pin=None):
    """Forward hooks on every MoE router: record its top-k choices, or replace them with pinned
    ones (the weights then are this model's own softmax probabilities at the pinned experts)."""
    handles = []
    for li, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def hook(mod, args, out, li=li):
            logits, scores, idx = out
            if record is not None:
                record.setdefault(li, []).append(idx.clone())
            if pin is None:
                return None
            idx = pin[li].pop(0)
            probs = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
            if mod.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(scores.dtype), idx

        handles.append(gate.register_forward_hook(hook))
    return handles


def _first_step_grads(model, step, **route):
    handles = _route(model, **route) if route else []
    for ids in step:
        model(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    return {n: p.grad for n, p in model.named_parameters()}


def _cosines(g_a, g_b, names):
    return {
        n: F.cosine_similarity(g_a[n].float().flatten(), g_b[n].float().flatten(), dim=0).item()
        for n in names
    }


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_first_step_weight_grads_match_bf16(kind, recipe):
    """Every converted weight's first-step gradient (4 microbatches) has cosine similarity
    >= 0.99 with the unconverted BF16 model's (same init, same batches).

    MoE: top-k routing is discontinuous. MX's forward perturbs the routers' inputs, so 2-5% of
    these random-init tokens pick a different expert pair than in BF16 (an FP32 run flips none),
    and each flip moves a whole token's gradient between experts — cosine ~0.97-0.99 for the
    expert stacks although MXFusedExperts itself is faithful (0.997 under identical routing).
    So the MoE comparison pins the MX run's routing to the BF16 run's choices (its own router
    probabilities at those experts): what remains is MX numerics, held to 0.99 for every
    converted weight and the routers. Unpinned, the attention weights are still held to 0.99
    and the expert stacks to 0.95 (the routing-flip effect, not a numerics error)."""
    step = make_batches(1, MICRO, seed=2)[0]
    record = {}
    g_bf16 = _first_step_grads(
        make_model(kind), step, **({"record": record} if kind == "moe" else {})
    )
    mx = make_model(kind)
    summary = zrw.convert(mx, recipe)
    names = converted_weight_names(summary)
    assert len(names) == summary.parameters
    if kind == "moe":
        pinned = _first_step_grads(mx, step, pin={k: list(v) for k, v in record.items()})
        names_pinned = names + [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
        cos = _cosines(pinned, g_bf16, names_pinned)
        low = {n: round(c, 4) for n, c in cos.items() if not c >= 0.99}
        assert not low, f"routing pinned: gradients with cosine < 0.99 to BF16's: {low}"
        cache.cache_clear()
        mx = make_model(kind)
        zrw.convert(mx, recipe)
    g_mx = _first_step_grads(mx, step)
    cos = _cosines(g_mx, g_bf16, names)
    bound = {
        n: (0.95 if n.endswith(("gate_up_proj", "down_proj")) and "experts" in n else 0.99)
        for n in names
    }
    low = {n: round(c, 4) for n, c in cos.items() if not c >= bound[n]}
    assert not low, f"weight gradients with cosine similarity below bound to BF16's: {low}"


# ------------------------------------------------------------------------------------------------
# a learnable task tracks BF16


def _pair_task(steps, batch=16, pairs=12, vocab=64, seed=3):
    """Sequences a0 f(a0) a1 f(a1) ... with a_i uniform and f a fixed permutation: every second
    next-token is determined (learnable), every other one is uniform (an entropy floor of
    ln(vocab)/2 per token on average, so 'within 5%' compares two non-zero losses)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        a = torch.randint(0, vocab, (batch, pairs), generator=g)
        out.append([torch.stack([a, perm[a]], dim=-1).reshape(batch, 2 * pairs)])
    return out


def _learn(convert_recipe, batches):
    model = make_model("dense", vocab=64, layers=1)
    if convert_recipe is not None:
        zrw.convert(model, convert_recipe)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=3e-3))
    losses = train(model, opt, batches)
    cache.cache_clear()
    return losses


def test_learnable_run_tracks_bf16():
    steps = 100
    batches = _pair_task(steps)
    floor = 11 / 23 * torch.log(torch.tensor(64.0)).item()  # 11 of 23 targets are random
    bf16 = _learn(None, batches)
    final_bf16 = bf16[-10:].mean().item()
    assert final_bf16 < 0.7 * bf16[0].item(), f"BF16 did not learn: {bf16[0]} -> {final_bf16}"
    for recipe in RECIPES:
        mx = _learn(recipe, batches)
        final = mx[-10:].mean().item()
        assert final < 0.7 * mx[0].item(), f"{recipe} did not learn: {mx[0]} -> {final}"
        assert abs(final - final_bf16) <= 0.05 * final_bf16, (
            f"{recipe}: final loss {final:.4f} vs BF16 {final_bf16:.4f} (floor ~{floor:.2f})"
        )


# ------------------------------------------------------------------------------------------------
# checkpoints


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip_resumes_bitwise(kind, recipe):
    batches = make_batches(STEPS, MICRO, seed=4)
    model, opt, _ = setup(kind, recipe)
    full = train(model, opt, batches)
    w_full = weights(model)
    del model, opt
    cache.cache_clear()

    model, opt, _ = setup(kind, recipe)
    first = train(model, opt, batches[:3])
    assert torch.equal(first, full[: 3 * MICRO])
    # The BF16-free step keeps the weights released: state_dict materializes them.
    assert cache.cache_stats()["released"] == cache.cache_stats()["pending"] > 0
    buf = _save({"model": model.state_dict(), "optim": opt.state_dict()})
    del model, opt
    cache.cache_clear()

    ckpt = torch.load(buf, weights_only=True)
    model, opt, _ = setup(kind, recipe, seed=123)  # a different init: loading must overwrite it
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    rest = train(model, opt, batches[3:])
    assert torch.equal(rest, full[3 * MICRO :]), f"resumed losses differ:\n{rest}\n{full}"
    assert_same_weights(weights(model), w_full, "resumed vs uninterrupted")


@pytest.mark.parametrize("kind", KINDS)
def test_saving_released_weights_raises_zrw_error(kind):
    """Mid-step, without a restore, the converted weights hold no data. With MasterWeights
    state_dict() materializes them exactly from the masters; with a plain optimizer (no
    master) state_dict() (before any save opens a file) and any read must raise zrw's error
    naming the weight, never write an empty or garbage checkpoint."""
    model, opt, summary = setup(kind, "mxfp8")
    ids = make_batches(1, 1)[0][0]
    model(input_ids=ids, labels=ids).loss.backward()
    sd = model.state_dict()
    for name, master in zip([n for n, _ in model.named_parameters()], opt.masters[0]):
        assert torch.equal(sd[name], master.to(BF16)), name
    cache.cache_clear()
    del opt, sd

    model = make_model(kind)
    summary = zrw.convert(model, "mxfp8")
    # held: the boundary owns the weights only while the optimizer lives
    opt = zrw.optim.attach(torch.optim.AdamW(model.parameters()), fill="dequant")  # noqa: F841
    model(input_ids=ids, labels=ids).loss.backward()
    assert cache.cache_stats()["released_bytes"] == summary.release_bytes
    with pytest.raises(
        RuntimeError, match=r"zrw: state_dict\(\) of '.+': weight\(s\) '.+' are released"
    ) as err:
        torch.save(model.state_dict(), io.BytesIO())
    named = str(err.value).split("'")[3]
    assert named in summary.released_weights, named
    assert named in dict(model.named_parameters()), "the error names the state_dict key"
    assert "restore_all('master')" in str(err.value)
    for name in summary.released_weights:
        with pytest.raises(RuntimeError, match=f"weight '{name}' is released"):
            model.get_parameter(name).sum()
    # nothing else is poisoned
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    torch.save(
        {n: p.detach() for n, p in state.items() if n not in summary.released_weights}, io.BytesIO()
    )


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_mid_step_save_with_master_fill(kind, recipe):
    """Mid-step (2 of 4 microbatches of step 2 done, weights released), restore_all("master")
    makes the state_dict exactly the BF16 of MasterWeights' FP32 masters — what the optimizer
    wrote — drops the FP8 entries, and the rest of training is bitwise unchanged."""
    batches = make_batches(3, MICRO, seed=5)
    model, opt, summary = setup(kind, recipe)
    full = train(model, opt, batches)
    del model, opt
    cache.cache_clear()

    model, opt, summary = setup(kind, recipe)
    names = [n for n, _ in model.named_parameters()]
    seen = {}

    def mid_step(step, mb):
        if (step, mb) != (1, 1):
            return
        assert cache.cache_stats()["released_bytes"] == summary.release_bytes
        n = cache.restore_all("master")
        assert n == len(summary.released_weights)
        st = cache.cache_stats()
        assert st["released"] == 0 and st["entries"] == 0, "restore_all drops the FP8 entries"
        sd = model.state_dict()
        for name, master in zip(names, opt.masters[0]):
            assert torch.equal(sd[name], master.to(BF16)), f"{name} is not bf16(master)"
        seen["sd"] = torch.load(_save(sd), weights_only=True)

    losses = train(model, opt, batches, mid_step)
    assert "sd" in seen and set(seen["sd"]) == set(names)
    # the rest of the step re-quantizes the same values: training is unchanged
    assert torch.equal(losses, full), f"mid-step restore changed training:\n{losses}\n{full}"


# ------------------------------------------------------------------------------------------------
# torch.compile


def _mlp(recipe):
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96, dtype=BF16), torch.nn.GELU(), torch.nn.Linear(96, 64, dtype=BF16)
    )
    zrw.convert(model, recipe)
    return model


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_mlp_matches_eager(recipe):
    g = torch.Generator().manual_seed(8)
    data = [
        (torch.randn(3, 16, 64, generator=g).to(BF16), torch.randn(3, 16, 64, generator=g))
        for _ in range(3)
    ]
    runs = []
    counters.clear()
    for compiled in (False, True):
        model = _mlp(recipe)
        opt = zrw.optim.attach(
            zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2)
        )
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        losses = []
        for x, t in data:  # 3 steps of 2 microbatches
            for _ in range(2):
                loss = F.mse_loss(fwd(x).float(), t)
                loss.backward()
                losses.append(loss.detach())
                assert cache.is_released(model[0].weight)
            opt.step()
            opt.zero_grad()
        runs.append((torch.stack(losses), weights(model)))
        cache.cache_clear()
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert torch.equal(runs[0][0], runs[1][0]), f"{runs[0][0]}\n{runs[1][0]}"
    assert_same_weights(runs[0][1], runs[1][1], "compiled vs eager")


def test_compiled_deep_model_compiles_each_layer_code_once():
    # 12 MXLinear layers: the layers' forward (and its resume functions after the cache lookup,
    # which dynamo skips) must compile for the first layer and be reused by the others, not
    # recompile per layer until torch.compile gives up and runs the rest eagerly. Allowed: one
    # recompile for the first layer's input not requiring grad.
    torch.manual_seed(3)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(32, 32, dtype=BF16), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    zrw.convert(model, "mxfp8")
    names = [m.zrw_name for m in model if isinstance(m, MXLinear)]
    assert names == [f"{i}.weight" for i in range(0, 24, 2)]
    opt = zrw.optim.attach(torch.optim.SGD(model.parameters(), lr=1e-2), fill="dequant")
    x = torch.randn(4, 32, dtype=BF16)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
            compiled = torch.compile(model, backend="eager")
            for _ in range(2):
                compiled(x).float().pow(2).mean().backward()
                # the names still reach the cache: entries carry them
                assert {e["name"] for e in cache.cache_entries()} >= set(names)
                opt.step()
                opt.zero_grad()
    finally:
        cache.cache_clear()
        torch._dynamo.reset()


@pytest.mark.slow  # -m slow: compile = eager bitwise is test_compiled_mlp_matches_eager's
def test_compiled_qwen3_matches_eager():
    batches = make_batches(2, 2, seed=9)
    runs = []
    counters.clear()
    for compiled in (False, True):
        model, opt, _ = setup("dense", "mxfp8", layers=1)
        fwd = torch.compile(model, backend="eager") if compiled else model
        runs.append(train(fwd, opt, batches))
        cache.cache_clear()
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert torch.equal(runs[0], runs[1]), f"{runs[0]}\n{runs[1]}"


# ------------------------------------------------------------------------------------------------
# convert's summary


@pytest.mark.parametrize("kind", KINDS)
def test_weight_names_survive_deepcopy_and_pickling(kind):
    # The layers keep their names on the Parameters (for torch.compile); copy.deepcopy makes new
    # Parameters without attributes, so the layers stamp them again.
    import copy

    model = make_model(kind)
    zrw.convert(model, "mxfp8")
    names = {n: cache.weight_name(p) for n, p in model.named_parameters() if cache.weight_name(p)}
    expected = {n for n, m in model.named_modules() if isinstance(m, MXLinear)}
    assert {n.rsplit(".", 1)[0] for n in names} >= expected
    if kind == "moe":
        assert any(n.endswith("gate_up_proj") for n in names)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        got = {
            n: cache.weight_name(p) for n, p in copied.named_parameters() if cache.weight_name(p)
        }
        assert got == names


@pytest.mark.parametrize("kind", KINDS)
def test_convert_summary_matches_released_bytes(kind):
    model = make_model(kind)
    params_before = {n: p for n, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    expected_modules = [
        n
        for n, m in model.named_modules()
        if (type(m) is torch.nn.Linear and n != "lm_head") or type(m).__name__ == "Qwen3MoeExperts"
    ]
    summary = zrw.convert(model, "mxfp8")

    assert summary.converted == expected_modules
    assert summary.parameters == len(converted_weight_names(summary))
    assert summary.parameters == (14 if kind == "dense" else 12)  # 2 layers x (4 attn + 3 | 2)
    assert set(summary.skipped) == {"lm_head"} and "lm_head" in summary.skipped["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    for name in summary.converted:
        assert isinstance(model.get_submodule(name), (MXLinear, MXFusedExperts))
    # same Parameter objects, same keys
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys_before
    expected_bytes = sum(params_before[n].numel() * 2 for n in converted_weight_names(summary))
    assert summary.release_bytes == expected_bytes
    assert sorted(summary.released_weights) == sorted(converted_weight_names(summary))

    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters()))
    ids = make_batches(1, 1)[0][0]
    for step in range(2):
        out = model(input_ids=ids, labels=ids)  # the first forward of a training step
        st = cache.cache_stats()
        assert st["released_bytes"] == summary.release_bytes, (step, st)
        assert st["released"] == summary.parameters
        released = sorted(e["name"] for e in cache.cache_entries() if e["status"] == "released")
        assert released == sorted(summary.released_weights)
        assert not cache.is_cached(model.lm_head.weight)
        assert not cache.is_cached(model.model.embed_tokens.weight)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        # The BF16-free step: still released, no FP8 bytes until the next first use.
        st = cache.cache_stats()
        assert st["released_bytes"] == summary.release_bytes and st["fp8_bytes"] == 0


def test_convert_tied_lm_head_is_never_released():
    model = make_model("dense", tie=True)
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb, "tie_word_embeddings: one Parameter, two modules"
    summary = zrw.convert(model, "mxfp8", skip=())
    assert "lm_head" in summary.converted and isinstance(model.lm_head, MXLinear)
    assert model.lm_head.weight is emb
    assert "tied" in summary.skipped["lm_head"]
    assert "model.embed_tokens.weight" in summary.skipped["lm_head"]
    assert "lm_head.weight" not in summary.released_weights
    assert summary.parameters == 15
    untied = [n for n in converted_weight_names(summary) if n != "lm_head.weight"]
    assert summary.release_bytes == sum(model.get_parameter(n).numel() * 2 for n in untied)

    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters()))
    ids = make_batches(1, 1)[0][0]
    for step in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        st = cache.cache_stats()
        assert st["released_bytes"] == summary.release_bytes
        assert cache.is_cached(emb) and not cache.is_released(emb), "the tied weight stays"
        assert emb.float().abs().sum() > 0  # readable: the embedding lookup needs it
        loss.backward()
        assert emb.grad is not None
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)
