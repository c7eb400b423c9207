"""The BF16-free optimizer step: MasterWeights(keep_released=True), the default.

A released weight stays released through the optimizer step; its FP8 copy goes before the inner
step, and its next first use quantizes straight from the FP32 master (one fused op that rounds
to BF16 first). What must hold: training is bit for bit the release-off run; no BF16 weight
storage is given bytes after the first step; everything between steps keeps working
(state_dict, torch.save, safetensors, save_pretrained, load_state_dict, eval under no_grad,
leaving the mode); and MasterWeights never holds the BF16 gradients and their FP32 copies in
full at once.
"""

import copy
import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import zrw
from helpers import child_env
from helpers.bitwise import same_bits
from helpers.models import (
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
from zrw import cache, memory, testing
from zrw.nn import MXLinear
from zrw.optim import MasterWeights, attach, detach

pytestmark = pytest.mark.usefixtures("clean_cache")


def converted(model):
    return [
        p
        for m in model.modules()
        for n in getattr(m, "zrw_quantized", ())
        if isinstance(p := getattr(m, n, None), torch.Tensor)
    ]


# ------------------------------------------------------------------------------------------------
# Bit for bit: an unused weight, gradient accumulation, torch.compile, both modes of the boundary


class Branchy(torch.nn.Module):
    """Three MXLinear layers; `extra` is used on even steps only, so on odd steps it gets no
    gradient (and, released since an earlier step, is never quantized that step)."""

    def __init__(self, recipe):
        super().__init__()
        torch.manual_seed(11)
        self.a = torch.nn.Linear(64, 96, dtype=BF16)
        self.extra = torch.nn.Linear(96, 96, dtype=BF16)
        self.b = torch.nn.Linear(96, 64, dtype=BF16)
        zrw.convert(self, recipe)
        self.use_extra = True

    def forward(self, x):
        h = F.gelu(self.a(x))
        if self.use_extra:
            h = h + self.extra(h)
        return self.b(h)


def _branchy_run(recipe, release, keep_released, compiled):
    model = Branchy(recipe)
    if not release:
        for m in model.modules():
            if isinstance(m, MXLinear):
                m.release = False
    opt = attach(
        MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2, keep_released=keep_released)
    )
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(8)
    losses, restored = [], []
    for step in range(5):
        model.use_extra = step % 2 == 0
        for _ in range(2):  # gradient accumulation over 2 micro-batches
            x = torch.randn(3, 16, 64, generator=g).to(BF16)
            t = torch.randn(3, 16, 64, generator=g)
            loss = F.mse_loss(fwd(x).float(), t)
            (loss / 2).backward()
            losses.append(loss.detach())
        if not model.use_extra:
            assert model.extra.weight.grad is None  # no gradient this step
        opt.step()
        opt.zero_grad()
        restored.append(cache.cache_stats()["restored"])
    out = torch.stack(losses), weights(model), restored, cache.cache_states(converted(model))
    del model, opt
    cache.cache_clear()
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_unused_weight_accumulation_and_compile_are_bitwise_release_off(recipe, compiled):
    counters.clear()
    off = _branchy_run(recipe, release=False, keep_released=True, compiled=compiled)
    free = _branchy_run(recipe, release=True, keep_released=True, compiled=compiled)
    seed = _branchy_run(recipe, release=True, keep_released=False, compiled=compiled)
    if compiled:
        assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    for what, run in (("BF16-free step", free), ("restore at step", seed)):
        assert torch.equal(run[0], off[0]), f"{what}: losses differ\n{run[0]}\n{off[0]}"
        assert_same_weights(run[1], off[1], what)
    # The BF16-free step never gives a released weight bytes again; all three stay released,
    # pending their next use's quantization from the master.
    assert free[2] == [0] * 5, free[2]
    assert free[3] == ["pending"] * 3, free[3]
    assert seed[2][-1] > 0 and seed[3] == ["none"] * 3  # the seed's design restores at each step


