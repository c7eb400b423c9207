"""zrw.convert: swap a model's linear layers and fused MoE experts for their MXFP8 versions."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from .. import cache, lifecycle
from .._dtensor import local_tensor
from ..config import QuantRecipe, get_recipe, known_recipes
from ..planes import checked_model, is_zrw_layer, name_list  # noqa: F401  (is_zrw_layer: as before)
from ..record import find_record, module_record
from .grouped import MXFusedExperts, is_fused_experts
from .linear import MXLinear

DEFAULT_SKIP = ("lm_head", "embed", "wte", "wpe")


@dataclass
class ConvertSummary:
    """What convert() did. `release_bytes` are the BF16 bytes the converted weights will release
    at their first use in a training step (the guard also checks aliasing at run time)."""

    recipe: str
    converted: List[str] = field(default_factory=list)
    parameters: int = 0
    release_bytes: int = 0
    released_weights: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        head = (
            f"zrw.convert ({self.recipe}): {len(self.converted)} modules converted, "
            f"{self.parameters} weights, {self.release_bytes / 2**20:.2f} MiB of BF16 "
            f"weights released per step"
        )
        return "\n".join([head] + [f"  kept {n}: {why}" for n, why in self.skipped.items()])


def _owners(model: nn.Module) -> Dict[int, List[str]]:
    """id of each parameter -> the qualified names it is held under (by every module)."""
    owners: Dict[int, List[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    return owners


def _releasable(p: torch.Tensor) -> bool:
    local = local_tensor(p)  # a sharded weight releases its local shard
    return (
        p.requires_grad
        and local.storage_offset() == 0
        and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    )


def _check_not_engine_wrapped(name: str, module: nn.Module) -> None:
    """transformers' tp_plan / ep_plan replace a module's forward by a wrapper that closes over
    the module itself; a converted replacement would silently lose the wrapper's collectives."""
    if getattr(module, "_is_hooked", False):
        raise RuntimeError(
            f"zrw.convert: '{name}' ({type(module).__name__}) was already sharded by "
            "transformers' tensor/expert-parallel plan: its forward is the engine's wrapper "
            "around this very module, which a converted module cannot take over. Convert "
            "before the plan is applied: build the model (its class or from_config, or "
            "from_pretrained without distributed_config), call zrw.convert, then apply the "
            "plan (zrw.parallel.apply_plan(model, DistributedConfig(...)), which runs "
            "transformers' own engine) and zrw.parallel.prepare(model). (With PyTorch's "
            "parallelize_module either order works.)"
        )


