// FP8 1x128 quantization along the rows (tokens) of bf16 rows, transposed
// (mok_params.h Fp8QuantizeColumnsParams): quantization.quantize_columnwise bit for bit, the
// operands of the FP8 weight gradients (tokens contiguous: K-major for a GEMM reducing over tokens).
// Optionally gathered (kGather): row r is src[row_index[r]], a zero row for -1, so a weight
// gradient's operand is quantized straight from the token rows, with no gathered bf16 copy; and
// weighted (kWeighted, with kGather): row r is src[row_index[r]] * row_weights[r], each value
// bf16(float(value) * w) as the weighted pull kernel rounds it (moe/dispatch_sm90.cuh), so the fc2
// weight gradient's w * dY operand needs no pulled bf16 rows. Or
// (kSwiglu) the rows are act = SwiGLU of src's gate/up rows (num_rows, 2 cols), each value computed
// as swiglu_forward_kernel computes it (fp32, rounded once to bf16) while the tile loads: the fc2
// weight gradient's act operand, with no bf16 act in memory. The gathered forms read their rows
// from one tensor (Fp8QuantizeColumnsParams) or, over expert parallelism's symmetric regions, from
// the ranks' copies where they lie (PeerFp8QuantizeColumnsParams, moe/row_source_sm90.cuh): the
// weight gradients' x and w * dY operands with no pulled (capacity, H) bf16 rows.
//
// One CTA per tile of 128 rows x 128 columns, in three steps:
//   load      the tile's 128 rows of 256 bytes into shared memory, 16-byte loads (a half-warp per
//             row), zeros for rows at or past the end (min(num_rows, *row_end)), not read (nor
//             their row_index entries);
//   amax      thread (pair p, part g) walks rows 32g .. 32g + 31 of columns 2p, 2p + 1; the four
//             parts of a pair are lanes of one quad: two shuffles give each column's amax;
//   quantize  each thread quantizes its 32 rows of both columns (read again from shared memory)
//             into 32 contiguous bytes of each column's output row (the quad writes the column's
//             128 bytes of this row block).
// Shared memory, 32 KB: row r's 64 words (bf16 pairs) at r * 256 bytes, pair p at word
// p ^ (8 * ((r / 32) % 4)): the four parts of a pair read rows 32 apart, and the swizzle puts
// them on different banks (the 16-byte pieces the loads write stay whole: it moves bits 3-4 only).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "common/failure_codes.h"
#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/swiglu_math.cuh"
#include "common/vec_utils.cuh"
#include "common/watchdog_sm90.cuh"
#include "moe/row_source_sm90.cuh"
#include "mok_params.h"

namespace mok {

constexpr int kColumnsTileRows = kFp8Block;
constexpr int kColumnsTileCols = 128;
constexpr int kColumnsThreads = 256;  // 64 column pairs x 4 parts of 32 rows
constexpr int kColumnsRowWords = kColumnsTileCols / 2;
constexpr int kColumnsRowsPerPart = kColumnsTileRows / 4;
static_assert(kColumnsThreads == (kColumnsTileCols / 2) * 4, "a thread per column pair and part");

__device__ __forceinline__ int columns_swizzle(int row) { return 8 * ((row / kColumnsRowsPerPart) % 4); }

// The bf16 pair (column 2 pair low, 2 pair + 1 high) of row `row` of a tile in shared memory.
__device__ __forceinline__ uint32_t columns_tile_pair(const uint32_t* words, int row, int pair) {
  return words[row * kColumnsRowWords + (pair ^ columns_swizzle(row))];
}

// The amax of this thread's two columns (2 pair, 2 pair + 1 of the tile) over its 128-row block: its
// own 32 rows from first_row, then the other three parts' (the lanes of its quad) by two shuffles
// each. Every lane of the warp calls it.
__device__ __forceinline__ void columns_pair_amax(const uint32_t* words, int first_row, int pair, float (&amax)[2]) {
  amax[0] = amax[1] = 0.f;
#pragma unroll
  for (int i = 0; i < kColumnsRowsPerPart; ++i) {
    const uint32_t w = columns_tile_pair(words, first_row + i, pair);
    amax[0] = max_nan(amax[0], fabsf(__uint_as_float(w << 16)));
    amax[1] = max_nan(amax[1], fabsf(__uint_as_float(w & 0xFFFF0000u)));
  }
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    amax[c] = max_nan(amax[c], __shfl_xor_sync(0xffffffffu, amax[c], 1));
    amax[c] = max_nan(amax[c], __shfl_xor_sync(0xffffffffu, amax[c], 2));
  }
}

