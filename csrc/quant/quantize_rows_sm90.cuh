// FP8 1x128 quantization along the columns of bf16 rows (mok_params.h Fp8QuantizeRowsParams):
// quantization.quantize_rowwise bit for bit, with its scales in the source layout and/or the GEMM-A
// layout (quantization.gemm_a_scales), and optionally a row gather (a dispatch quantizing straight
// from token rows). Memory-bound: each byte is read once and each output written once.
//
// A warp quantizes one row at a time (grid-stride over rows; a gathered row's index is read once).
// A 1x128 block is 16 threads, 8 bf16 each (one 16-byte load), its amax a reduction over the 16
// (four shuffles inside a half-warp), then 8 E4M3 bytes per thread (one 8-byte store). The two
// halves of a warp take neighbouring blocks (512 contiguous bytes), each thread kRowsUnroll blocks
// per pass, all loads issued before the first is used.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/failure_codes.h"
#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/watchdog_sm90.cuh"
#include "mok_params.h"
#include "quant/row_block_sm90.cuh"

namespace mok {

constexpr int kQuantizeThreads = 256;
constexpr int kRowsUnroll = 2;

// A row index outside [-1, num_src_rows): record it, then trap (an index is the caller's input; a
// wrong one must not read another tensor's memory or become a silent zero row).
__device__ __noinline__ void fail_row_index_check(const Fp8QuantizeRowsParams& p) {
  record_failure(p.failure_record, kFp8QuantizeKernel, kCheckRowIndex, -1, -1);
  asm volatile("trap;");
}

// The GEMM-A layout's padding columns, (gemm_a_rows - num_rows) per block of columns: 1, as
// quantization.gemm_a_scales writes them (grid-stride over the blocks of columns).
__device__ __forceinline__ void fill_gemm_a_padding(float* gemm_a_scales, int64_t blocks_per_row, int64_t num_rows,
                                                    int64_t gemm_a_rows) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t block = thread; block < blocks_per_row; block += int64_t(gridDim.x) * blockDim.x) {
    for (int64_t row = num_rows; row < gemm_a_rows; ++row) gemm_a_scales[block * gemm_a_rows + row] = 1.f;
  }
}

// A thread's place in the half-warp block layout: its warp in the grid and the grid's warps (for
// grid-stride loops), its 8 columns of a block (piece) and its half of the warp.
struct HalfWarpLane {
  int64_t warp, num_warps;
  int piece, half;
  __device__ HalfWarpLane()
      : warp((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32),
        num_warps(int64_t(gridDim.x) * blockDim.x / 32),
        piece(threadIdx.x % kRowsUnitThreads),
        half((threadIdx.x / kRowsUnitThreads) % 2) {}
};

template <bool kGather>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_rows_kernel(const Fp8QuantizeRowsParams p) {
  const int64_t blocks_per_row = p.cols / kFp8Block;
  const HalfWarpLane lane;
  const int piece = lane.piece, half = lane.half;

  if (p.gemm_a_scales != nullptr) fill_gemm_a_padding(p.gemm_a_scales, blocks_per_row, p.num_rows, p.gemm_a_rows);

  const auto* src = static_cast<const __nv_bfloat16*>(p.src);
  // A warp per row; its halves take alternate blocks. Both loops are warp-uniform, so every lane
  // takes part in the shuffles; a block past the row's end computes on zeros and stores nothing.
  for (int64_t row = lane.warp; row < p.num_rows; row += lane.num_warps) {
    int64_t src_row = row;
    if constexpr (kGather) {
      src_row = __ldg(p.row_index + row);
      if (src_row < -1 || src_row >= p.num_src_rows) fail_row_index_check(p);
    }
    const uint4* src_row_packs = reinterpret_cast<const uint4*>(src + src_row * p.cols);
    uint8_t* q_row = p.q + row * p.cols;
    for (int64_t first = 0; first < blocks_per_row; first += 2 * kRowsUnroll) {
      uint4 raw[kRowsUnroll];
#pragma unroll
      for (int u = 0; u < kRowsUnroll; ++u) {
        const int64_t block = first + 2 * u + half;
        raw[u] = make_uint4(0, 0, 0, 0);
        if (block < blocks_per_row && src_row >= 0) raw[u] = __ldg(src_row_packs + block * kRowsUnitThreads + piece);
      }
#pragma unroll
      for (int u = 0; u < kRowsUnroll; ++u) {
        const int64_t block = first + 2 * u + half;
        float v[8];
        unpack_bf16x8(raw[u], v);
        const float amax = half_warp_block_amax(v);
        if (block >= blocks_per_row) continue;
        const float scale = fp8_block_scale(amax, p.pow2 != 0);
        store_quantized_piece(q_row + block * kFp8Block, piece, scale, v);
        if (piece == 0) {
          if (p.scales != nullptr) p.scales[row * blocks_per_row + block] = scale;
          if (p.gemm_a_scales != nullptr) p.gemm_a_scales[block * p.gemm_a_rows + row] = scale;
        }
      }
    }
  }
}

}  // namespace mok
