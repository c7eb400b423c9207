"""zrw.fsdp.prepare without a process group: which weights it wraps and what they carry, and the
module structure that keeps zrw.fsdp and zrw.nn apart (a layer declares what it quantizes; the
gathered weight is a zrw.planes.MXPlanesCarrier; the optimizer boundary calls fsdp back)."""

import ast
import pathlib
import subprocess
import sys

import torch
from torch import nn

import zrw
import zrw.fsdp
from helpers.bitwise import same_bits
from zrw.fsdp import MXGatheredWeight, PreQuantWeight
from zrw.planes import MXPlane, MXPlanesCarrier, MXWeight

PKG = pathlib.Path(zrw.__file__).parent


def _imported_modules(path: pathlib.Path):
    """Every module a file imports, absolute (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


def test_fsdp_and_the_layers_do_not_import_each_other():
    assert not {m for m in _imported_modules(PKG / "fsdp.py") if m.startswith("zrw.nn")}
    for layer_file in (PKG / "nn").glob("*.py"):
        assert "zrw.fsdp" not in _imported_modules(layer_file), layer_file.name
    r = subprocess.run(
        [sys.executable, "-c", "import sys, zrw.nn; print('zrw.fsdp' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]


class _DeclaredLayer(nn.Module):
    """A layer that is none of zrw's classes but declares what it quantizes."""

    zrw_quantized = ("w1", "w2")

    def __init__(self, recipe):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 32))
        self.w2 = nn.Parameter(torch.randn(2, 64, 32))
        self.plain = nn.Parameter(torch.randn(64, 32))
        self.recipe = recipe


def _e5m2_rceil():
    name = "test-prepare-e5m2-rceil-32x32"
    if name not in zrw.config.known_recipes():
        mx = zrw.config.ScalingGranularityEnum.MX

        @zrw.recipe_register(name)
        def _factory():
            g = zrw.config.ScalingGranularity
            return zrw.QuantRecipe(
                name,
                g(mx, [1, 32, 32]),
                g(mx, [1, 1, 32]),
                g(mx, [1, 1, 32]),
                torch.float8_e5m2,
                "rceil",
            )

    return zrw.get_recipe(name)


def test_prepare_finds_layers_by_their_declaration_and_carries_the_recipe():
    recipe = _e5m2_rceil()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    zrw.convert(model, recipe, release=False)
    model.add_module("experts", zrw.nn.MXGroupedLinear(2, 32, 64, recipe=recipe, release=False))
    model.add_module("custom", _DeclaredLayer(recipe.name))
    assert zrw.fsdp.prepare(model) == 5
    wrapped = {n: p for n, p in model.named_parameters() if isinstance(p.data, PreQuantWeight)}
    assert sorted(wrapped) == ["0.weight", "2.weight", "custom.w1", "custom.w2", "experts.weight"]
    # (a Parameter of a wrapper subclass: isinstance of the Parameter itself)
    assert all(isinstance(p, PreQuantWeight) for p in wrapped.values())
    assert not isinstance(model.custom.plain, PreQuantWeight)
    for p in wrapped.values():
        assert p._mx_recipe == recipe  # the QuantRecipe itself, not the layout's name
        inner, meta = p.__tensor_flatten__()
        again = PreQuantWeight.__tensor_unflatten__(
            {"_tensor": p._tensor}, meta, p.shape, p.stride()
        )
        assert again._mx_recipe == recipe
    assert zrw.fsdp.prepare(model) == 0  # idempotent


def test_the_shard_quantization_uses_the_recipe():
    recipe = _e5m2_rceil()
    w = torch.randn(64, 96)
    pq = PreQuantWeight(w, recipe, "w")
    q = pq._quantized_shard(torch.bfloat16)
    assert q.recipe == "mxfp8-32x32" and q.fwd.data is q.bwd.data
    data, block = q.fwd.data, q.block_scale
    ref_data, ref_block = zrw.ops.mx_quantize_block(
        w.to(torch.bfloat16), torch.float8_e5m2, "rceil"
    )
    assert data.dtype == torch.float8_e5m2
    assert same_bits(data, ref_data)
    assert same_bits(block, ref_block)


def test_the_gathered_weight_is_a_planes_carrier():
    recipe = _e5m2_rceil()
    g = MXGatheredWeight(
        torch.Size((64, 96)), torch.bfloat16, torch.device("cpu"), recipe, "layer.weight"
    )
    assert isinstance(g, MXPlanesCarrier) and g.zrw_name == "layer.weight"
    data, block = zrw.ops.mx_quantize_block(torch.randn(64, 96), torch.float8_e5m2, "rceil")
    g._set_planes(
        MXWeight(
            "mxfp8-32x32",
            MXPlane(data, zrw.ops.expand_block_scale(block, (64, 96), -1)),
            MXPlane(data, zrw.ops.expand_block_scale(block, (64, 96), -2)),
        ),
        "block",
    )
    q = g.mx_weight("fwd")
    assert q.recipe == "mxfp8-32x32" and q.fwd.data is data


def test_the_optimizer_boundary_drops_the_shard_caches():
    p = nn.Parameter(torch.randn(64, 32))
    pq = PreQuantWeight(p.detach(), zrw.get_recipe("mxfp8"), "w")
    pq._quantized_shard(torch.bfloat16)
    assert pq._mx_planes is not None
    opt = zrw.optim.attach(torch.optim.SGD([p], lr=0.1), fill="dequant")
    p.grad = torch.zeros_like(p)
    opt.step()
    assert pq._mx_planes is None


def test_a_write_into_the_shard_is_seen_by_the_next_quantization():
    """The shard planes follow the native cache's rule for unreleased weights: a load into the
    shard (DCP's copy_, a hand-written update) between two boundaries is quantized afresh."""
    p = nn.Parameter(torch.randn(64, 32))
    pq = PreQuantWeight(p.detach(), zrw.get_recipe("mxfp8"), "w")
    first = pq._quantized_shard(torch.bfloat16)
    assert pq._quantized_shard(torch.bfloat16) is first  # same step, unchanged: kept
    with torch.no_grad():
        pq.copy_(torch.randn(64, 32))  # into the inner tensor (copy_ keeps the subclass)
    again = pq._quantized_shard(torch.bfloat16)
    want = zrw.ops.mx_quantize_dual(pq._tensor.to(torch.bfloat16), torch.float8_e4m3fn, "rceil")
    assert again is not first
    assert torch.equal(again.fwd.data.view(torch.uint8), want[0].view(torch.uint8))
