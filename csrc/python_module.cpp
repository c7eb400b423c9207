// `zrw._C` is a Python extension module only so that `import zrw._C` loads the shared library
// (and with it the TORCH_LIBRARY registrations). It exposes no functions: everything is a
// dispatcher op reached through torch.ops.zrw.*, so the library needs no libtorch_python.
#include <Python.h>

static struct PyModuleDef zrw_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&zrw_module); }
