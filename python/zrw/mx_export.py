"""The trained MXFP8 weights as torchao MX tensors, out and back in (docs/export.md).

Public as zrw.checkpoint.export_mx, iter_mx_state_dict, load_mx and save_mx_pretrained: each
converted weight's forward MXFP8 plane, byte for byte, as torchao's MX inference tensor
(MXTensor), the rest of the state dict as zrw.checkpoint.iter_state_dict gives it. That plane
(E4M3 or E5M2 codes in blocks of 32 along K, one E8M0 scale per block, (.., N, K/32); for
"mxfp8-32x32" the row expansion of the tile scales) is the layout of torchao's MXTensor for a
linear weight, so zrw's bytes go to torchao unchanged: nothing is re-quantized by torchao.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import cache, lifecycle
from ._dtensor import is_dtensor, local_tensor
from ._safetensors import (
    MX_DTYPES,
    checked_entry,
    checked_path,
    fspath,
    saved_value,
    state_plan,
    temporary_name,
    write_file,
)
from .planes import MXPlanesCarrier, checked_model, is_zrw_layer
from .record import find_record

_SCALE_DTYPE = torch.float8_e8m0fnu
_CHOICES = {  # argument -> (its values, what it means)
    "kernel": (
        ("emulated", "auto"),
        "torchao's KernelPreference: 'emulated' runs on any device, 'auto' needs torchao's MX "
        "GEMM on a CUDA GPU",
    ),
    "experts": (
        ("refuse", "bf16"),
        "what to do with 3-d expert stacks, which torchao's MXTensor cannot serve in "
        "transformers' experts",
    ),
}


def _choice(op: str, arg: str, value) -> str:
    allowed, why = _CHOICES[arg]
    if not isinstance(value, str):
        raise TypeError(f"{op}: {arg} must be a str, one of {allowed}, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{op}: {arg} must be one of {allowed} ({why}), got {value!r}")
    return value


def _torchao(op: str, kernel: str = "emulated", scale_mode: str = "rceil"):
    """torchao's MXTensor, its kwargs class, and `kernel`'s and `scale_mode`'s torchao enums."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, QuantizeTensorToMXKwargs
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as e:  # pragma: no cover - torchao is in the test extra
        raise ImportError(
            f"{op}: the MX export builds torchao's MXTensor (torchao.prototype.mx_formats), "
            f"but torchao could not be imported ({e}); install it: pip install torchao==0.18.0"
        ) from e
    pref = KernelPreference.EMULATED if kernel == "emulated" else KernelPreference.AUTO
    mode = Mode.RCEIL if scale_mode == "rceil" else Mode.FLOOR
    return MXTensor, QuantizeTensorToMXKwargs, pref, mode


class _MXEntry(NamedTuple):
    """One converted weight of the export plan."""

    name: str
    param: Tensor
    recipe: object


