"""The ZRW_NPU option: AUTO skips the native target _C_npu here, ON says what is missing; the
ZRW_TEST_OPS option: the test library is built by default, outside the package.

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
# What this machine lacks, which the AUTO/ON tests expect to be missing.
npu_toolchain_absent = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None
    or any(os.environ.get(v) for v in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"))
    or Path("/usr/local/Ascend/ascend-toolkit/latest").exists(),
    reason="torch_npu or CANN is installed here",
)


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
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("ZRW_NPU", "ZRW_CUDA", "ZRW_TEST_OPS", "ASCEND_TOOLKIT_HOME",
                             "ASCEND_HOME_PATH")}
    args = setup_py().cmake_args(build_dir / "out")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []

    def run(env=None, **cmake_vars):
        extra = [f"-D{k}={v}" for k, v in cmake_vars.items()]
        return subprocess.run(["cmake", str(ROOT), *generator, *args, *extra], cwd=build_dir,
                              env={**base_env, **(env or {})}, capture_output=True, text=True,
                              timeout=300)

    return run


def test_setup_py_passes_whether_torch_npu_imports():
    module = setup_py()
    args = module.cmake_args("/tmp/out")
    assert f"-DZRW_TORCH_NPU={module._torch_npu_version()}" in args
    if importlib.util.find_spec("torch_npu") is None:
        assert module._torch_npu_version() == ""
    assert f"-DPython3_EXECUTABLE={sys.executable}" in args


@npu_toolchain_absent
def test_auto_skips_the_native_target(configure):
    r = configure(ZRW_NPU="AUTO")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "zrw: NPU adapter (PrivateUse1 kernels over torch_npu's npu:: operators): in _C" in out
    assert "zrw: native NPU target _C_npu: skipped (ZRW_NPU=AUTO), missing: torch_npu" in out
    assert "the CANN toolkit" in out


@npu_toolchain_absent
def test_on_fails_naming_what_is_missing(configure):
    r = configure(ZRW_NPU="ON")
    assert r.returncode != 0
    err = " ".join(r.stderr.split())  # CMake wraps its messages
    assert "ZRW_NPU=ON but the native NPU target _C_npu cannot be built, missing:" in err
    assert "torch_npu (it does not import in" in err
    assert "the CANN toolkit (no include/acl/acl.h and lib64/libascendcl.so under" in err
    assert "source <CANN install>/set_env.sh" in err


@npu_toolchain_absent
def test_on_with_torch_npu_but_no_cann(configure):
    r = configure(ZRW_NPU="ON", ZRW_TORCH_NPU="2.13.0")
    assert r.returncode != 0
    err = " ".join(r.stderr.split())
    assert "the CANN toolkit" in err and "torch_npu (it does not import" not in err


def test_off_skips(configure):
    r = configure(ZRW_NPU="OFF")
    assert r.returncode == 0, r.stderr
    assert "zrw: native NPU target _C_npu: skipped (ZRW_NPU=OFF)" in r.stdout


def test_invalid_value(configure):
    r = configure(ZRW_NPU="YES")
    assert r.returncode != 0
    assert "ZRW_NPU must be AUTO, ON or OFF, got 'YES'" in " ".join(r.stderr.split())


def test_the_test_library_is_on_by_default_and_outside_the_package(configure):
    # ON by default (the CI command sets nothing), into the directory the tests load it from.
    r = configure(ZRW_NPU="OFF")  # the build dir caches the last ZRW_NPU, which may be invalid
    assert r.returncode == 0, r.stderr
    assert ("zrw: test library libzrw_npu_test_ops (namespace zrw_npu_test): built into "
            f"{npu_test_ops.LIBRARY.parent} (ZRW_TEST_OPS=ON)") in r.stdout
    r = configure(ZRW_NPU="OFF", ZRW_TEST_OPS="OFF")
    assert r.returncode == 0, r.stderr
    assert "zrw: test library libzrw_npu_test_ops: skipped (ZRW_TEST_OPS=OFF" in r.stdout


def test_found_cann_and_torch_npu_build_the_target(configure, tmp_path):
    # Last: CMake caches a found CANN. A fake toolkit layout is enough for the configure step.
    cann = tmp_path / "ascend-toolkit" / "latest"
    (cann / "include" / "acl").mkdir(parents=True)
    (cann / "include" / "acl" / "acl.h").write_text("/* fake */\n")
    (cann / "lib64").mkdir()
    (cann / "lib64" / "libascendcl.so").write_bytes(b"")
    r = configure(ZRW_NPU="AUTO", ZRW_TORCH_NPU="2.13.0", env={"ASCEND_TOOLKIT_HOME": str(cann)})
    assert r.returncode == 0, r.stderr
    assert "zrw: native NPU target _C_npu: built (ZRW_NPU=AUTO; torch_npu 2.13.0" in r.stdout