def test_no_bf16_weight_storage_between_the_first_step_and_the_last():
    """Counted two ways: the cache's own count of released storages given bytes again (every
    restore path goes through it), and the counting allocator, which sees no block of a
    converted weight's exact BF16 size after the first step (the model's other tensors have
    different sizes here)."""
    memory.install()
    model, opt, summary = setup("dense", "mxfp8")
    sizes = {p.numel() * 2 for p in converted(model)}
    batches = make_batches(5, 2)
    train(model, opt, batches[:1])
    st = cache.cache_stats()
    assert st["released"] == st["pending"] == len(summary.released_weights) > 0
    before = cache.cache_stats()["restored"]
    seen = []
    for step in batches[1:]:
        start = memory.current()
        train(model, opt, [step])
        seen.append(cache.cache_stats()["restored"] - before)
        assert memory.current() - start < min(sizes), "memory grew by a weight's BF16 bytes"
    assert seen == [0, 0, 0, 0]
    assert all(s == "pending" for s in cache.cache_states(converted(model)))
    assert summary.release_bytes == sum(sizes_of(converted(model)))


def sizes_of(ws):
    return [w.numel() * w.element_size() for w in ws]


# ------------------------------------------------------------------------------------------------
# Between steps: state_dict, torch.save, safetensors, save_pretrained, load_state_dict, eval


