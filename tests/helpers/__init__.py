"""Helpers that the test files share: importable as `helpers.<module>` because pyproject.toml's
[tool.pytest.ini_options] puts tests/ on sys.path (`pythonpath = ["tests"]`). A child process or
a spawned worker script gets the same through its environment (`child_env()`), never through
sys.path.insert.

  bitwise         bit-for-bit comparison of tensors and state dicts (the one such helper)
  models          the one tiny Qwen3 / Qwen3-MoE factory (make_model) and their training
  mx_layer        a minimal MX linear on zrw.ops and parameter helpers (tests/cache, tests/optim)
  user_actions    the lifecycle tests' tiny model and the user actions applied to it
  hf              Hugging Face Trainer runs: token data, the common arguments, the logs
  refusal         what a refused call must leave as it was (the fixture nothing_changes)
  quant           byte-for-byte comparison of MX quantizations, stable seeds, CPU kernel builds
  torchao_oracle  torchao's to_mx as an independent oracle (skips the importing module without it)
  ranks           launching the 2- and 4-rank worker scripts (gloo on CPU), free ports
  worker          the worker scripts' side: flags, process group, meshes, training loop
  fsdp_runs       the FSDP2 tests' model, recipes and the runs compared with each other
  npu_cases       the NPU adapter's inputs and cases (test_adapter.py, test_real_torch_npu.py)
  npu_standins    stand-in torch_npu MX operators for the adapter's CPU tests
  torch_npu_wheel the real torch_npu wheel, read as files

The fixture for an empty weight cache, `clean_cache`, is in tests/conftest.py. Test files import
from here (and use conftest.py fixtures), never from each other. One helper stays beside its
tests: tests/npu/npu_test_ops.py, whose path CMakeLists.txt and csrc/npu/npu_test_ops.cpp name.
"""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)  # the repository


def child_env(*dirs: str, **overrides: str) -> dict:
    """os.environ for a child process that imports `helpers` (and modules in `dirs`): PYTHONPATH
    gets tests/ and `dirs` in front of what it held; `overrides` set further variables."""
    path = [TESTS, *dirs, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **overrides}
