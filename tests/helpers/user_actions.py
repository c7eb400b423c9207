"""The tiny model of the lifecycle tests and the user actions applied to it (tests/cache:
test_user_actions.py, test_stateful.py, test_hostile_actions.py).

Tiny: embedding, norm and head outside zrw's layers by default (`build` converts up, down and head
and skips the embedding), trained under zrw.optim.MasterWeights(AdamW). BETWEEN holds what a
user may do between two optimizer steps (loads, casts, applies, evals under no_grad and
inference_mode, zero_grad variants, optimizer state round trips, ties, saves, deepcopies);
INSIDE what may run inside a step, between two micro-batches, while weights are released. Each
action is fn(model, opt, ctx); ctx["saved"] is a state dict taken after the first step.
"""

import copy
import io

import pytest
import torch
from torch import nn

import zrw
from zrw.optim import MasterWeights, attach

BF16 = torch.bfloat16


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(48, 64)
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 64)
        self.head = nn.Linear(64, 48, bias=False)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        return self.head(h + self.down(torch.relu(self.up(h))))


def build(release, recipe="mxfp8", seed=0):
    torch.manual_seed(seed)
    model = Tiny().to(BF16)
    zrw.convert(model, recipe, release=release, skip=("embed",))
    opt = attach(MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2))
    return model, opt


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 48, (3, 8), generator=g)


def loss_of(model, seed):
    return model(batch(seed)).float().logsumexp(-1).mean()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _init(mod):
    g = torch.Generator().manual_seed(7)
    if isinstance(mod, (nn.Linear, nn.Embedding)):
        with torch.no_grad():
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g).to(mod.weight.dtype) * 0.02)


def _init_data(mod):
    if isinstance(mod, nn.LayerNorm):
        mod.weight.data.fill_(1.25)


# Each action: (name, fn(model, opt, ctx)). ctx["saved"] is a state dict taken after step 1.
def _load(model, opt, ctx):
    model.load_state_dict(ctx["saved"])


def _load_partial(model, opt, ctx):
    model.load_state_dict(
        {k: v for k, v in ctx["saved"].items() if "norm" in k or "up" in k}, strict=False
    )


def _load_bad_shape(model, opt, ctx):
    bad = dict(ctx["saved"])
    bad["norm.weight"] = torch.zeros(3)
    model.load_state_dict(bad)


def _load_not_a_tensor(model, opt, ctx):
    bad = dict(ctx["saved"])
    bad["up.weight"] = "not a tensor"
    model.load_state_dict(bad)


def _apply_init(model, opt, ctx):
    model.apply(_init)


def _apply_data(model, opt, ctx):
    model.apply(_init_data)


def _cast_round_trip(model, opt, ctx):
    model.float()
    model.to(BF16)


def _to_same(model, opt, ctx):
    model.to(torch.bfloat16)


def _eval_no_grad(model, opt, ctx):
    with torch.no_grad():
        model(batch(99))


def _eval_inference(model, opt, ctx):
    with torch.inference_mode():
        model(batch(98))


def _zero_keep(model, opt, ctx):
    opt.zero_grad(set_to_none=False)


def _opt_round_trip(model, opt, ctx):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _inplace_no_grad(model, opt, ctx):
    with torch.no_grad():
        model.norm.weight.mul_(0.5)
        model.embed.weight.add_(0.01)


def _tie(model, opt, ctx):
    # A weight tied after convert: the embedding reads the converted head's weight.
    model.embed.weight = model.head.weight
    # what docs/guarantees.md asks for before an apply or a cast (a forward, state_dict() or
    # load_state_dict() of the converted model finds the tie by itself)
    zrw.nn.hold_tied_weights(model)


def _save_load(model, opt, ctx):
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))


def _deepcopy(model, opt, ctx):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin(batch(97))


def _state_dict_read(model, opt, ctx):
    sd = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())


BETWEEN = {
    "load": _load,
    "load_partial": _load_partial,
    "load_bad_shape": _load_bad_shape,
    "load_not_a_tensor": _load_not_a_tensor,
    "apply_init": _apply_init,
    "apply_data": _apply_data,
    "cast_round_trip": _cast_round_trip,
    "to_same": _to_same,
    "eval_no_grad": _eval_no_grad,
    "eval_inference": _eval_inference,
    "zero_keep": _zero_keep,
    "opt_round_trip": _opt_round_trip,
    "inplace_no_grad": _inplace_no_grad,
    "state_dict": _state_dict_read,
    "tie": _tie,
    "save_load": _save_load,
    "deepcopy": _deepcopy,
    "fault_step": None,  # handled in run(): the next step fails once, then is retried
}
# Inside a step (between micro-batches): what can run while weights are released.
INSIDE = {
    "eval_no_grad": _eval_no_grad,
    "eval_inference": _eval_inference,
    "cast_round_trip": _cast_round_trip,
    "to_same": _to_same,
    "state_dict": _state_dict_read,
    "apply_init": _apply_init,
    "deepcopy": _deepcopy,
    "save_load": _save_load,
}


def assert_step_fails_inside(opt):
    """opt.step() with an exception injected into its inner optimizer's step raises it (the
    caller retries the step; the hook is gone by then)."""

    def boom(*_):
        raise RuntimeError("injected")

    h = opt.inner.register_step_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            opt.step()
    finally:
        h.remove()