def convert(
    model: nn.Module,
    recipe: str | QuantRecipe = "mxfp8",
    release: bool = True,
    skip: Optional[Iterable[str]] = None,
    release_frozen: bool = False,
    main_grad: bool = False,
) -> ConvertSummary:
    """Replace, in place, every nn.Linear and every fused-experts module (Hugging Face's 3-D
    gate_up_proj / down_proj layout) whose qualified name contains none of `skip` (name parts;
    default: lm_head and embeddings stay in high precision; a str is ONE name part, never its
    characters; an empty one is refused). Returns a ConvertSummary.

    The parameters are kept (the same objects: optimizers that hold them still work, and the
    state_dict keys do not change). A weight shared by several modules (tied, by identity) is
    converted with release=False and never released. `main_grad=True` accumulates the weight
    gradients in FP32 `main_grad` (Megatron-style) instead of `.grad`. Convert before
    transformers' tp_plan / ep_plan is applied (a module it already wraps is refused); with
    PyTorch's parallelize_module either order works. A sharded weight's `release_bytes` are its
    local shard's.

    Every argument is checked before the model is touched, each error naming it. A
    `torch.compile(model)` wrapper is converted as the model it wraps (`_orig_mod`).
    """
    op = "zrw.convert"
    model = checked_model(op, model)  # torch.compile(model): the model itself
    if not isinstance(recipe, (str, QuantRecipe)):
        raise TypeError(
            f"{op}: recipe must be a zrw.QuantRecipe or a registered recipe name "
            f"(one of {known_recipes()}), got {type(recipe).__name__}"
        )
    if isinstance(recipe, str) and recipe not in known_recipes():
        raise ValueError(
            f"{op}: recipe must be a zrw.QuantRecipe or one of {known_recipes()}, got {recipe!r}"
        )
    flags = {"release": release, "release_frozen": release_frozen, "main_grad": main_grad}
    for arg, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {arg} must be a bool, got {type(value).__name__} ({value!r})")
    skip = DEFAULT_SKIP if skip is None else tuple(skip) if isinstance(skip, dict) else skip
    what = "name parts of the modules to keep in high precision"
    skip = name_list(op, "skip", skip, what, "module name contains: it would skip every module")
    rcp = get_recipe(recipe)
    summary = ConvertSummary(recipe=rcp.name)
    tied = {k: v for k, v in _owners(model).items() if len(set(v)) > 1}  # tied weights

    unconverted_experts: List[str] = []

    def visit(parent: nn.Module, prefix: str, param_wrapped: bool = False) -> None:
        # A PEFT tuner layer (LoRA, ...) names its adapter sub-layers: they stay trainable in
        # high precision, in either order of convert and get_peft_model.
        adapters = set(getattr(parent, "adapter_layer_names", ()) or ())
        # PEFT's LoRA on parameters (target_parameters: a ParamWrapper, which names its
        # `parameter_name`) rebuilds the wrapped weight as W + BA at every forward.
        param_wrapped = param_wrapped or bool(adapters and hasattr(parent, "parameter_name"))
        for cname, child in list(parent.named_children()):
            name = f"{prefix}.{cname}" if prefix else cname
            if isinstance(child, (MXLinear, MXFusedExperts)):
                summary.skipped[name] = "already converted"
                continue
            if cname in adapters:
                summary.skipped[name] = "PEFT adapter layer: kept in high precision"
                continue
            is_linear = type(child) is nn.Linear
            is_experts = not is_linear and is_fused_experts(child)
            if not (is_linear or is_experts):
                visit(child, name, param_wrapped)
                continue
            if is_experts and param_wrapped:
                unconverted_experts.append(name)
            hit = next((s for s in skip if s in name), None)
            if hit is not None:
                summary.skipped[name] = f"skipped (name matches {hit!r})"
                continue
            _check_not_engine_wrapped(name, child)
            # The replacement keeps the source's parameters: those it declares it quantizes.
            layer_cls = MXLinear if is_linear else MXFusedExperts
            weights = [(pname, getattr(child, pname)) for pname in layer_cls.zrw_quantized]
            shared = [w for _, w in weights if id(w) in tied]
            layer_release = release and not shared
            if shared:
                summary.skipped[name] = (
                    "converted, never released: tied weight shared with "
                    + ", ".join(tied[id(shared[0])])
                )
            args = (child, rcp, layer_release, release_frozen)
            if is_linear:
                new = MXLinear.from_linear(*args, main_grad, name=f"{name}.weight")
            else:
                new = MXFusedExperts(*args, name=name, main_grad=main_grad)
            setattr(parent, cname, new)
            summary.converted.append(name)
            for pname, w in weights:
                summary.parameters += 1
                local = local_tensor(w)
                if layer_release and (
                    _releasable(w)
                    or (release_frozen and not w.requires_grad and local.storage_offset() == 0)
                ):
                    summary.release_bytes += local.numel() * local.element_size()
                    summary.released_weights.append(f"{name}.{pname}")

    visit(model, "")
    if unconverted_experts:
        shown = ", ".join(unconverted_experts[:4])
        more = f" and {len(unconverted_experts) - 4} more" if len(unconverted_experts) > 4 else ""
        for name in unconverted_experts:
            summary.skipped[name] = (
                "converted, never released: PEFT's LoRA on its weights "
                "(target_parameters) rebuilds them at every forward"
            )
        warnings.warn(
            f"zrw.convert: {len(unconverted_experts)} fused-experts module(s) under PEFT's LoRA "
            f"on parameters (target_parameters): {shown}{more}. PEFT rebuilds their weight "
            "stacks as W + BA at every forward, so zrw quantizes that sum at each use and "
            "cannot release the BF16 stacks (no saving on them; numerics as without release). "
            "For the saving, target the experts' linear modules, or train the experts without "
            "LoRA on their parameters",
            UserWarning,
            stacklevel=2,
        )
    _install_root_hooks(model)
    return summary


