"""The test-only library of the NPU adapter, ``libzrw_npu_test_ops.so``: the namespace zrw_npu_test.

It holds the adapter's kernels (the same compiled code as zrw._C) registered for CPU in a mirror
namespace (csrc/npu/npu_test_ops.cpp says why), and is not part of zrw: CMake builds it next to
zrw._C (option ZRW_TEST_OPS, ON by default) into build/test_ops/ of the source tree, which no
wheel ships, and the tests load it with ``torch.ops.load_library``.
"""

import os
from pathlib import Path

import torch

import zrw  # noqa: F401  (zrw's ops, whose schemas the mirror's are compared with)

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "build" / "test_ops" / "libzrw_npu_test_ops.so"


def load():
    """torch.ops.zrw_npu_test, loading the library on first use."""
    if os.path.realpath(LIBRARY) not in torch.ops.loaded_libraries:
        if not LIBRARY.exists():
            raise RuntimeError(
                f"the NPU adapter's test library {LIBRARY} is missing: build zrw from this source "
                "tree with the test library on (the default; ZRW_TEST_OPS=ON), e.g. "
                'pip install --no-build-isolation -e ".[test]"'
            )
        torch.ops.load_library(str(LIBRARY))
    return torch.ops.zrw_npu_test
