// `zrw._C` is a Python extension module so that `import zrw._C` loads the shared library (and
// with it the TORCH_LIBRARY registrations). The ops are reached through torch.ops.zrw.*; the
// module itself only reports build facts, so the library needs no libtorch_python.
#include <Python.h>

#include "mx/mx_cpu_kernels.h"

namespace {

PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(zrw::cpu::active_isa());
}

PyMethodDef zrw_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "Instruction set of the CPU quantization kernel in use: 'avx512', 'avx2' or 'base'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef zrw_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, zrw_methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&zrw_module); }
