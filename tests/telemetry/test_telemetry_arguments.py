"""zrw.telemetry's arguments: a str is one name (a tensor kind, a layer name part, a scale
rule), never its characters; a name part that matches no measured layer is refused; and every
argument of every public telemetry callable that has the wrong type or value raises an error
that names it, before any hook is installed. The table below must cover every public callable
of the module: a new one that it does not list fails the test."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import zrw
import zrw.telemetry as telemetry

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


class TwoLayers(nn.Module):
    """Layers named fc1 and fc2, with fc10 to show that a name part is a substring."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 64, dtype=BF16)
        self.fc2 = nn.Linear(64, 64, dtype=BF16)
        self.fc10 = nn.Linear(64, 64, dtype=BF16)

    def forward(self, x):
        return self.fc10(self.fc2(self.fc1(x)))


pytestmark = pytest.mark.usefixtures("clean_cache")


def _converted():
    model = TwoLayers()
    zrw.convert(model)
    return model


def _x():
    return torch.randn(4, 64, dtype=BF16, generator=torch.Generator().manual_seed(1))


def _run(model):
    with torch.no_grad():  # (an eval: no optimizer is needed to measure)
        model(_x())


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _measured(tel):
    return {layer for layer, _, _ in tel.stats()}


def test_a_str_of_layers_is_one_name_part():
    model = _converted()
    with telemetry.collect(model, layers="fc1") as tel:
        _run(model)
    # "fc1" is a name part: fc1 and fc10 contain it, fc2 does not (by character, all three).
    assert _measured(tel) == {"fc1", "fc10"}
    with telemetry.collect(model, layers=["fc2"]) as tel:
        _run(model)
    assert _measured(tel) == {"fc2"}


def test_a_str_of_tensors_or_scale_modes_is_one_name():
    model = _converted()
    with telemetry.collect(model, tensors="weight", scale_modes="floor", layers="fc2") as tel:
        _run(model)
    assert set(tel.stats()) == {("fc2", "weight", "floor")}


def test_a_layer_name_part_that_matches_nothing_is_refused():
    model = _converted()
    before = _hooks(model)
    with pytest.raises(ValueError, match=r"layers.*\['fc3'\]"):
        telemetry.collect(model, layers=["fc1", "fc3"]).start()
    with pytest.raises(ValueError, match=r"layers\[0\] is the empty string"):
        telemetry.collect(model, layers="").start()
    assert _hooks(model) == before


def _quant_stats_call(**bad):
    args = dict(x=torch.ones(2, 64), dim=-1, elem_dtype=E4M3, scale_mode="rceil")
    args.update(bad)
    return lambda: telemetry.quant_stats(**args)


def _collect_call(**bad):
    def call():
        model = _converted()
        before = _hooks(model)
        args = dict(model=model)
        args.update(bad)
        try:
            return telemetry.collect(**args).start()
        finally:
            assert _hooks(model) == before  # nothing installed

    return call


def _table_call(pooled):
    def call():
        model = _converted()
        with telemetry.collect(model) as tel:
            _run(model)
        return tel.table(pooled=pooled)

    return call


