// Host-side TMA tensor maps for the sm90 kernels. The driver's encoder is reached through the
// runtime's entry-point query, so the extension needs no link against libcuda.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

namespace mok {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "megatron_mok: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12 or newer)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A bf16 tensor of `rank` dimensions (dims innermost first, in elements; byte strides of dims 1..),
// read or written in boxes of `box` elements with 128-byte swizzle; out-of-bounds parts of a box
// read as zeros and are not written. The innermost extent and every stride must be whole 16 bytes.
template <int kRank>
CUtensorMap bf16_tensor_map_sw128_nd(const void* base, const cuuint64_t (&dims)[kRank],
                                     const cuuint64_t (&byte_strides)[kRank - 1], const cuuint32_t (&box)[kRank],
                                     const char* name) {
  bool whole_16_bytes = dims[0] % 8 == 0;
  for (int d = 0; d < kRank - 1; ++d) whole_16_bytes = whole_16_bytes && byte_strides[d] % 16 == 0;
  TORCH_CHECK(whole_16_bytes, name, ": rows must be a multiple of 16 bytes for TMA, got ", std::to_string(dims[0]),
              " columns");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, name, " must start 16-byte aligned");
  CUtensorMap map;
  cuuint32_t element_strides[kRank];
  for (int d = 0; d < kRank; ++d) element_strides[d] = 1;
  const CUresult result = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, const_cast<void*>(base),
                                               dims, byte_strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "megatron_mok: cuTensorMapEncodeTiled failed for ", name, " (CUresult ",
              std::to_string(int(result)), ")");
  return map;
}

// A row-major bf16 matrix of (rows, cols) at `base` with rows `row_stride` elements apart, in boxes
// of (box_rows, 64). cols and row_stride must be multiples of 8 (16-byte rows).
inline CUtensorMap bf16_tensor_map_sw128(const void* base, int64_t rows, int64_t cols, int64_t row_stride,
                                         uint32_t box_rows, const char* name) {
  return bf16_tensor_map_sw128_nd<2>(base, {cuuint64_t(cols), cuuint64_t(rows)}, {cuuint64_t(row_stride) * 2},
                                     {64, box_rows}, name);
}

// A (batches, rows, cols) bf16 tensor, contiguous, as a 3-D map with 64 x box_rows x 1 boxes: a box
// never crosses into the next batch (rows past a batch's end are zeros).
inline CUtensorMap bf16_tensor_map_3d_sw128(const void* base, int64_t batches, int64_t rows, int64_t cols,
                                            uint32_t box_rows, const char* name) {
  return bf16_tensor_map_sw128_nd<3>(base, {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(batches)},
                                     {cuuint64_t(cols) * 2, cuuint64_t(rows * cols) * 2}, {64, box_rows, 1}, name);
}

// A row-major E4M3 matrix (rows, cols) at `base`, one byte per value, read in boxes of box_rows rows
// x 128 bytes (one FP8 scale block along the rows) with 128-byte swizzle, what wgmma's K-major
// descriptors expect; parts of a box past the rows or columns read as zeros. cols must be a
// multiple of 16 (whole 16-byte rows).
inline CUtensorMap e4m3_tensor_map_sw128(const void* base, int64_t rows, int64_t cols, uint32_t box_rows,
                                         const char* name) {
  TORCH_CHECK(cols % 16 == 0, name, ": rows must be a multiple of 16 bytes for TMA, got ", std::to_string(cols),
              " columns");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, name, " must start 16-byte aligned");
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t byte_strides[1] = {cuuint64_t(cols)};
  const cuuint32_t box[2] = {128, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  CUtensorMap map;
  const CUresult result = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, byte_strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "megatron_mok: cuTensorMapEncodeTiled failed for ", name, " (CUresult ",
              std::to_string(int(result)), ")");
  return map;
}

}  // namespace mok
