"""Thin driver of CMake: configure, build and place zrw._C next to the Python package (and, with
ZRW_TEST_OPS on, the default, the test-only libzrw_npu_test_ops in build/test_ops/, outside it).

Everything about the build graph lives in CMakeLists.txt. This file only passes what Python
knows: torch's include and library directories and its C++ ABI flag.
Build against the installed torch with `pip install --no-build-isolation .` (or `-e .`).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A persistent CMake build directory in the checkout (not pip's temporary one), so that
        # `pip install --no-build-isolation -e .` after a change, or the README's second
        # command after its first, rebuilds only what changed (a full build is minutes on 2
        # cores). ZRW_BUILD_DIR overrides it.
        build_dir = Path(os.environ.get("ZRW_BUILD_DIR") or ROOT / "build" / "cmake") / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        args = cmake_args(out_dir, cfg)
        generator = ["-G", "Ninja"] if _have("ninja") else []
        subprocess.run(["cmake", str(ROOT), *generator, *args], cwd=build_dir, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(
            ["cmake", "--build", ".", "--config", cfg, "-j", jobs], cwd=build_dir, check=True
        )


def cmake_args(out_dir, cfg: str = "Release") -> list:
    """The -D arguments of the CMake configure step: what only Python knows, plus the
    ZRW_TEST_OPS option from the environment. A function so that tests can configure with
    them."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - a build-time message
        raise RuntimeError(
            "zrw builds against the installed torch: install torch first "
            "(pip install torch==2.13.0) and build with --no-build-isolation"
        ) from e

    args = [
        f"-DCMAKE_BUILD_TYPE={cfg}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        "-DZRW_TORCH_INCLUDE_DIRS=" + ";".join(cpp_extension.include_paths()),
        f"-DZRW_TORCH_LIBRARY_DIR={Path(torch.__file__).parent / 'lib'}",
        f"-DZRW_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DZRW_OUTPUT_DIR={out_dir}",
    ]
    for opt in ("ZRW_TEST_OPS",):
        if os.environ.get(opt):
            args.append(f"-D{opt}={os.environ[opt]}")
    return args


def _have(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


if __name__ == "__main__":  # pip runs setup.py as __main__; tests import cmake_args from it
    setup(
        ext_modules=[CMakeExtension("zrw._C")],
        cmdclass={"build_ext": CMakeBuild},
    )
