"""The build's options: the ZRW_TEST_OPS option builds the test library by default, outside the
package; the NPU adapter is part of _C on every machine; no accelerator-kernel option exists.

Runs CMake's configure step only, in a temporary build directory, with the -D arguments setup.py
passes (``cmake_args`` from setup.py), so the decision tested is the one a real build makes.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import npu_test_ops
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def setup_py():
    spec = importlib.util.spec_from_file_location("zrw_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() does not run
    return module


@pytest.fixture(scope="module")
def configure(tmp_path_factory):
    """configure(**cmake_vars, env={...}) -> CompletedProcess; one build dir for every call, so
    only the first pays for compiler detection."""
    build_dir = tmp_path_factory.mktemp("zrw_cmake")
    base_env = {k: v for k, v in os.environ.items() if k != "ZRW_TEST_OPS"}
    args = setup_py().cmake_args(build_dir / "out")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []

    def run(env=None, **cmake_vars):
        extra = [f"-D{k}={v}" for k, v in cmake_vars.items()]
        return subprocess.run(
            ["cmake", str(ROOT), *generator, *args, *extra],
            cwd=build_dir,
            env={**base_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def test_setup_py_passes_what_only_python_knows():
    args = setup_py().cmake_args("/tmp/out")
    assert f"-DPython3_EXECUTABLE={sys.executable}" in args
    assert "-DZRW_OUTPUT_DIR=/tmp/out" in args
    assert not any("CUDA" in a or "NPU" in a for a in args)  # no accelerator-kernel targets


def test_the_adapter_is_in_c_and_nothing_else_is_configured(configure):
    r = configure()
    assert r.returncode == 0, r.stderr
    assert (
        "zrw: NPU adapter (PrivateUse1 kernels over torch_npu's npu:: operators): in _C" in r.stdout
    )
    assert "_C_npu" not in r.stdout and "CUDA" not in r.stdout


def test_the_test_library_is_on_by_default_and_outside_the_package(configure):
    # ON by default (the CI command sets nothing), into the directory the tests load it from.
    r = configure()
    assert r.returncode == 0, r.stderr
    assert (
        "zrw: test library libzrw_npu_test_ops (namespace zrw_npu_test): built into "
        f"{npu_test_ops.LIBRARY.parent} (ZRW_TEST_OPS=ON)"
    ) in r.stdout
    r = configure(ZRW_TEST_OPS="OFF")
    assert r.returncode == 0, r.stderr
    assert "zrw: test library libzrw_npu_test_ops: skipped (ZRW_TEST_OPS=OFF" in r.stdout
