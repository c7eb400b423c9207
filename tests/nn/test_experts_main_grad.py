"""Megatron-style FP32 gradients for expert stacks: zrw.convert(model, main_grad=True) makes the
fused experts accumulate their weight gradient in FP32 `main_grad` (no `.grad`), as MXLinear
does; MasterWeights steps with it and zero_grad clears it."""

import pytest
import torch

import zrw
from helpers.models import make_model  # (skips this module without transformers)
from zrw.nn import MXFusedExperts

pytestmark = pytest.mark.usefixtures("clean_cache")


def make(main_grad):
    model = make_model("moe", vocab=64, layers=1, moe_ffn=64)
    zrw.convert(model, "mxfp8", main_grad=main_grad)
    return model


def test_experts_accumulate_fp32_main_grad():
    ids = [
        torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    runs = {}
    for main_grad in (False, True):
        model = make(main_grad)
        experts = next(m for m in model.modules() if isinstance(m, MXFusedExperts))
        assert experts.main_grad is main_grad
        opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1))
        before = experts.down_proj.detach().clone()
        for x in ids:  # two micro-batches: the second accumulates into main_grad
            model(input_ids=x, labels=x).loss.backward()
        grads = {}
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            if main_grad:
                assert p.grad is None and p.main_grad.dtype == torch.float32
                grads[name] = p.main_grad.clone()
            else:
                assert getattr(p, "main_grad", None) is None
                grads[name] = p.grad.float()
        opt.step()
        # Read through state_dict: the BF16-free step keeps the stack released.
        assert not torch.equal(experts.state_dict()["down_proj"], before)  # the step used main_grad
        opt.zero_grad()
        assert getattr(experts.down_proj, "main_grad", None) is None
        runs[main_grad] = grads
        zrw.cache.cache_clear()
    for name, g in runs[False].items():
        # The same MX products, summed in FP32 rather than rounded to BF16 per micro-batch.
        torch.testing.assert_close(
            runs[True][name], g, rtol=2**-7, atol=2**-7 * g.abs().max().item()
        )