// The scales of this thread's two columns (low, high) from their block amax (columns_pair_amax).
__device__ __forceinline__ float2 columns_pair_scales(const float (&amax)[2], bool pow2) {
  return make_float2(fp8_block_scale(amax[0], pow2), fp8_block_scale(amax[1], pow2));
}

// A row index outside [-1, num_src_rows): record it, then trap (as the row kernel does).
__device__ __noinline__ void fail_columns_row_index_check(const Fp8QuantizeColumnsParams& p) {
  record_failure(p.failure_record, kFp8QuantizeKernel, kCheckRowIndex, -1, -1);
  asm volatile("trap;");
}

// Eight bf16 values of one 16-byte piece times w: the weighted pull's scaled_pack (common/vec_utils.cuh),
// so the two give the same bits by construction.
__device__ __forceinline__ uint4 weighted_piece(const uint4& piece, float w) {
  using Piece = Pack<__nv_bfloat16, 8>;
  static_assert(sizeof(Piece) == sizeof(uint4), "a 16-byte piece is eight bf16 values");
  const Piece scaled = scaled_pack<__nv_bfloat16, 8>(reinterpret_cast<const Piece&>(piece), w);
  return reinterpret_cast<const uint4&>(scaled);
}

// Eight bf16 act values of one 16-byte piece: SwiGLU of the gate and up pieces, value by value.
__device__ __forceinline__ uint4 swiglu_piece(const uint4& gate, const uint4& up) {
  const auto* g = reinterpret_cast<const __nv_bfloat16*>(&gate);
  const auto* u = reinterpret_cast<const __nv_bfloat16*>(&up);
  float gate_values[8], up_values[8], values[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) gate_values[j] = to_float(g[j]), up_values[j] = to_float(u[j]);
  swiglu_values(gate_values, up_values, values);
  uint4 act;
  auto* a = reinterpret_cast<__nv_bfloat16*>(&act);
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = from_float<__nv_bfloat16>(values[j]);
  return act;
}

// The first of the tile's columns of gathered row g: in the one tensor, or in its rank's region.
__device__ __forceinline__ const __nv_bfloat16* columns_source_row(const Fp8QuantizeColumnsParams& p, int64_t g) {
  return static_cast<const __nv_bfloat16*>(p.src) + g * p.cols;
}
__device__ __forceinline__ const __nv_bfloat16* columns_source_row(const PeerFp8QuantizeColumnsParams& p, int64_t g) {
  return source_row<__nv_bfloat16>(p.source, g, p.cols);
}

