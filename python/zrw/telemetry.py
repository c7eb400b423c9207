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

Weights are read once per optimizer step (zrw.cache's step counter), as the value the layer
quantizes: a weight that is not released is its own storage (also right after a
`load_state_dict`, an `apply` or a write through `.data`: its FP32 master takes that value only
at its next use in training); a released weight is its FP32 master rounded to the weight's
dtype (bitwise what the layer quantizes; zrw.cache.master_of); a frozen weight released for
good without a master is not measured (its FP8 copy is its only value). Activations
and gradients are measured at every call inside the block and summed over calls (a forward
hook, and a gradient hook on the layer's output). Grouped-expert layers (3-D weights) report
their weights only. `recipe=` also measures the plain nn.Linear layers of an unconverted model
as that recipe would quantize them; `scale_modes=("floor", "rceil")` measures each tensor under
both scale rules, whatever the layers use, to compare them on the same values.

Nothing changes what the model computes: the hooks read tensors and return nothing, and outside
the block there are no hooks at all (zero cost when off). Inside it each measured tensor costs
one extra quantize and dequantize. The hooks run eagerly (they read tensor values): a
`torch.compile(model)` wrapper is measured as the model it wraps, with a graph break at each
measured layer while the block is open.

Arguments are checked when the collector is made, each error naming the argument, what was
expected and what was found: `tensors`, `layers` and `scale_modes` take one str (one tensor
kind, one name part, one scale rule) or an iterable of str, never a str's characters; a name
part in `layers` that matches no measured layer is refused (a typo would measure nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import cache, ops
from .config import QuantRecipe, get_recipe
from .planes import MXPlanesCarrier, is_zrw_layer, unwrap_model

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

    def __post_init__(self):
        for name in ("elements", "nonzero", "saturated", "flushed", "calls"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"zrw.telemetry.QuantStats: {name} must be an int >= 0, got {v!r}")
        for name in ("signal", "noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"zrw.telemetry.QuantStats: {name} must be a float, got {v!r}")

    def add(self, other: "QuantStats") -> "QuantStats":
        if not isinstance(other, QuantStats):
            raise TypeError(
                f"QuantStats.add: other must be a QuantStats, got {type(other).__name__}"
            )
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
    if not isinstance(elem_dtype, torch.dtype) or elem_dtype not in _ELEM_MAX:
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
    """The value the layer quantizes, as zrw.cache and zrw.state_dict decide it: a weight that
    is not released holds it in its storage (a weight loaded, initialized or written since its
    optimizer's last write-back holds the new value, and its master takes it only at the
    weight's next use in training); a released weight's value is its FP32 master rounded to
    its dtype (zrw.cache.master_of). None where there is nothing to compare with: FSDP2's
    gathered planes, a frozen weight released for good without a master (its FP8 copy is its
    only value)."""
    if isinstance(w, MXPlanesCarrier):
        return None  # FSDP2's gathered planes: no values to compare with
    local = w.to_local() if hasattr(w, "to_local") else w
    if not cache.cache_state(local).released:
        return local.detach()
    master = cache.master_of(local)
    return None if master is None else master.detach().to(local.dtype)


def _names(op: str, arg: str, value, what: str) -> Tuple[str, ...]:
    """`value` as a tuple of str: one str is ONE name (never its characters), else an iterable
    of str; anything else is the TypeError that names the argument."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, bytearray, dict)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{op}: {arg} must be a str or an iterable of str ({what}), got {type(value).__name__}"
        )
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, str):
            raise TypeError(
                f"{op}: {arg} must hold str ({what}), got {arg}[{i}] = {v!r} ({type(v).__name__})"
            )
    return out


class NumericsTelemetry:
    """Collects QuantStats per layer and tensor while installed (see the module docstring).

    `model`: any nn.Module (a `torch.compile` wrapper: the model it wraps); its zrw layers are
    measured (with `recipe`, also its plain nn.Linear layers). `tensors`: which of TENSORS to
    measure, one name or several. `layers`: optional name parts, one str or several; a layer is
    measured when its qualified name contains one of them (`layers="fc1"` is `["fc1"]`, and
    also measures "fc10"; a part that matches no measured layer raises ValueError).
    `scale_modes`: measure under these scale rules (one or several) instead of each layer's own.

    Use as a context manager (`with collect(model) as tel:`) or with start() / stop().
    """

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
        if not isinstance(model, nn.Module):
            raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
        model = unwrap_model(model)  # torch.compile(model): the model's own names and modules
        self.tensors = _names(op, "tensors", tensors, f"among {TENSORS}")
        unknown = [t for t in self.tensors if t not in TENSORS]
        if unknown or not self.tensors:
            raise ValueError(
                f"{op}: tensors must name at least one of {TENSORS}, got {self.tensors!r}"
            )
        if scale_modes is not None:
            scale_modes = _names(op, "scale_modes", scale_modes, f"among {ops.SCALE_MODES}")
            bad = [m for m in scale_modes if m not in ops.SCALE_MODES]
            if bad or not scale_modes:
                raise ValueError(
                    f"{op}: scale_modes must be None or name at least one of "
                    f"{ops.SCALE_MODES}, got {scale_modes!r}"
                )
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
        parts = None
        if layers is not None:
            parts = _names(op, "layers", layers, "name parts of the layers to measure")
            for i, part in enumerate(parts):
                if not part:
                    raise ValueError(
                        f"{op}: layers[{i}] is the empty string, which every layer name "
                        "contains; pass layers=None to measure every layer"
                    )
        self._layers: List[_Layer] = []
        matched = set()
        for name, m in model.named_modules():
            if is_zrw_layer(m):
                weights = tuple(m.zrw_quantized)
                rcp = m.recipe
            elif default is not None and type(m) is nn.Linear:
                weights, rcp = ("weight",), default
            else:
                continue
            if parts is not None:
                hits = [p for p in parts if p in name]
                if not hits:
                    continue
                matched.update(hits)
            w0 = getattr(m, weights[0])
            linear = weights == ("weight",) and w0.dim() == 2
            self._layers.append(_Layer(name, m, rcp, weights, linear))
        if parts is not None:
            unmatched = [p for p in parts if p not in matched]
            if unmatched:
                raise ValueError(
                    f"{op}: layers holds name parts that match no layer it measures: "
                    f"{unmatched} (the layers it measures: "
                    f"{self._measurable(model, default)[:8]})"
                )
        self._handles: list = []

    @staticmethod
    def _measurable(model: nn.Module, default) -> List[str]:
        return [
            n
            for n, m in model.named_modules()
            if is_zrw_layer(m) or (default is not None and type(m) is nn.Linear)
        ]

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

    @torch._dynamo.disable(reason="zrw.telemetry reads tensor values: its hooks run eagerly")
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

    @torch._dynamo.disable(reason="zrw.telemetry reads tensor values: its hooks run eagerly")
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
        if not isinstance(pooled, bool):
            raise TypeError(
                f"NumericsTelemetry.table: pooled must be a bool, got {type(pooled).__name__}"
            )
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
