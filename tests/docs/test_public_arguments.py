"""Argument checks of zrw's public functions (docs/design.md §8): None or a wrong type raises
TypeError, a bad value ValueError; the message names the function and the argument, what was
expected and what was found; and it is raised before anything changes (the model is not
converted, no weight is cached or restored, no file is written, no hook is installed, no master
is registered).

Also: `zrw.convert(model, skip="name")` takes a str as one name (it used to skip by character),
and concurrent `zrw.checkpoint.save_safetensors` calls to one path each write their own
temporary file (they used to share one named by the process id)."""

from __future__ import annotations

import functools
import os
import threading

import pytest
import torch
from torch import nn

import zrw
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
    """What the cases act on, and a snapshot of everything a refused call must leave alone."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.model = Tiny()
        self.w = _param(64, 64)  # never cached
        self.wr = _param(64, 64)  # released, with its FP8 copy
        cache.quant_and_release(self.wr, name="wr")
        assert cache.is_released(self.wr)
        self.m = torch.randn(64, 64)  # an FP32 "master"
        self.opt = torch.optim.SGD([self.w], lr=0.1)
        self.recipe = zrw.get_recipe("mxfp8")
        self.path = str(tmp_path / "model.safetensors")
        self.before = self.snapshot()

    def snapshot(self):
        return {
            "modules": [(n, type(m).__name__) for n, m in self.model.named_modules()],
            "params": [(n, id(p), p.detach().clone()) for n, p in self.model.named_parameters()],
            "w": self.w.detach().clone(),
            "w_state": cache.cache_state(self.w),
            "wr_state": cache.cache_state(self.wr),
            "masters": (cache.master_of(self.w), cache.master_of(self.wr)),
            "stats": {k: v for k, v in cache.cache_stats().items() if k not in ("hits", "misses")},
            "files": sorted(os.listdir(self.tmp)),
            "cwd_files": sorted(os.listdir(".")),
            "hooks": getattr(zrw.record.find_optimizer_record(self.opt), "hooks", None),
            "names": (cache.weight_name(self.w), cache.weight_name(self.wr)),
        }

    def assert_unchanged(self):
        after = self.snapshot()
        b = self.before
        assert after["modules"] == b["modules"]
        assert [(n, i) for n, i, _ in after["params"]] == [(n, i) for n, i, _ in b["params"]]
        for (_, _, x), (_, _, y) in zip(after["params"], b["params"]):
            assert torch.equal(x, y)
        assert torch.equal(after["w"], b["w"])
        for k in ("w_state", "wr_state", "stats", "files", "cwd_files", "hooks", "names"):
            assert after[k] == b[k], k
        assert all(x is y for x, y in zip(after["masters"], b["masters"]))


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
        r"^MasterWeights: optimizer_cls must be a torch\.optim\.Optimizer subclass .*got the "
        r"class torch\.nn\.modules\.linear\.Linear",
    ),
    (
        "MasterWeights-instance",
        lambda e: optim.MasterWeights(torch.optim.SGD([e.m], lr=0.1), [e.w]),
        TypeError,
        r"^MasterWeights: optimizer_cls must be a torch\.optim\.Optimizer subclass .*instance of "
        r"SGD",
    ),
    (
        "MasterWeights-None",
        lambda e: optim.MasterWeights(None, [e.w]),
        TypeError,
        r"^MasterWeights: optimizer_cls must be .*got NoneType",
    ),
    (
        "MasterWeights-str",
        lambda e: optim.MasterWeights("AdamW", [e.w]),
        TypeError,
        r"^MasterWeights: optimizer_cls must be .*got str",
    ),
    (
        "MasterWeights-factory-not-optimizer",
        lambda e: optim.MasterWeights(lambda groups, **kw: list(groups), [e.w]),
        TypeError,
        r"^MasterWeights: optimizer_cls .*lambda.* must return a torch\.optim\.Optimizer, got list",
    ),
    (
        "MasterWeights-params-None",
        lambda e: optim.MasterWeights(torch.optim.SGD, None, lr=0.1),
        TypeError,
        r"^MasterWeights: params must be an iterable of tensors .*got NoneType",
    ),
    (
        "MasterWeights-params-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, "w", lr=0.1),
        TypeError,
        r"^MasterWeights: params must be an iterable of tensors .*got str",
    ),
    (
        "MasterWeights-params-tensor",
        lambda e: optim.MasterWeights(torch.optim.SGD, e.w, lr=0.1),
        TypeError,
        r"^MasterWeights: params must be an iterable of tensors .*got a single "
        r"Parameter",
    ),
    (
        "MasterWeights-params-None-entry",
        lambda e: optim.MasterWeights(torch.optim.SGD, [e.w, None], lr=0.1),
        TypeError,
        r"^MasterWeights: params\[1\] must be a tensor, got NoneType",
    ),
    (
        "MasterWeights-params-str-entries",
        lambda e: optim.MasterWeights(torch.optim.SGD, ["a", "a"], lr=0.1),
        TypeError,
        r"^MasterWeights: params\[0\] must be a tensor, got str",
    ),
    (
        "MasterWeights-group-params-None",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": None}], lr=0.1),
        TypeError,
        r"^MasterWeights: param group 0's 'params' must be a tensor or an iterable of tensors, "
        r"got NoneType",
    ),
    (
        "MasterWeights-group-params-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": "w"}], lr=0.1),
        TypeError,
        r"^MasterWeights: param group 0's 'params' .*got str",
    ),
    (
        "MasterWeights-group-without-params",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": [e.w]}, {"lr": 1.0}], lr=0.1),
        TypeError,
        r"^MasterWeights: param group 1 must be a dict with 'params'.*keys \['lr'\]",
    ),
    (
        "MasterWeights-group-not-dict",
        lambda e: optim.MasterWeights(torch.optim.SGD, [{"params": [e.w]}, e.m], lr=0.1),
        TypeError,
        r"^MasterWeights: param group 1 must be a dict with 'params'.*got Tensor",
    ),
    (
        "MasterWeights-group-entry-None",
        lambda e: optim.MasterWeights(
            torch.optim.SGD, [{"params": [e.w]}, {"params": [None]}], lr=0.1
        ),
        TypeError,
        r"^MasterWeights: param_groups\[1\]\['params'\]\[0\] must be a tensor, got NoneType",
    ),
    (
        "MasterWeights-keep_released-str",
        lambda e: optim.MasterWeights(torch.optim.SGD, [e.w], keep_released="yes", lr=0.1),
        TypeError,
        r"^MasterWeights: keep_released must be a bool, got str",
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
        r"^zrw\.cache\.register_boundary_callback: fn must be callable, got NoneType",
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
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_named_error_before_anything_changes(
    tmp_path, monkeypatch, call, exc, pattern
):
    monkeypatch.chdir(tmp_path)  # a relative path a wrong call might write lands here
    env = Env(tmp_path)
    with torch.enable_grad(), pytest.raises(exc, match=pattern) as ei:
        call(env)
    assert type(ei.value) is exc  # not a subclass standing in for another error
    env.assert_unchanged()


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