# (public callable, argument, a call with a wrong value of it, the error, a text it names)
CASES = [
    ("collect", "model", _collect_call(model=5), TypeError, "model must be a torch.nn.Module"),
    ("collect", "tensors", _collect_call(tensors=5), TypeError, "tensors must be a str or"),
    ("collect", "tensors", _collect_call(tensors=[5]), TypeError, r"tensors\[0\] = 5"),
    ("collect", "tensors", _collect_call(tensors="bias"), ValueError, "tensors must name"),
    ("collect", "tensors", _collect_call(tensors=()), ValueError, "tensors must name"),
    ("collect", "recipe", _collect_call(recipe=5), TypeError, "recipe must be None"),
    ("collect", "recipe", _collect_call(recipe="mxfp4"), ValueError, "recipe: get_recipe"),
    ("collect", "layers", _collect_call(layers=5), TypeError, "layers must be a str or"),
    ("collect", "layers", _collect_call(layers=[1]), TypeError, r"layers\[0\] = 1"),
    ("collect", "scale_modes", _collect_call(scale_modes=5), TypeError, "scale_modes must be"),
    ("collect", "scale_modes", _collect_call(scale_modes="round"), ValueError, "scale_modes"),
    ("collect", "scale_modes", _collect_call(scale_modes=[]), ValueError, "scale_modes"),
    ("quant_stats", "x", _quant_stats_call(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    ("quant_stats", "x", _quant_stats_call(x=torch.ones(2, dtype=torch.int32)), TypeError, "x "),
    ("quant_stats", "x", _quant_stats_call(x=torch.tensor(1.0)), ValueError, "x must have"),
    ("quant_stats", "dim", _quant_stats_call(dim="-1"), TypeError, "dim must be an int"),
    ("quant_stats", "dim", _quant_stats_call(dim=2), ValueError, "dim must be in"),
    ("quant_stats", "dim", _quant_stats_call(x=torch.ones(0, 4), dim=2), ValueError, "dim must"),
    ("quant_stats", "elem_dtype", _quant_stats_call(elem_dtype=BF16), TypeError, "elem_dtype"),
    ("quant_stats", "elem_dtype", _quant_stats_call(elem_dtype="e4m3"), TypeError, "elem_dtype"),
    ("quant_stats", "scale_mode", _quant_stats_call(scale_mode="round"), ValueError, "scale_mode"),
    ("quant_stats", "scale_mode", _quant_stats_call(scale_mode=1), ValueError, "scale_mode"),
    ("quant_stats", "block_32x32", _quant_stats_call(block_32x32="y"), TypeError, "block_32x32"),
    (
        "quant_stats",
        "block_32x32",
        _quant_stats_call(x=torch.ones(64), block_32x32=True),
        ValueError,
        "x must be 2-d",
    ),
    ("NumericsTelemetry.table", "pooled", _table_call("yes"), TypeError, "pooled must be a bool"),
    ("QuantStats", "elements", lambda: telemetry.QuantStats(elements="1"), TypeError, "elements"),
    ("QuantStats", "calls", lambda: telemetry.QuantStats(calls=-1), TypeError, "calls"),
    ("QuantStats", "signal", lambda: telemetry.QuantStats(signal="0"), TypeError, "signal"),
    ("QuantStats.add", "other", lambda: telemetry.QuantStats().add(5), TypeError, "other"),
]


@pytest.mark.parametrize(
    "call,error,text",
    [c[2:] for c in CASES],
    ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)],
)
def test_a_wrong_argument_raises_an_error_that_names_it(call, error, text):
    with pytest.raises(error, match=text):
        call()


def test_every_public_callable_and_argument_is_covered():
    """Every public function, class and method of zrw.telemetry (and each of its arguments)
    has a case above; NumericsTelemetry is made through collect, with the same arguments."""
    covered = {(name, arg) for name, arg, *_ in CASES}
    public = {}
    for name in telemetry.__all__:
        obj = getattr(telemetry, name)
        if inspect.isfunction(obj):
            public[name] = obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and not attr.startswith("_"):
                    public[f"{name}.{attr}"] = member
            if "__init__" in vars(obj) or "__dataclass_fields__" in vars(obj):
                public[name] = obj
    missing = []
    for name, fn in public.items():
        if name == "NumericsTelemetry":
            name, fn = "collect", telemetry.collect  # the same keyword arguments
        params = inspect.signature(fn).parameters
        for arg in params:
            if arg in ("self",):
                continue
            if name == "QuantStats" and arg in ("nonzero", "saturated", "flushed", "noise"):
                continue  # checked by the same loops as elements / calls / signal
            if (name, arg) not in covered:
                missing.append(f"{name}({arg})")
    assert not missing, f"public telemetry arguments without a wrong-value case: {missing}"
    assert math.isnan(telemetry.QuantStats().sqnr_db)  # (a valid one still constructs)