def _install_root_hooks(model: nn.Module) -> None:
    """Hooks on the converted model itself (once): the all-or-nothing load_state_dict check,
    and the tie checks at the first forward of each step and at state_dict()."""
    rec = module_record(model)
    if rec.root_hooks is not None:
        return
    rec.root_hooks = (
        model.register_load_state_dict_pre_hook(_validate_load),
        model.register_forward_pre_hook(_tie_check_pre_hook),
        model.register_state_dict_pre_hook(_tie_check_state_dict_pre_hook),
    )


@torch._dynamo.disable(reason=cache.EAGER_ONLY)
def _tie_check_pre_hook(module: nn.Module, args) -> None:
    """hold_tied_weights at the first forward of each optimizer step (module-level, so that the
    model still pickles; eager-only, like the cache it reads)."""
    step = cache.cache_stats()["step"]
    rec = module_record(module)
    if rec.tie_step != step:
        rec.tie_step = step
        hold_tied_weights(module)


def _tie_check_state_dict_pre_hook(module: nn.Module, prefix, keep_vars) -> None:
    """state_dict() of a converted model: a weight tied since the last check is restored first,
    so that every module holding it reads its value."""
    hold_tied_weights(module)


def hold_tied_weights(model: nn.Module) -> List[str]:
    """Weights of zrw layers that another module holds too (tied after convert, e.g.
    `lm_head.weight = embed_tokens.weight`): the other module reads the tensor, so it must
    never be released. Each is restored (exactly, from its master) if it is released, and kept
    from release for as long as it is shared, as convert keeps the weights tied before it.
    Returns the names of the tied weights. The converted model runs this at the first forward
    of every optimizer step, and at every state_dict() and load_state_dict(); call it yourself
    after tying weights if the next thing you do is `model.apply(fn)` or a cast."""
    model = checked_model("zrw.nn.convert.hold_tied_weights", model)
    owners = _owners(model)
    quantized: Dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for pname in getattr(mod, "zrw_quantized", ()):
            if mod._parameters.get(pname) is not None:
                quantized[id(mod._parameters[pname])] = mod._parameters[pname]
    tied = []
    for key, p in quantized.items():
        names = sorted(set(owners[key]))
        local = local_tensor(p)
        rec = find_record(local)
        if len(names) > 1:
            tied.append(names[0])
            lifecycle.tie(local, tuple(names))
            if cache.cache_state(local).released:
                cache.restore_value(local)
        elif rec is not None and rec.tied:
            lifecycle.tie(local, None)
    return tied


def _validate_load(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """load_state_dict of a converted model is all or nothing: every value is checked against
    its parameter or buffer (a tensor, of the same shape), as torch checks each when it copies
    it, but before the first one is written, so that a load that fails changes nothing (torch
    itself writes the valid keys, then raises)."""
    hold_tied_weights(module)  # a weight tied since the last forward: restored first
    errors = []
    for mname, mod in module.named_modules():
        base = f"{prefix}{mname}." if mname else prefix
        tensors = list(mod._parameters.items()) + [
            (n, b)
            for n, b in mod._buffers.items()
            if n not in getattr(mod, "_non_persistent_buffers_set", ())
        ]
        for name, param in tensors:
            key = base + name
            if param is None or key not in state_dict:
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                errors.append(
                    f'While copying the parameter named "{key}", expected '
                    "torch.Tensor or Tensor-like object from checkpoint but "
                    f"received {type(value)}"
                )
                continue
            if isinstance(param, nn.parameter.UninitializedParameter):
                continue
            shape = tuple(param.shape)
            if not shape and tuple(value.shape) == (1,):
                continue  # torch accepts a 1-element 1-d value for a 0-d parameter
            if tuple(value.shape) != shape:
                errors.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(value.shape)} from checkpoint, the shape in current "
                    f"model is {torch.Size(shape)}."
                )
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__} (zrw: checked before "
            "any value was written; the model is unchanged):\n\t" + "\n\t".join(errors)
        )
