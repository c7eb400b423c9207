"""Low-bit optimizer states on FP32 masters: torchao's AdamW8bit, AdamWFp8 and
AdamW4bit, and torch's AdamW with foreach=False / foreach=True / fused=True, as the inner
optimizer of zrw.optim.MasterWeights, and zrw.optim.AdamW(state_dtype=...) that maps onto them.

Each inner optimizer trains a small converted model (three zrw linears, a LayerNorm and a bias
that stay BF16) with two micro-batches per step and an LR scheduler: release on gives the bits
of release off (losses, weights, masters, every optimizer state tensor, a quantized state's
codes and scales included), in both recipes; a resume from a saved model, optimizer and
scheduler continues bit for bit as the uninterrupted run; and the masters step exactly as the
same optimizer stepping plain FP32 copies of the parameters with the same gradients. What does
not compose is refused at construction, by name (docs/training.md, "Low-bit optimizer states").
"""

import io

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

import zrw
from helpers.bitwise import assert_bitwise_dicts, same_bits
from helpers.mx_layer import BF16, value
from zrw import cache
from zrw.optim import MasterWeights, attach, has_boundary

pytestmark = pytest.mark.usefixtures("clean_cache")

ao = pytest.importorskip("torchao.optim")

# name: (class, keyword arguments). torchao's step is torch.compile'd (inductor on CPU).
INNERS = {
    "adamw": (torch.optim.AdamW, {"foreach": False}),
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adamw8bit": (ao.AdamW8bit, {}),
    "adamwfp8": (ao.AdamWFp8, {}),
    "adamw4bit": (ao.AdamW4bit, {}),
}
LOW_BIT = {"adamw8bit", "adamwfp8", "adamw4bit"}
QUANTIZED_STATE = {
    "adamw8bit": "OptimState8bit",
    "adamwfp8": "OptimStateFp8",
    "adamw4bit": "OptimState4bit",
}
RECIPES = list(cache.RECIPES)
STEPS, MICRO, LR = 4, 2, 1e-2


@pytest.fixture(autouse=True)
def _eager_backend_unless_slow(request):
    """torchao's low-bit step is torch.compile'd with inductor, whose C++ compile of each shape
    took about 7 minutes for this file on a cold 2-core machine. The default run traces the same
    step with dynamo and runs it with dynamo's eager backend (what is compared, release on
    against off, zrw against plain FP32 copies, runs the same code either way); the `-m slow`
    tests (a Qwen3 and the Trainer with FP8 moments) run inductor, as a user's run does."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    with torch._dynamo.config.patch(debug_backend_override=">=0:eager"):
        yield


class Net(torch.nn.Module):
    """up and mid are 64 x 64 (4096 elements: torchao quantizes their moments), down is
    32 x 64 (2048: torchao keeps its moments in FP32, as the LayerNorm's and the bias')."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 64, bias=False)
        self.mid = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        h = torch.nn.functional.gelu(self.mid(h))
        return self.down(self.norm(h))


def build(inner, recipe, release, seed=0):
    torch.manual_seed(seed)
    model = Net().to(BF16)
    summary = zrw.convert(model, recipe, release=release)
    assert summary.converted == ["up", "mid", "down"]
    cls, kw = INNERS[inner]
    opt = attach(MasterWeights(cls, model.parameters(), lr=LR, weight_decay=0.1, **kw))
    sched = LambdaLR(opt, lambda s: 0.7**s)
    return model, opt, sched


def data(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(16, 64, generator=g).to(BF16), torch.randn(16, 32, generator=g))
            for _ in range(MICRO)
        ]
        for _ in range(steps)
    ]


def train(model, opt, sched, batches):
    """Steps of MICRO micro-batches (gradient accumulation), the optimizer, the scheduler."""
    losses = []
    for step in batches:
        for x, target in step:
            loss = (model(x).float() - target).pow(2).mean()
            (loss / len(step)).backward()
            losses.append(loss.detach().clone())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def state_tensors(opt):
    """Every tensor of the inner optimizer's state by (parameter index, key), a quantized
    state (a torchao tensor subclass) by its inner tensors: codes, scales (and its table)."""
    out = {}
    masters = [m for ms in opt.masters for m in ms]
    for i, m in enumerate(masters):
        for k, v in opt.inner.state[m].items():
            if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
                for name in v.__tensor_flatten__()[0]:
                    out[f"{i}.{k}.{name}"] = getattr(v, name)
            else:
                out[f"{i}.{k}"] = v
    return out


def snapshot(model, opt):
    """Weights (through state_dict: a released weight is materialized from its master), the
    masters and the optimizer's state, as copies."""
    sd = model.state_dict()
    return {
        "weights": {n: sd[n].detach().clone() for n, _ in model.named_parameters()},
        "masters": {str(i): m.detach().clone() for i, m in enumerate(sum(opt.masters, []))},
        "state": {k: v.detach().clone() for k, v in state_tensors(opt).items()},
    }