def _two_runs(kind, recipe, steps=2):
    """The same 2 steps with release off and with the BF16-free step."""
    batches = make_batches(steps, 2, seed=3)
    out = []
    for release in (False, True):
        model, opt, summary = setup(kind, recipe, release=release)
        train(model, opt, batches)
        out.append((model, opt, summary))
    return out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_and_savers_give_exact_bf16_without_restoring(kind, recipe, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    (off, _, _), (free, opt, summary) = _two_runs(kind, recipe)
    ref = off.state_dict()
    restored = cache.cache_stats()["restored"]
    sd = free.state_dict()
    assert sd.keys() == ref.keys()
    bad = [k for k in ref if not torch.equal(sd[k], ref[k]) or sd[k].dtype != ref[k].dtype]
    assert not bad, bad
    # The weights stay released: nothing restored, nothing re-quantized.
    assert cache.cache_stats()["restored"] == restored
    assert all(cache.is_released(free.get_parameter(n)) for n in summary.released_weights)
    # torch.save (loaded with weights_only), safetensors, transformers' save_pretrained.
    buf = io.BytesIO()
    torch.save(free.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    safetensors.save_file(free.state_dict(), str(tmp_path / "w.safetensors"))
    loaded = safetensors.load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    free.save_pretrained(str(tmp_path / "hf"))
    again = type(free).from_pretrained(str(tmp_path / "hf"), dtype=BF16)
    assert_same_weights(weights(again), weights(off), "save_pretrained round trip")
    assert cache.cache_stats()["restored"] == restored


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_save_holds_one_weight_at_a_time(kind, tmp_path):
    """zrw.checkpoint.save_safetensors writes model.state_dict() tensor by tensor: the file is
    exactly the release-off model's state dict (safetensors and from_pretrained load it), the
    weights stay released, and the save never holds more than one materialized weight (the
    dict of model.state_dict() holds them all)."""
    safetensors = pytest.importorskip("safetensors.torch")
    memory.install()
    (off, _, _), (free, _, summary) = _two_runs(kind, "mxfp8")
    ref = off.state_dict()
    restored = cache.cache_stats()["restored"]
    path = str(tmp_path / "model.safetensors")
    with memory.window() as w:
        zrw.checkpoint.save_safetensors(free, path, metadata={"format": "pt"})
    sizes = sizes_of([free.get_parameter(n) for n in summary.released_weights])
    assert w["peak"] - w["start"] <= max(sizes) + 4096, (w["peak"] - w["start"], max(sizes))
    assert memory.current() - w["start"] <= 4096
    assert sum(sizes) > 2 * max(sizes)  # holding them all would exceed the bound
    loaded = safetensors.load_file(path)
    assert loaded.keys() == ref.keys()
    bad = [k for k in ref if not torch.equal(loaded[k], ref[k]) or loaded[k].dtype != ref[k].dtype]
    assert not bad, bad
    assert cache.cache_stats()["restored"] == restored
    assert all(cache.is_released(free.get_parameter(n)) for n in summary.released_weights)
    # iter_state_dict: the same entries, in state_dict() order
    names = [n for n, _ in zrw.checkpoint.iter_state_dict(free)]
    assert names == list(ref)
    # transformers loads the file as a checkpoint of the model
    free.config.save_pretrained(str(tmp_path))
    again = type(free).from_pretrained(str(tmp_path), dtype=BF16)
    assert_same_weights(weights(again), weights(off), "from_pretrained of the streamed file")


def test_streaming_save_refuses_before_it_touches_the_file(tmp_path):
    """A released weight without a master (mid-step, plain optimizer): a named error before the
    file is opened, so an existing checkpoint survives."""
    lin = MXLinear.from_linear(torch.nn.Linear(64, 64, dtype=BF16), "mxfp8", name="layer")
    opt = zrw.optim.attach(torch.optim.SGD(lin.parameters(), lr=0.1), fill="dequant")  # noqa: F841
    x = torch.randn(4, 64).to(BF16)
    lin(x).float().sum().backward()
    assert cache.is_released(lin.weight)
    path = tmp_path / "old.safetensors"
    path.write_bytes(b"the old checkpoint")
    with pytest.raises(
        RuntimeError,
        match=r"weight 'layer' \(weight\) is released and has no "
        r"FP32 master",
    ):
        zrw.checkpoint.save_safetensors(lin, str(path))
    assert path.read_bytes() == b"the old checkpoint"
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        zrw.checkpoint.save_safetensors({}, str(path))
    cache.restore(lin.weight, "dequant")
    with pytest.raises(TypeError, match=r"metadata must be a dict of str to str, got \{1: 2\}"):
        zrw.checkpoint.save_safetensors(lin, str(path), metadata={1: 2})

    class Odd(torch.nn.Module):
        def __init__(self, extra):
            super().__init__()
            self.extra = extra
            self.register_buffer("z", torch.zeros(2, dtype=torch.complex64))

        def get_extra_state(self):
            return self.extra

    with pytest.raises(
        TypeError,
        match=r"'z' has dtype torch.complex64, which safetensors "
        r"cannot hold \(supported: .*torch.bfloat16",
    ):
        zrw.checkpoint.save_safetensors(Odd(torch.ones(1)), str(path))
    with pytest.raises(
        TypeError,
        match=r"state-dict entry '_extra_state' must be a tensor, "
        r"got dict",
    ):
        zrw.checkpoint.save_safetensors(Odd({"step": 3}), str(path))
    assert path.read_bytes() == b"the old checkpoint"
    assert list(tmp_path.iterdir()) == [path]


def test_state_dict_materializes_each_weight_once_without_temporaries():
    """state_dict allocates the BF16 tensors it returns and nothing more: no FP32 temporaries,
    no restore of the whole model."""
    memory.install()
    model, opt, summary = setup("dense", "mxfp8")
    train(model, opt, make_batches(1, 1))
    released = sum(sizes_of(converted(model)))
    with memory.window() as w:
        sd = model.state_dict()
    held = memory.current() - w["start"]
    assert held == released  # only the materialized BF16 weights (the rest are views)
    assert w["peak"] - w["start"] == held
    del sd


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_updates_masters_and_drops_fp8(kind, recipe):
    """Loading another model's weights mid-training: the masters take them (the weights stay
    released, their FP8 copies go) and training continues bit for bit as with release off."""
    batches = make_batches(4, 2, seed=6)
    other = make_model(kind, seed=77).state_dict()
    runs = []
    for release in (False, True):
        model, opt, summary = setup(kind, recipe, release=release)
        train(model, opt, batches[:2])
        restored = cache.cache_stats()["restored"]
        model.load_state_dict(other)
        if release:
            assert cache.cache_stats()["restored"] == restored
            for n in summary.released_weights:
                p = model.get_parameter(n)
                assert cache.is_released(p) and torch.equal(cache.master_of(p), other[n].float())
            assert cache.cache_stats()["fp8_bytes"] == 0
        sd = model.state_dict()
        assert all(torch.equal(sd[k], other[k]) for k in other)
        runs.append((train(model, opt, batches[2:]), weights(model)))
        del model, opt
        cache.cache_clear()
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_weights(runs[0][1], runs[1][1], "after load_state_dict")


@pytest.mark.parametrize("recipe", RECIPES)
def test_load_state_dict_into_a_frozen_weight_released_for_good(recipe):
    """A frozen weight released for good (release_frozen: FP8 only, no master) takes loaded
    values: restored with them, released again at its next use, and the layer then computes
    exactly what a fresh layer holding those values computes. Its trainable neighbour (with
    MasterWeights) still loads into its master."""
    torch.manual_seed(5)

    def net():
        m = torch.nn.Sequential(
            torch.nn.Linear(64, 64, bias=False, dtype=BF16),
            torch.nn.Linear(64, 32, bias=False, dtype=BF16),
        )
        zrw.convert(m, recipe, release_frozen=True)
        m[0].weight.requires_grad_(False)
        return m

    model, fresh = net(), net()
    opt = MasterWeights(torch.optim.SGD, [model[1].weight], lr=0.1)
    x = torch.randn(8, 64, dtype=BF16)
    model(x).float().square().mean().backward()
    opt.step()
    assert cache.cache_state(model[0].weight) == "released_for_good"  # released for good
    assert cache.cache_state(model[1].weight) == "pending"  # released, pending from its master
    new = {"0.weight": torch.randn(64, 64, dtype=BF16), "1.weight": torch.randn(32, 64, dtype=BF16)}
    model.load_state_dict(new)
    assert cache.cache_state(model[0].weight) == "none"
    assert torch.equal(model[0].weight, new["0.weight"])
    assert torch.equal(cache.master_of(model[1].weight), new["1.weight"].float())
    fresh.load_state_dict(new)
    out, want = model(x), fresh(x)  # a training-mode use (under no_grad nothing is released)
    assert torch.equal(out, want)
    # released again by its next use
    assert cache.cache_state(model[0].weight) == "released_for_good"
    del opt
    cache.cache_clear()


@pytest.mark.parametrize("kind", KINDS)
def test_eval_under_no_grad_uses_fp8_copies(kind):
    (off, _, _), (free, _, summary) = _two_runs(kind, "mxfp8")
    ids = make_batches(1, 1, seed=9)[0][0]
    restored = cache.cache_stats()["restored"]
    with torch.no_grad():
        a = off(input_ids=ids).logits
        b = free(input_ids=ids).logits
        b2 = free(input_ids=ids).logits
    assert torch.equal(a, b) and torch.equal(b, b2)
    assert cache.cache_stats()["restored"] == restored
    assert all(cache.is_released(free.get_parameter(n)) for n in summary.released_weights)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save(model)"])
@pytest.mark.parametrize("kind", KINDS)
def test_copies_of_the_model_between_steps_hold_exact_bf16_weights(kind, how):
    """copy.deepcopy(model) (an EMA or best-model copy) and torch.save(model) / torch.load of
    the whole module between steps: the copy's weights are the exact BF16 values (bf16 of the
    masters), ordinary readable tensors; the model itself stays released."""
    (off, _, _), (free, _, summary) = _two_runs(kind, "mxfp8")
    ref = off.state_dict()
    restored = cache.cache_stats()["restored"]
    if how == "deepcopy":
        twin = copy.deepcopy(free)
    else:
        buf = io.BytesIO()
        torch.save(free, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert cache.cache_stats()["restored"] == restored
    assert all(cache.is_released(free.get_parameter(n)) for n in summary.released_weights)
    for n in summary.released_weights:
        p = twin.get_parameter(n)
        assert cache.cache_state(p) == "none" and p.requires_grad
        assert torch.equal(p.detach(), ref[n]), n  # readable, and exactly the BF16 weight
    assert_same_weights(weights(twin), weights(off), how)
    ids = make_batches(1, 1, seed=9)[0][0]
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, free(input_ids=ids).logits)
    # The copy is a zrw model of its own: its layers keep their names and train.
    name = summary.released_weights[0]
    assert cache.weight_name(twin.get_parameter(name)) == name
    opt = zrw.optim.attach(MasterWeights(torch.optim.AdamW, twin.parameters(), lr=1e-3))
    train(twin, opt, make_batches(1, 1, seed=10))
    assert cache.is_released(twin.get_parameter(name))


@pytest.mark.parametrize("leave", ["restore_all", "detach"])
def test_leaving_the_mode_brings_bf16_weights_back_exactly(leave):
    (off, _, _), (free, opt, summary) = _two_runs("moe", "mxfp8-32x32")
    name = summary.released_weights[0]
    with pytest.raises(RuntimeError, match=rf"weight '{name}' is released.*state_dict\(\)"):
        free.get_parameter(name).float()
    if leave == "restore_all":
        assert cache.restore_all("master") == len(summary.released_weights)
    else:
        detach(opt)
    assert cache.cache_stats()["released"] == 0
    assert_same_weights(
        {n: p.detach() for n, p in free.named_parameters()},
        {n: p.detach() for n, p in off.named_parameters()},
        leave,
    )


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    """A checkpoint taken mid-run (torch.save of model.state_dict() and the optimizer's) is
    loaded by a fresh process, which resumes bit for bit."""
    script = textwrap.dedent("""
        import sys, torch
        torch.set_num_threads(1)
        from helpers.models import setup, train, make_batches, weights
        from zrw import cache
        modes, path = sys.argv[1].split(","), sys.argv[2]
        batches = make_batches(5, 2, seed=12)
        for mode in modes:
            cache.cache_clear()
            if mode == "full":
                model, opt, _ = setup("moe", "mxfp8")
                losses = train(model, opt, batches)
            elif mode == "first":
                model, opt, _ = setup("moe", "mxfp8")
                losses = train(model, opt, batches[:3])
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                           path + ".ckpt")
            else:
                model, opt, _ = setup("moe", "mxfp8", seed=123)  # another init: the load
                ckpt = torch.load(path + ".ckpt", weights_only=True)  # overwrites it
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optim"])
                losses = train(model, opt, batches[3:])
            torch.save({"losses": losses, "weights": weights(model)}, path + "." + mode)
            del model, opt
    """)
    path = str(tmp_path / "run")
    # The uninterrupted run and the run up to the checkpoint in one process (one start instead
    # of two), the resume in another: fresh, it has nothing but the checkpoint.
    for modes in (("full", "first"), ("resume",)):
        r = subprocess.run(
            [sys.executable, "-c", script, ",".join(modes), path],
            capture_output=True,
            text=True,
            timeout=300,
            env=child_env(),
        )
        assert r.returncode == 0, r.stderr[-3000:]
    full = torch.load(path + ".full", weights_only=True)
    first = torch.load(path + ".first", weights_only=True)
    resumed = torch.load(path + ".resume", weights_only=True)
    assert torch.equal(torch.cat([first["losses"], resumed["losses"]]), full["losses"])
    assert_same_weights(resumed["weights"], full["weights"], "resumed in a fresh process")


# ------------------------------------------------------------------------------------------------
# An optimizer that keeps its own masters; MasterWeights' gradient memory; errors


class OwnMastersSGD(torch.optim.Optimizer):
    """A mixed-precision SGD with FP32 masters of its own, written back through zrw's hook."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.masters = {}
        for g in self.param_groups:
            for p in g["params"]:
                self.masters[p] = p.detach().float().clone()
                cache.register_master(p, self.masters[p])

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            for p in ps:
                self.masters[p].add_(p.grad.float(), alpha=-g["lr"])
            cache.assign_weights(ps, [self.masters[p] for p in ps], keep_released=True)


def test_optimizer_with_its_own_masters_uses_the_hook():
    runs = []
    for release in (False, True):
        model = Branchy("mxfp8")
        model.use_extra = True
        if not release:
            for m in model.modules():
                if isinstance(m, MXLinear):
                    m.release = False
        opt = attach(OwnMastersSGD(model.parameters(), lr=0.05), own_masters=True)
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(4):
            loss = F.mse_loss(
                model(torch.randn(8, 64, generator=g).to(BF16)).float(), torch.zeros(8, 64)
            )
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        if release:
            assert cache.cache_stats()["restored"] == 0
            assert cache.is_released(model.a.weight)
        runs.append((torch.stack(losses), weights(model)))
        cache.cache_clear()
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_weights(runs[0][1], runs[1][1], "own masters")
    with pytest.raises(ValueError, match="own_masters=True .* fill must be None"):
        attach(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1), "dequant", own_masters=True
        )


def test_master_weights_never_holds_bf16_and_fp32_gradients_in_full():
    """The FP32 master gradients are made one tensor at a time, each BF16 gradient freed once
    converted: the step's gradient memory stays at 4 bytes per weight (plus one BF16 gradient),
    never 6. Inner SGD without momentum has no state and no temporaries."""
    memory.install()
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(256, 256).to(BF16)) for _ in range(8)]
    opt = MasterWeights(torch.optim.SGD, ws, lr=0.1, foreach=False)
    for w in ws:
        w.grad = torch.randn(256, 256).to(BF16)
    n = sum(w.numel() for w in ws)
    with memory.window() as win:
        opt.step()
    assert all(w.grad is None for w in ws), "the BF16 gradients are consumed by the step"
    grown = win["peak"] - win["start"]
    assert grown <= 2 * n + 2 * 256 * 256 + 4096, (grown, n)  # +4N FP32 - 2N BF16 freed


def test_bad_arguments_are_named():
    w = torch.nn.Parameter(torch.randn(64, 64).to(BF16))
    with pytest.raises(TypeError, match="keep_released must be a bool, got str"):
        MasterWeights(torch.optim.SGD, [w], lr=1, keep_released="yes")
    cache.quant_and_release(w)
    with pytest.raises(
        RuntimeError,
        match=r"source 0 of released weight .* must be its float32 "
        r"master .* got BFloat16",
    ):
        cache.assign_weights([w], [torch.zeros(64, 64, dtype=BF16)], keep_released=True)
    assert cache.is_released(w) and cache.cache_stats()["fp8_bytes"] > 0  # nothing changed
    with pytest.raises(TypeError, match="keep_released must be a bool"):
        cache.assign_weights([w], [torch.zeros(64, 64)], keep_released=1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_failed_quantization_from_the_master_loses_nothing(recipe):
    """Out of memory while a released weight is quantized from its master (its first use after
    the step): the error propagates, the weight stays released with its master, and both a
    retry and a restore give the exact values."""
    memory.install()
    w = torch.nn.Parameter(torch.randn(256, 256).to(BF16))
    cache.set_weight_name(w, "w")
    opt = attach(MasterWeights(torch.optim.SGD, [w], lr=0.1))
    cache.quant_and_release(w, recipe)
    w.grad = torch.ones(256, 256, dtype=BF16)
    opt.step()
    master = opt.masters[0][0]
    assert cache.cache_stats()["pending"] == 1
    with testing.fail_allocations(min_bytes=256 * 256, count=1):
        with pytest.raises(torch.OutOfMemoryError):
            cache.quant_and_release(w, recipe)
    assert cache.is_released(w) and cache.master_of(w) is master
    assert cache.cache_stats()["pending"] == 1 and cache.cache_stats()["restored"] == 0
    q = cache.quant_and_release(w, recipe)  # the retry quantizes the master's values
    bf16 = master.to(BF16)
    ref = zrw.ops.mx_quantize_dual(bf16) if recipe == "mxfp8" else zrw.ops.mx_quantize_block(bf16)
    assert same_bits(q.fwd.data, ref[0])
    # Out of memory in the restore that leaves the mode: nothing changes, the retry is exact.
    with testing.fail_allocations(min_bytes=256 * 256, count=1):
        with pytest.raises(RuntimeError, match="'w': .*injected allocation failure"):
            cache.restore_all("master")
    assert cache.is_released(w)
    cache.restore_all("master")
    assert torch.equal(w.detach(), master.to(BF16))
