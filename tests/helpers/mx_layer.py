"""What the cache and optimizer tests (tests/cache, tests/optim) share: a minimal MX linear built
only on zrw.ops, and parameter helpers.

It is deliberately not zrw.nn.MXLinear: the cache tests check the native cache and the
optimizer boundary on their own, with nn.Linear weights used through quant_and_release.
y = Q_K(x) @ W_fwd^T and dgrad Q_N(dy) @ W_bwd through mx_matmul; wgrad dy^T x in bf16. The
layer calls quant_and_release OUTSIDE the Function: inside Function.forward grad mode is off and
the release guard would skip the release as "no_grad".
"""

import pytest
import torch

from zrw import cache, ops

BF16 = torch.bfloat16


def value(w):
    """A weight's BF16 value: a weight released by the BF16-free step (MasterWeights'
    default) holds none, its value is bf16 of its master."""
    if cache.is_released(w) and cache.master_of(w) is not None:
        return cache.master_of(w).to(w.dtype)
    return w.detach().clone()


def param(*shape, seed=0, requires_grad=True):
    """A bf16 Parameter of randn values from its own generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(
        torch.randn(*shape, generator=g).to(BF16), requires_grad=requires_grad
    )


def assert_step_refused(opt, w, match):
    """`opt`, an optimizer without zrw's boundary, refuses to step the released weight `w` (given
    a gradient here) with a RuntimeError matching `match`."""
    w.grad = torch.ones_like(w)
    with pytest.raises(RuntimeError, match=match):
        opt.step()


class MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, q):
        xd, xs = ops.mx_quantize(x, -1)
        ctx.save_for_backward(x, q.bwd.data, q.bwd.scale)
        return ops.mx_matmul(xd, xs, q.fwd.data, q.fwd.scale, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, db, sb = ctx.saved_tensors
        dd, ds = ops.mx_quantize(dy, -1)
        dx = ops.mx_matmul(dd, ds, db.t(), sb.t(), dy.dtype)
        return dx, dy.t() @ x, None
