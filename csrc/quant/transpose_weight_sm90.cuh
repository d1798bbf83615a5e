// The transposed copy of a weight's 128x128 FP8 quantization, made from that quantization
// (mok_params.h Fp8TransposeWeightParams): quantization.transpose_weight bit for bit. A 128x128 block
// transposes exactly (the same values, so the same amax, scale and bytes), so the dgrads' copy is
// the forward copy's bytes moved, one byte read per element instead of the bf16 weight's two.
//
// One CTA per 128x128 block of one expert's (n, k) forward copy (with expert_offsets, of the experts
// with rows only): thread t loads rows t / 8 + 32 s
// (s = 0..3), bytes 16 (t % 8) .. + 16 of each (a row's 128 bytes are 8 threads' 16-byte loads) into
// the shared tile of quant/transpose_tile_sm90.cuh, which stores it transposed; thread 0 moves the
// block's scale to its transposed place.
#pragma once

#include <cstdint>

#include "common/limits.h"
#include "mok_params.h"
#include "quant/transpose_tile_sm90.cuh"

namespace mok {

constexpr int kTransposeThreads = kTransposeTileThreads;
constexpr int kTransposeLoadsPerThread = kFp8Block * kFp8Block / 16 / kTransposeThreads;  // 4 of 16 bytes

// Block `block` of the forward copy ((expert, nb, kb) row-major), by the whole CTA, through `tile`
// (128 rows (n) x 128 bytes (k) of shared memory, swizzled).
__device__ __forceinline__ void transpose_weight_block(const Fp8TransposeWeightParams& p, int64_t block, uint4* tile) {
  const int64_t k_blocks = p.k / kFp8Block, n_blocks = p.n / kFp8Block;
  const int64_t kb = block % k_blocks;
  const int64_t nb = (block / k_blocks) % n_blocks;
  const int64_t expert = block / (k_blocks * n_blocks);
  const uint8_t* q = p.q + (expert * p.n + nb * kFp8Block) * p.k + kb * kFp8Block;

  constexpr int kPiecesPerRow = kFp8Block / 16;
  const int piece = threadIdx.x % kPiecesPerRow;
  uint4 raw[kTransposeLoadsPerThread];
#pragma unroll
  for (int s = 0; s < kTransposeLoadsPerThread; ++s) {
    const int row = threadIdx.x / kPiecesPerRow + s * (kTransposeThreads / kPiecesPerRow);
    raw[s] = __ldg(reinterpret_cast<const uint4*>(q + row * p.k) + piece);
  }
#pragma unroll
  for (int s = 0; s < kTransposeLoadsPerThread; ++s) {
    const int row = threadIdx.x / kPiecesPerRow + s * (kTransposeThreads / kPiecesPerRow);
    tile[row * kPiecesPerRow + transpose_tile_piece(row, piece)] = raw[s];
  }
  if (threadIdx.x == 0) p.scales_t[(expert * k_blocks + kb) * n_blocks + nb] = __ldg(p.scales + block);
  __syncthreads();  // the whole block is in shared memory before its columns are read

  // q_t (expert, k, n): rows kb * 128 .., bytes nb * 128 ..
  store_transposed_tile(reinterpret_cast<const uint32_t*>(tile),
                        p.q_t + (expert * p.k + kb * kFp8Block) * p.n + nb * kFp8Block, p.n);
}

// As quantize_weight_kernel: one CTA per block, those of an expert without rows in expert_offsets
// returning at once.
__global__ void __launch_bounds__(kTransposeThreads) transpose_weight_kernel(const Fp8TransposeWeightParams p) {
  __shared__ uint4 tile[kFp8Block * kFp8Block / 16];  // 128 rows (n) x 128 bytes (k), swizzled
  const int64_t per_expert = (p.n / kFp8Block) * (p.k / kFp8Block);
  if (!expert_has_rows(p.expert_offsets, blockIdx.x / per_expert)) return;
  transpose_weight_block(p, blockIdx.x, tile);
}

}  // namespace mok
