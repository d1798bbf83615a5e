// What the bindings of the memory-bound stages share (bindings/moe_ops.cu, bindings/exchange_ops.cu):
// (with bindings/checks.h's argument checks, which name the argument) the dtype dispatch, the grid size, and the peer address
// tables of the exchange's ops.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "bindings/checks.h"
#include "common/device_info.h"
#include "common/limits.h"

namespace mok::bindings {

template <typename T, int V>
struct Tag {
  using type = T;
  static constexpr int kVec = V;
};

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Calls fn(Tag<element type, pack size>): 16-byte packs when every row of every tensor starts
// 16-byte aligned, one element otherwise.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, bool packs_ok, Fn&& fn) {
  if (dtype == at::kBFloat16) {
    packs_ok ? fn(Tag<__nv_bfloat16, 8>{}) : fn(Tag<__nv_bfloat16, 1>{});
  } else if (dtype == at::kFloat) {
    packs_ok ? fn(Tag<float, 4>{}) : fn(Tag<float, 1>{});
  } else {
    TORCH_CHECK(false, "megatron_mok kernels take bfloat16 or float32, got ", dtype);
  }
}

inline int grid_for(int64_t items) {
  const int sms = multiprocessor_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, int64_t(sms) * 16)));
}

inline bool row_packs_ok(int64_t row_elems, at::ScalarType dtype, std::initializer_list<at::Tensor> tensors) {
  if ((row_elems * c10::elementSize(dtype)) % 16 != 0) return false;
  for (const auto& t : tensors) {
    if (!aligned16(t)) return false;
  }
  return true;
}

// Every rank's address of one symmetric region, in rank order (comm/symmetric.py peer_ptrs), as
// the kernels take them (`out`, kMaxEpRanks entries, the unused ones null). Checked: one address per
// rank of a group of at most kMaxEpRanks (`num_ranks` > 0: exactly that many), none null, each
// `alignment`-aligned. That the table is the region of the tensor that stands for it (its shape and
// dtype) is the caller's to keep (SymmetricRegion carries both); it cannot be checked here without
// refusing the copies torch.library.opcheck makes of every tensor argument.
template <typename Ptr>
int fill_peer_table(Ptr (&out)[kMaxEpRanks], c10::IntArrayRef ptrs, const char* op, const char* name, int64_t num_ranks,
                    size_t alignment) {
  const int64_t n = int64_t(ptrs.size());
  TORCH_CHECK(n >= 1 && n <= kMaxEpRanks, op, ": ", name, " must hold one address per rank, at most ",
              std::to_string(kMaxEpRanks), " (limits.MAX_EP_RANKS), got ", std::to_string(n));
  TORCH_CHECK(num_ranks <= 0 || n == num_ranks, op, ": ", name, " must hold one address per rank (",
              std::to_string(num_ranks), "), got ", std::to_string(n));
  for (int b = 0; b < kMaxEpRanks; ++b) out[b] = nullptr;
  for (int64_t r = 0; r < n; ++r) {
    const uint64_t address = static_cast<uint64_t>(ptrs[r]);
    TORCH_CHECK(address != 0 && address % alignment == 0, op, ": ", name, "[", std::to_string(r),
                "] must be a non-null ", std::to_string(alignment), "-byte aligned device address, got ",
                std::to_string(address));
    out[r] = reinterpret_cast<Ptr>(address);
  }
  return int(n);
}

// Whether every address of a table (its first n) is 16-byte aligned.
template <typename Ptr>
bool table_aligned16(const Ptr (&table)[kMaxEpRanks], int n) {
  for (int r = 0; r < n; ++r) {
    if (reinterpret_cast<uintptr_t>(table[r]) % 16 != 0) return false;
  }
  return true;
}

}  // namespace mok::bindings
