// FP8 128x128 quantization of a weight and its transposed copy in one pass
// (mok_params.h Fp8QuantizeWeightParams): quantization.quantize_weight, and
// quantization.transpose_weight of it, bit for bit. Once per weight version (the weight cache).
//
// One CTA per 128x128 block of one expert's (n, k) weight (quantize_weight_block; with expert_offsets
// only the blocks of the experts with rows are done):
//   load      thread t holds rows t / 16 + 16 s (s = 0..7), columns 8 (t % 16) .. + 8 (a half-warp
//             reads a row's 128 values in order);
//   amax      over its 64 values, then the warp (shuffles) and the CTA (shared memory);
//   quantize  its 8 x 8 bytes to q (a half-warp writes a row's 128 bytes), and, with the transposed
//             copy, into a 128 x 128 byte tile in shared memory (row n, byte k) that
//             quant/transpose_tile_sm90.cuh stores transposed into q_t.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "mok_params.h"
#include "quant/transpose_tile_sm90.cuh"

namespace mok {

constexpr int kWeightThreads = kTransposeTileThreads;
constexpr int kWeightRowsPerThread = kFp8Block * kFp8Block / 8 / kWeightThreads;  // 8 rows of 8 values
static_assert(kWeightThreads == 16 * (kFp8Block / kWeightRowsPerThread), "16 threads per row, 8 values each");

// 8 consecutive values of a row -> fp32.
__device__ __forceinline__ void load8(const __nv_bfloat16* src, float (&v)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void load8(const float* src, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(src)), b = __ldg(reinterpret_cast<const float4*>(src) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Block `block` of the weight ((expert, nb, kb) row-major), by the whole CTA. transposed: 128 rows (n)
// x 128 bytes (k) of shared memory, swizzled; warp_amax: one float per warp.
template <typename T>
__device__ __forceinline__ void quantize_weight_block(const Fp8QuantizeWeightParams& p, int64_t block,
                                                      uint32_t* transposed, float* warp_amax) {
  const int64_t k_blocks = p.k / kFp8Block, n_blocks = p.n / kFp8Block;
  const int64_t kb = block % k_blocks;
  const int64_t nb = (block / k_blocks) % n_blocks;
  const int64_t expert = block / (k_blocks * n_blocks);
  const int piece = threadIdx.x % 16, row_in_step = threadIdx.x / 16;
  // Element (r, c) of the block: expert's row nb * 128 + r, column kb * 128 + c.
  const int64_t block_offset = (expert * p.n + nb * kFp8Block) * p.k + kb * kFp8Block;
  const T* src = static_cast<const T*>(p.src) + block_offset;

  float v[kWeightRowsPerThread][8];
#pragma unroll
  for (int s = 0; s < kWeightRowsPerThread; ++s) load8(src + (row_in_step + 16 * s) * p.k + 8 * piece, v[s]);
  float amax = 0.f;
#pragma unroll
  for (int s = 0; s < kWeightRowsPerThread; ++s) {
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = max_nan(amax, fabsf(v[s][i]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();  // every warp's amax is in shared memory
#pragma unroll
  for (int w = 0; w < kWeightThreads / 32; ++w) amax = max_nan(amax, warp_amax[w]);
  const float scale = fp8_block_scale(amax, p.pow2 != 0);
  const Fp8BlockQuantizer quantizer(scale, std::is_same_v<T, __nv_bfloat16>);

  uint8_t* q = p.q != nullptr ? p.q + block_offset : nullptr;  // null: only the transposed copy
#pragma unroll
  for (int s = 0; s < kWeightRowsPerThread; ++s) {
    const int row = row_in_step + 16 * s;
    const uint2 bytes = make_uint2(quantizer.quad(v[s][0], v[s][1], v[s][2], v[s][3]),
                                   quantizer.quad(v[s][4], v[s][5], v[s][6], v[s][7]));
    if (q != nullptr) reinterpret_cast<uint2*>(q + row * p.k)[piece] = bytes;
    if (p.q_t != nullptr) {  // 8-byte piece `piece` of the row: half of 16-byte piece piece / 2, swizzled
      const int swizzled = 2 * transpose_tile_piece(row, piece / 2) + piece % 2;
      reinterpret_cast<uint2*>(transposed + row * kTransposeTileRowWords)[swizzled] = bytes;
    }
  }
  if (threadIdx.x == 0) {
    if (p.q != nullptr) p.scales[block] = scale;  // (expert, nb, kb) row-major is the block's index
    if (p.q_t != nullptr) p.scales_t[(expert * k_blocks + kb) * n_blocks + nb] = scale;
  }
  if (p.q_t == nullptr) return;
  __syncthreads();  // the whole quantized block is in shared memory before its columns are read

  // q_t (expert, k, n): rows kb * 128 .., bytes nb * 128 ..
  store_transposed_tile(transposed, p.q_t + (expert * p.k + kb * kFp8Block) * p.n + nb * kFp8Block, p.n);
}

// One CTA per block; with expert_offsets the CTAs of an expert without rows there return at once (a
// copy for a receive window that holds a few of the experts costs about their blocks).
template <typename T>
__global__ void __launch_bounds__(kWeightThreads) quantize_weight_kernel(const Fp8QuantizeWeightParams p) {
  __shared__ __align__(16) uint32_t transposed[kFp8Block * kFp8Block / 4];  // 128 rows (n) x 128 bytes (k), swizzled
  __shared__ float warp_amax[kWeightThreads / 32];
  const int64_t per_expert = (p.n / kFp8Block) * (p.k / kFp8Block);
  if (!expert_has_rows(p.expert_offsets, blockIdx.x / per_expert)) return;
  quantize_weight_block<T>(p, blockIdx.x, transposed, warp_amax);
}

}  // namespace mok
