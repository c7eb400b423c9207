"""The FSDP2 tests' model and recipes (tests/fsdp/fsdp_worker.py and dcp_ddp_worker.py train it on
2 ranks; fsdp_worker.py's --mode single on one) and what test_fsdp.py and test_fsdp_recipe.py
compare: the worker's initial weights, and what must hold between an FP8 all-gather run, the
BF16 all-gather run and the single-process run on the global batch."""

import argparse
import os

import torch
from torch import nn

from helpers import TESTS

WORKER = os.path.join(TESTS, "fsdp", "fsdp_worker.py")


class Experts(nn.Module):
    """A Hugging Face style fused-experts module (3-D gate_up_proj / down_proj, act_fn)."""

    def __init__(self, e, h, i):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * h**-0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * i**-0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):  # BF16 reference path (unused)
        raise NotImplementedError


class Net(nn.Module):
    def __init__(self, d, hidden, experts, moe):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, d, bias=False)
        self.moe = moe
        if moe:
            self.router = nn.Linear(d, experts, bias=False)
            self.experts = Experts(experts, d, hidden // 2)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if self.moe:
            logits = self.router(h).float()
            w, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
            h = h + self.experts(
                h.reshape(-1, h.shape[-1]), idx.reshape(-1, 2), w.reshape(-1, 2).to(h.dtype)
            ).reshape(h.shape)
        return h


# Registered recipes that differ from the built-ins only in element dtype and scale rule: what
# FSDP2's all-gather must keep (the layer's QuantRecipe, not its layout's built-in recipe).
TEST_RECIPES = {"test-e5m2-rceil": (1, 1, 32), "test-e5m2-rceil-32x32": (1, 32, 32)}


def register_test_recipes():
    from zrw.config import (
        QuantRecipe,
        ScalingGranularity,
        ScalingGranularityEnum,
        known_recipes,
        recipe_register,
    )

    def mx(block):
        return ScalingGranularity(ScalingGranularityEnum.MX, list(block))

    for name, block in TEST_RECIPES.items():
        if name in known_recipes():
            continue
        recipe_register(name)(
            lambda name=name, block=block: QuantRecipe(
                name=name,
                weight_granularity=mx(block),
                act_granularity=mx((1, 1, 32)),
                grad_granularity=mx((1, 1, 32)),
                elem_dtype=torch.float8_e5m2,
                scale_mode="rceil",
            )
        )


def build(args):
    import zrw

    register_test_recipes()
    torch.manual_seed(0)
    model = Net(args.d, args.hidden, args.experts, args.moe)
    with torch.no_grad():
        # FP32 masters that hold bf16-representable values: the single-process run starts from
        # model.to(bf16), whose MasterWeights masters are exactly these.
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    zrw.convert(model, args.recipe, release=False, skip=("router",))
    return model


def initial_weight(name, args):
    """The worker's initial full weight (same seed, same construction) in bf16."""
    ns = argparse.Namespace(
        d=128, hidden=256, experts=4, moe="--moe" in args, recipe=args[args.index("--recipe") + 1]
    )
    model = build(ns)
    return dict(model.named_parameters())[name].detach().to(torch.bfloat16)


def assert_trains_like_bf16_gather_and_single_process(z, b, s, args):
    """z (FP8 all-gather) against b (FSDP2's BF16 all-gather, quantized after the gather) and s
    (the single-process run on the global batch)."""
    # The FP8 gather changes nothing but bytes: bitwise the run that gathers BF16 and quantizes.
    assert z["losses"] == b["losses"]
    for n in z["weights"]:
        assert torch.equal(z["weights"][n], b["weights"][n]), n
    # ... and matches the single-process run on the global batch up to reduction order: each
    # rank's wgrad leaves its GEMM (fp32 accumulation) rounded to the bf16 parameter dtype
    # before FSDP's fp32 reduce-scatter, where the single process rounds the global sum once:
    # a difference of bf16 rounding (2^-8 relative) in the gradients, nothing more. The first
    # loss (before any update) differs only by the fp32 order of the loss's own reduction.
    assert abs(z["losses"][0] - s["losses"][0]) <= 1e-6 * abs(s["losses"][0])
    torch.testing.assert_close(
        torch.tensor(z["losses"]), torch.tensor(s["losses"]), rtol=1e-2, atol=0
    )
    for n, w in z["weights"].items():
        moved = (s["weights"][n] - initial_weight(n, args).float()).abs().max()
        diff = (w - s["weights"][n]).abs().max()
        assert diff <= 0.05 * moved, (n, float(diff), float(moved))
