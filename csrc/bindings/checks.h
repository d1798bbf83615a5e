// Argument checks shared by the bindings: every failed check is a TORCH_CHECK naming the argument.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace mok {

// Numbers in error messages go through std::to_string: streaming an integer into the message's
// ostream crashed on the device image, where the extension's libstdc++ is not torch's.
inline std::string sizes_str(const at::Tensor& t) {
  std::string out = "(";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + ")";
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_index(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
}

}  // namespace mok
