"""Numerics telemetry: what MXFP8 quantization does to each layer's weights, activations and
gradients, measured on your own model while it trains (docs/accuracy.md shows its use):

    with zrw.telemetry.collect(model) as tel:        # hooks live only inside the block
        model(**batch).loss.backward()               # one step (or several)
    print(tel.table())                               # per layer and tensor; tel.records(): dicts

Each zrw layer's tensors are quantized with the layer's own recipe (element format, scale
rule, block shape), dequantized and compared with the input:

  weight      the forward operand: blocks of 32 along K (`mxfp8`) or 32x32 tiles (`mxfp8-32x32`)
  weight_bwd  `mxfp8` only: the backward copy, blocks of 32 along N (the 32x32 copy is both)
  activation  the layer's input x, blocks of 32 along K (the forward GEMM's operand)
  gradient    the gradient of the layer's output dy, blocks of 32 along N (the dgrad operand)

and reported per (layer, tensor, scale rule):

  sqnr_db     10 log10(sum x^2 / sum (x - dequant(quant(x)))^2); inf for an exact copy
  saturated   fraction of elements clamped: |x| beyond the largest element (448 for E4M3) times
              the block's scale (only the `floor` rule saturates)
  flushed     fraction of elements that are not zero but quantize to zero (underflow)

Weights are read once per optimizer step (zrw.cache's step counter), as the value the layer
quantizes (`_weight_value`); activations and gradients at every call inside the block, summed
over calls. Grouped-expert layers (3-D weights) report their weights only. `recipe=` also
measures the plain nn.Linear layers as that recipe would; `scale_modes=` measures each tensor
under the rules given instead of the layers' own.

Nothing changes what the model computes: the hooks read tensors and return nothing, and outside
the block there are none (zero cost when off); inside it each measured tensor costs one extra
quantize and dequantize. The hooks run eagerly: a `torch.compile(model)` wrapper is measured as
the model it wraps, with a graph break at each measured layer while the block is open.
Arguments are checked when the collector is made (a str is one name, never its characters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import cache, ops
from .config import QuantRecipe, get_recipe
from .planes import MXPlanesCarrier, checked_model, is_zrw_layer, name_list
from .reference import BLOCK, ELEM_MAX

__all__ = ["QuantStats", "NumericsTelemetry", "collect", "quant_stats", "TENSORS"]

TENSORS = ("weight", "weight_bwd", "activation", "gradient")


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

    def __post_init__(self):
        for f in fields(self):
            v, counts = getattr(self, f.name), f.type == "int"
            if isinstance(v, bool) or not (
                isinstance(v, int) and v >= 0 if counts else isinstance(v, (int, float))
            ):
                want = "an int >= 0" if counts else "a float"
                raise TypeError(f"zrw.telemetry.QuantStats: {f.name} must be {want}, got {v!r}")

    def add(self, other: "QuantStats") -> "QuantStats":
        if not isinstance(other, QuantStats):
            raise TypeError(
                f"QuantStats.add: other must be a QuantStats, got {type(other).__name__}"
            )
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
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
        fractions = {"saturated": self.saturated_fraction, "flushed": self.flushed_fraction}
        counts = {"elements": self.elements, "nonzero": self.nonzero, "calls": self.calls}
        return {"sqnr_db": self.sqnr_db} | fractions | counts


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
    op = "zrw.telemetry.quant_stats"
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if not isinstance(block_32x32, bool):
        raise TypeError(f"{op}: block_32x32 must be a bool, got {type(block_32x32).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    if block_32x32:
        if x.dim() not in (2, 3):
            raise ValueError(
                f"{op}: x must be 2-d (N, K) or 3-d (E, N, K) with block_32x32=True, got "
                f"shape {tuple(x.shape)}"
            )
    elif x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a 0-d tensor")
    elif not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{op}: dim must be in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, "
            f"got {dim}"
        )
    if not isinstance(elem_dtype, torch.dtype) or elem_dtype not in ELEM_MAX:
        raise TypeError(
            f"{op}: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype!r}"
        )
    if not isinstance(scale_mode, str) or scale_mode not in ops.SCALE_MODES:
        raise ValueError(f"{op}: scale_mode must be one of {ops.SCALE_MODES}, got {scale_mode!r}")
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
    per_element = _scale_values(scale).repeat_interleave(BLOCK, dim).narrow(dim, 0, length)
    finite = torch.isfinite(per_element)
    err = torch.where(finite, xf - deq, torch.zeros_like(xf))
    signal = torch.where(finite, xf, torch.zeros_like(xf))
    nonzero = (xf != 0) & finite
    limit = ELEM_MAX[elem_dtype] * per_element
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
    """The value the layer quantizes, as zrw.cache and zrw.state_dict decide it: a weight that
    is not released holds it in its storage (a weight loaded, initialized or written since its
    optimizer's last write-back holds the new value, and its master takes it only at the
    weight's next use in training); a released weight's value is its FP32 master rounded to
    its dtype (zrw.cache.master_of). None where there is nothing to compare with: FSDP2's
    gathered planes, a frozen weight released for good without a master (its FP8 copy is its
    only value)."""
    if isinstance(w, MXPlanesCarrier):
        return None
    local = w.to_local() if hasattr(w, "to_local") else w
    if not cache.cache_state(local).released:
        return local.detach()
    master = cache.master_of(local)
    return None if master is None else master.detach().to(local.dtype)


def _names(op: str, arg: str, value, allowed: tuple) -> Tuple[str, ...]:
    """name_list of `value`, at least one name, each in `allowed`."""
    out = name_list(op, arg, value, f"among {allowed}")
    if not out or any(v not in allowed for v in out):
        raise ValueError(f"{op}: {arg} must name at least one of {allowed}, got {out!r}")
    return out


class NumericsTelemetry:
    """Collects QuantStats per layer, tensor and scale rule while installed (the module
    docstring), as a context manager (`with collect(model) as tel:`) or with start() / stop().
    `tensors`: which of TENSORS. `layers`: name parts; a layer is measured when its qualified
    name contains one (`layers="fc1"` also measures "fc10"; a part matching no layer is
    refused). `scale_modes`: measure under these rules instead of each layer's own."""

    def __init__(
        self,
        model: nn.Module,
        *,
        tensors: Union[str, Iterable[str]] = TENSORS,
        recipe: Union[str, QuantRecipe, None] = None,
        layers: Union[str, Iterable[str], None] = None,
        scale_modes: Union[str, Sequence[str], None] = None,
    ):
        op = "zrw.telemetry.NumericsTelemetry"
        model = checked_model(op, model)
        self.tensors = _names(op, "tensors", tensors, TENSORS)
        if scale_modes is not None:
            scale_modes = _names(op, "scale_modes", scale_modes, ops.SCALE_MODES)
        self.scale_modes = scale_modes
        if recipe is not None and not isinstance(recipe, (str, QuantRecipe)):
            raise TypeError(
                f"{op}: recipe must be None, a zrw.QuantRecipe or a registered recipe name, "
                f"got {type(recipe).__name__}"
            )
        try:
            default = None if recipe is None else get_recipe(recipe)
        except ValueError as e:
            raise ValueError(f"{op}: recipe: {e}") from None
        if layers is not None:
            why = "layer name contains; pass layers=None to measure every layer"
            layers = name_list(op, "layers", layers, "name parts of the layers to measure", why)
        self._layers: List[_Layer] = []
        measurable, matched = [], set()
        for name, m in model.named_modules():
            if is_zrw_layer(m):
                weights, rcp = tuple(m.zrw_quantized), m.recipe
            elif default is not None and type(m) is nn.Linear:
                weights, rcp = ("weight",), default
            else:
                continue
            measurable.append(name)
            hits = [p for p in layers or () if p in name]
            matched.update(hits)
            if layers is None or hits:
                linear = weights == ("weight",) and getattr(m, weights[0]).dim() == 2
                self._layers.append(_Layer(name, m, rcp, weights, linear))
        unmatched = [p for p in layers or () if p not in matched]
        if unmatched:
            raise ValueError(
                f"{op}: layers holds name parts that match no layer it measures: {unmatched} "
                f"(the layers it measures: {measurable[:8]})"
            )
        self._handles: list = []

    # ---- installing ----------------------------------------------------------------------
    def start(self) -> "NumericsTelemetry":
        if self._handles:
            return self
        for layer in self._layers:
            m = layer.module
            self._handles.append(m.register_forward_pre_hook(partial(self._pre_forward, layer)))
            if layer.linear and "gradient" in self.tensors:
                self._handles.append(m.register_forward_hook(partial(self._post_forward, layer)))
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
    def _measure(self, layer: _Layer, tensor: str, x: Tensor, dim: int, block=False) -> None:
        for mode in self.scale_modes or (layer.recipe.scale_mode,):
            stats = quant_stats(x, dim, layer.recipe.elem_dtype, mode, block_32x32=block)
            layer.stats.setdefault((tensor, mode), QuantStats()).add(stats)

    @torch._dynamo.disable(reason="zrw.telemetry reads tensor values: its hooks run eagerly")
    @torch.no_grad()
    def _pre_forward(self, layer: _Layer, module, args) -> None:
        step = cache.cache_stats()["step"]
        if layer.weight_step != step and ({"weight", "weight_bwd"} & set(self.tensors)):
            layer.weight_step = step
            block = layer.recipe.block_32x32
            for pname in layer.weights:
                w = _weight_value(getattr(layer.module, pname))
                if w is not None and "weight" in self.tensors:
                    self._measure(layer, "weight", w, -1, block)
                if w is not None and "weight_bwd" in self.tensors and not block:
                    self._measure(layer, "weight_bwd", w, -2)
        if layer.linear and "activation" in self.tensors and args and isinstance(args[0], Tensor):
            self._measure(layer, "activation", args[0], -1)

    @torch._dynamo.disable(reason="zrw.telemetry reads tensor values: its hooks run eagerly")
    def _post_forward(self, layer: _Layer, module, args, out) -> None:
        if isinstance(out, Tensor) and out.requires_grad:

            @torch.no_grad()
            def on_grad(dy: Tensor) -> None:
                self._measure(layer, "gradient", dy, -1)

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
        return [
            {"layer": layer.name, "tensor": t, "recipe": layer.recipe.name, "scale_mode": mode}
            | s.as_dict()
            for layer in self._layers
            for (t, mode), s in sorted(layer.stats.items(), key=lambda i: TENSORS.index(i[0][0]))
        ]

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
        return [
            {"recipe": key[0], "tensor": key[1], "scale_mode": key[2]}
            | s.as_dict()
            | {"min_sqnr_db": worst[key][0], "min_sqnr_layer": worst[key][1]}
            for key, s in sorted(pooled.items(), key=lambda i: TENSORS.index(i[0][1]))
        ]

    def table(self, pooled: bool = False) -> str:
        """A readable table of records() (or of summary() with pooled=True)."""
        if not isinstance(pooled, bool):
            raise TypeError(
                f"NumericsTelemetry.table: pooled must be a bool, got {type(pooled).__name__}"
            )
        first = "recipe" if pooled else "layer"
        header = [first, "tensor", "scale", "SQNR dB", "saturated", "flushed", "elements"]
        cells = [header] + [
            [str(r[first]), r["tensor"], r["scale_mode"], f"{r['sqnr_db']:.2f}"]
            + [f"{r['saturated']:.2e}", f"{r['flushed']:.2e}", str(r["elements"])]
            for r in (self.summary() if pooled else self.records())
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


def collect(
    model: nn.Module,
    *,
    tensors: Union[str, Iterable[str]] = TENSORS,
    recipe: Union[str, QuantRecipe, None] = None,
    layers: Union[str, Iterable[str], None] = None,
    scale_modes: Union[str, Sequence[str], None] = None,
) -> NumericsTelemetry:
    """NumericsTelemetry(model, ...), to use as `with zrw.telemetry.collect(model) as t:`."""
    return NumericsTelemetry(
        model, tensors=tensors, recipe=recipe, layers=layers, scale_modes=scale_modes
    )