def _mx_plan(
    op: str, model: torch.nn.Module, experts: str
) -> Tuple[Dict[str, Tensor], Dict[str, _MXEntry]]:
    """model.state_dict() (released weights as themselves) and, by state-dict name, the
    converted weights to export as MX; every refusal is raised here, before anything is
    quantized, built or written."""
    model = checked_model(op, model)
    plan = state_plan(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    mx: Dict[str, _MXEntry] = {}
    for name in plan:
        prefix, _, pname = name.rpartition(".")
        module = modules.get(prefix)
        if module is not None and is_zrw_layer(module) and pname in module.zrw_quantized:
            mx[name] = _MXEntry(name, module._parameters.get(pname), module.recipe)
    if not mx:
        raise ValueError(
            f"{op}: model has no converted weights (no zrw layer: MXLinear, MXFusedExperts); "
            "the MX export reads the FP8 copies zrw trains with. Convert it first "
            "(zrw.convert(model, recipe)), or save BF16 with zrw.checkpoint.save_safetensors"
        )
    by_tensor: Dict[int, str] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        if name in plan:
            first = by_tensor.setdefault(id(t), name)
            if first != name and (first in mx or name in mx):
                raise ValueError(
                    f"{op}: weight '{name}' is the same tensor as '{first}' (tied weights), "
                    "and one of them is a converted weight: an MX export holds one tensor per "
                    "name, MX or not, so the tie would not survive a load. Keep the tied "
                    "module in high precision (zrw.convert(..., skip=[...])) or untie it"
                )
    stacks: list = []
    for name, e in mx.items():
        p = e.param
        if "." not in name:
            raise ValueError(
                f"{op}: converted weight '{name}' has no module prefix: torchao's format names "
                "an MX tensor's parts '<module>._<param>_qdata', so the model itself cannot be "
                "the zrw layer; wrap it (torch.nn.Sequential(model))"
            )
        if isinstance(p, MXPlanesCarrier):
            raise TypeError(
                f"{op}: weight '{name}' is an FSDP2 gathered weight ({type(p).__name__}); "
                "export outside FSDP2's forward, from the unsharded model"
            )
        if not isinstance(p, Tensor) or is_dtensor(p):
            raise TypeError(
                f"{op}: weight '{name}' must be a plain tensor on one device, got "
                f"{type(p).__name__} (a sharded model: gather it first, e.g. save with "
                "torch.distributed.checkpoint and load into one unsharded model)"
            )
        if p.is_meta:
            raise ValueError(f"{op}: weight '{name}' is on the meta device (no data to export)")
        if p.dim() == 3:
            if experts == "bf16":
                stacks.append(name)
                continue
            raise ValueError(
                f"{op}: weight '{name}' is a 3-d expert stack {tuple(p.shape)}: torchao 0.18's "
                "MXTensor runs linear layers only (transformers' experts forward transposes the "
                "stack and calls grouped_mm, which MXTensor does not implement). Pass "
                "experts='bf16' to export the stacks as their exact BF16 values (not the "
                "training grid), or keep them out of zrw.convert"
            )
        if p.dim() != 2:
            raise ValueError(f"{op}: weight '{name}' must be (N, K), got shape {tuple(p.shape)}")
        if p.shape[-1] % 32 != 0:
            raise ValueError(
                f"{op}: weight '{name}' has K = {p.shape[-1]} (shape {tuple(p.shape)}), not a "
                "multiple of 32: torchao's MXTensor holds whole blocks of 32 along K only "
                "(zrw's last, shorter block has no torchao layout)"
            )
        local = local_tensor(p)
        rec = find_record(local)
        asked = (e.recipe.cache_layout, e.recipe.elem_dtype, e.recipe.scale_mode)
        if (
            rec is not None
            and rec.quantized_as not in (None, asked)
            and cache.cache_state(local).released
        ):
            raise ValueError(
                f"{op}: weight '{name}' is released with its FP8 copy made as "
                f"{rec.quantized_as}, but its layer now asks for {asked} (its recipe changed "
                "since): the copy the forward used and the layer disagree. Restore it first "
                "(zrw.cache.restore_all('master')) or export with the recipe it trained with"
            )
        if p.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(
                f"{op}: weight '{name}' has dtype {p.dtype}: torchao's MX tensors dequantize to "
                "bfloat16 or float32 only"
            )
    for name in stacks:
        del mx[name]
    if not mx:
        raise ValueError(f"{op}: model has no converted 2-d weights to export as MX")
    return plan, mx


def _forward_plane(e: _MXEntry) -> Tuple[Tensor, Tensor]:
    """The forward plane of a converted weight, as copies: the cache's inference read
    (docs/design.md §5), which serves the cached copy or makes the one the next forward will
    use (from the FP32 master after a BF16-free step) and changes no entry, state or record."""
    w = local_tensor(e.param)
    r = e.recipe
    tensors = lifecycle.served(w, (r.cache_layout, r.elem_dtype, r.scale_mode), e.name)
    data, scale = tensors[0], tensors[1]
    want = (*w.shape[:-1], w.shape[-1] // 32)
    if data.shape != w.shape or tuple(scale.shape) != want or scale.dtype != _SCALE_DTYPE:
        raise RuntimeError(  # pragma: no cover - the cache's layout contract
            f"zrw.checkpoint: weight '{e.name}': the cache returned a forward plane of shape "
            f"{tuple(data.shape)} with scale {tuple(scale.shape)} {scale.dtype}, expected "
            f"{tuple(w.shape)} and {want} {_SCALE_DTYPE}"
        )
    return data.clone(), scale.clone()


def _mx_tensor(op: str, e: _MXEntry, data: Tensor, scale: Tensor, kernel: str):
    MXTensor, Kwargs, pref, mode = _torchao(op, kernel, e.recipe.scale_mode)
    # The activations: quantized by torchao at serving time, as zrw's layers do (1x32 blocks
    # along K, the recipe's element dtype and scale rule).
    act = Kwargs(
        elem_dtype=e.recipe.elem_dtype, block_size=32, scaling_mode=mode, kernel_preference=pref
    )
    return MXTensor(data, scale, data.dtype, 32, e.param.dtype, pref, act, False)


def iter_mx_state_dict(
    model: torch.nn.Module, *, kernel: str = "emulated", experts: str = "refuse"
) -> Iterator[Tuple[str, Tensor]]:
    """(name, tensor) for every entry of `model.state_dict()`, in its order, each converted
    weight as torchao's MXTensor holding zrw's forward plane (see `export_mx`), the rest as
    `iter_state_dict` gives it (BF16 as trained). One MX weight's codes and scales (about 1.03
    bytes per element) are copied when its turn comes; drop it before asking for the next.
    Every check runs at the call, before anything is iterated."""
    op = "zrw.checkpoint.iter_mx_state_dict"
    _choice(op, "kernel", kernel)
    plan, mx = _mx_plan(op, model, _choice(op, "experts", experts))
    _torchao(op)

    def entries() -> Iterator[Tuple[str, Tensor]]:
        for name, t in plan.items():
            e = mx.get(name)
            if e is None:
                yield name, saved_value(name, t)
            else:
                yield name, _mx_tensor(op, e, *_forward_plane(e), kernel)

    return entries()


def export_mx(
    model: torch.nn.Module,
    path: "str | os.PathLike | None" = None,
    *,
    kernel: str = "emulated",
    experts: str = "refuse",
) -> Optional[Dict[str, Tensor]]:
    """Export the training grid: each converted weight's forward MXFP8 plane as torchao's MX
    inference tensor (MXTensor), byte for byte the plane zrw computes with (the cached copy,
    else the one the next forward makes with zrw's own op: from the FP32 master after a
    BF16-free step, never from a rounded BF16 copy), every other entry of the state dict as it
    is. Nothing in the cache changes. `kernel` is torchao's KernelPreference for serving:
    "emulated" (any device) or "auto" (torchao's MX GEMM, a CUDA GPU that has one). path None:
    returns the state dict; else writes a safetensors file in torchao's format, one tensor at a
    time, and returns None. Every check runs before anything is quantized or the file is
    opened."""
    op = "zrw.checkpoint.export_mx"
    _choice(op, "kernel", kernel)
    if path is not None:
        path = checked_path(op, path)
    plan, mx = _mx_plan(op, model, _choice(op, "experts", experts))
    _torchao(op)
    if path is None:
        return dict(iter_mx_state_dict(model, kernel=kernel, experts=experts))
    write_file(path, *_mx_file(op, plan, mx, kernel))
    return None


def _mx_file(op, plan, mx, kernel):
    """The safetensors file of an MX export, checked and laid out, nothing written yet:
    (metadata, entries (file name, dtype, shape) in order, produce(file name) -> the tensor to
    write). Every refusal is raised here, before any file is opened or created."""
    from torchao.prototype.safetensors.safetensors_utils import TensorSubclassAttributeJSONEncoder

    metadata: Dict[str, str] = {"format": "pt"}
    parts: Dict[str, Tuple[str, str]] = {}  # file name -> (state-dict name, "qdata"/"scale")
    entries: list = []
    for name, t in plan.items():
        e = mx.get(name)
        if e is None:
            checked_entry(op, name, t, MX_DTYPES)
            metadata[name] = json.dumps({"_type": "Tensor"})
            entries.append((name, t.dtype, t.shape))
            parts[name] = (name, "")
            continue
        p = e.param
        sshape = [*p.shape[:-1], p.shape[-1] // 32]
        elem = e.recipe.elem_dtype
        meta = (
            torch.empty(p.shape, dtype=elem, device="meta"),
            torch.empty(sshape, dtype=_SCALE_DTYPE, device="meta"),
        )
        metadata[name] = json.dumps(
            _mx_tensor(op, e, *meta, kernel), cls=TensorSubclassAttributeJSONEncoder
        )
        module, _, pname = name.rpartition(".")
        for part, dtype, shape in (("qdata", elem, p.shape), ("scale", _SCALE_DTYPE, sshape)):
            fname = f"{module}._{pname}_{part}"
            entries.append((fname, dtype, shape))
            parts[fname] = (name, part)
    metadata["tensor_names"] = json.dumps(list(plan))
    held: Dict[str, Tensor] = {}  # the scale of the weight whose codes were just written

    def produce(fname: str) -> Tensor:
        name, part = parts[fname]
        if not part:
            return saved_value(name, plan[name])
        if part == "qdata":
            data, held[name] = _forward_plane(mx[name])
            return data
        return held.pop(name)

    return metadata, entries, produce


def load_mx(model: torch.nn.Module, path: "str | os.PathLike") -> torch.nn.Module:
    """Load a file written by `export_mx(model, path)` into `model`, an unconverted model of
    the same architecture: each exported weight becomes an `nn.Parameter(MXTensor,
    requires_grad=False)` (nn.Linear runs it through torchao's MX linear), every other entry is
    loaded as saved. Returns `model` (a `torch.compile` wrapper: the wrapper). All or nothing:
    every entry of the file is checked against the model first (names, shapes, none missing);
    where any does not match, the error names each mismatch and nothing was written."""
    op = "zrw.checkpoint.load_mx"
    given = model
    model = checked_model(op, model)
    path = checked_path(op, path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{op}: path {path!r} does not exist")
    layers = [n or "<model>" for n, m in model.named_modules() if is_zrw_layer(m)]
    if layers:
        raise ValueError(
            f"{op}: model has zrw layers ({', '.join(layers[:3])}"
            f"{' and more' if len(layers) > 3 else ''}): load the MX export into an unconverted "
            "model of the same architecture (torchao's MX weights run in nn.Linear)"
        )
    MXTensor = _torchao(op)[0]
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    from torchao.prototype.safetensors.safetensors_utils import is_metadata_torchao

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    if not is_metadata_torchao(metadata):
        raise ValueError(
            f"{op}: {path!r} holds no torchao metadata (tensor_names and one entry per "
            "tensor): write it with zrw.checkpoint.export_mx(model, path)"
        )
    state, leftover = unflatten_tensor_state_dict(load_file(path), metadata)
    if leftover:
        raise ValueError(f"{op}: {path!r} holds tensors no entry names: {sorted(leftover)[:5]}")
    mx = {k: v for k, v in state.items() if isinstance(v, MXTensor)}
    plain = {k: v for k, v in state.items() if k not in mx}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    # What load_state_dict(strict=True) would write into: checked before the first write.
    targets = model.state_dict(keep_vars=True)
    errors = []
    for name, t in mx.items():
        old = params.get(name)
        if old is None or name.rpartition(".")[0] not in modules:
            errors.append(f"MX weight '{name}' is in the file, but the model has no such parameter")
        elif tuple(old.shape) != tuple(t.shape):
            errors.append(
                f"MX weight '{name}' has shape {tuple(t.shape)} in the file, the model's "
                f"parameter has {tuple(old.shape)}"
            )
    for name, t in plain.items():
        target = targets.get(name)
        if name not in targets:
            errors.append(f"'{name}' is in the file, but the model has no such entry")
        elif not isinstance(target, Tensor):
            continue  # a module's extra state: its own set_extra_state checks it
        elif not isinstance(t, Tensor):
            errors.append(f"'{name}' must be a tensor in the file, found {type(t).__name__}")
        elif tuple(t.shape) != tuple(target.shape) and not (
            target.dim() == 0 and tuple(t.shape) == (1,)
        ):
            errors.append(
                f"'{name}' has shape {tuple(t.shape)} in the file, the model's has "
                f"{tuple(target.shape)}"
            )
    missing = [k for k in targets if k not in state]
    if missing:
        errors.append(
            f"the model's entries {missing[:5]}{' and more' if len(missing) > 5 else ''} are "
            "not in the file"
        )
    if errors:
        raise ValueError(
            f"{op}: {path!r} does not match model (checked before anything was written; the "
            "model is unchanged):\n\t" + "\n\t".join(errors)
        )
    result = model.load_state_dict(plain, strict=False)
    if result.unexpected_keys or [k for k in result.missing_keys if k not in mx]:
        raise RuntimeError(  # pragma: no cover - every key was checked above
            f"{op}: internal error: keys not checked before the load: "
            f"{result.unexpected_keys} {result.missing_keys}"
        )
    for name, t in mx.items():
        prefix, _, pname = name.rpartition(".")
        setattr(modules[prefix], pname, torch.nn.Parameter(t, requires_grad=False))
    return given


def save_mx_pretrained(
    model: torch.nn.Module,
    save_directory: "str | os.PathLike",
    *,
    kernel: str = "emulated",
    experts: str = "refuse",
) -> None:
    """Write a Hugging Face model directory that `from_pretrained` loads as torchao's MX
    inference model: `config.json` with `quantization_config` = TorchAoConfig(
    MXDynamicActivationMXWeightConfig(...)) (the recipe's element dtype and scale rule,
    `kernel`), `generation_config.json` where the model has one, and `model.safetensors` as
    `export_mx` writes it. `model` is a converted transformers model (or a `torch.compile`
    wrapper of one); its own config is left unchanged. All or nothing: every check runs first,
    and the files go to a temporary directory that takes `save_directory`'s place (or whose
    files replace its files) once all are complete: a refused or failed call leaves nothing."""
    op = "zrw.checkpoint.save_mx_pretrained"
    _choice(op, "kernel", kernel)
    model = checked_model(op, model)
    save_directory = fspath(op, "save_directory", save_directory, "directory")
    if os.path.exists(save_directory) and not os.path.isdir(save_directory):
        raise ValueError(f"{op}: save_directory {save_directory!r} is a file, not a directory")
    plan, mx = _mx_plan(op, model, _choice(op, "experts", experts))
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"{op}: model must be a transformers PreTrainedModel (it has no config with "
            f"save_pretrained: {type(model).__name__}); use export_mx(model, path) for others"
        )
    recipes = {(e.recipe.elem_dtype, e.recipe.scale_mode) for e in mx.values()}
    dtypes = {e.param.dtype for e in mx.values()}
    if len(dtypes) != 1:
        raise ValueError(
            f"{op}: the converted weights have several dtypes ({sorted(map(str, dtypes))}); "
            "from_pretrained loads a model in one dtype"
        )
    if len(recipes) != 1:
        raise ValueError(
            f"{op}: the converted weights use several element dtypes / scale rules "
            f"({sorted(str(r) for r in recipes)}); one torchao config describes one"
        )
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
    from transformers import TorchAoConfig

    ((elem, scale_mode),) = recipes
    _, _, pref, mode = _torchao(op, kernel, scale_mode)
    qc = TorchAoConfig(
        MXDynamicActivationMXWeightConfig(
            activation_dtype=elem, weight_dtype=elem, kernel_preference=pref, scaling_mode=mode
        )
    )
    file = _mx_file(op, plan, mx, kernel)
    config = copy.deepcopy(config)  # the model's own config stays as it is
    config.quantization_config = qc
    # from_pretrained's dtype="auto" reads it (it cannot infer one from E8M0 scales).
    config.dtype = next(iter(dtypes))
    gen = getattr(model, "generation_config", None)
    # Staged in the nearest existing directory of the target, on its file system: a rename puts
    # it in place. (mkdir, not mkdtemp: the directory gets the mode of any other one.)
    ancestor = os.path.abspath(save_directory)
    while not os.path.isdir(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)
    staging = os.path.join(ancestor, "." + temporary_name())
    os.mkdir(staging)
    try:
        write_file(os.path.join(staging, "model.safetensors"), *file)
        config.save_pretrained(staging)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(staging)
        if os.path.isdir(save_directory):
            for fname in sorted(os.listdir(staging)):
                os.replace(os.path.join(staging, fname), os.path.join(save_directory, fname))
        else:
            os.makedirs(os.path.dirname(os.path.abspath(save_directory)), exist_ok=True)
            os.rename(staging, save_directory)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
