"""From a layer's weight to its MX planes: one policy, one handle (a level above zrw.cache,
below the layers).

`WeightPolicy` is how a layer treats its quantized weights: the recipe, whether to release
(and release frozen weights for good), whether the gradient accumulates in FP32 `main_grad`,
and the name for zrw's messages. Every zrw layer carries one (`layer.policy`), built from its
public attributes.

`resolve(weight)` decides once per layer call what a weight is (`WeightHandle`: its kind, the
tensor the cache works on, its record, whether it is trained, where main_grad goes), and
`planes(handle, policy)` gives its MX planes. The kinds:
  * a tensor that carries its planes (zrw.planes.MXPlanesCarrier: FSDP2's gathered weight);
  * a parallel engine's `DTensor.to_local()` view (transformers' expert styles): the planes of
    the local shard it shows, which `prepare_local_shards` (zrw.parallel.prepare's pre-hook)
    quantized and released before the view existed;
  * a DTensor (DTensor TP): its local shard, trainable as its DTensor is;
  * any other tensor: itself, through the native cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from . import cache, frozen, lifecycle
from ._dtensor import check_tensor, engine_view_owner, is_dtensor, wrap_like
from .config import QuantRecipe, get_recipe
from .planes import MXPlane, MXPlanesCarrier, MXWeight
from .record import find_record


@dataclass(frozen=True)
class WeightPolicy:
    """How a layer quantizes its weights: `recipe` (a QuantRecipe), `release` (free the BF16
    storage from the first use in a step to the optimizer boundary), `release_frozen` (frozen
    weights too, for good), `main_grad` (accumulate the weight gradient in FP32 `main_grad`,
    no `.grad`), `name` (for messages; None: the weight's own, zrw.cache.set_weight_name)."""

    recipe: QuantRecipe
    release: bool = True
    release_frozen: bool = False
    main_grad: bool = False
    name: Optional[str] = None

    @staticmethod
    def of(module, name: Optional[str] = None) -> "WeightPolicy":
        """The policy of a zrw layer, from its attributes (`recipe`, `release`, and where it has
        them `release_frozen` and `main_grad`)."""
        return WeightPolicy(
            get_recipe(module.recipe),
            module.release,
            getattr(module, "release_frozen", False),
            getattr(module, "main_grad", False),
            name,
        )

    @staticmethod
    def cached(module) -> "WeightPolicy":
        """WeightPolicy.of(module), made again only when one of the layer's attributes it reads
        changed since the last call (a layer's forward asks for it at every call)."""
        key = (
            module.recipe,
            module.release,
            getattr(module, "release_frozen", False),
            getattr(module, "main_grad", False),
        )
        hit = module.__dict__.get("_policy")
        if hit is not None and hit[0] == key:
            return hit[1]
        policy = WeightPolicy.of(module)
        module.__dict__["_policy"] = (key, policy)
        return policy

    def named(self, name: Optional[str]) -> "WeightPolicy":
        return self if name == self.name else replace(self, name=name)


def check_policy(op: str, policy) -> WeightPolicy:
    if not isinstance(policy, WeightPolicy):
        raise TypeError(
            f"{op}: policy must be a zrw.weights.WeightPolicy, got {type(policy).__name__}"
        )
    return policy


def check_recipe(op: str, recipe) -> QuantRecipe:
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(
            f"{op}: recipe must be a zrw.QuantRecipe (zrw.get_recipe(name)), got "
            f"{type(recipe).__name__}"
        )
    return recipe


@torch._dynamo.disable(reason=cache.EAGER_ONLY)
def quant_local(
    owner: Tensor,
    requires_grad: bool,
    recipe: QuantRecipe,
    release: bool,
    release_frozen: bool,
    name: Optional[str] = None,
) -> MXWeight:
    """quant_and_release on a rank's local shard, trainable as its DTensor (or the engine's
    view of it) is (`requires_grad`)."""
    check_tensor("zrw.weights.quant_local", "owner", owner)
    check_recipe("zrw.weights.quant_local", recipe)
    return cache.quant_and_release(
        owner,
        recipe.cache_layout,
        release,
        release_frozen=release_frozen,
        elem_dtype=recipe.elem_dtype,
        scale_mode=recipe.scale_mode,
        name=name,
        require_owner=True,
        trainable=bool(requires_grad),
    )


def quant_engine_view(
    view: Tensor,
    owner: Tensor,
    recipe: QuantRecipe,
    release: bool,
    release_frozen: bool,
    name: Optional[str] = None,
) -> MXWeight:
    """The planes of a weight the engine handed to forward as a `to_local()` view: those of
    its local tensor, which `prepare`'s pre-hook quantized (and released) before the view
    existed."""
    check_tensor("zrw.weights.quant_engine_view", "view", view)
    check_tensor("zrw.weights.quant_engine_view", "owner", owner)
    rec = find_record(owner)
    if rec is None or not rec.prepared:
        shown = name or cache.weight_name(owner) or f"<weight of local shape {tuple(owner.shape)}>"
        raise RuntimeError(
            f"zrw: weight '{shown}' reaches its layer as a DTensor.to_local() view (a "
            "parallel engine, e.g. transformers' moe_tp_experts / ep_dispatch_experts, hands "
            "the layer its local shard), but zrw.parallel.prepare(model) has not run on it. "
            "Call zrw.parallel.prepare(model) once after the model is sharded: it checks the "
            "local shards and quantizes and releases them before the engine makes the view"
        )
    return quant_local(owner, view.requires_grad, recipe, release, release_frozen, name)


class WeightHandle:
    """What a layer's weight is, decided once per layer call (`resolve`):

    kind        "plain", "dtensor" (DTensor TP: its local shard), "engine_view" (a parallel
                engine's to_local() view of a prepared local shard) or "carrier" (FSDP2's
                gathered weight, which carries its planes)
    weight      the tensor the layer was given (autograd hands it the weight gradient)
    local       the tensor the cache works on (the local shard; the weight itself otherwise)
    record      its weight record, or None
    trainable   whether an optimizer steps it (a local shard: its DTensor's flag)
    grad_owner  the parameter that accumulates its main_grad
    """

    __slots__ = ("kind", "weight", "local", "record", "trainable", "grad_owner")

    def __init__(self, kind, weight, local, record, trainable, grad_owner):
        self.kind, self.weight, self.local, self.record = kind, weight, local, record
        self.trainable, self.grad_owner = trainable, grad_owner

    @property
    def name(self) -> str:
        """Its name for messages: the record's (the only store of a weight's name)."""
        return self.record.name if self.record is not None else ""


def resolve(weight: Tensor) -> WeightHandle:
    """The handle of a weight a zrw layer meets (see the module docstring). Under
    torch.compile it runs eagerly (a graph break with zrw's reason): it reads the records."""
    if torch.compiler.is_compiling():
        return _resolve_eagerly(weight)
    return _resolve(weight)


def _resolve(weight: Tensor) -> WeightHandle:
    if isinstance(weight, MXPlanesCarrier):
        return WeightHandle("carrier", weight, weight, None, weight.requires_grad, weight)
    if is_dtensor(weight):
        local = weight._local_tensor
        return WeightHandle(
            "dtensor", weight, local, find_record(local), weight.requires_grad, weight
        )
    owner = engine_view_owner(weight)
    if owner is not None:
        rec = find_record(owner)
        dt = rec.dtensor() if rec is not None and rec.dtensor is not None else None
        return WeightHandle(
            "engine_view", weight, owner, rec, weight.requires_grad, weight if dt is None else dt
        )
    return WeightHandle("plain", weight, weight, find_record(weight), weight.requires_grad, weight)


_resolve_eagerly = torch._dynamo.disable(_resolve, reason=cache.EAGER_ONLY)


def planes(h: WeightHandle, policy: WeightPolicy) -> MXWeight:
    """The MX planes of a resolved weight. For a carrier the backward plane is None: it is read
    from the weight in backward, after FSDP2's re-gather (FSDP2 frees the gathered planes at
    reshard and refills them then). Any other kind: the native cache's lookup of its local
    tensor (quantize, file and release on a miss), with the policy's recipe (a checked
    QuantRecipe) and the weight's name from its record."""
    if h.kind == "carrier":
        q = h.weight.mx_weight("fwd")
        return MXWeight(q.recipe, q.fwd, MXPlane(None, None))
    if h.kind == "engine_view" and (h.record is None or not h.record.prepared):
        raise RuntimeError(
            f"zrw: weight '{policy.name or h.name or tuple(h.local.shape)}' reaches its layer "
            "as a DTensor.to_local() view (a parallel engine, e.g. transformers' "
            "moe_tp_experts / ep_dispatch_experts, hands the layer its local shard), but "
            "zrw.parallel.prepare(model) has not run on it. Call zrw.parallel.prepare(model) "
            "once after the model is sharded: it checks the local shards and quantizes and "
            "releases them before the engine makes the view"
        )
    recipe = policy.recipe
    w = h.local
    if torch.compiler.is_compiling() or w.is_meta:  # graph break / the named refusals
        return cache.quant_and_release(
            w,
            recipe.cache_layout,
            policy.release,
            release_frozen=policy.release_frozen,
            elem_dtype=recipe.elem_dtype,
            scale_mode=recipe.scale_mode,
            name=policy.name,
            require_owner=True,
            trainable=h.trainable,
        )
    tensors = lifecycle.use(
        "zrw.cache.quant_and_release",
        w,
        (recipe.cache_layout, recipe.elem_dtype, recipe.scale_mode),
        policy.release,
        policy.release_frozen,
        policy.name,
        True,
        h.trainable,
        h.record,
    )
    if policy.release and policy.release_frozen and not h.trainable:
        frozen.mark(w)
    return MXWeight.from_tensors(recipe.cache_layout, tensors)


def weight_planes(weight: Tensor, policy: WeightPolicy) -> MXWeight:
    """planes(resolve(weight), policy), for one call."""
    check_policy("zrw.weights.weight_planes", policy)
    return planes(resolve(weight), policy)


def main_grad_owner(weight: Tensor) -> Tensor:
    """The parameter that accumulates `weight`'s main_grad: for an engine's to_local() view,
    the DTensor parameter it shows (recorded by `prepare`); else `weight` itself."""
    check_tensor("zrw.weights.main_grad_owner", "weight", weight)
    base = engine_view_owner(weight)
    rec = find_record(base) if base is not None else None
    param = rec.dtensor() if rec is not None and rec.dtensor is not None else None
    return weight if param is None else param


def _engine_accumulates(owner: Tensor) -> bool:
    """Whether the running backward pass would accumulate a gradient into `owner` (a leaf):
    False inside `torch.autograd.grad(outputs, inputs)` / `backward(inputs=...)` that do not
    ask for it, which leave `.grad` alone and so must leave `main_grad` alone too (e.g. the
    metadata inference of torch.distributed.pipelining's PipelineStage, which runs a backward
    on empty inputs for the input gradients' shapes). Where torch cannot tell (an
    `autograd.grad` that asks for `owner` itself, a call outside backward): True."""
    try:
        node = torch.autograd.graph.get_gradient_edge(owner).node
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return True


def accumulate_main_grad(owner: Tensor, grad: Tensor) -> None:
    """Megatron-style: add the FP32 gradient `grad` (of owner's local shard, for a DTensor
    owner) into `owner.main_grad`, creating it at the first backward of a step. Nothing is
    added by a backward pass that does not accumulate into `owner` (`_engine_accumulates`).
    `nn.Module.zero_grad` clears it as it clears `.grad` (`_clear_main_grads`)."""
    if not _engine_accumulates(owner):
        return
    g = wrap_like(owner, grad)
    if getattr(owner, "main_grad", None) is None:
        _install_zero_grad()
        lifecycle.main_grad_started(owner)
        owner.main_grad = g
    else:
        owner.main_grad.add_(g)


# `model.zero_grad()` must clear main_grad as it clears `.grad` (a micro-batch discarded with
# it must not reach the next step), and torch gives a module's zero_grad no hook: zrw wraps
# nn.Module.zero_grad once, when it first accumulates a main_grad. The wrapper runs torch's own
# zero_grad, then clears the main_grad of each parameter of the module whose record says zrw
# accumulates it (set_to_none: None, as torch sets `.grad`; else zeros); other parameters and
# modules are untouched.
_zero_grad_installed = False


def _install_zero_grad() -> None:
    global _zero_grad_installed
    if _zero_grad_installed:
        return
    _zero_grad_installed = True
    torch_zero_grad = torch.nn.Module.zero_grad

    @functools.wraps(torch_zero_grad)
    def zero_grad(self, set_to_none: bool = True) -> None:
        torch_zero_grad(self, set_to_none)
        _clear_main_grads(self.parameters(), set_to_none)

    torch.nn.Module.zero_grad = zero_grad


def _clear_main_grads(params, set_to_none: bool) -> None:
    for p in params:
        if getattr(p, "main_grad", None) is None:
            continue
        rec = find_record(p)
        if rec is None or not rec.main_grad:
            continue
        if set_to_none:
            p.main_grad = None
        else:
            with torch.no_grad():
                p.main_grad.zero_()


def prepare_local_shards(module, args, kwargs=None):
    """Forward pre-hook of a zrw layer with DTensor weights (zrw.parallel.prepare installs it):
    quantize (and release) the local shards now, before an engine's forward wrapper swaps in
    `to_local()` views of them."""
    if not torch.is_grad_enabled():
        return None  # eval / inference: nothing is cached or released (zrw.cache)
    policy = WeightPolicy.of(module)
    for pname in module.zrw_quantized:
        p = module._parameters.get(pname)
        if is_dtensor(p):
            quant_local(
                p._local_tensor,
                p.requires_grad,
                policy.recipe,
                policy.release,
                policy.release_frozen,
                cache.weight_name(p._local_tensor) or None,
            )
    return None