def state_kinds(opt):
    """The type of each parameter's exp_avg, by the parameter's name in Net."""
    names = ["up.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias", "down.weight"]
    return {n: type(opt.inner.state[m]["exp_avg"]).__name__ for n, m in zip(names, opt.masters[0])}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("inner", list(INNERS))
def test_release_on_equals_release_off(inner, recipe):
    batches = data(STEPS)
    runs = {}
    for release in (True, False):
        model, opt, sched = build(inner, recipe, release)
        first = snapshot(model, opt)["weights"]
        losses = train(model, opt, sched, batches)
        # the BF16-free step: the converted weights stay released between steps
        assert cache.is_released(model.up.weight) is release
        runs[release] = dict(losses=torch.stack(losses), lr=opt.param_groups[0]["lr"])
        runs[release].update(snapshot(model, opt))
        kinds = state_kinds(opt)
        del model, opt, sched
    on, off = runs[True], runs[False]
    assert torch.equal(on["losses"], off["losses"])
    for part in ("weights", "masters", "state"):
        assert_bitwise_dicts(on[part], off[part], f"{inner} {recipe} {part}")
    # the run trained, and the schedule reached the inner optimizer
    assert not torch.equal(first["up.weight"], on["weights"]["up.weight"])
    assert float(on["lr"]) == pytest.approx(LR * 0.7**STEPS)
    if inner in LOW_BIT:
        # torchao quantizes the moments of tensors of >= 4096 elements only
        quantized = QUANTIZED_STATE[inner]
        assert kinds == {
            "up.weight": quantized,
            "mid.weight": quantized,
            "mid.bias": "Tensor",
            "norm.weight": "Tensor",
            "norm.bias": "Tensor",
            "down.weight": "Tensor",
        }
    else:
        assert set(kinds.values()) == {"Tensor"}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("inner", list(INNERS))
def test_resume_equals_the_uninterrupted_run(inner, recipe):
    """Train 2 steps, save model, optimizer and scheduler (torch.save), build everything afresh
    from another seed, load, train 2 more: the bits of 4 uninterrupted steps."""
    batches = data(STEPS)
    model, opt, sched = build(inner, recipe, True)
    full = torch.stack(train(model, opt, sched, batches))
    ref = snapshot(model, opt)
    del model, opt, sched

    model, opt, sched = build(inner, recipe, True)
    head = train(model, opt, sched, batches[:2])
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf
    )
    del model, opt, sched
    buf.seek(0)
    saved = torch.load(buf)  # weights_only: torchao registers its state classes as safe
    model, opt, sched = build(inner, recipe, True, seed=7)  # other initial values
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    tail = train(model, opt, sched, batches[2:])
    assert torch.equal(torch.stack(head + tail), full)
    got = snapshot(model, opt)
    for part in ("weights", "masters", "state"):
        assert_bitwise_dicts(got[part], ref[part], f"{inner} {recipe} resumed {part}")


SHAPES = [(64, 64), (32, 64), (64,)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g).to(BF16) for s in SHAPES]


@pytest.mark.parametrize("inner", list(INNERS))
def test_masters_step_as_the_optimizer_on_fp32_copies(inner):
    """The independent reference: the same optimizer class stepping plain FP32 copies of the
    parameters with the same gradients and schedule, no zrw. Released weights every step; a
    learning rate set by hand as a number reaches torchao's tensor-valued lr."""
    cls, kw = INNERS[inner]
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(BF16)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ps]
    opt = attach(MasterWeights(cls, ps, lr=LR, weight_decay=0.1, **kw))
    ref_opt = cls(ref, lr=LR, weight_decay=0.1, **kw)
    sched, ref_sched = LambdaLR(opt, lambda s: 0.7**s), LambdaLR(ref_opt, lambda s: 0.7**s)
    for step in range(5):
        for p in ps[:2]:
            cache.quant_and_release(p)  # as a zrw layer's first use does
        if step == 3:  # by hand, as a number (torchao keeps lr as a tensor)
            opt.param_groups[0]["lr"] = 0.02
            if isinstance(ref_opt.param_groups[0]["lr"], torch.Tensor):
                ref_opt.param_groups[0]["lr"].fill_(0.02)
            else:
                ref_opt.param_groups[0]["lr"] = 0.02
        for p, r, gr in zip(ps, ref, _grads(step)):
            p.grad, r.grad = gr, gr.float()
        opt.step()
        ref_opt.step()
        if step == 3:  # the step ran with it (the scheduler sets its own at its next step)
            assert float(opt.inner.param_groups[0]["lr"]) == pytest.approx(0.02)
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for i, (p, m, r) in enumerate(zip(ps, opt.masters[0], ref)):
            assert torch.equal(m, r.detach()), f"{inner} step {step} param {i}"
            assert same_bits(value(p), r.detach().to(BF16))
        mine = state_tensors(opt)
        theirs = {}
        for i, r in enumerate(ref):
            for k, v in ref_opt.state[r].items():
                if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
                    for name in v.__tensor_flatten__()[0]:
                        theirs[f"{i}.{k}.{name}"] = getattr(v, name)
                else:
                    theirs[f"{i}.{k}"] = v
        assert_bitwise_dicts(mine, theirs, f"{inner} step {step} state")


