"""The real torch_npu wheel, read as files: obtained as a user's machine would, never imported.

torch_npu cannot be imported without Ascend's CANN toolkit, but its wheel ships as plain files what
zrw's NPU adapter depends on: the operator schemas (``torch_npu/csrc/aten/
npu_native_functions_by_codegen.yaml``, section ``custom``: the ``npu::`` operators) and the meta
functions that state each operator's output shapes and dtypes (``torch_npu/op_plugin/meta/
_meta_registrations.py``). This module downloads the wheel with ``pip download --no-deps`` into a
cache directory, checks the files it reads against the wheel's RECORD, and runs the meta functions
on meta tensors with a minimal stand-in for the few torch_npu names they use.

The cache directory is ``$ZRW_WHEEL_CACHE`` (``.ci/run`` sets it), else ``~/.cache/zrw/wheels``.
A wheel already there is used without asking the registry. ``obtain()`` raises
``RegistryUnreachable`` only when pip could not connect to the package index; any other failure
(no such version, a broken wheel) is an ordinary error.
"""

import ast
import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch

VERSION = "2.13.0"  # the torch_npu release for torch 2.13 (its Requires-Dist: torch==2.13.0.*)
REQUIREMENT = f"torch-npu=={VERSION}"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
# torch_npu's own dtype codes are 256 + aclDataType (custom_dtype/Init.h: g_toAclOffset), with the
# aclDataType values of CANN's acl_base_rt.h, both shipped in the wheel's include/ directory.
DTYPE_OFFSET_FILE = "torch_npu/include/torch_npu/csrc/custom_dtype/Init.h"
ACL_DTYPE_FILE = "torch_npu/include/acl/acl_base_rt.h"
# torch_npu's Python names for its dtype codes -> the aclDataType each stands for.
NPU_DTYPE_NAMES = {
    "int4": "ACL_INT4",
    "hifloat8": "ACL_HIFLOAT8",
    "float8_e5m2": "ACL_FLOAT8_E5M2",
    "float8_e4m3fn": "ACL_FLOAT8_E4M3FN",
    "float8_e8m0fnu": "ACL_FLOAT8_E8M0",
    "float4_e2m1fn_x2": "ACL_FLOAT4_E2M1",
    "float4_e1m2fn_x2": "ACL_FLOAT4_E1M2",
}

# What pip prints when it cannot reach the index (urllib3 / requests / socket errors).
_UNREACHABLE = re.compile(
    r"NewConnectionError|ConnectTimeoutError|ReadTimeoutError|Max retries exceeded|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"Connection refused|ProxyError|SSLError|No route to host|ConnectionResetError"
)


class RegistryUnreachable(RuntimeError):
    """pip could not connect to the package index."""


def cache_dir():
    return Path(os.environ.get("ZRW_WHEEL_CACHE") or Path.home() / ".cache" / "zrw" / "wheels")


def _cached(directory):
    wheels = sorted(directory.glob(f"torch_npu-{VERSION}-*.whl"))
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                if {SCHEMA_FILE, META_FILE} <= set(z.namelist()):
                    return wheel
        except zipfile.BadZipFile:
            pass
    return None


