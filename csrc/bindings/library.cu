// The `megatron_mok` op library and the extension module. The kernels' ops register as fragments
// of it (bindings/moe_ops.cu, bindings/expert_gemm_ops.cu); the ops here describe the build
// itself and need no device, so they work wherever the extension loads.
#include <Python.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/failure_record.h"
#include "common/limits.h"

namespace mok {
namespace {

// The values of megatron_mok/limits.py COMPILED this build was compiled with, in the order of
// compiled_limit_names() (common/limits.h).
std::vector<int64_t> compiled_limits() {
  return std::vector<int64_t>(std::begin(kCompiledLimitValues), std::end(kCompiledLimitValues));
}

std::vector<std::string> compiled_limit_names() {
  return std::vector<std::string>(std::begin(kCompiledLimitNames), std::end(kCompiledLimitNames));
}

// "" when no kernel of this process failed, else which wait timed out or which check failed, in
// which kernel and block (common/failure_record.h). Read from host memory: no device needed.
std::string last_failure() { return last_failure_message(); }

}  // namespace

TORCH_LIBRARY(megatron_mok, m) {
  m.def("compiled_limits() -> int[]", &compiled_limits);
  m.def("compiled_limit_names() -> str[]", &compiled_limit_names);
  m.def("last_failure() -> str", &last_failure);
}

}  // namespace mok

// `import megatron_mok._C` loads the library above; the module itself has no Python API.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
