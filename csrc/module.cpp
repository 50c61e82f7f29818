// Python module elastic_plugin._C.  Importing it loads this shared library, whose
// static TORCH_LIBRARY blocks register the ops under torch.ops.elastic_plugin.
// Plain CPython API (no pybind11) keeps this translation unit quick to compile.
#include <Python.h>

#ifndef ELASTIC_PLUGIN_WITH_CUDA
#define ELASTIC_PLUGIN_WITH_CUDA 0
#endif

// setup.py passes the torch version as bare tokens; stringify them here, which avoids
// quoting a string literal through the shell and ninja.
#define ELASTIC_PLUGIN_STR_(x) #x
#define ELASTIC_PLUGIN_STR(x) ELASTIC_PLUGIN_STR_(x)
#ifdef ELASTIC_PLUGIN_TORCH_VERSION
#define ELASTIC_PLUGIN_TORCH_VERSION_STR ELASTIC_PLUGIN_STR(ELASTIC_PLUGIN_TORCH_VERSION)
#else
#define ELASTIC_PLUGIN_TORCH_VERSION_STR ""
#endif
// The TORCH_CUDA_ARCH_LIST the CUDA kernels were compiled for, ';' written as '_' (e.g.
// 8.0_9.0_10.0); empty for a C++-only build.
#ifdef ELASTIC_PLUGIN_CUDA_ARCHS
#define ELASTIC_PLUGIN_CUDA_ARCHS_STR ELASTIC_PLUGIN_STR(ELASTIC_PLUGIN_CUDA_ARCHS)
#else
#define ELASTIC_PLUGIN_CUDA_ARCHS_STR ""
#endif

static struct PyModuleDef elastic_plugin_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Compiled kernels of elastic_plugin; the ops live in torch.ops.elastic_plugin.",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&elastic_plugin_c_module);
  if (module == nullptr) return nullptr;
  // WITH_CUDA: whether CUDA kernels were compiled in.  TORCH_VERSION: the torch this was
  // built against; the loader refuses a mismatch instead of risking an ABI crash.
  // CUDA_ARCHS: the architectures the build asked for (the binary's own list is read from
  // its fatbin, elastic_plugin/ops/_binary.py).
  if (PyModule_AddIntConstant(module, "WITH_CUDA", ELASTIC_PLUGIN_WITH_CUDA) < 0 ||
      PyModule_AddStringConstant(module, "TORCH_VERSION", ELASTIC_PLUGIN_TORCH_VERSION_STR) < 0 ||
      PyModule_AddStringConstant(module, "CUDA_ARCHS", ELASTIC_PLUGIN_CUDA_ARCHS_STR) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