def obtain(directory=None, timeout_s=600):
    """The path of torch_npu's wheel, from the cache or downloaded into it by pip."""
    directory = Path(directory or cache_dir())
    directory.mkdir(parents=True, exist_ok=True)
    wheel = _cached(directory)
    if wheel is not None:
        return wheel
    # Into a fresh directory first, then moved: an interrupted download never looks cached.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--timeout",
            "30",
            "--retries",
            "2",
            REQUIREMENT,
            "-d",
            tmp,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        output = r.stdout + r.stderr
        if r.returncode != 0:
            if _UNREACHABLE.search(output):
                why = next(
                    line.strip() for line in output.splitlines() if _UNREACHABLE.search(line)
                )
                raise RegistryUnreachable(
                    f"`pip download --no-deps {REQUIREMENT}` could not reach the package index: "
                    f"{why[:300]}\n{output[-2000:]}"
                )
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{output[-4000:]}")
        got = list(Path(tmp).glob(f"torch_npu-{VERSION}-*.whl"))
        if len(got) != 1:
            raise RuntimeError(
                f"pip downloaded {[p.name for p in Path(tmp).iterdir()]}, expected "
                f"one torch_npu-{VERSION}-*.whl:\n{output[-2000:]}"
            )
        target = directory / got[0].name
        os.replace(got[0], target)
    return target


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class Wheel:
    """The files of one torch_npu wheel that the tests read, each checked against its RECORD."""

    def __init__(self, path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        dist_info = f"torch_npu-{VERSION}.dist-info"
        record = self._zip.read(f"{dist_info}/RECORD").decode()
        self._hashes = {
            line.split(",")[0]: line.split(",")[1]
            for line in record.splitlines()
            if line.count(",") >= 2
        }
        self.metadata = self.read(f"{dist_info}/METADATA")
        self._meta = None
        self._schemas = None

    def read(self, name):
        data = self._zip.read(name)
        expected = self._hashes.get(name)
        if expected and _record_hash(data) != expected:
            raise RuntimeError(f"{self.path.name}: {name} does not match the wheel's RECORD")
        return data.decode()

    # -- metadata ---------------------------------------------------------------------------------
    def metadata_field(self, field):
        return [
            line.split(":", 1)[1].strip()
            for line in self.metadata.splitlines()
            if line.startswith(f"{field}:")
        ]

    def source_branch(self):
        """The branch of Ascend/pytorch the README in METADATA says this release is built from,
        ``v{torch}-{Ascend Extension for PyTorch release}``, e.g. ``v2.13.0-26.2.0``."""
        found = re.findall(r"git clone https://\S+ -b (v[\w.\-]+)", self.metadata)
        return found[0] if found else None

    # -- operator schemas -------------------------------------------------------------------------
    def custom_schemas(self):
        """{operator name: schema string} of the yaml's ``custom`` section: torch_npu's own
        operators, registered in the ``npu`` namespace."""
        if self._schemas is None:
            self._schemas = self._read_custom_schemas()
        return self._schemas

    def _read_custom_schemas(self):
        section, schemas = None, {}
        for line in self.read(SCHEMA_FILE).splitlines():
            top = re.match(r"^(\w+):", line)
            if top:
                section = top.group(1)
                continue
            func = re.match(r"^(?:- |  )func: (.*)$", line)
            if func and section == "custom":
                schema = func.group(1).strip()
                name = schema.split("(", 1)[0]
                if name in schemas:
                    raise RuntimeError(f"{SCHEMA_FILE}: {name} is declared twice")
                schemas[name] = schema
        if not schemas:
            raise RuntimeError(
                f"{SCHEMA_FILE}: no `custom:` operators found; has its layout changed?"
            )
        return schemas

    # -- dtype codes ------------------------------------------------------------------------------
    def npu_dtype_codes(self):
        """{torch_npu dtype name: its integer code}, e.g. float8_e8m0fnu -> 293."""
        offset = re.search(r"g_toAclOffset\s*=\s*(\d+)", self.read(DTYPE_OFFSET_FILE))
        acl = dict(re.findall(r"\b(ACL_\w+)\s*=\s*(\d+)", self.read(ACL_DTYPE_FILE)))
        return {
            name: int(offset.group(1)) + int(acl[acl_name])
            for name, acl_name in NPU_DTYPE_NAMES.items()
        }

    # -- meta functions ---------------------------------------------------------------------------
    def meta(self):
        """The meta-registration module's namespace after running it with stand-ins for what it
        imports from torch_npu and torch.library: ``meta().functions[(namespace, op)]`` is the
        function it registers for the Meta key of ``namespace::op``."""
        if self._meta is None:
            self._meta = _run_meta_module(self.read(META_FILE), self.npu_dtype_codes())
        return self._meta


class _ErrCode:
    """torch_npu.utils._error_code.ErrCode: only used to build messages."""

    def __getattr__(self, name):
        return name


def _unavailable(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"torch_npu.{name} needs CANN and an NPU; the stand-in cannot answer")

    return call


def _run_meta_module(source, dtype_codes):
    """Executes the meta-registration source without torch_npu. The module's imports of
    torch_npu and torch.library are replaced by stand-ins; its top-level calls that need the
    registered operators (``has_side_effect(torch.ops.npu.X.default)``) are skipped; ``@impl``
    records each function instead of registering it with the dispatcher."""
    tree = ast.parse(source)

    def keep(node):
        if isinstance(node, ast.Import):
            return not any(a.name.split(".")[0] == "torch_npu" for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return not (
                node.module.split(".")[0] == "torch_npu"
                or node.module in ("torch.library", "torch.fx.node")
            )
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            return False
        return True

    tree.body = [node for node in tree.body if keep(node)]
    functions = {}

    class Library:
        def __init__(self, ns, kind, dispatch_key=""):
            self.ns, self.kind, self.dispatch_key = ns, kind, dispatch_key

    def impl(lib, name, *args, **kwargs):
        def register(fn):
            functions[(lib.ns, name)] = fn
            return fn

        return register

    torch_npu = types.SimpleNamespace(
        **dtype_codes,
        npu=types.SimpleNamespace(
            utils=types.SimpleNamespace(
                _is_gte_cann_version=_unavailable("npu.utils._is_gte_cann_version")
            )
        ),
    )
    namespace = {
        "__name__": "torch_npu_meta_registrations",
        "torch": torch,
        "torch_npu": torch_npu,
        "Library": Library,
        "impl": impl,
        "has_side_effect": lambda *a, **k: None,
        "ErrCode": _ErrCode(),
        "ops_error": lambda code: f" [torch_npu error: {code}]",
        "get_cann_version": _unavailable("npu.utils.get_cann_version"),
        "get_soc_version": _unavailable("npu._backends.get_soc_version"),
    }
    exec(compile(tree, META_FILE, "exec"), namespace)  # noqa: S102 (the wheel's own source)
    module = types.SimpleNamespace(**{k: v for k, v in namespace.items() if not k.startswith("__")})
    module.functions = functions
    return module
