// `zrw._C` is a Python extension module so that `import zrw._C` loads the shared library (and
// with it the TORCH_LIBRARY registrations). The ops are reached through torch.ops.zrw.*; the
// module itself only reports build facts (and digests raw bytes for zrw.cache), so the library
// needs no libtorch_python.
#include <Python.h>

#include <cstdint>
#include <exception>

#include "common/digest.h"
#include "common/names.h"
#include "memory/counting_allocator.h"
#include "mx/mx_cpu_kernels.h"

namespace {

PyObject* cpu_isa(PyObject*, PyObject*) { return PyUnicode_FromString(zrw::cpu::active_isa()); }

PyObject* cpu_gemm(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(zrw::cpu::gemm_path_name());
  } catch (const std::exception& e) {  // a bad ZRW_CPU_GEMM: a Python error, not a crash
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* cpu_gemm_counts(PyObject*, PyObject*) {
  const auto c = zrw::cpu::gemm_counts();
  return Py_BuildValue("{s:L,s:L,s:L}", "fp32", static_cast<long long>(c.fp32), "bf16",
                       static_cast<long long>(c.bf16), "bf16_to_fp32",
                       static_cast<long long>(c.bf16_to_fp32));
}

PyObject* cpu_reset_gemm_counts(PyObject*, PyObject*) {
  zrw::cpu::reset_gemm_counts();
  Py_RETURN_NONE;
}

PyObject* cpu_matmul_workspace_bytes(PyObject*, PyObject*) {
  return PyLong_FromLongLong(zrw::cpu::matmul_workspace_bytes());
}

PyObject* cpu_free_matmul_workspace(PyObject*, PyObject*) {
  return PyLong_FromLongLong(zrw::cpu::free_matmul_workspace());
}

// The digest (common/digest.h) of `nbytes` bytes at `addr` (a contiguous CPU tensor's data,
// read, never written), without the GIL.
PyObject* bits_digest(PyObject*, PyObject* args) {
  unsigned long long addr = 0;
  long long nbytes = 0;
  if (!PyArg_ParseTuple(args, "KL", &addr, &nbytes)) return nullptr;
  if (nbytes < 0 || (addr == 0 && nbytes > 0)) {
    PyErr_Format(PyExc_ValueError,
                 "zrw._C.bits_digest: expected a data pointer and a byte "
                 "count >= 0, got %llu and %lld",
                 addr, nbytes);
    return nullptr;
  }
  const auto* p = reinterpret_cast<const unsigned char*>(addr);
  uint64_t h = 0;
  Py_BEGIN_ALLOW_THREADS;
  h = zrw::digest::of(p, nbytes);
  Py_END_ALLOW_THREADS;
  return PyLong_FromUnsignedLongLong(h);
}

PyObject* cpu_native_bf16(PyObject*, PyObject*) {
  return PyBool_FromLong(zrw::cpu::cpu_has_native_bf16());
}

template <size_t N>
PyObject* name_tuple(const char* const (&names)[N]) {
  PyObject* t = PyTuple_New(N);
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* s = PyUnicode_FromString(names[i]);
    if (s == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, i, s);
  }
  return t;
}

PyObject* scale_modes(PyObject*, PyObject*) { return name_tuple(zrw::names::kScaleModes); }
PyObject* fill_names(PyObject*, PyObject*) { return name_tuple(zrw::names::kFills); }
PyObject* cache_recipes(PyObject*, PyObject*) { return name_tuple(zrw::names::kCacheRecipes); }
PyObject* state_names(PyObject*, PyObject*) { return name_tuple(zrw::names::kStates); }

PyObject* memory_install(PyObject*, PyObject*) {
  zrw::memory::install();
  Py_RETURN_NONE;
}
PyObject* memory_installed(PyObject*, PyObject*) {
  return PyBool_FromLong(zrw::memory::installed());
}
PyObject* memory_current(PyObject*, PyObject*) {
  return PyLong_FromLongLong(zrw::memory::current_bytes());
}
PyObject* memory_peak(PyObject*, PyObject*) {
  return PyLong_FromLongLong(zrw::memory::peak_bytes());
}
PyObject* memory_fail_next(PyObject*, PyObject* args) {
  long long min_bytes = 0, skip = 0, count = 0;
  if (!PyArg_ParseTuple(args, "LLL", &min_bytes, &skip, &count)) return nullptr;
  if (!zrw::memory::installed()) {
    PyErr_SetString(PyExc_RuntimeError,
                    "zrw.memory: install() the counting allocator before injecting failures");
    return nullptr;
  }
  zrw::memory::fail_next(min_bytes, skip, count);
  Py_RETURN_NONE;
}
PyObject* fault_injection_built(PyObject*, PyObject*) {
#ifdef ZRW_FAULT_INJECTION
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* memory_pending_failures(PyObject*, PyObject*) {
  return PyLong_FromLongLong(zrw::memory::pending_failures());
}
PyObject* memory_reset_peak(PyObject*, PyObject*) {
  zrw::memory::reset_peak();
  Py_RETURN_NONE;
}

PyMethodDef zrw_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "Instruction set of the CPU quantization kernel in use: 'avx512', 'avx2' or 'base'."},
    {"cpu_gemm", cpu_gemm, METH_NOARGS,
     "The inner GEMM of mx_matmul on CPU: 'bf16' (native BF16 dot products) or 'fp32'."},
    {"cpu_gemm_counts", cpu_gemm_counts, METH_NOARGS,
     "mx_matmul calls per GEMM since the last reset: fp32, bf16, bf16_to_fp32 (extremes)."},
    {"cpu_reset_gemm_counts", cpu_reset_gemm_counts, METH_NOARGS, "Zero cpu_gemm_counts()."},
    {"cpu_matmul_workspace_bytes", cpu_matmul_workspace_bytes, METH_NOARGS,
     "Bytes held by mx_matmul's persistent CPU tile workspace."},
    {"cpu_free_matmul_workspace", cpu_free_matmul_workspace, METH_NOARGS,
     "Free mx_matmul's CPU tile workspace; returns the bytes dropped."},
    {"cpu_native_bf16", cpu_native_bf16, METH_NOARGS,
     "Whether this CPU has native BF16 dot products (avx512_bf16, AMX-BF16, Arm BF16)."},
    {"bits_digest", bits_digest, METH_VARARGS,
     "bits_digest(data_ptr, nbytes): a 64-bit digest of a contiguous CPU tensor's bytes."},
    {"scale_modes", scale_modes, METH_NOARGS, "The MX scale rules the ops accept."},
    {"fill_names", fill_names, METH_NOARGS, "The fills a restore of a released weight accepts."},
    {"cache_recipes", cache_recipes, METH_NOARGS, "The native cache's weight layouts."},
    {"state_names", state_names, METH_NOARGS,
     "The native cache's weight states, indexed by the code cache_state returns."},
    {"memory_install", memory_install, METH_NOARGS,
     "Install the counting CPU allocator (once; before the tensors to be measured exist)."},
    {"memory_installed", memory_installed, METH_NOARGS,
     "Whether the counting allocator is in use."},
    {"memory_current", memory_current, METH_NOARGS, "Live CPU bytes allocated since install."},
    {"memory_peak", memory_peak, METH_NOARGS, "Peak live CPU bytes since install or reset."},
    {"memory_fail_next", memory_fail_next, METH_VARARGS,
     "Fault injection: of the allocations of >= min_bytes, skip some, then fail `count` (OOM)."},
    {"fault_injection_built", fault_injection_built, METH_NOARGS,
     "Whether this build has fault injection (a test build: ZRW_TEST_OPS=ON)."},
    {"memory_pending_failures", memory_pending_failures, METH_NOARGS,
     "Injected failures not yet consumed."},
    {"memory_reset_peak", memory_reset_peak, METH_NOARGS, "Set the peak to the current bytes."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef zrw_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, zrw_methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&zrw_module); }
