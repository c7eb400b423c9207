// zrw._C_npu: the place for native Ascend C kernels, which need the CANN toolkit and torch_npu
// to build (CMake option ZRW_NPU). It holds none yet: on NPU every zrw op runs through the
// adapter in zrw._C (csrc/npu/mx_npu.cpp), which calls torch_npu's MX operators. The module
// exists so that the build decision is made, and reported (zrw.backends()), in one place.
#include <Python.h>

namespace {

PyObject* native_kernels(PyObject*, PyObject*) { return PyTuple_New(0); }

PyMethodDef methods[] = {
    {"native_kernels", native_kernels, METH_NOARGS,
     "Names of the zrw ops with a native Ascend C kernel in this module (none yet)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_npu", nullptr, 0, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C_npu(void) { return PyModule_Create(&module); }