template <bool kGather, bool kSwiglu = false, bool kWeighted = false, typename Params = Fp8QuantizeColumnsParams>
__global__ void __launch_bounds__(kColumnsThreads, kSwiglu ? 4 : 3)
    quantize_columns_kernel(const Params p) {
  static_assert(!(kGather && kSwiglu), "a gathered source or a SwiGLU source, not both");
  static_assert(!kWeighted || kGather, "row weights go with a gathered source");
  static_assert(kGather || std::is_same_v<Params, Fp8QuantizeColumnsParams>, "the regions' form is a gather");
  __shared__ uint4 tile[kColumnsTileRows * kColumnsRowWords / 4];
  auto* words = reinterpret_cast<uint32_t*>(tile);
  const int64_t col_tiles = p.cols / kColumnsTileCols;
  const int64_t row_block = blockIdx.x / col_tiles;
  const int64_t col0 = (blockIdx.x % col_tiles) * kColumnsTileCols;
  const int64_t row0 = row_block * kColumnsTileRows;
  int64_t end = p.num_rows;
  if (p.row_end != nullptr) end = min(end, int64_t(*p.row_end));

  // Load: 128 rows x 16 pieces of 16 bytes, 8 per thread, all issued before the first store (a
  // gather's 8 row indices first, all of them, then the 8 rows).
  constexpr int kPieces = kColumnsTileRows * (kColumnsTileCols * 2 / 16) / kColumnsThreads;
  int64_t src_rows[kPieces];
  float row_weights[kWeighted ? kPieces : 1];
#pragma unroll
  for (int s = 0; s < kPieces; ++s) {
    const int64_t row = row0 + (threadIdx.x + s * kColumnsThreads) / 16;
    src_rows[s] = row < end ? row : -1;  // -1: a zero row
    if constexpr (kGather) {
      if (row < end) src_rows[s] = __ldg(p.row_index + row);
    }
    if constexpr (kWeighted) row_weights[s] = row < end ? __ldg(p.row_weights + row) : 0.f;
  }
  const auto store_piece = [&](int s, const uint4& value) {
    const int i = threadIdx.x + s * kColumnsThreads, row = i / 16, piece = i % 16;
    tile[row * (kColumnsRowWords / 4) + (piece ^ (columns_swizzle(row) / 4))] = value;
  };
  if constexpr (kSwiglu) {
    // Gate and up pieces in two batches, each batch's act stored before the next batch loads: the
    // SwiGLU math (an exp and a division per value) runs while other CTAs load, and the registers
    // allow a fourth CTA per SM.
    constexpr int kBatch = kPieces / 2;
#pragma unroll
    for (int b = 0; b < kPieces; b += kBatch) {
      uint4 gate[kBatch], up[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = b + k, piece = (threadIdx.x + s * kColumnsThreads) % 16;
        gate[k] = up[k] = make_uint4(0, 0, 0, 0);  // a zero row's act is zero: SwiGLU(0, 0) = 0
        if (src_rows[s] >= 0) {
          const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(p.src) + src_rows[s] * 2 * p.cols + col0;
          gate[k] = __ldg(reinterpret_cast<const uint4*>(row) + piece);
          up[k] = __ldg(reinterpret_cast<const uint4*>(row + p.cols) + piece);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) store_piece(b + k, swiglu_piece(gate[k], up[k]));
    }
  } else {
    uint4 raw[kPieces];
#pragma unroll
    for (int s = 0; s < kPieces; ++s) {
      const int piece = (threadIdx.x + s * kColumnsThreads) % 16;
      if constexpr (kGather) {
        if (src_rows[s] < -1 || src_rows[s] >= p.num_src_rows) fail_columns_row_index_check(p);
      }
      raw[s] = make_uint4(0, 0, 0, 0);
      if (src_rows[s] >= 0) raw[s] = __ldg(reinterpret_cast<const uint4*>(columns_source_row(p, src_rows[s]) + col0) + piece);
    }
#pragma unroll
    for (int s = 0; s < kPieces; ++s) {
      if constexpr (kWeighted) {
        if (src_rows[s] >= 0) raw[s] = weighted_piece(raw[s], row_weights[s]);  // (a zero row stays zero)
      }
      store_piece(s, raw[s]);
    }
  }
  __syncthreads();  // every row of the tile is in shared memory before any column is read

  const int pair = threadIdx.x / 4, part = threadIdx.x % 4;
  const int first_row = part * kColumnsRowsPerPart;
  // The bf16 pair (column 2p low, 2p + 1 high) of row first_row + i, read twice (amax, then
  // quantize) rather than held in registers.
  const auto pair_of = [&](int i) { return columns_tile_pair(words, first_row + i, pair); };
  float amax[2];
  columns_pair_amax(words, first_row, pair, amax);
  const float2 scale = columns_pair_scales(amax, p.pow2 != 0);
  if (part == 0) *reinterpret_cast<float2*>(p.scales + row_block * p.cols + col0 + 2 * pair) = scale;
  const Fp8BlockQuantizer quantizer[2] = {Fp8BlockQuantizer(scale.x, /*bf16_values=*/true),
                                          Fp8BlockQuantizer(scale.y, /*bf16_values=*/true)};
  uint32_t out[2][kColumnsRowsPerPart / 4];  // each column's 32 bytes, row first_row + 4j + i in byte i of word j
#pragma unroll
  for (int j = 0; j < kColumnsRowsPerPart / 4; ++j) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pair_of(4 * j + i);
    out[0][j] = quantizer[0].quad(__uint_as_float(w[0] << 16), __uint_as_float(w[1] << 16),
                                  __uint_as_float(w[2] << 16), __uint_as_float(w[3] << 16));
    out[1][j] = quantizer[1].quad(__uint_as_float(w[0] & 0xFFFF0000u), __uint_as_float(w[1] & 0xFFFF0000u),
                                  __uint_as_float(w[2] & 0xFFFF0000u), __uint_as_float(w[3] & 0xFFFF0000u));
  }
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    uint4* dst = reinterpret_cast<uint4*>(p.q + (col0 + 2 * pair + c) * p.padded_rows + row0 + first_row);
    dst[0] = make_uint4(out[c][0], out[c][1], out[c][2], out[c][3]);
    dst[1] = make_uint4(out[c][4], out[c][5], out[c][6], out[c][7]);
  }
}

}  // namespace mok