@pytest.mark.parametrize("inner", sorted(LOW_BIT))
def test_add_param_group_and_clipping_with_a_low_bit_inner(inner):
    """A group added later is stepped with its own lr (torchao makes it a tensor, the outer group
    shows the same one) and max_grad_norm clips the FP32 gradients as
    torch.nn.utils.clip_grad_norm_ clips those of the plain optimizer's FP32 copies."""
    cls, kw = INNERS[inner]
    g = torch.Generator().manual_seed(0)
    p, q = (torch.nn.Parameter(torch.randn(64, 64, generator=g).to(BF16)) for _ in range(2))
    rp, rq = (torch.nn.Parameter(t.detach().float()) for t in (p, q))
    opt = attach(MasterWeights(cls, [p], lr=LR, max_grad_norm=1.0, **kw))
    ref = cls([rp], lr=LR, **kw)
    opt.add_param_group({"params": [q], "lr": 5e-3, "weight_decay": 0.0})
    ref.add_param_group({"params": [rq], "lr": 5e-3, "weight_decay": 0.0})
    assert opt.param_groups[1]["lr"] is opt.inner.param_groups[1]["lr"]
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(5e-3)
    for _ in range(3):
        gp, gq = (torch.randn(64, 64, generator=g).to(BF16) for _ in range(2))
        p.grad, q.grad, rp.grad, rq.grad = gp, gq, gp.float(), gq.float()
        opt.step()
        torch.nn.utils.clip_grad_norm_([rp, rq], 1.0)
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert opt.last_grad_norm > 1.0  # it did clip
    assert torch.equal(opt.masters[0][0], rp.detach())
    assert torch.equal(opt.masters[1][0], rq.detach())


@pytest.mark.parametrize(
    "state_dtype, expected",
    [
        (None, torch.optim.AdamW),
        ("fp32", torch.optim.AdamW),
        ("int8", ao.AdamW8bit),
        ("fp8", ao.AdamWFp8),
        ("int4", ao.AdamW4bit),
    ],
)
def test_adamw_state_dtype_is_master_weights_over_that_class(state_dtype, expected):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(BF16)) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = zrw.optim.AdamW(ps, lr=LR, state_dtype=state_dtype)
    assert type(opt.inner) is expected and has_boundary(opt)
    assert zrw.optim.STATE_DTYPES[state_dtype].endswith(expected.__name__)
    ref = attach(MasterWeights(expected, qs, lr=LR))
    for step in range(2):
        for p, q, gr in zip(ps, qs, _grads(step)):
            p.grad, q.grad = gr, gr.clone()
        opt.step()
        ref.step()
    for m, r in zip(opt.masters[0], ref.masters[0]):
        assert torch.equal(m, r)
    assert_bitwise_dicts(state_tensors(opt), state_tensors(ref), f"state_dtype={state_dtype}")


def test_adamw_state_dtype_arguments_are_checked_by_name():
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=BF16))
    with pytest.raises(ValueError, match=r"one of .* got 'bf16'.*torchao has no"):
        zrw.optim.AdamW([p], state_dtype="bf16")
    with pytest.raises(ValueError, match=r"state_dtype must be one of .* got 'int2'"):
        zrw.optim.AdamW([p], state_dtype="int2")
    with pytest.raises(TypeError, match="state_dtype must be None or a str.* got int"):
        zrw.optim.AdamW([p], state_dtype=8)
    with pytest.raises(TypeError, match=r"foreach= is not an argument of torchao.optim.AdamW8bit"):
        zrw.optim.AdamW([p], state_dtype="int8", foreach=True)
    with pytest.raises(TypeError, match=r"block_size= is not an argument of torch.optim.AdamW"):
        zrw.optim.AdamW([p], block_size=128)
    # nothing was registered for the refused ones
    assert cache.master_of(p) is None
    # the keyword arguments of the class are passed on
    assert zrw.optim.AdamW([p], state_dtype="fp8", block_size=128).inner.block_size == 128
    assert zrw.optim.AdamW([p], fused=True).inner.param_groups[0]["fused"] is True


