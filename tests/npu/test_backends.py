"""zrw.backends(): what this build has and what can run in this process."""

import re
from pathlib import Path

import pytest

import zrw
from helpers.npu_standins import PINNED, SCHEMAS, StandIns, torch_npu_loaded
from zrw.backends import MX_OPS, NPU_OPERATORS


@pytest.mark.skipif(torch_npu_loaded(), reason="expects a machine without torch_npu")
def test_this_machine():
    b = zrw.backends()
    assert set(b) == {"cpu", "cuda", "npu"}
    assert b["cpu"] == {
        "available": True,
        "kernels": list(MX_OPS),
        "isa": zrw._C.cpu_isa(),
        "gemm": zrw._C.cpu_gemm(),
        "native_bf16": zrw._C.cpu_native_bf16(),
    }
    assert b["cuda"] == {"available": False, "kernels": []}
    npu = b["npu"]
    assert npu["kernels"] == list(MX_OPS)  # the adapter is built into zrw._C everywhere
    assert npu["operators"] == {name: False for name in NPU_OPERATORS}  # no torch_npu here
    assert npu["available"] is False
    assert npu["torch_npu"] is None
    assert set(npu) == {"available", "kernels", "torch_npu", "operators"}


def test_operators_count_only_with_an_npu_kernel():
    # Stand-ins with CPU kernels only are not torch_npu: nothing runs on an NPU through them.
    with StandIns(SCHEMAS[PINNED]):
        assert not any(zrw.backends()["npu"]["operators"].values())
    # Registered for PrivateUse1, as torch_npu registers them, they count.
    with StandIns(SCHEMAS[PINNED], dispatch_keys=("CPU", "PrivateUse1")):
        npu = zrw.backends()["npu"]
        assert all(npu["operators"].values()) and npu["available"] is True
    # A torch_npu without the MX operators (7.x)
    with StandIns(SCHEMAS["7.x"], dispatch_keys=("PrivateUse1",)):
        npu = zrw.backends()["npu"]
        assert npu["operators"]["npu_quant_matmul"] is True
        assert npu["operators"]["npu_dynamic_mx_quant"] is False and npu["available"] is False
    assert not any(zrw.backends()["npu"]["operators"].values())


def test_every_adapter_operator_is_reported():
    # The operators the C++ adapter calls, as its source names them.
    source = (Path(__file__).parents[2] / "csrc" / "npu" / "mx_npu.cpp").read_text()
    assert set(re.findall(r'npu_name = "(\w+)"', source)) == set(NPU_OPERATORS)
