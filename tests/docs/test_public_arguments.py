"""Argument checks of zrw's public functions (docs/design.md §8): None or a wrong type raises
TypeError, a bad value ValueError; the message names the function (`zrw.<module>.<function>:`)
and the argument, what was expected and what was found; and it is raised before anything
changes: each refused call runs inside the `nothing_changes` fixture (helpers.refusal), which
compares the record registry, every weight's native state and bytes, its masters, the cache's
stats, torch's global hooks, the model and the files before and after.

The table covers every public callable by construction: a test walks the `__all__` of every
user-facing module (USER_MODULES; every other module says why it is not one) and fails, naming
it, on a callable taking arguments that no case here, nor the tables of tests/ops,
tests/telemetry and tests/rfc, covers (NO_WRONG_ARGUMENT lists the few with no argument that
can be wrong, each with its reason).

Also: `zrw.convert(model, skip="name")` takes a str as one name (it used to skip by character),
and concurrent `zrw.checkpoint.save_safetensors` calls to one path each write their own
temporary file (they used to share one named by the process id)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import threading
import types

import pytest
import torch
from torch import nn

import zrw
import zrw.fsdp
import zrw.rfc
import zrw.testing
from helpers import TESTS
from zrw import cache, checkpoint, optim, parallel
from zrw.nn import MXLinear

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("clean_cache")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Linear(64, 64, dtype=BF16)
        self.lm_head = nn.Linear(64, 32, dtype=BF16)

    def forward(self, x):
        return self.lm_head(self.down(x))


def _param(*shape):
    return nn.Parameter(torch.randn(*shape).to(BF16))


class Env:
    """What the cases act on: a model, weights in three states, an FP32 master, an optimizer.
    What a refused call must leave alone is everything helpers.refusal snapshots (the fixture
    nothing_changes): the record registry, every weight's native state and bytes, the cache's
    stats, torch's global hooks, these roots and the files in tmp_path and the working
    directory."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.model = Tiny()
        self.w = _param(64, 64)  # never cached
        self.wr = _param(64, 64)  # released, with its FP8 copy
        cache.quant_and_release(self.wr, name="wr")
        assert cache.is_released(self.wr)
        self.m = torch.randn(64, 64)  # an FP32 "master"
        self.wm = _param(64, 64)  # cached, not released, with that master registered
        cache.register_master(self.wm, self.m)
        cache.quant_and_release(self.wm, name="wm", release=False)
        self.opt = torch.optim.SGD([self.w], lr=0.1)
        self.recipe = zrw.get_recipe("mxfp8")
        self.path = str(tmp_path / "model.safetensors")

    @property
    def roots(self):
        return (self.model, self.w, self.wr, self.wm, self.m, self.opt)


def _dist_config_or_dict():
    return {"tp_size": 1}


class FakePretrained(nn.Module):
    """Stands for a transformers PreTrainedModel: records the engine's two steps."""

    calls: list = []

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, dtype=BF16)

    @classmethod
    def prepare_distribute_model(cls, distributed_config):
        cls.calls.append(("prepare", distributed_config))
        return distributed_config, None, None

    @classmethod
    def maybe_distribute_model(cls, model, dc, mesh_manager):
        cls.calls.append(("distribute", dc))
        return model


