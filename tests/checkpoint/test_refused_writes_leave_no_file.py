"""Every path of zrw.checkpoint that writes a file refuses bad arguments and refused states before
it opens or creates anything: a refused save_safetensors, export_mx(model, path) or
save_mx_pretrained leaves no file (not even an empty or partial one) and no directory behind,
and an existing file or directory keeps what it held. A save_mx_pretrained that fails while
writing (its config's save_pretrained raising) leaves nothing behind either."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("torchao")


import zrw  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw.checkpoint import export_mx, frozen_values, save_mx_pretrained, save_safetensors  # noqa: E402

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("clean_cache")


class WithState(nn.Module):
    """A module with extra state that is not a tensor (safetensors holds tensors only)."""

    def get_extra_state(self):
        return {"step": 1}

    def set_extra_state(self, state):
        pass


def converted(**config):
    model = make_model(**{**HF_QWEN3, **config})
    zrw.convert(model)
    return model


def with_complex_buffer():
    model = converted()
    model.model.register_buffer("phase", torch.zeros(4, dtype=torch.complex64))
    return model


def with_extra_state():
    model = converted()
    model.model.extra = WithState()
    return model


def released_without_master():
    """Mid-step under a plain optimizer: released weights that no FP32 master backs."""
    model = converted()
    opt = zrw.optim.attach(torch.optim.SGD(model.parameters(), lr=0.1), fill="dequant")
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    model._test_optimizer = opt  # (kept alive with the model)
    return model


def frozen_released_for_good():
    model = make_model(**HF_QWEN3)
    zrw.convert(model, release_frozen=True)
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(0, 128, (1, 8))
    with torch.enable_grad():
        model(input_ids=ids)
    assert zrw.cache.cache_stats()["frozen"] > 0
    return model


def compiled_without_converted_weights():
    return torch.compile(make_model(**HF_QWEN3), backend="eager")


# (what, a call given the target path) -> the error it raises
FILE_CASES = {
    "save_safetensors: model": (lambda p: save_safetensors(5, p), TypeError),
    "save_safetensors: path bytes": (
        lambda p: save_safetensors(converted(), os.fsencode(p)),
        TypeError,
    ),
    "save_safetensors: metadata": (
        lambda p: save_safetensors(converted(), p, metadata={"step": 1}),
        TypeError,
    ),
    "save_safetensors: extra state": (lambda p: save_safetensors(with_extra_state(), p), TypeError),
    "save_safetensors: complex buffer": (
        lambda p: save_safetensors(with_complex_buffer(), p),
        TypeError,
    ),
    "save_safetensors: released without master": (
        lambda p: save_safetensors(released_without_master(), p),
        RuntimeError,
    ),
    "save_safetensors: frozen under raise": (
        lambda p: _under_raise(lambda: save_safetensors(frozen_released_for_good(), p)),
        RuntimeError,
    ),
    "export_mx: kernel": (lambda p: export_mx(converted(), p, kernel="cuda"), ValueError),
    "export_mx: experts": (lambda p: export_mx(converted(), p, experts="mx"), ValueError),
    "export_mx: model": (lambda p: export_mx([], p), TypeError),
    "export_mx: path bytes": (lambda p: export_mx(converted(), os.fsencode(p)), TypeError),
    "export_mx: no converted weights": (
        lambda p: export_mx(compiled_without_converted_weights(), p),
        ValueError,
    ),
    "export_mx: K not a multiple of 32": (
        lambda p: export_mx(converted(hidden_size=48, head_dim=12), p),
        ValueError,
    ),
    "export_mx: extra state": (lambda p: export_mx(with_extra_state(), p), TypeError),
    "export_mx: complex buffer": (lambda p: export_mx(with_complex_buffer(), p), TypeError),
}


def _under_raise(call):
    with frozen_values("raise"):
        return call()


@pytest.mark.parametrize("case", list(FILE_CASES))
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_refused_file_write_leaves_no_file(case, existing, tmp_path):
    call, error = FILE_CASES[case]
    path = tmp_path / "model.safetensors"
    if existing:
        path.write_bytes(b"the old file")
    with pytest.raises(error):
        call(str(path))
    assert sorted(os.listdir(tmp_path)) == (["model.safetensors"] if existing else [])
    if existing:
        assert path.read_bytes() == b"the old file"


def test_a_save_into_a_missing_directory_creates_nothing(tmp_path):
    path = tmp_path / "missing" / "model.safetensors"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_safetensors(converted(), path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_mx(converted(), path)
    assert os.listdir(tmp_path) == []


class FailingConfigSave(Exception):
    pass


def _failing_config(monkeypatch, model):
    def refuse(self, *args, **kwargs):
        raise FailingConfigSave("config.save_pretrained refused")

    monkeypatch.setattr(type(model.config), "save_pretrained", refuse)
    return model


DIRECTORY_CASES = {
    "kernel": (lambda d, mp: save_mx_pretrained(converted(), d, kernel="cuda"), ValueError),
    "experts": (lambda d, mp: save_mx_pretrained(converted(), d, experts=1), TypeError),
    "save_directory": (lambda d, mp: save_mx_pretrained(converted(), 5), TypeError),
    "save_directory bytes": (
        lambda d, mp: save_mx_pretrained(converted(), os.fsencode(d)),
        TypeError,
    ),
    "model": (lambda d, mp: save_mx_pretrained(None, d), TypeError),
    "plain module": (
        lambda d, mp: save_mx_pretrained(_converted_sequential(), d),
        TypeError,
    ),
    "complex buffer": (lambda d, mp: save_mx_pretrained(with_complex_buffer(), d), TypeError),
    "extra state": (lambda d, mp: save_mx_pretrained(with_extra_state(), d), TypeError),
    "config.save_pretrained fails": (
        lambda d, mp: save_mx_pretrained(_failing_config(mp, converted()), d),
        FailingConfigSave,
    ),
}

# What each message names.
DIRECTORY_TEXTS = {
    "kernel": "save_mx_pretrained: kernel must be",
    "experts": "save_mx_pretrained: experts must be",
    "save_directory": "save_mx_pretrained: save_directory must be a str",
    "save_directory bytes": "save_mx_pretrained: save_directory must be a str",
    "model": "save_mx_pretrained: model must be a torch.nn.Module",
    "plain module": "save_mx_pretrained: model must be a transformers PreTrainedModel",
    "complex buffer": "save_mx_pretrained: 'model.phase' has dtype torch.complex64",
    "extra state": "save_mx_pretrained: state-dict entry 'model.extra._extra_state' must be",
    "config.save_pretrained fails": "config.save_pretrained refused",
}


def _converted_sequential():
    model = nn.Sequential(nn.Linear(64, 64, dtype=BF16), nn.Linear(64, 64, dtype=BF16))
    zrw.convert(model)
    return model


@pytest.mark.parametrize("case", list(DIRECTORY_CASES))
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_refused_save_mx_pretrained_leaves_nothing(case, existing, tmp_path, monkeypatch):
    call, error = DIRECTORY_CASES[case]
    text = DIRECTORY_TEXTS[case]
    target = tmp_path / "out" / "mx"  # its parent does not exist either
    if existing:
        target.mkdir(parents=True)
        (target / "config.json").write_text("the old config")
    with pytest.raises(error, match=text):
        call(str(target), monkeypatch)
    if existing:
        assert sorted(os.listdir(target)) == ["config.json"]
        assert (target / "config.json").read_text() == "the old config"
        assert sorted(os.listdir(tmp_path)) == ["out"]
        assert sorted(os.listdir(tmp_path / "out")) == ["mx"]
    else:
        assert os.listdir(tmp_path) == []


def test_save_mx_pretrained_onto_a_file_is_refused(tmp_path):
    target = tmp_path / "mx"
    target.write_text("a file")
    with pytest.raises(ValueError, match="save_directory .* is a file"):
        save_mx_pretrained(converted(), target)
    assert sorted(os.listdir(tmp_path)) == ["mx"] and target.read_text() == "a file"


def test_save_mx_pretrained_replaces_the_files_of_an_existing_directory(tmp_path):
    target = tmp_path / "mx"
    target.mkdir()
    (target / "config.json").write_text("the old config")
    (target / "README.md").write_text("kept")
    save_mx_pretrained(converted(), target)
    assert sorted(os.listdir(target)) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (target / "README.md").read_text() == "kept"
    assert "quantization_config" in (target / "config.json").read_text()
    save_mx_pretrained(converted(), tmp_path / "new" / "mx")  # parents created as needed
    assert sorted(os.listdir(tmp_path / "new" / "mx")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert sorted(os.listdir(tmp_path)) == ["mx", "new"]  # no staging directory left