@pytest.mark.parametrize("cls", [ao.AdamW8bit, ao.AdamWFp8, ao.AdamW4bit])
def test_bf16_stochastic_round_is_refused(cls):
    """torchao applies it to BF16 parameters only; the inner optimizer steps FP32 masters, so
    the flag would do nothing: refused at construction, naming it."""
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=BF16))
    with pytest.raises(ValueError, match=rf"{cls.__qualname__}\(bf16_stochastic_round=True\)"):
        MasterWeights(cls, [p], bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="bf16_stochastic_round=True"):
        zrw.optim.AdamW([p], state_dtype="int8", bf16_stochastic_round=True)
    assert cache.master_of(p) is None
    MasterWeights(cls, [p], bf16_stochastic_round=False)  # the default is fine


def test_capturable_on_cpu_is_refused_at_construction_and_in_add_param_group():
    """torch's capturable step needs a CUDA/XPU/HPU/XLA tensor; on CPU its first step would
    assert after MasterWeights converted the gradients: refused before anything changes."""
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=BF16))
    with pytest.raises(ValueError, match=r"AdamW\(capturable=True\) in param group 0 .* \['cpu'\]"):
        MasterWeights(torch.optim.AdamW, [p], capturable=True)
    assert cache.master_of(p) is None
    opt = MasterWeights(torch.optim.AdamW, [p])
    q = torch.nn.Parameter(torch.zeros(32, 64, dtype=BF16))
    with pytest.raises(ValueError, match=r"capturable=True\) in param group 1"):
        opt.add_param_group({"params": [q], "capturable": True})
    assert len(opt.param_groups) == len(opt.inner.param_groups) == len(opt.masters) == 1
    assert cache.master_of(q) is None
    opt.add_param_group({"params": [q]})  # the same group without it is taken
    assert len(opt.inner.param_groups) == 2 and cache.master_of(q) is opt.masters[1][0]


# -m slow: the default run checks the same property on the small converted Net above in both
# recipes (test_release_on_equals_release_off); this is a real model's case, a tiny Qwen3 (dense,
# and MoE with its 3-D expert stacks, whose moments torchao quantizes too), where torchao
# compiles its step for every distinct parameter shape (~40 s on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qwen3_with_fp8_moments_release_on_equals_release_off(kind):
    from helpers.models import assert_same_weights, make_batches, make_model, weights
    from helpers.models import train as train_hf

    batches = make_batches(3, MICRO)
    runs = {}
    for release in (True, False):
        cache.cache_clear()
        model = make_model(kind)
        zrw.convert(model, "mxfp8-32x32", release=release)
        opt = zrw.optim.AdamW(model.parameters(), lr=1e-3, state_dtype="fp8")
        runs[release] = (train_hf(model, opt, batches), weights(model), state_tensors(opt))
        kinds = {type(s["exp_avg"]).__name__ for s in opt.inner.state.values()}
        del model, opt
    assert torch.equal(runs[True][0], runs[False][0])
    assert_same_weights(runs[True][1], runs[False][1], f"qwen3 {kind} fp8 moments")
    assert_bitwise_dicts(runs[True][2], runs[False][2], f"qwen3 {kind} fp8 moments state")
    assert kinds == {"OptimStateFp8", "Tensor"}


# -m slow: zrw.optim.AdamW(state_dtype=...) built by Hugging Face's Trainer from
# optimizer_cls_and_kwargs (its linear schedule on torchao's tensor lr, its optimizer.pt
# checkpoint of the quantized states); the default run checks release on = off and the resume
# on the small Net, and tests/hf the Trainer with FP32 moments.
@pytest.mark.slow
def test_trainer_with_fp8_moments_release_on_equals_off_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from helpers.hf import Tokens, final_weights, losses_and_norms, trainer_args
    from helpers.models import make_model

    def run(out, release, resume=None):
        cache.cache_clear()
        model = make_model("dense")
        zrw.convert(model, "mxfp8-32x32", release=release)
        args = TrainingArguments(
            **trainer_args(
                out,
                max_steps=4,
                learning_rate=1e-3,
                lr_scheduler_type="linear",
                save_strategy="steps",
                save_steps=2,
                data_seed=0,
            )
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(),
            optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": 1e-3, "state_dtype": "fp8"}),
        )
        trainer.train(resume_from_checkpoint=resume)
        assert type(trainer.optimizer.optimizer.inner) is ao.AdamWFp8
        return losses_and_norms(trainer), final_weights(model)

    on, off = run(tmp_path / "on", True), run(tmp_path / "off", False)
    assert on[0] == off[0] and len(on[0]) == 4
    assert_bitwise_dicts(on[1], off[1], "Trainer fp8 moments")
    resumed = run(tmp_path / "resumed", True, resume=str(tmp_path / "on" / "checkpoint-2"))
    assert resumed[0] == on[0]  # the checkpoint's 2 logged steps, then the 2 resumed ones
    assert_bitwise_dicts(resumed[1], on[1], "Trainer fp8 moments resumed")
