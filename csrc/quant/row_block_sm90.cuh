// The pieces of the 1x128 row-block layout that the row quantization kernels (quant/quantize_rows_sm90.cuh,
// quant/quantize_swiglu_backward_sm90.cuh) and the FP8 GEMM's SwiGLU-backward epilogue
// (gemm/epilogue_fp8_swiglu_bwd_sm90.cuh) share: a block of a row is 16 threads of a half-warp, 8
// bf16 values each (one 16-byte load), its amax four shuffles, its E4M3 bytes one 8-byte store per
// thread. Device functions only: no kernel, so any translation unit may include it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_block_math.cuh"
#include "common/limits.h"

namespace mok {

constexpr int kRowsUnitThreads = kFp8Block / 8;  // 16 threads x 8 bf16 per 1x128 block

// 8 bf16 (one 16-byte pack) -> 8 fp32, in order.
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);  // bf16 -> fp32 is exact: the high half of the word
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// 8 fp32 values -> one 16-byte pack of 8 bf16, each rounded to nearest even.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // (low half: v[2i])
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// The amax of a 1x128 block whose 128 values the 16 threads of a half-warp hold, 8 each: four
// shuffles inside the half-warp (every lane of the warp calls it: both halves reduce their own block).
__device__ __forceinline__ float half_warp_block_amax(const float (&v)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = max_nan(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = kRowsUnitThreads / 2; offset > 0; offset /= 2) {
    amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  return amax;
}

// This thread's 8 bf16 values (exact in fp32) of a block with `scale` as 8 E4M3 bytes, one 8-byte
// store at byte 8 * piece of the block's q.
__device__ __forceinline__ void store_quantized_piece(uint8_t* block_q, int piece, float scale, const float (&v)[8]) {
  const Fp8BlockQuantizer quantizer(scale, /*bf16_values=*/true);
  reinterpret_cast<uint2*>(block_q)[piece] =
      make_uint2(quantizer.quad(v[0], v[1], v[2], v[3]), quantizer.quad(v[4], v[5], v[6], v[7]));
}

}  // namespace mok
