"""Your own layer on zrw's ops (the design's API, docs/design.md §4): a projection whose GEMMs
run on MXFP8 operands, with its weight quantized once per optimizer step and its BF16 storage
released.

  zrw.ops.quant_and_release(w, recipe, release)  first use in a step: quantize both 1x32 planes,
                                                 file them in the cache, release w's BF16 bytes;
                                                 later uses (micro-batches, backward): a lookup
  zrw.ops.mx_quantize_dual(x)                    an activation or gradient, both axes, one read
  zrw.ops.mx_matmul(a, sa, b, sb, dtype)         a @ b.T on MX operands, FP32 accumulation

Trained with zrw.optim.AdamW (FP32 masters, the zrw boundary attached): run it to see the same
losses with release on and off, bit for bit, and 2 bytes released per weight element.
`python examples/custom_layer.py`
"""

import torch

import zrw
from zrw import ops


class MXProjectionFn(torch.autograd.Function):
    """y = x @ W.T: forward on (Q_K(x), W_fwd); dx from (Q_N(dy), W_bwd); dW from the token
    axis of both. Saves FP8 tensors for backward, never the BF16 weight."""

    @staticmethod
    def forward(ctx, x, weight, w_fwd, w_fwd_scale, w_bwd, w_bwd_scale):
        qx_k, sx_k, qx_m, sx_m = ops.mx_quantize_dual(x)
        ctx.save_for_backward(qx_m, sx_m, w_bwd, w_bwd_scale)
        ctx.w_dtype = weight.dtype
        return ops.mx_matmul(qx_k, sx_k, w_fwd, w_fwd_scale, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        qx_m, sx_m, w_bwd, w_bwd_scale = ctx.saved_tensors
        qdy_n, sdy_n, qdy_m, sdy_m = ops.mx_quantize_dual(dy.contiguous())
        dx = ops.mx_matmul(qdy_n, sdy_n, w_bwd.t(), w_bwd_scale.t(), dy.dtype)
        dw = ops.mx_matmul(qdy_m.t(), sdy_m.t(), qx_m.t(), sx_m.t(), ctx.w_dtype)
        return dx, dw, None, None, None, None


class MXProjection(torch.nn.Module):
    def __init__(self, d_in, d_out, release=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) * d_in**-0.5)
        self.release = release

    def forward(self, x):
        # require_owner: release only while an optimizer with the zrw boundary owns the weight
        # (what zrw's own layers do), so a weight no optimizer steps is never left released.
        q = ops.quant_and_release(self.weight, "mxfp8", self.release, require_owner=True)
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y = MXProjectionFn.apply(x2d, self.weight, q.fwd.data, q.fwd.scale, q.bwd.data, q.bwd.scale)
        return y.reshape(*x.shape[:-1], -1)


def train(release, steps=4, micro_batches=2):
    zrw.cache.cache_clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        MXProjection(64, 256, release), torch.nn.GELU(), MXProjection(256, 64, release)
    ).to(torch.bfloat16)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, released = [], []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(8, 16, 64, generator=g).to(torch.bfloat16)
            loss = (model(x).float() - x.float()).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        released.append(zrw.cache.cache_stats()["released_bytes"])
        opt.step()
        opt.zero_grad()
    zrw.cache.restore_all("master")  # the BF16 weights back, exactly, to read them
    weights = [p.detach().clone() for p in model.parameters()]
    elements = sum(p.numel() for p in model.parameters())
    return losses, released, weights, elements


def main():
    on = train(True)
    off = train(False)
    same = on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[2], off[2]))
    print(f"losses (release on):  {[round(v, 4) for v in on[0]]}")
    print(
        f"BF16 bytes released per step: {on[1]} for {on[3]} weight elements "
        f"({on[1][-1] / on[3]:.0f} bytes each); release off: {off[1]}"
    )
    print(f"release on vs off, losses and final weights bit for bit: {same}")
    return on, off, same


if __name__ == "__main__":
    main()
