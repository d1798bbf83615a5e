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

// Whether two contiguous tensors share bytes (each covers [data_ptr, data_ptr + nbytes)): an output a
// kernel writes while it reads the other.
inline bool contiguous_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a.numel() > 0 && b.numel() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace mok