def _extra_state_model():
    class WithExtra(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def get_extra_state(self):
            return {"step": 3}

        def set_extra_state(self, state):
            pass

    return WithExtra()


# (id, call, exception, pattern the message must match: the function, then the argument)
CASES = [
    # ---- zrw.convert -----------------------------------------------------------------------
    (
        "convert-None",
        lambda e: zrw.convert(None),
        TypeError,
        r"^zrw\.convert: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "convert-str-model",
        lambda e: zrw.convert("model"),
        TypeError,
        r"^zrw\.convert: model must be .*got str",
    ),
    (
        "convert-recipe-None",
        lambda e: zrw.convert(e.model, recipe=None),
        TypeError,
        r"^zrw\.convert: recipe must be .*got NoneType",
    ),
    (
        "convert-recipe-unknown",
        lambda e: zrw.convert(e.model, recipe="mxfp4"),
        ValueError,
        r"^zrw\.convert: recipe must be .*'mxfp8'.*got 'mxfp4'",
    ),
    (
        "convert-release-str",
        lambda e: zrw.convert(e.model, release="yes"),
        TypeError,
        r"^zrw\.convert: release must be a bool, got str",
    ),
    (
        "convert-release-None",
        lambda e: zrw.convert(e.model, release=None),
        TypeError,
        r"^zrw\.convert: release must be a bool, got NoneType",
    ),
    (
        "convert-release_frozen-int",
        lambda e: zrw.convert(e.model, release_frozen=1),
        TypeError,
        r"^zrw\.convert: release_frozen must be a bool, got int",
    ),
    (
        "convert-main_grad-str",
        lambda e: zrw.convert(e.model, main_grad="no"),
        TypeError,
        r"^zrw\.convert: main_grad must be a bool, got str",
    ),
    (
        "convert-skip-int-entry",
        lambda e: zrw.convert(e.model, skip=["lm_head", 3]),
        TypeError,
        r"^zrw\.convert: skip must hold str name parts, got skip\[1\] = 3 \(int\)",
    ),
    (
        "convert-skip-None-entry",
        lambda e: zrw.convert(e.model, skip=[None]),
        TypeError,
        r"^zrw\.convert: skip .*skip\[0\] = None",
    ),
    (
        "convert-skip-int",
        lambda e: zrw.convert(e.model, skip=5),
        TypeError,
        r"^zrw\.convert: skip must be a str or an iterable of str.*got int",
    ),
    (
        "convert-skip-bytes",
        lambda e: zrw.convert(e.model, skip=b"lm_head"),
        TypeError,
        r"^zrw\.convert: skip must be a str or an iterable of str.*got bytes",
    ),
    (
        "convert-skip-empty-str",
        lambda e: zrw.convert(e.model, skip=""),
        ValueError,
        r"^zrw\.convert: skip\[0\] is the empty string",
    ),
    (
        "convert-skip-empty-entry",
        lambda e: zrw.convert(e.model, skip=["lm_head", ""]),
        ValueError,
        r"^zrw\.convert: skip\[1\] is the empty string",
    ),
    # ---- zrw.parallel ----------------------------------------------------------------------
    (
        "prepare-None",
        lambda e: parallel.prepare(None),
        TypeError,
        r"^zrw\.parallel\.prepare: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "prepare-list",
        lambda e: parallel.prepare([e.model]),
        TypeError,
        r"^zrw\.parallel\.prepare: model must be .*got list",
    ),
    (
        "apply_plan-None",
        lambda e: parallel.apply_plan(None, {"tp_size": 2}),
        TypeError,
        r"^zrw\.parallel\.apply_plan: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "apply_plan-not-hf",
        lambda e: parallel.apply_plan(e.model, {"tp_size": 2}),
        TypeError,
        r"^zrw\.parallel\.apply_plan: model must be a transformers PreTrainedModel.*got Tiny",
    ),
    (
        "local_tensor-None",
        lambda e: parallel.local_tensor(None),
        TypeError,
        r"^zrw\.parallel\.local_tensor: t must be a torch\.Tensor, got NoneType",
    ),
    (
        "local_tensors-None",
        lambda e: parallel.local_tensors(None),
        TypeError,
        r"^zrw\.parallel\.local_tensors: ts must be an iterable of tensors.*got NoneType",
    ),
    (
        "local_tensors-tensor",
        lambda e: parallel.local_tensors(e.w),
        TypeError,
        r"^zrw\.parallel\.local_tensors: ts must be an iterable of tensors.*got Parameter",
    ),
    (
        "local_tensors-str",
        lambda e: parallel.local_tensors("wr"),
        TypeError,
        r"^zrw\.parallel\.local_tensors: ts must be an iterable of tensors.*got str",
    ),
    (
        "local_tensors-None-entry",
        lambda e: parallel.local_tensors([e.w, None]),
        TypeError,
        r"^zrw\.parallel\.local_tensors: ts\[1\] must be a torch\.Tensor, got NoneType",
    ),
    (
        "engine_view_owner-None",
        lambda e: parallel.engine_view_owner(None),
        TypeError,
        r"^zrw\._dtensor\.engine_view_owner: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "main_grad_owner-None",
        lambda e: parallel.main_grad_owner(None),
        TypeError,
        r"^zrw\.weights\.main_grad_owner: weight must be a torch\.Tensor, got NoneType",
    ),
    (
        "quant_local-owner-None",
        lambda e: parallel.quant_local(None, True, e.recipe, True, False),
        TypeError,
        r"^zrw\.weights\.quant_local: owner must be a torch\.Tensor, got NoneType",
    ),
    (
        "quant_local-recipe-str",
        lambda e: parallel.quant_local(e.w, True, "mxfp8", True, False),
        TypeError,
        r"^zrw\.weights\.quant_local: recipe must be a zrw\.QuantRecipe.*got str",
    ),
    (
        "quant_engine_view-view-None",
        lambda e: parallel.quant_engine_view(None, e.w, e.recipe, True, False),
        TypeError,
        r"^zrw\.weights\.quant_engine_view: view must be a torch\.Tensor, got NoneType",
    ),
    (
        "quant_engine_view-owner-None",
        lambda e: parallel.quant_engine_view(e.w, None, e.recipe, True, False),
        TypeError,
        r"^zrw\.weights\.quant_engine_view: owner must be a torch\.Tensor, got NoneType",
    ),
    (
        "check_placements-plain",
        lambda e: parallel.check_placements(e.w, "w"),
        TypeError,
        r"^zrw\._dtensor\.check_placements: w must be a DTensor.*got a plain Parameter",
    ),
    (
        "check_placements-None",
        lambda e: parallel.check_placements(None, "w"),
        TypeError,
        r"^zrw\._dtensor\.check_placements: w must be a DTensor.*got NoneType",
    ),
    (
        "wrap_like-param-None",
        lambda e: parallel.wrap_like(None, e.m),
        TypeError,
        r"^zrw\._dtensor\.wrap_like: param must be a torch\.Tensor, got NoneType",
    ),
    (
        "wrap_like-local-None",
        lambda e: parallel.wrap_like(e.w, None),
        TypeError,
        r"^zrw\._dtensor\.wrap_like: local must be a torch\.Tensor, got NoneType",
    ),
    (
        "dtensor_linear-plain-weight",
        lambda e: parallel.dtensor_linear(
            torch.ones(2, 64, dtype=BF16), e.w, None, e.recipe, True, False, "w", False
        ),
        TypeError,
        r"^zrw\.nn\.functional\.dtensor_linear: weight must be a DTensor.*got a plain Parameter",
    ),
    # ---- zrw.checkpoint --------------------------------------------------------------------
    (
        "materialize-p-None",
        lambda e: checkpoint.materialize(None, e.m),
        TypeError,
        r"^zrw\.state_dict\.materialize: p must be a torch\.Tensor.*got NoneType",
    ),
    (
        "materialize-master-None",
        lambda e: checkpoint.materialize(e.w, None),
        TypeError,
        r"^zrw\.state_dict\.materialize: master must be a torch\.Tensor.*got NoneType",
    ),
    (
        "materialize-master-shape",
        lambda e: checkpoint.materialize(e.w, e.m[:32]),
        ValueError,
        r"^zrw\.state_dict\.materialize: master must have the shape of p's local tensor "
        r"\(64, 64\), got \(32, 64\)",
    ),
    (
        "iter_state_dict-None",
        lambda e: checkpoint.iter_state_dict(None),
        TypeError,
        r"^zrw\.checkpoint\.iter_state_dict: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "save-model-None",
        lambda e: checkpoint.save_safetensors(None, e.path),
        TypeError,
        r"^zrw\.checkpoint\.save_safetensors: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "save-path-bytes",
        lambda e: checkpoint.save_safetensors(e.model, os.fsencode(e.path)),
        TypeError,
        r"^zrw\.checkpoint\.save_safetensors: path must be a str or an os\.PathLike, "
        r"got bytes",
    ),
    (
        "save-path-bytes-relative",
        lambda e: checkpoint.save_safetensors(e.model, b"x.st"),
        TypeError,
        r"^zrw\.checkpoint\.save_safetensors: path must be .*got bytes",
    ),
    (
        "save-path-None",
        lambda e: checkpoint.save_safetensors(e.model, None),
        TypeError,
        r"^zrw\.checkpoint\.save_safetensors: path must be a str or an os\.PathLike, got NoneType",
    ),
    (
        "save-path-dir",
        lambda e: checkpoint.save_safetensors(e.model, str(e.tmp)),
        ValueError,
        r"^zrw\.checkpoint\.save_safetensors: path must name a file, got the directory",
    ),
    (
        "save-path-empty",
        lambda e: checkpoint.save_safetensors(e.model, ""),
        ValueError,
        r"^zrw\.checkpoint\.save_safetensors: path must name a file, got ''",
    ),
    (
        "save-path-no-dir",
        lambda e: checkpoint.save_safetensors(e.model, str(e.tmp / "nope" / "m.safetensors")),
        FileNotFoundError,
        r"^zrw\.checkpoint\.save_safetensors: the directory of path .*nope",
    ),
    # ---- zrw.optim -------------------------------------------------------------------------
    (
        "MasterWeights-Linear",
        lambda e: optim.MasterWeights(nn.Linear, [e.w]),
        TypeError,
        r"^zrw\.optim\.MasterWeights: optimizer_cls must be a torch\.optim\.Optimizer subclass "
        r".*got the class torch\.nn\.modules\.linear\.Linear",
    ),
    (
        "MasterWeights-instance",
        lambda e: optim.MasterWeights(torch.optim.SGD([e.m], lr=0.1), [e.w]),
        TypeError,
        r"^zrw\.optim\.MasterWeights: optimizer_cls must be a torch\.optim\.Optimizer subclass "
        r".*instance of SGD",
    ),
    (
        "MasterWeights-None",
        lambda e: optim.MasterWeights(None, [e.w]),
        TypeError,
        r"^zrw\.optim\.MasterWeights: optimizer_cls must be .*got NoneType",
    ),
    (
        "MasterWeights-str",
        lambda e: optim.MasterWeights("AdamW", [e.w]),
        TypeError,
        r"^zrw\.optim\.MasterWeights: optimizer_cls must be .*got str",
    ),
    (
        "MasterWeights-factory-not-optimizer",
        lambda e: optim.MasterWeights(lambda groups, **kw: list(groups), [e.w]),
        TypeError,
        r"^zrw\.optim\.MasterWeights: optimizer_cls .*lambda.* must return a "
        r"torch\.optim\.Optimizer, got list",
    ),
    (
        "MasterWeights-params-None",
        lambda e: optim.MasterWeights(torch.optim.SGD, None, lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params must be an iterable of tensors .*got NoneType",
    ),
    (
        "MasterWeights-params-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, "w", lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params must be an iterable of tensors .*got str",
    ),
    (
        "MasterWeights-params-tensor",
        lambda e: optim.MasterWeights(torch.optim.SGD, e.w, lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params must be an iterable of tensors .*got a single "
        r"Parameter",
    ),
    (
        "MasterWeights-params-None-entry",
        lambda e: optim.MasterWeights(torch.optim.SGD, [e.w, None], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params\[1\] must be a tensor, got NoneType",
    ),
    (
        "MasterWeights-params-str-entries",
        lambda e: optim.MasterWeights(torch.optim.SGD, ["a", "a"], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params\[0\] must be a tensor, got str",
    ),
    (
        "MasterWeights-group-params-None",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": None}], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: param group 0's 'params' must be a tensor or an iterable "
        r"of tensors, got NoneType",
    ),
    (
        "MasterWeights-group-params-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": "w"}], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: param group 0's 'params' .*got str",
    ),
    (
        "MasterWeights-group-without-params",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": [e.w]}, {"lr": 1.0}], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: param group 1 must be a dict with 'params'.*keys \['lr'\]",
    ),
    (
        "MasterWeights-group-not-dict",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": [e.w]}, e.m], lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: param group 1 must be a dict with 'params'.*got Tensor",
    ),
    (
        "MasterWeights-group-entry-None",
        lambda e: optim.MasterWeights(
            torch.optim.SGD, [{"params": [e.w]}, {"params": [None]}], lr=0.1
        ),
        TypeError,
        r"^zrw\.optim\.MasterWeights: param_groups\[1\]\['params'\]\[0\] must be a tensor, "
        r"got NoneType",
    ),
    (
        "MasterWeights-keep_released-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, [e.w], keep_released="yes", lr=0.1),
        TypeError,
        r"^zrw\.optim\.MasterWeights: keep_released must be a bool, got str",
    ),
    (
        "detach-None",
        lambda e: optim.detach(None),
        TypeError,
        r"^zrw\.optim\.detach: optimizer must be a torch\.optim\.Optimizer, got NoneType",
    ),
    (
        "detach-list",
        lambda e: optim.detach([e.opt]),
        TypeError,
        r"^zrw\.optim\.detach: optimizer must be .*got list",
    ),
    (
        "attach-None",
        lambda e: optim.attach(None),
        TypeError,
        r"^zrw\.optim\.attach: optimizer must be a torch\.optim\.Optimizer, got NoneType",
    ),
    (
        "attach-fill-int",
        lambda e: optim.attach(e.opt, fill=1),
        TypeError,
        r"^zrw\.optim\.attach: fill must be None or a str.*got int",
    ),
    (
        "attach-fill-bogus",
        lambda e: optim.attach(e.opt, fill="bogus"),
        ValueError,
        r"^zrw\.optim\.attach: fill must be one of .*got 'bogus'",
    ),
    (
        "attach-own_masters-str",
        lambda e: optim.attach(e.opt, own_masters="yes"),
        TypeError,
        r"^zrw\.optim\.attach: own_masters must be a bool, got str",
    ),
    (
        "register_boundary_callback-None",
        lambda e: optim.register_boundary_callback(None),
        TypeError,
        r"^zrw\.optim\.register_boundary_callback: fn must be callable, got NoneType",
    ),
    # ---- zrw.cache -------------------------------------------------------------------------
    (
        "quant_and_release-None",
        lambda e: cache.quant_and_release(None),
        TypeError,
        r"^zrw\.cache\.quant_and_release: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "quant_and_release-recipe-None",
        lambda e: cache.quant_and_release(e.w, None),
        TypeError,
        r"^zrw\.cache\.quant_and_release: recipe must be a str.*got NoneType",
    ),
    (
        "quant_and_release-recipe-object",
        lambda e: cache.quant_and_release(e.w, e.recipe),
        TypeError,
        r"^zrw\.cache\.quant_and_release: recipe must be a str.*got QuantRecipe",
    ),
    (
        "quant_and_release-release-str",
        lambda e: cache.quant_and_release(e.w, release="yes"),
        TypeError,
        r"^zrw\.cache\.quant_and_release: release must be a bool, got str",
    ),
    (
        "quant_and_release-release_frozen-str",
        lambda e: cache.quant_and_release(e.w, release_frozen="x"),
        TypeError,
        r"^zrw\.cache\.quant_and_release: release_frozen must be a bool, got str",
    ),
    (
        "quant_and_release-elem_dtype-None",
        lambda e: cache.quant_and_release(e.w, elem_dtype=None),
        TypeError,
        r"^zrw\.cache\.quant_and_release: elem_dtype must be a torch\.dtype.*got NoneType",
    ),
    (
        "quant_and_release-scale_mode-None",
        lambda e: cache.quant_and_release(e.w, scale_mode=None),
        TypeError,
        r"^zrw\.cache\.quant_and_release: scale_mode must be a str, got NoneType",
    ),
    (
        "quant_and_release-name-int",
        lambda e: cache.quant_and_release(e.w, name=5),
        TypeError,
        r"^zrw\.cache\.quant_and_release: name must be a str or None, got int",
    ),
    (
        "restore-None",
        lambda e: cache.restore(None),
        TypeError,
        r"^zrw\.cache\.restore: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "restore-fill-int",
        lambda e: cache.restore(e.wr, 5),
        TypeError,
        r"^zrw\.cache\.restore: fill must be a str, one of .*got int",
    ),
    (
        "restore_weights-None",
        lambda e: cache.restore_weights(None),
        TypeError,
        r"^zrw\.cache\.restore_weights: weights must be an iterable of tensors.*got NoneType",
    ),
    (
        "restore_weights-tensor",
        lambda e: cache.restore_weights(e.wr),
        TypeError,
        r"^zrw\.cache\.restore_weights: weights must be an iterable of tensors.*got Parameter",
    ),
    (
        "restore_weights-str",
        lambda e: cache.restore_weights("wr"),
        TypeError,
        r"^zrw\.cache\.restore_weights: weights must be an iterable of tensors.*got str",
    ),
    (
        "restore_weights-dict",
        lambda e: cache.restore_weights({"wr": e.wr}),
        TypeError,
        r"^zrw\.cache\.restore_weights: weights must be an iterable of tensors.*got dict",
    ),
    (
        "restore_weights-None-entry",
        lambda e: cache.restore_weights([e.wr, None], "dequant"),
        TypeError,
        r"^zrw\.cache\.restore_weights: weights\[1\] must be a torch\.Tensor, "
        r"got NoneType",
    ),
    (
        "restore_weights-fill-None",
        lambda e: cache.restore_weights([e.wr], None),
        TypeError,
        r"^zrw\.cache\.restore_weights: fill must be a str.*got NoneType",
    ),
    (
        "assign_weights-None",
        lambda e: cache.assign_weights(None, [e.m]),
        TypeError,
        r"^zrw\.cache\.assign_weights: weights must be an iterable of tensors.*got NoneType",
    ),
    (
        "assign_weights-sources-tensor",
        lambda e: cache.assign_weights([e.wr], e.m),
        TypeError,
        r"^zrw\.cache\.assign_weights: sources must be an iterable of tensors.*got Tensor",
    ),
    (
        "assign_weights-keep_released-None",
        lambda e: cache.assign_weights([e.wr], [e.m], keep_released=None),
        TypeError,
        r"^zrw\.cache\.assign_weights: keep_released must be a bool, got NoneType",
    ),
    (
        "restore_all-fill-None",
        lambda e: cache.restore_all(None),
        TypeError,
        r"^zrw\.cache\.restore_all: fill must be a str.*got NoneType",
    ),
    (
        "cache_clear-fill-int",
        lambda e: cache.cache_clear(0),
        TypeError,
        r"^zrw\.cache\.cache_clear: fill must be a str.*got int",
    ),
    (
        "cache_invalidate-None",
        lambda e: cache.cache_invalidate(None),
        TypeError,
        r"^zrw\.cache\.cache_invalidate: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "cache_invalidate-fill-None",
        lambda e: cache.cache_invalidate(e.wr, None),
        TypeError,
        r"^zrw\.cache\.cache_invalidate: fill must be a str.*got NoneType",
    ),
    (
        "cache_state-None",
        lambda e: cache.cache_state(None),
        TypeError,
        r"^zrw\.cache\.cache_state: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "cache_states-None",
        lambda e: cache.cache_states(None),
        TypeError,
        r"^zrw\.cache\.cache_states: weights must be an iterable of tensors.*got NoneType",
    ),
    (
        "cache_states-str",
        lambda e: cache.cache_states("wr"),
        TypeError,
        r"^zrw\.cache\.cache_states: weights must be an iterable of tensors.*got str",
    ),
    (
        "is_released-None",
        lambda e: cache.is_released(None),
        TypeError,
        r"^zrw\.cache\.is_released: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "is_cached-str",
        lambda e: cache.is_cached("wr"),
        TypeError,
        r"^zrw\.cache\.is_cached: w must be a torch\.Tensor, got str",
    ),
    (
        "register_master-None",
        lambda e: cache.register_master(None, e.m),
        TypeError,
        r"^zrw\.cache\.register_master: weight must be a torch\.Tensor, got NoneType",
    ),
    (
        "register_master-master-None",
        lambda e: cache.register_master(e.w, None),
        TypeError,
        r"^zrw\.cache\.register_master: master must be a torch\.Tensor, got NoneType",
    ),
    (
        "master_of-None",
        lambda e: cache.master_of(None),
        TypeError,
        r"^zrw\.cache\.master_of: weight must be a torch\.Tensor, got NoneType",
    ),
    (
        "cache_master-None",
        lambda e: cache.cache_master(None),
        TypeError,
        r"^zrw\.cache\.cache_master: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "set_weight_name-None",
        lambda e: cache.set_weight_name(None, "x"),
        TypeError,
        r"^zrw\.cache\.set_weight_name: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "set_weight_name-name-int",
        lambda e: cache.set_weight_name(e.w, 5),
        TypeError,
        r"^zrw\.cache\.set_weight_name: name must be a str, got int",
    ),
    (
        "weight_name-None",
        lambda e: cache.weight_name(None),
        TypeError,
        r"^zrw\.cache\.weight_name: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "quant_and_release-trainable-str",
        lambda e: cache.quant_and_release(e.w, "mxfp8", trainable="yes"),
        TypeError,
        r"^zrw\.cache\.quant_and_release: trainable must be a bool or None, got str",
    ),
    (
        "restore-source-str",
        lambda e: cache.restore(e.w, "master", source="x"),
        TypeError,
        r"^zrw\.cache\.restore: source must be a torch\.Tensor, got str",
    ),
    (
        "restore-source-fill",
        lambda e: cache.restore(e.w, "dequant", source=e.w),
        ValueError,
        r"^zrw\.cache\.restore: source is only read by fill='master', got fill='dequant'",
    ),
    # ---- zrw.cache: the write check, the rule of truth, owners, verify, frozen weights -------
    (
        "is_owned-str",
        lambda e: cache.is_owned("wr"),
        TypeError,
        r"^zrw\.cache\.is_owned: w must be a torch\.Tensor, got str",
    ),
    (
        "register_owner-None",
        lambda e: cache.register_owner(None, e.opt),
        TypeError,
        r"^zrw\.cache\.register_owner: weights must be an iterable of tensors.*got NoneType",
    ),
    (
        "register_owner-optimizer-None",
        lambda e: cache.register_owner([e.w], None),
        TypeError,
        r"^zrw\.cache\.register_owner: optimizer must be a torch\.optim\.Optimizer, got NoneType",
    ),
    (
        "unregister_owner-tensor",
        lambda e: cache.unregister_owner(e.w, e.opt),
        TypeError,
        r"^zrw\.cache\.unregister_owner: weights must be an iterable of tensors.*got Parameter",
    ),
    (
        "unregister_owner-optimizer-str",
        lambda e: cache.unregister_owner([e.w], "opt"),
        TypeError,
        r"^zrw\.cache\.unregister_owner: optimizer must be a torch\.optim\.Optimizer, got str",
    ),
    (
        "register_master-shape",
        lambda e: cache.register_master(e.w, e.m[:32]),
        ValueError,
        r"^zrw\.cache\.register_master: master must have the weight's shape \(64, 64\), "
        r"got \(32, 64\)",
    ),
    (
        "restore_value-None",
        lambda e: cache.restore_value(None),
        TypeError,
        r"^zrw\.cache\.restore_value: w must be a torch\.Tensor, got NoneType",
    ),
    (
        "restore_frozen-None",
        lambda e: cache.restore_frozen(None),
        TypeError,
        r"^zrw\.cache\.restore_frozen: model_or_weights must be an iterable of tensors.*NoneType",
    ),
    (
        "restore_frozen-fill-int",
        lambda e: cache.restore_frozen(e.model, 5),
        TypeError,
        r"^zrw\.cache\.restore_frozen: fill must be the str 'dequant', got int",
    ),
    (
        "restore_frozen-fill-master",
        lambda e: cache.restore_frozen(e.model, "master"),
        ValueError,
        r"^zrw\.cache\.restore_frozen: fill must be 'dequant' .*got 'master'",
    ),
    (
        "write_back-None",
        lambda e: cache.write_back(None, [e.m], False),
        TypeError,
        r"^zrw\.cache\.write_back: weights must be an iterable of tensors.*got NoneType",
    ),
    (
        "write_back-source-None",
        lambda e: cache.write_back([e.wm], [None], False),
        TypeError,
        r"^zrw\.cache\.write_back: sources\[0\] must be a torch\.Tensor, got NoneType",
    ),
    (
        "write_back-lengths",
        lambda e: cache.write_back([e.wm, e.w], [e.m], False),
        ValueError,
        r"^zrw\.cache\.write_back: weights and sources must have the same length, got 2 and 1",
    ),
    (
        "write_back-keep_released-None",
        lambda e: cache.write_back([e.wm], [e.m], None),
        TypeError,
        r"^zrw\.cache\.write_back: keep_released must be a bool, got NoneType",
    ),
    (
        "weight_signature-None",
        lambda e: cache.weight_signature(None),
        TypeError,
        r"^zrw\.cache\.weight_signature: p must be a torch\.Tensor, got NoneType",
    ),
    (
        "weight_digest-list",
        lambda e: cache.weight_digest([1.0]),
        TypeError,
        r"^zrw\.cache\.weight_digest: p must be a torch\.Tensor, got list",
    ),
    (
        "holds_master-None",
        lambda e: cache.holds_master(None, e.m),
        TypeError,
        r"^zrw\.cache\.holds_master: p must be a torch\.Tensor, got NoneType",
    ),
    (
        "holds_master-m-str",
        lambda e: cache.holds_master(e.w, "m"),
        TypeError,
        r"^zrw\.cache\.holds_master: m must be a torch\.Tensor, got str",
    ),
    (
        "take_into_master-None",
        lambda e: cache.take_into_master(None, e.w),
        TypeError,
        r"^zrw\.cache\.take_into_master: master must be a torch\.Tensor, got NoneType",
    ),
    (
        "take_into_master-shape",
        lambda e: cache.take_into_master(e.m, e.w[:32]),
        ValueError,
        r"^zrw\.cache\.take_into_master: value must have the master's shape \(64, 64\), "
        r"got \(32, 64\)",
    ),
    (
        "unchanged_since_write_back-None",
        lambda e: cache.unchanged_since_write_back(None, None, e.m),
        TypeError,
        r"^zrw\.cache\.unchanged_since_write_back: p must be a torch\.Tensor, got NoneType",
    ),
    (
        "unchanged_since_write_back-rec-str",
        lambda e: cache.unchanged_since_write_back(e.wm, "rec", e.m),
        TypeError,
        r"^zrw\.cache\.unchanged_since_write_back: rec must be a zrw\.record\.WeightRecord or "
        r"None, got str",
    ),
    (
        "verify-str",
        lambda e: cache.verify("yes"),
        TypeError,
        r"^zrw\.cache\.verify: enabled must be a bool, got str",
    ),
    (
        "frozen_values-int",
        lambda e: cache.frozen_values(1),
        TypeError,
        r"^zrw\.cache\.frozen_values: mode must be a str, one of \('dequant', 'raise'\), got int",
    ),
    (
        "frozen_values-bogus",
        lambda e: checkpoint.frozen_values("exact"),
        ValueError,
        r"^zrw\.cache\.frozen_values: mode must be one of \('dequant', 'raise'\), got 'exact'",
    ),
    # ---- zrw.optim: AdamW, adamw_class, has_boundary ------------------------------------------
    (
        "AdamW-params-None",
        lambda e: optim.AdamW(None),
        TypeError,
        r"^zrw\.optim\.MasterWeights: params must be an iterable of tensors .*got NoneType",
    ),
    (
        "AdamW-state_dtype-int",
        lambda e: optim.AdamW([e.w], state_dtype=8),
        TypeError,
        r"^zrw\.optim\.AdamW: state_dtype must be None or a str, .*got int",
    ),
    (
        "AdamW-state_dtype-bf16",
        lambda e: optim.AdamW([e.w], state_dtype="bf16"),
        ValueError,
        r"^zrw\.optim\.AdamW: state_dtype must be one of .*got 'bf16'",
    ),
    (
        "AdamW-unknown-kwarg",
        lambda e: optim.AdamW([e.w], block_size=256),
        TypeError,
        r"^zrw\.optim\.AdamW: block_size= is not an argument of torch\.optim\.AdamW",
    ),
    (
        "adamw_class-int",
        lambda e: optim.adamw_class(8),
        TypeError,
        r"^zrw\.optim\.adamw_class: state_dtype must be None or a str, .*got int",
    ),
    (
        "adamw_class-bogus",
        lambda e: optim.adamw_class("fp16"),
        ValueError,
        r"^zrw\.optim\.adamw_class: state_dtype must be one of .*got 'fp16'",
    ),
    (
        "adamw_class-kwargs-list",
        lambda e: optim.adamw_class(None, ["lr"]),
        TypeError,
        r"^zrw\.optim\.adamw_class: kwargs must be None or a dict, got list",
    ),
    (
        "has_boundary-None",
        lambda e: optim.has_boundary(None),
        TypeError,
        r"^zrw\.optim\.has_boundary: optimizer must be a torch\.optim\.Optimizer, got NoneType",
    ),
    (
        "MasterWeights-max_grad_norm-negative",
        lambda e: optim.MasterWeights(torch.optim.SGD, [e.w], max_grad_norm=-1.0, lr=0.1),
        ValueError,
        r"^zrw\.optim\.MasterWeights: max_grad_norm must be a positive number or None",
    ),
    # ---- zrw.nn --------------------------------------------------------------------------------
    (
        "MXFusedExperts-None",
        lambda e: zrw.nn.MXFusedExperts(None),
        TypeError,
        r"^zrw\.nn\.grouped\.MXFusedExperts: source must be a fused-experts module .*NoneType",
    ),
    (
        "MXFusedExperts-Linear",
        lambda e: zrw.nn.MXFusedExperts(e.model.down),
        TypeError,
        r"^zrw\.nn\.grouped\.MXFusedExperts: source must be a fused-experts module .*got Linear",
    ),
    (
        "hold_tied_weights-None",
        lambda e: zrw.nn.hold_tied_weights(None),
        TypeError,
        r"^zrw\.nn\.convert\.hold_tied_weights: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "mx_linear-input-None",
        lambda e: zrw.nn.mx_linear(None, e.w, None, e.recipe),
        TypeError,
        r"^zrw\.nn\.functional\.mx_linear: input must be a torch\.Tensor, got NoneType",
    ),
    (
        "mx_linear-recipe-int",
        lambda e: zrw.nn.functional.mx_linear(torch.ones(2, 64, dtype=BF16), e.w, None, 8),
        TypeError,
        r"^zrw\.nn\.functional\.mx_linear: recipe must be a zrw\.QuantRecipe or a registered",
    ),
    (
        "mx_linear-bias-shape",
        lambda e: zrw.nn.mx_linear(torch.ones(2, 64, dtype=BF16), e.w, e.m[0, :32], e.recipe),
        ValueError,
        r"^zrw\.nn\.functional\.mx_linear: bias must have shape \(64,\)",
    ),
    (
        "mx_linear-in_features",
        lambda e: zrw.nn.mx_linear(torch.ones(2, 32, dtype=BF16), e.w, None, e.recipe),
        ValueError,
        r"^zrw\.nn\.functional\.mx_linear: input's last dim must equal weight",
    ),
    (
        "mx_grouped_linear-weight-None",
        lambda e: zrw.nn.mx_grouped_linear(torch.ones(4, 64, dtype=BF16), None, [4], e.recipe),
        TypeError,
        r"^zrw\.nn\.functional\.mx_grouped_linear: weight must be a torch\.Tensor, got NoneType",
    ),
    (
        "mx_grouped_linear-counts-str",
        lambda e: zrw.nn.mx_grouped_linear(torch.ones(4, 64, dtype=BF16), e.w[None], "4", e.recipe),
        TypeError,
        r"^zrw\.nn\.functional\.mx_grouped_linear: counts must be a sequence of ints",
    ),
    (
        "mx_grouped_linear-counts-negative",
        lambda e: zrw.nn.mx_grouped_linear(
            torch.ones(4, 64, dtype=BF16), e.w[None], [-1], e.recipe
        ),
        ValueError,
        r"^zrw\.nn\.functional\.mx_grouped_linear: counts must be >= 0",
    ),
    # ---- zrw.ops: the Python helper and the from-master quantizations ---------------------------
    (
        "expand_block_scale-None",
        lambda e: zrw.ops.expand_block_scale(None, (64, 64), -1),
        TypeError,
        r"^zrw\.ops\.expand_block_scale: block_scale must be a torch\.Tensor, got NoneType",
    ),
    (
        "expand_block_scale-shape-rank",
        lambda e: zrw.ops.expand_block_scale(torch.ones(2, 2).to(torch.float8_e8m0fnu), (64,), -1),
        ValueError,
        r"^zrw\.ops\.expand_block_scale: shape must be the 2-d \(N, K\) or 3-d",
    ),
    *[
        case
        for op, call in (
            ("mx_quantize_from_master", lambda m, **kw: zrw.ops.mx_quantize_from_master(m, **kw)),
            (
                "mx_quantize_dual_from_master",
                lambda m, **kw: zrw.ops.mx_quantize_dual_from_master(m, **kw),
            ),
            (
                "mx_quantize_block_from_master",
                lambda m, **kw: zrw.ops.mx_quantize_block_from_master(m, **kw),
            ),
        )
        for case in (
            (
                f"{op}-None",
                lambda e, call=call: call(None),
                TypeError,
                rf"^zrw\.{op}: master must be a torch\.Tensor, got NoneType",
            ),
            (
                f"{op}-bf16-master",
                lambda e, call=call: call(e.w.detach()),
                TypeError,
                rf"^zrw\.{op}: master must be torch\.float32 \(the FP32 master weight\), got "
                r"(BFloat16|torch\.bfloat16)",
            ),
            (
                f"{op}-param_dtype-fp32",
                lambda e, call=call: call(e.m, param_dtype=torch.float32),
                TypeError,
                rf"^zrw\.{op}: param_dtype must be torch\.bfloat16 or torch\.float16",
            ),
            (
                f"{op}-scale_mode",
                lambda e, call=call: call(e.m, scale_mode="round"),
                ValueError,
                rf'^zrw\.{op}: scale_mode must be "floor" or "rceil", got "round"',
            ),
        )
    ],
    # ---- zrw.checkpoint: the MX export ---------------------------------------------------------
    (
        "export_mx-None",
        lambda e: checkpoint.export_mx(None),
        TypeError,
        r"^zrw\.checkpoint\.export_mx: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "export_mx-kernel-int",
        lambda e: checkpoint.export_mx(e.model, kernel=1),
        TypeError,
        r"^zrw\.checkpoint\.export_mx: kernel must be a str, one of \('emulated', 'auto'\), "
        r"got int",
    ),
    (
        "export_mx-experts-bogus",
        lambda e: checkpoint.export_mx(e.model, experts="drop"),
        ValueError,
        r"^zrw\.checkpoint\.export_mx: experts must be one of \('refuse', 'bf16'\).*got 'drop'",
    ),
    (
        "export_mx-path-int",
        lambda e: checkpoint.export_mx(e.model, path=3),
        TypeError,
        r"^zrw\.checkpoint\.export_mx: path must be a str or an os\.PathLike, got int",
    ),
    (
        "export_mx-path-dir",
        lambda e: checkpoint.export_mx(e.model, path=str(e.tmp)),
        ValueError,
        r"^zrw\.checkpoint\.export_mx: path must name a file, got the directory",
    ),
    (
        "iter_mx_state_dict-None",
        lambda e: checkpoint.iter_mx_state_dict(None),
        TypeError,
        r"^zrw\.checkpoint\.iter_mx_state_dict: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "iter_mx_state_dict-kernel-bogus",
        lambda e: checkpoint.iter_mx_state_dict(e.model, kernel="triton"),
        ValueError,
        r"^zrw\.checkpoint\.iter_mx_state_dict: kernel must be one of .*got 'triton'",
    ),
    (
        "load_mx-None",
        lambda e: checkpoint.load_mx(None, e.path),
        TypeError,
        r"^zrw\.checkpoint\.load_mx: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "load_mx-path-None",
        lambda e: checkpoint.load_mx(e.model, None),
        TypeError,
        r"^zrw\.checkpoint\.load_mx: path must be a str or an os\.PathLike, got NoneType",
    ),
    (
        "load_mx-path-missing",
        lambda e: checkpoint.load_mx(e.model, e.path),
        FileNotFoundError,
        r"^zrw\.checkpoint\.load_mx: path '.*model\.safetensors' does not exist",
    ),
    (
        "save_mx_pretrained-None",
        lambda e: checkpoint.save_mx_pretrained(None, str(e.tmp / "out")),
        TypeError,
        r"^zrw\.checkpoint\.save_mx_pretrained: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "save_mx_pretrained-dir-None",
        lambda e: checkpoint.save_mx_pretrained(e.model, None),
        TypeError,
        r"^zrw\.checkpoint\.save_mx_pretrained: save_directory must be a str or an os\.PathLike",
    ),
    (
        "save_mx_pretrained-dir-empty",
        lambda e: checkpoint.save_mx_pretrained(e.model, ""),
        ValueError,
        r"^zrw\.checkpoint\.save_mx_pretrained: save_directory must name a directory, got ''",
    ),
    (
        "save-metadata-int",
        lambda e: checkpoint.save_safetensors(e.model, e.path, metadata=5),
        TypeError,
        r"^zrw\.checkpoint\.save_safetensors: metadata must be a dict of str to str, got 5",
    ),
    # ---- zrw.fsdp --------------------------------------------------------------------------------
    (
        "PreQuantWeight-None",
        lambda e: zrw.fsdp.PreQuantWeight(None, e.recipe, "w"),
        TypeError,
        r"^zrw\.fsdp\.PreQuantWeight: tensor must be a torch\.Tensor, got NoneType",
    ),
    (
        "PreQuantWeight-int-tensor",
        lambda e: zrw.fsdp.PreQuantWeight(torch.ones(64, 64, dtype=torch.int32), e.recipe, "w"),
        TypeError,
        r"^zrw\.fsdp\.PreQuantWeight: tensor must be a floating-point tensor .*got torch\.int32",
    ),
    (
        "PreQuantWeight-recipe-str",
        lambda e: zrw.fsdp.PreQuantWeight(e.m, "mxfp8", "w"),
        TypeError,
        r"^zrw\.fsdp\.PreQuantWeight: recipe must be a zrw\.QuantRecipe .*got str",
    ),
    (
        "PreQuantWeight-name-int",
        lambda e: zrw.fsdp.PreQuantWeight(e.m, e.recipe, 0),
        TypeError,
        r"^zrw\.fsdp\.PreQuantWeight: name must be a str, got int",
    ),
    (
        "PreQuantWeight-both_planes-str",
        lambda e: zrw.fsdp.PreQuantWeight(e.m, e.recipe, "w", "yes"),
        TypeError,
        r"^zrw\.fsdp\.PreQuantWeight: both_planes must be a bool, got str",
    ),
    (
        "MXGatheredWeight-size-None",
        lambda e: zrw.fsdp.MXGatheredWeight(None, BF16, "cpu", e.recipe, "w"),
        TypeError,
        r"^zrw\.fsdp\.MXGatheredWeight: size must be a torch\.Size or a tuple of ints, "
        r"got NoneType",
    ),
    (
        "MXGatheredWeight-dtype-str",
        lambda e: zrw.fsdp.MXGatheredWeight((64, 64), "bf16", "cpu", e.recipe, "w"),
        TypeError,
        r"^zrw\.fsdp\.MXGatheredWeight: dtype must be a torch\.dtype, got str",
    ),
    (
        "MXGatheredWeight-recipe-str",
        lambda e: zrw.fsdp.MXGatheredWeight((64, 64), BF16, "cpu", "mxfp8", "w"),
        TypeError,
        r"^zrw\.fsdp\.MXGatheredWeight: recipe must be a zrw\.QuantRecipe .*got str",
    ),
    (
        "MXGatheredWeight-requires_grad-int",
        lambda e: zrw.fsdp.MXGatheredWeight((64, 64), BF16, "cpu", e.recipe, "w", 1),
        TypeError,
        r"^zrw\.fsdp\.MXGatheredWeight: requires_grad must be a bool, got int",
    ),
    (
        "fsdp-prepare-None",
        lambda e: zrw.fsdp.prepare(None),
        TypeError,
        r"^zrw\.fsdp\.prepare: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "fsdp-prepare-both_planes-int",
        lambda e: zrw.fsdp.prepare(e.model, both_planes=1),
        TypeError,
        r"^zrw\.fsdp\.prepare: both_planes must be a bool, got int",
    ),
    # ---- zrw.telemetry (its own table covers the rest), zrw.testing ------------------------------
    (
        "NumericsTelemetry-None",
        lambda e: zrw.telemetry.NumericsTelemetry(None),
        TypeError,
        r"^zrw\.telemetry\.NumericsTelemetry: model must be a torch\.nn\.Module, got NoneType",
    ),
    (
        "NumericsTelemetry-tensors-bias",
        lambda e: zrw.telemetry.NumericsTelemetry(e.model, tensors="bias"),
        ValueError,
        r"^zrw\.telemetry\.NumericsTelemetry: tensors must name at least one of",
    ),
    (
        "fail_allocations-str",
        lambda e: zrw.testing.fail_allocations("1"),
        TypeError,
        r"^zrw\.testing\.fail_allocations: min_bytes must be an int >= 0, got str '1'",
    ),
    (
        "fail_allocations-negative",
        lambda e: zrw.testing.fail_allocations(count=-1),
        ValueError,
        r"^zrw\.testing\.fail_allocations: count must be an int >= 0, got -1",
    ),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_named_error_before_anything_changes(
    tmp_path, monkeypatch, nothing_changes, call, exc, pattern
):
    monkeypatch.chdir(tmp_path)  # a relative path a wrong call might write lands here
    env = Env(tmp_path)
    with nothing_changes(*env.roots, dirs=[tmp_path]):
        with torch.enable_grad(), pytest.raises(exc, match=pattern) as ei:
            call(env)
    assert type(ei.value) is exc  # not a subclass standing in for another error


# ---- the snapshot sees each kind of change ---------------------------------------------------


def _global_hook(e):
    e.handle = nn.modules.module.register_module_forward_hook(lambda *a: None)


PLANTED = [
    ("a record field", lambda e: cache.set_weight_name(e.wr, "renamed"), r"records\["),
    ("a new record", lambda e: cache.quant_and_release(e.w, release=False), r"records\["),
    ("a native state", lambda e: cache.restore(e.wr, "dequant"), r"states\["),
    ("the cache's stats", lambda e: cache.next_step(), r"stats\['step'\]"),
    ("a weight's bytes", lambda e: e.w.data.add_(1), r"\['bytes'\]: the bytes differ"),
    ("a master's bytes", lambda e: e.m.add_(1), r"master 0@.*the bytes differ"),
    ("an optimizer's hooks", lambda e: optim.attach(e.opt, fill="dequant"), r"optimizer records"),
    ("a module's structure", lambda e: zrw.convert(e.model), r"\['modules'\]"),
    ("torch's global hooks", _global_hook, r"module_forward_hooks"),
    ("a file", lambda e: open(e.tmp / "x", "w").close(), r"files"),
]


@pytest.mark.parametrize("change,where", [c[1:] for c in PLANTED], ids=[c[0] for c in PLANTED])
def test_nothing_changes_fails_on_each_kind_of_change(tmp_path, nothing_changes, change, where):
    env = Env(tmp_path)
    try:
        with pytest.raises(AssertionError, match=where):
            with nothing_changes(*env.roots, dirs=[tmp_path]):
                with torch.no_grad():
                    change(env)
    finally:
        if hasattr(env, "handle"):
            env.handle.remove()
        optim.detach(env.opt)


# ---- every public callable is covered, by construction --------------------------------------

# The modules a user imports. Each has an explicit __all__; every callable in it that takes an
# argument must have a refusal case, here or in its module's own table (OTHER_TABLES).
USER_MODULES = (
    "zrw",
    "zrw.cache",
    "zrw.optim",
    "zrw.nn",
    "zrw.nn.functional",
    "zrw.ops",
    "zrw.checkpoint",
    "zrw.parallel",
    "zrw.fsdp",
    "zrw.memory",
    "zrw.telemetry",
    "zrw.rfc",
    "zrw.testing",
    "zrw.backends",
    "zrw.config",
)

# Every other module of the package, and why a user does not import it (a module whose name
# starts with "_" is private). A new module must be placed here or in USER_MODULES.
NOT_USER_FACING = {
    "zrw.bench": "the benchmarks, an application (python -m zrw.bench NAME)",
    "zrw.demo": "an application (zrw-demo): its arguments are its command line's",
    "zrw.boundary": "the optimizer boundary: public as zrw.optim.attach, detach, ...",
    "zrw.frozen": "frozen weights: public through zrw.cache and zrw.checkpoint",
    "zrw.lifecycle": "the state machine: public through zrw.cache's checked calls",
    "zrw.verify": "verify mode: public as zrw.cache.verify and zrw.cache.StaleCopyError",
    "zrw.write_check": "the write check: public through zrw.cache's checked calls",
    "zrw.master_groups": "MasterWeights' parameter groups: public as zrw.optim.MasterWeights",
    "zrw.master_weights": "public as zrw.optim.MasterWeights",
    "zrw.mx_export": "the MX export: public through zrw.checkpoint",
    "zrw.nn.convert": "public through zrw.nn",
    "zrw.nn.grouped": "public through zrw.nn",
    "zrw.nn.linear": "public through zrw.nn",
    "zrw.planes": "plane types and the layer protocol: MXWeight is public as zrw.MXWeight",
    "zrw.record": "the weight record: read through zrw.cache",
    "zrw.reference": "the plain-PyTorch spec the tests compare zrw.ops with (the checked API)",
    "zrw.state_dict": "released weights' state dicts: materialize is public in zrw.checkpoint",
    "zrw.weights": "weight planes and policies: public through zrw.parallel",
}

# Public callables with no argument that can be wrong, each with its reason.
NO_WRONG_ARGUMENT = {
    "zrw.MXWeight": "the planes zrw returns (quant_and_release): a user reads one, never builds it",
    "zrw.cache.CacheState": "an enum: CacheState(x) is Python's own lookup (ValueError naming x)",
    "zrw.cache.StaleCopyError": "an exception class zrw raises; its argument is the message",
    "zrw.cache.FP8OnlyParameter": "a class for isinstance; its constructor is nn.Parameter's",
    "zrw.config.ScalingGranularityEnum": "an enum: Python's own lookup",
    "zrw.nn.ConvertSummary": "the report zrw.convert returns: a user reads it, never builds it",
    "zrw.parallel.ParallelSummary": "the report prepare() returns: a user reads it",
    "zrw.parallel.is_dtensor": "takes any object and answers whether it is a DTensor",
}

# Modules with their own table of refusal cases (telemetry's and rfc's also check their own
# coverage, argument by argument): test file -> how to read the labels its cases cover.
OTHER_TABLES = {
    "telemetry/test_telemetry_arguments.py": lambda t: {f"zrw.telemetry.{c[0]}" for c in t.CASES},
    "rfc/test_rfc_arguments.py": lambda t: {f"zrw.rfc.{c[0]}" for c in t.CASES},
    # The ops name themselves as their dispatcher op (design.md §8: "zrw.mx_quantize: ...").
    "ops/test_errors.py": lambda t: (
        {f"zrw.{m.group(1)}" for c in t.CASES if (m := re.match(r"\^?zrw\\\.(\w+):", c[3]))}
        | {f"zrw.{c[2]}" for c in t.TYPE_CASES}
    ),
}


def _label(pattern: str) -> str:
    r"""The function a case's message pattern starts with: r"^zrw\.cache\.restore: w" gives
    "zrw.cache.restore"."""
    return pattern.lstrip("^").split(":")[0].replace("\\", "")


def _other_tables() -> set:
    labels = set()
    for i, (path, read) in enumerate(OTHER_TABLES.items()):
        spec = importlib.util.spec_from_file_location(
            f"_covering_table_{i}", os.path.join(TESTS, path)
        )
        table = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(table)
        labels |= read(table)
    return labels


def _takes_arguments(obj) -> bool:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # no signature to read: treat as taking arguments
        return True
    return any(p not in ("self", "cls") for p in params)


def _public_callables():
    """{id: (object, its labels)} of every callable that takes arguments in the __all__ of a
    user-facing module. Its labels: each module.name it is listed under, its home
    (__module__.__qualname__) and, for zrw.ops, the dispatcher op's name."""
    found = {}
    for mod_name in USER_MODULES:
        mod = importlib.import_module(mod_name)
        assert "__all__" in vars(mod), f"{mod_name} has no __all__"
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType) or not callable(obj):
                continue
            if not _takes_arguments(obj):
                continue
            _, labels = found.setdefault(id(obj), (obj, set()))
            labels.add(f"{mod_name}.{name}")
            labels.add(f"{obj.__module__}.{obj.__qualname__}")
            if mod_name == "zrw.ops":
                labels.add(f"zrw.{name}")
    return found


def test_every_module_is_user_facing_or_says_why_not():
    unplaced = [
        m.name
        for m in pkgutil.walk_packages(zrw.__path__, "zrw.")
        if not any(part.startswith("_") for part in m.name.split("."))
        and m.name not in USER_MODULES
        and not any(m.name == k or m.name.startswith(k + ".") for k in NOT_USER_FACING)
    ]
    assert not unplaced, f"place these modules in USER_MODULES or NOT_USER_FACING: {unplaced}"


def test_every_public_callable_has_a_refusal_case():
    """A case covers zrw.cache.restore when its message pattern starts with that label (or the
    callable's home, zrw.lifecycle.verify for zrw.cache.verify); the modules with their own
    tables (OTHER_TABLES) cover theirs."""
    covered = {_label(c[3]) for c in CASES} | _other_tables()
    public = _public_callables()
    exempt = {
        id(getattr(importlib.import_module(k.rsplit(".", 1)[0]), k.rsplit(".", 1)[1]))
        for k in NO_WRONG_ARGUMENT
    }
    assert all(NO_WRONG_ARGUMENT.values())
    missing = sorted(
        min(labels)
        for key, (obj, labels) in public.items()
        if key not in exempt and not labels & covered
    )
    assert not missing, f"public callables without a refusal case: {missing}"
    assert len(public) >= 80  # the walk found the API (a broken __all__ would find less)


def test_the_enumeration_would_catch_a_new_public_function(monkeypatch):
    def new_public_function(x):
        return x

    monkeypatch.setattr(zrw.cache, "new_public_function", new_public_function, raising=False)
    monkeypatch.setattr(zrw.cache, "__all__", [*zrw.cache.__all__, "new_public_function"])
    with pytest.raises(AssertionError, match="new_public_function"):
        test_every_public_callable_has_a_refusal_case()


def test_no_wrong_argument_lists_public_callables_only():
    public = _public_callables()
    for k in NO_WRONG_ARGUMENT:
        mod, name = k.rsplit(".", 1)
        obj = getattr(importlib.import_module(mod), name)
        assert id(obj) in public, f"{k} is not a public callable taking arguments"
        assert name in importlib.import_module(mod).__all__, k


# ---- apply_plan's distributed_config: refused before the engine runs --------------------------


@pytest.mark.parametrize("bad", [None, "tp_size=2", 2])
def test_apply_plan_refuses_a_config_that_is_neither_a_distributed_config_nor_a_dict(bad):
    pytest.importorskip("transformers")
    model = FakePretrained()
    FakePretrained.calls = []
    with pytest.raises(
        TypeError,
        match=r"^zrw\.parallel\.apply_plan: distributed_config must "
        r"be a transformers DistributedConfig or a dict, got " + type(bad).__name__,
    ):
        parallel.apply_plan(model, bad)
    assert FakePretrained.calls == []  # the engine never ran


def test_apply_plan_passes_a_dict_or_a_distributed_config_to_the_engine():
    transformers_distributed = pytest.importorskip("transformers.distributed")
    model = FakePretrained()
    for dc in ({"tp_size": 1}, transformers_distributed.DistributedConfig(tp_size=1)):
        FakePretrained.calls = []
        assert parallel.apply_plan(model, dc) is model
        assert [c[0] for c in FakePretrained.calls] == ["prepare", "distribute"]


# ---- convert's skip: a str is one name --------------------------------------------------------


def test_convert_takes_a_str_skip_as_one_name():
    # Character by character, "lm_head" would also skip "down" (it contains a 'd').
    model = Tiny()
    summary = zrw.convert(model, skip="lm_head")
    assert isinstance(model.down, MXLinear)
    assert type(model.lm_head) is nn.Linear
    assert summary.converted == ["down"]
    assert summary.skipped == {"lm_head": "skipped (name matches 'lm_head')"}


@pytest.mark.parametrize("skip", [["down"], ("down",), "down", iter(["down"]), {"down"}])
def test_convert_skip_as_a_str_or_any_iterable_of_str(skip):
    model = Tiny()
    summary = zrw.convert(model, skip=skip)
    assert type(model.down) is nn.Linear and isinstance(model.lm_head, MXLinear)
    assert summary.converted == ["lm_head"]


def test_convert_default_and_empty_skip():
    model = Tiny()
    zrw.convert(model)  # default: lm_head stays
    assert isinstance(model.down, MXLinear) and type(model.lm_head) is nn.Linear
    model = Tiny()
    zrw.convert(model, skip=[])  # nothing skipped
    assert isinstance(model.down, MXLinear) and isinstance(model.lm_head, MXLinear)


def test_convert_accepts_a_recipe_object():
    model = Tiny()
    assert zrw.convert(model, recipe=zrw.get_recipe("mxfp8"), skip=[]).recipe == "mxfp8"


# ---- what stays allowed -----------------------------------------------------------------------


def test_master_weights_takes_a_factory_that_returns_an_optimizer():
    w = _param(32, 32)
    opt = optim.MasterWeights(functools.partial(torch.optim.SGD, lr=0.5), [w])
    assert isinstance(opt.inner, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5


def test_detach_of_an_optimizer_without_the_boundary_is_a_no_op():
    opt = torch.optim.SGD([_param(32, 32)], lr=0.1)
    optim.detach(opt)
    assert not zrw.optim.has_boundary(opt)


def test_iter_state_dict_refuses_at_the_call_and_yields_extra_state():
    with pytest.raises(TypeError, match="iter_state_dict: model"):
        checkpoint.iter_state_dict(None)  # not deferred to the first next()
    entries = dict(checkpoint.iter_state_dict(_extra_state_model()))
    assert entries["_extra_state"] == {"step": 3}
    assert set(entries) == {"lin.weight", "lin.bias", "_extra_state"}


def test_save_safetensors_takes_a_pathlike(tmp_path):
    from safetensors.torch import load_file

    model = Tiny()
    checkpoint.save_safetensors(model, tmp_path / "m.safetensors")
    got = load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert os.listdir(tmp_path) == ["m.safetensors"]


# ---- concurrent saves to one path -------------------------------------------------------------


def test_concurrent_saves_to_one_path_each_write_their_own_file(tmp_path):
    from safetensors.torch import load_file

    n = 6
    models = []
    for i in range(n):
        torch.manual_seed(i)
        m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        models.append(m)
    expected = [m.state_dict() for m in models]
    path = str(tmp_path / "shared.safetensors")
    barrier = threading.Barrier(n)
    errors = []

    def save(i):
        try:
            barrier.wait()
            for _ in range(3):
                checkpoint.save_safetensors(models[i], path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    got = load_file(path)
    assert any(
        set(got) == set(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
        for sd in expected
    )
    assert os.listdir(tmp_path) == ["shared.safetensors"]  # no temporary file left


def test_a_failed_save_removes_its_temporary_file_and_keeps_the_old(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    path = str(tmp_path / "m.safetensors")
    old = Tiny()
    checkpoint.save_safetensors(old, path)
    real = checkpoint._value
    calls = []

    def failing(name, t):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real(name, t)

    monkeypatch.setattr(checkpoint, "_value", failing)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save_safetensors(Tiny(), path)
    assert os.listdir(tmp_path) == ["m.safetensors"]
    got = load_file(path)
    assert all(torch.equal(got[k], v) for k, v in old.state_dict().items())
