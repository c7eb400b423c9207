"""Every op in the `zrw` library is complete: schema, CPU kernel, fake, wrapper and reference.

The ops are enumerated from the dispatcher, so an op added to csrc/registration.cpp is checked here
without touching this file (docs/design.md §10, "An op, end to end").
"""

import inspect

import pytest
import torch
from torch._library import simple_registry

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from zrw import cache, lifecycle, ops, reference

# Ops that legitimately have no plain-PyTorch spec in zrw.reference because they are stateful
# (the native weight cache: lookups, release/restore, step bookkeeping): their behaviour is a
# sequence of effects, tested in their own files, not a function of their arguments. Each entry
# needs a reason. Everything else must have a reference.
_CACHE = (
    "stateful: the native weight cache (a process-wide table, storage release and "
    "restore); its behaviour is a sequence of effects, tested in tests/cache/"
)
STATEFUL_NO_REFERENCE: dict = {
    "quant_and_release": _CACHE,
    "restore": _CACHE,
    "restore_all": _CACHE,
    "cache_invalidate": _CACHE,
    "cache_clear": _CACHE,
    "next_step": _CACHE,
    "cache_stats": _CACHE,
    "cache_entries": _CACHE,
    "cache_state": _CACHE,
    "cache_states": _CACHE,
    "restore_weights": _CACHE,
    "assign_weights": _CACHE,
    "cache_master": _CACHE,
}

# The MX ops this package was built around: if one disappears, the enumeration is broken.
CORE_OPS = {"mx_quantize", "mx_quantize_dual", "mx_quantize_block", "mx_dequantize", "mx_matmul"}


def zrw_op_names():
    """Short names of every op registered in the zrw namespace, sorted."""
    return sorted(
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("zrw::")
    )


OP_NAMES = zrw_op_names()


def test_the_zrw_library_is_registered():
    assert CORE_OPS <= set(OP_NAMES), f"zrw ops found: {OP_NAMES}"


def test_exemptions_name_existing_ops():
    # A stale exemption would silently cover a future op of the same name.
    assert set(STATEFUL_NO_REFERENCE) <= set(OP_NAMES)
    assert not set(STATEFUL_NO_REFERENCE) & CORE_OPS


def _schemas(name):
    packet = getattr(torch.ops.zrw, name)
    return [getattr(packet, overload)._schema for overload in packet.overloads()]


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_has_a_schema(name):
    schemas = _schemas(name)
    assert schemas, f"zrw::{name} has no overload"
    for schema in schemas:
        assert schema.name == f"zrw::{name}"


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_has_a_cpu_kernel(name):
    # A kernel that serves CPU: a CPU registration, or CompositeExplicitAutograd (how ops without
    # a tensor to dispatch on, such as the cache bookkeeping, register).
    assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"zrw::{name}", "CPU"), (
        f"zrw::{name} has no kernel for CPU"
    )


# Cache ops with no tensor argument: FakeTensor and meta tensors can never dispatch to them, so a
# fake would be unreachable. (The cache ops that take a weight have fakes that refuse clearly.)
TENSORLESS_NO_FAKE = {"restore_all", "cache_clear", "next_step", "cache_stats", "cache_entries"}


@pytest.mark.parametrize("name", [n for n in OP_NAMES if n not in TENSORLESS_NO_FAKE])
def test_op_has_a_fake(name):
    # torch.library.register_fake records the fake in torch's simple registry and also installs
    # it as the op's Meta kernel; a C++ Meta kernel serves FakeTensor too. A CompositeExplicit
    # kernel does not count: on meta/fake tensors it would run the real (stateful) code.
    qualname = f"zrw::{name}"
    python_fake = simple_registry.singleton.find(qualname).fake_impl.kernel is not None
    meta_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")
    assert python_fake or meta_kernel, f"{qualname} has no fake (register_fake) or Meta kernel"


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_has_a_wrapper(name):
    # Stateless ops are wrapped in zrw.ops; the cache's stateful ones are zrw.cache's public
    # calls, and the op itself is called by the lifecycle (the only writer of weight state).
    module = cache if name in STATEFUL_NO_REFERENCE else ops
    wrapper = getattr(module, name, None)
    assert callable(wrapper), f"{module.__name__}.{name} is missing"
    source = inspect.getsource(wrapper)
    if module is cache and f"torch.ops.zrw.{name}" not in source:
        source = inspect.getsource(lifecycle)
    assert f"torch.ops.zrw.{name}" in source, f"{module.__name__}.{name}: nothing calls the op"


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_has_a_reference(name):
    if name in STATEFUL_NO_REFERENCE:
        pytest.skip(f"stateful, no reference: {STATEFUL_NO_REFERENCE[name]}")
    assert callable(getattr(reference, name, None)), f"zrw.reference.{name} is missing"


@pytest.mark.parametrize("name", [n for n in OP_NAMES if n not in STATEFUL_NO_REFERENCE])
def test_wrapper_and_reference_take_the_schema_arguments(name):
    # One-to-one: the wrapper and the reference take the schema's arguments, by the same names and
    # in the same order, so a call can move between op, wrapper and reference unchanged.
    wrapper, spec = getattr(ops, name, None), getattr(reference, name, None)
    if not (callable(wrapper) and callable(spec)):
        pytest.skip("reported by the wrapper/reference tests")
    (schema,) = _schemas(name)
    expected = [arg.name for arg in schema.arguments]
    assert list(inspect.signature(wrapper).parameters) == expected, f"zrw.ops.{name}"
    assert list(inspect.signature(spec).parameters) == expected, f"zrw.reference.{name}"


def test_the_design_cards_entry_points_are_in_zrw_ops():
    """docs/design.md §4: `zrw.ops.quant_and_release(w)` is the call a custom layer makes, with the
    restore calls next to it; they are zrw.cache's functions themselves (one implementation)."""

    for name in ("quant_and_release", "restore", "restore_all"):
        assert getattr(zrw.ops, name) is getattr(zrw.cache, name), name
    w = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    q = zrw.ops.quant_and_release(w, "mxfp8", name="card")
    assert zrw.cache.is_released(w) and q.fwd.data.dtype == torch.float8_e4m3fn
    zrw.ops.restore(w, "dequant")
    assert not zrw.cache.is_released(w)
