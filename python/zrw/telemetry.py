"""Numerics telemetry: what MXFP8 quantization does to each layer's weights, activations and
gradients, measured on your own model while it trains.

    with zrw.telemetry.collect(model) as tel:        # hooks live only inside the block
        model(**batch).loss.backward()               # one step (or several)
    print(tel.table())                               # per layer and tensor
    rows = tel.records()                             # the same as dicts (JSON-ready)

For every zrw layer of a converted model (a module with `zrw_quantized` and a `recipe`, e.g.
zrw.nn.MXLinear) it quantizes, with the layer's own recipe (element format, scale rule, block
shape), the tensors the layer's GEMMs quantize, dequantizes them and compares with the input:

  weight      the forward operand: blocks of 32 along K (`mxfp8`) or 32x32 tiles (`mxfp8-32x32`)
  weight_bwd  `mxfp8` only: the backward copy, blocks of 32 along N (the 32x32 copy is both)
  activation  the layer's input x, blocks of 32 along K (the forward GEMM's operand)
  gradient    the gradient of the layer's output dy, blocks of 32 along N (the dgrad operand)

and reports per (layer, tensor):

  sqnr_db     10 log10(sum x^2 / sum (x - dequant(quant(x)))^2); inf for an exact copy
  saturated   fraction of elements clamped: |x| beyond the largest element (448 for E4M3) times
              the block's scale. Only the `floor` rule saturates (`rceil` picks the scale so that
              the block's largest value fits).
  flushed     fraction of elements that are not zero but quantize to zero (underflow)

Weights are read once per optimizer step (zrw.cache's step counter): from the FP32 master
rounded to the weight's dtype where zrw.optim.MasterWeights holds one (bitwise what the layer
quantizes, also while the BF16 weight is released), else from the weight itself. Activations
and gradients are measured at every call inside the block and summed over calls (a forward
hook, and a gradient hook on the layer's output). Grouped-expert layers (3-D weights) report
their weights only. `recipe=` also measures the plain nn.Linear layers of an unconverted model
as that recipe would quantize them; `scale_modes=("floor", "rceil")` measures each tensor under
both scale rules, whatever the layers use, to compare them on the same values.

Nothing changes what the model computes: the hooks read tensors and return nothing, and outside
the block there are no hooks at all (zero cost when off). Inside it each measured tensor costs
one extra quantize and dequantize. Eager-mode only (the hooks read tensor values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import cache, ops
from .config import QuantRecipe, get_recipe
from .planes import MXPlanesCarrier, is_zrw_layer

__all__ = ["QuantStats", "NumericsTelemetry", "collect", "quant_stats", "TENSORS"]

TENSORS = ("weight", "weight_bwd", "activation", "gradient")
_ELEM_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_BLOCK = 32


@dataclass
class QuantStats:
    """Sums over the elements measured (add() merges two). `signal` = sum x^2 and `noise` =
    sum (x - dequant(quant(x)))^2 in float64; counts of elements, nonzero, saturated, flushed."""

    elements: int = 0
    nonzero: int = 0
    saturated: int = 0
    flushed: int = 0
    signal: float = 0.0
    noise: float = 0.0
    calls: int = 0

    def add(self, other: "QuantStats") -> "QuantStats":
        for name in ("elements", "nonzero", "saturated", "flushed", "signal", "noise", "calls"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    @property
    def sqnr_db(self) -> float:
        """Signal-to-quantization-noise ratio in dB (inf when nothing was lost, nan when
        nothing was measured or the signal is zero)."""
        if self.signal <= 0:
            return math.nan
        if self.noise <= 0:
            return math.inf
        return 10.0 * math.log10(self.signal / self.noise)

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.elements if self.elements else math.nan

    @property
    def flushed_fraction(self) -> float:
        return self.flushed / self.elements if self.elements else math.nan

    def as_dict(self) -> dict:
        return {
            "sqnr_db": self.sqnr_db,
            "saturated": self.saturated_fraction,
            "flushed": self.flushed_fraction,
            "elements": self.elements,
            "nonzero": self.nonzero,
            "calls": self.calls,
        }


def _scale_values(scale: Tensor) -> Tensor:
    """fp32 value of each E8M0 scale byte: 2^(byte - 127); 0xFF (NaN block) -> nan."""
    byte = scale.view(torch.uint8).to(torch.float32)
    return torch.where(byte == 255, torch.full_like(byte, math.nan), torch.exp2(byte - 127.0))


def quant_stats(
    x: Tensor,
    dim: int = -1,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
    block_32x32: bool = False,
) -> QuantStats:
    """QuantStats of MX-quantizing `x` (bf16, fp16 or fp32) as zrw's kernels do.

    Blocks of 32 along `dim` (zrw.ops.mx_quantize), or with block_32x32=True one scale per
    32x32 tile of the last two dims (zrw.ops.mx_quantize_block; x is (N, K) or (E, N, K)).
    Elements of blocks holding NaN or Inf are left out of the sums (their scale is NaN).
    """
    if not isinstance(x, Tensor):
        raise TypeError(
            f"zrw.telemetry.quant_stats: x must be a torch.Tensor, got {type(x).__name__}"
        )
    x = x.detach()
    if x.numel() == 0:
        return QuantStats(calls=1)
    if block_32x32:
        data, block = ops.mx_quantize_block(x.contiguous(), elem_dtype, scale_mode)
        dim = -1
        scale = ops.expand_block_scale(block, x.shape, dim)
    else:
        data, scale = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
    deq = ops.mx_dequantize(data, scale, dim, torch.float32)
    xf = x.to(torch.float32)
    length = x.shape[dim]
    # Each element's block scale, laid out as x (the last block along dim may be shorter).
    per_element = _scale_values(scale).repeat_interleave(_BLOCK, dim).narrow(dim, 0, length)
    finite = torch.isfinite(per_element)
    err = torch.where(finite, xf - deq, torch.zeros_like(xf))
    signal = torch.where(finite, xf, torch.zeros_like(xf))
    nonzero = (xf != 0) & finite
    limit = _ELEM_MAX[elem_dtype] * per_element
    return QuantStats(
        elements=int(finite.sum()),
        nonzero=int(nonzero.sum()),
        saturated=int(((xf.abs() > limit) & finite).sum()),
        flushed=int((nonzero & (deq == 0)).sum()),
        signal=float(signal.double().pow(2).sum()),
        noise=float(err.double().pow(2).sum()),
        calls=1,
    )


@dataclass
class _Layer:
    name: str
    module: nn.Module
    recipe: QuantRecipe
    weights: Tuple[str, ...]  # the parameters it quantizes
    linear: bool  # a 2-D weight and forward(x): activations and gradients too
    weight_step: Optional[int] = None
    stats: Dict[Tuple[str, str], QuantStats] = field(default_factory=dict)


def _weight_value(w: Tensor) -> Optional[Tensor]:
    """What the layer quantizes: bf16 of the FP32 master where one is registered (the BF16-free
    step keeps the weight released), else the weight itself; None where neither is readable."""
    if isinstance(w, MXPlanesCarrier):
        return None  # FSDP2's gathered planes: no values to compare with
    master = cache.master_of(w)
    if master is not None:
        return master.detach().to(w.dtype)
    if cache.is_released(w):
        return None
    local = w.to_local() if hasattr(w, "to_local") else w
    return local.detach()


class NumericsTelemetry:
    """Collects QuantStats per layer and tensor while installed (see the module docstring).

    `model`: any nn.Module; its zrw layers are measured (with `recipe`, also its plain
    nn.Linear layers). `tensors`: which of TENSORS to measure. `layers`: optional name parts; a
    layer is measured when its qualified name contains one of them. `scale_modes`: measure
    under these scale rules instead of each layer's own.

    Use as a context manager (`with collect(model) as tel:`) or with start() / stop().
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tensors: Iterable[str] = TENSORS,
        recipe: str | QuantRecipe | None = None,
        layers: Optional[Iterable[str]] = None,
        scale_modes: Optional[Sequence[str]] = None,
    ):
        op = "zrw.telemetry.NumericsTelemetry"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
        self.tensors = tuple(tensors)
        unknown = [t for t in self.tensors if t not in TENSORS]
        if unknown:
            raise ValueError(f"{op}: tensors must be among {TENSORS}, got {unknown}")
        if scale_modes is not None:
            scale_modes = tuple(scale_modes)
            bad = [m for m in scale_modes if m not in ops.SCALE_MODES]
            if bad or not scale_modes:
                raise ValueError(
                    f"{op}: scale_modes must be a non-empty sequence of "
                    f"{ops.SCALE_MODES}, got {scale_modes!r}"
                )
        self.scale_modes = scale_modes
        default = None if recipe is None else get_recipe(recipe)
        parts = None if layers is None else tuple(layers)
        self._layers: List[_Layer] = []
        for name, m in model.named_modules():
            if parts is not None and not any(p in name for p in parts):
                continue
            if is_zrw_layer(m):
                weights = tuple(m.zrw_quantized)
                rcp = m.recipe
            elif default is not None and type(m) is nn.Linear:
                weights, rcp = ("weight",), default
            else:
                continue
            w0 = getattr(m, weights[0])
            linear = weights == ("weight",) and w0.dim() == 2
            self._layers.append(_Layer(name, m, rcp, weights, linear))
        self._handles: list = []

    # ---- installing ----------------------------------------------------------------------
    def start(self) -> "NumericsTelemetry":
        if self._handles:
            return self
        for layer in self._layers:
            self._handles.append(
                layer.module.register_forward_pre_hook(
                    lambda m, args, layer=layer: self._pre_forward(layer, args)
                )
            )
            if layer.linear and "gradient" in self.tensors:
                self._handles.append(
                    layer.module.register_forward_hook(
                        lambda m, args, out, layer=layer: self._post_forward(layer, out)
                    )
                )
        return self

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "NumericsTelemetry":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def reset(self) -> None:
        """Forget what was collected (the hooks stay as they are)."""
        for layer in self._layers:
            layer.stats.clear()
            layer.weight_step = None

    # ---- measuring -----------------------------------------------------------------------
    def _modes(self, layer: _Layer) -> Tuple[str, ...]:
        return self.scale_modes or (layer.recipe.scale_mode,)

    def _add(self, layer: _Layer, tensor: str, mode: str, stats: QuantStats) -> None:
        key = (tensor, mode)
        if key in layer.stats:
            layer.stats[key].add(stats)
        else:
            layer.stats[key] = stats

    @torch.no_grad()
    def _pre_forward(self, layer: _Layer, args) -> None:
        rcp = layer.recipe
        step = cache.cache_stats()["step"]
        if layer.weight_step != step and ({"weight", "weight_bwd"} & set(self.tensors)):
            layer.weight_step = step
            for pname in layer.weights:
                w = _weight_value(getattr(layer.module, pname))
                if w is None:
                    continue
                for mode in self._modes(layer):
                    if "weight" in self.tensors:
                        self._add(
                            layer,
                            "weight",
                            mode,
                            quant_stats(w, -1, rcp.elem_dtype, mode, block_32x32=rcp.block_32x32),
                        )
                    if "weight_bwd" in self.tensors and not rcp.block_32x32:
                        self._add(
                            layer, "weight_bwd", mode, quant_stats(w, -2, rcp.elem_dtype, mode)
                        )
        if layer.linear and "activation" in self.tensors and args and isinstance(args[0], Tensor):
            for mode in self._modes(layer):
                self._add(layer, "activation", mode, quant_stats(args[0], -1, rcp.elem_dtype, mode))

    def _post_forward(self, layer: _Layer, out) -> None:
        if isinstance(out, Tensor) and out.requires_grad:

            def on_grad(dy: Tensor, layer=layer) -> None:
                with torch.no_grad():
                    for mode in self._modes(layer):
                        self._add(
                            layer,
                            "gradient",
                            mode,
                            quant_stats(dy, -1, layer.recipe.elem_dtype, mode),
                        )

            out.register_hook(on_grad)

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> Dict[Tuple[str, str, str], QuantStats]:
        """{(layer name, tensor, scale mode): QuantStats} of what was collected."""
        return {
            (layer.name, t, m): s for layer in self._layers for (t, m), s in layer.stats.items()
        }

    def records(self) -> List[dict]:
        """One dict per (layer, tensor, scale mode): layer, tensor, recipe, scale_mode, sqnr_db,
        saturated, flushed (fractions), elements, nonzero, calls."""
        out = []
        for layer in self._layers:
            for tensor in TENSORS:
                for (t, mode), s in layer.stats.items():
                    if t == tensor:
                        out.append(
                            {
                                "layer": layer.name,
                                "tensor": t,
                                "recipe": layer.recipe.name,
                                "scale_mode": mode,
                                **s.as_dict(),
                            }
                        )
        return out

    def summary(self) -> List[dict]:
        """records() pooled over layers: one dict per (recipe, tensor, scale mode) with the
        pooled sqnr_db / saturated / flushed (sums over every layer's elements) and the worst
        layer's SQNR (min_sqnr_db, min_sqnr_layer)."""
        pooled: Dict[Tuple[str, str, str], QuantStats] = {}
        worst: Dict[Tuple[str, str, str], Tuple[float, str]] = {}
        for layer in self._layers:
            for (t, mode), s in layer.stats.items():
                key = (layer.recipe.name, t, mode)
                pooled.setdefault(key, QuantStats()).add(s)
                if key not in worst or s.sqnr_db < worst[key][0]:
                    worst[key] = (s.sqnr_db, layer.name)
        out = []
        for tensor in TENSORS:
            for (rname, t, mode), s in pooled.items():
                if t == tensor:
                    out.append(
                        {
                            "recipe": rname,
                            "tensor": t,
                            "scale_mode": mode,
                            **s.as_dict(),
                            "min_sqnr_db": worst[(rname, t, mode)][0],
                            "min_sqnr_layer": worst[(rname, t, mode)][1],
                        }
                    )
        return out

    def table(self, pooled: bool = False) -> str:
        """A readable table of records() (or of summary() with pooled=True)."""
        rows = self.summary() if pooled else self.records()
        first = "recipe" if pooled else "layer"
        header = [first, "tensor", "scale", "SQNR dB", "saturated", "flushed", "elements"]
        cells = [header] + [
            [
                str(r[first]),
                r["tensor"],
                r["scale_mode"],
                f"{r['sqnr_db']:.2f}",
                f"{r['saturated']:.2e}",
                f"{r['flushed']:.2e}",
                str(r["elements"]),
            ]
            for r in rows
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        lines = [
            "  ".join(
                c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
            for row in cells
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def collect(model: nn.Module, **kwargs) -> NumericsTelemetry:
    """NumericsTelemetry(model, **kwargs), to use as `with zrw.telemetry.collect(model) as t:`."""
    return NumericsTelemetry(model, **kwargs)
