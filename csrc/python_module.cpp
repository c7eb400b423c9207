// `zrw._C` is a Python extension module so that `import zrw._C` loads the shared library (and
// with it the TORCH_LIBRARY registrations). The ops are reached through torch.ops.zrw.*; the
// module itself only reports build facts, so the library needs no libtorch_python.
#include <Python.h>

#include "memory/counting_allocator.h"
#include "mx/mx_cpu_kernels.h"

namespace {

PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(zrw::cpu::active_isa());
}

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
PyObject* memory_reset_peak(PyObject*, PyObject*) {
  zrw::memory::reset_peak();
  Py_RETURN_NONE;
}

PyMethodDef zrw_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "Instruction set of the CPU quantization kernel in use: 'avx512', 'avx2' or 'base'."},
    {"memory_install", memory_install, METH_NOARGS,
     "Install the counting CPU allocator (once; before the tensors to be measured exist)."},
    {"memory_installed", memory_installed, METH_NOARGS, "Whether the counting allocator is in use."},
    {"memory_current", memory_current, METH_NOARGS, "Live CPU bytes allocated since install."},
    {"memory_peak", memory_peak, METH_NOARGS, "Peak live CPU bytes since install or reset."},
    {"memory_reset_peak", memory_reset_peak, METH_NOARGS, "Set the peak to the current bytes."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef zrw_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, zrw_methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&zrw_module); }
