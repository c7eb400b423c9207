"""Helpers that several test files share: importable as `helpers.<module>` because pyproject.toml's
[tool.pytest.ini_options] puts tests/ on sys.path (`pythonpath = ["tests"]`). A child process or
a spawned worker script gets the same through its environment (`child_env()`), never through
sys.path.insert.

  ranks           launching the 2- and 4-rank worker scripts (gloo on CPU), free ports
  worker          the worker scripts' side: flags, process group, meshes, training loop
  fsdp_runs       the FSDP2 tests' model, recipes and the runs compared with each other
  models          tiny Hugging Face Qwen3 / Qwen3-MoE models converted and trained with zrw
  quant           byte-for-byte comparison of MX quantizations, stable seeds, CPU kernel builds
  torchao_oracle  torchao's to_mx as an independent oracle (skips the importing module without it)
  npu_cases       the NPU adapter's inputs and cases (test_adapter.py, test_real_torch_npu.py)

Test files import from here (and use their conftest.py fixtures), never from each other. Helper
modules that only one folder's tests use stay beside them: tests/npu/npu_standins.py,
torch_npu_wheel.py and npu_test_ops.py (whose path CMakeLists.txt and csrc/npu/npu_test_ops.cpp
name), tests/hf/hf_models.py, and tests/mx_test_layer.py for the tests at the top of tests/.
"""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*dirs: str, **overrides: str) -> dict:
    """os.environ for a child process that imports `helpers` (and modules in `dirs`): PYTHONPATH
    gets tests/ and `dirs` in front of what it held; `overrides` set further variables."""
    path = [TESTS, *dirs, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **overrides}
