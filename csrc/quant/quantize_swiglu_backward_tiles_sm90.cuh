// The SwiGLU backward with both of d gate_up's FP8 copies, from one pass over 128 x 128 tiles
// (mok_params.h Fp8QuantizeSwigluBackwardCopiesParams): d gate_up = the SwiGLU backward of gate_up with
// d act, each value as swiglu_backward_kernel computes it (fp32, common/swiglu_math.cuh, rounded once
// to bf16), quantized 1x128 along 2F (the gate/up dgrad's left operand, GEMM-A scales) and 1x128
// along the rows (the fc1 weight gradient's operand, transposed): bit for bit
// quantize_swiglu_backward_kernel's row copy and quantize_columns_kernel's column copy of its bf16
// d gate_up, with no bf16 d gate_up in memory. Memory-bound: gate_up and d act read once, each copy
// and its scales written once (the two launches it replaces also write the bf16 values and read
// them back).
//
// One CTA per tile of 128 rows and 128 of F's columns: the same columns of d gate (a 128 x 128 block
// of the column copy, and a 1x128 block of each row of the row copy) and of d up (F columns on). Two
// steps:
//   rows     a half-warp per row (16 threads of 8 columns, one 16-byte load each of gate, up and
//            d act), a row at a time with the next row's loads issued before it is computed; the
//            row blocks' amax four shuffles inside the half-warp, their E4M3 bytes stored at once,
//            the rounded bf16 values of d gate and d up kept in shared memory;
//   columns  thread (pair p, part g) takes rows 32g .. 32g + 31 of columns 2p, 2p + 1 of the d gate
//            tile and then of the d up tile (quant/quantize_columns_sm90.cuh's step and swizzle).
// Rows at or past the schedule's end (min(expert_offsets[E], num_rows)) are not read: zero rows of
// every copy (the row copy's scale 1), what the separate launches give there; rows past num_rows
// (the last row block's padding) are zeros of the column copies and absent from the row copy.
//
// Shared memory: the two bf16 tiles, 64 KB (dynamic): three CTAs per SM at this kernel's 80
// registers. kActColumns (act_columns): act = SwiGLU of the same gate and up values too, rounded to
// bf16 into a third tile, and its column copy (quantize_columns_kernel's SwiGLU form's bytes), so
// that backward reads gate_up once: 96 KB, two CTAs per SM at 96 registers.
//
// Why this kernel can beat the launches it replaces where its first form (2026-12-04) could not:
// that form was issue-bound on the IEEE divisions' branches and calls, per value in the SwiGLU math
// and per four values in the quantization. Here the SwiGLU backward takes swiglu_backward_values'
// batched fast path, each block decides once whether its quantizer divides, and the dividing
// blocks (NaN, inf, tiny amax) take out-of-line functions, so the common path's code is the
// multiply or reciprocal quotient alone.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/swiglu_math.cuh"
#include "mok_params.h"
#include "quant/quantize_columns_sm90.cuh"
#include "quant/quantize_rows_sm90.cuh"
#include "quant/quantize_swiglu_backward_sm90.cuh"
#include "quant/row_block_sm90.cuh"

namespace mok {

constexpr int kTilesThreads = 256;
constexpr int kTilesHalfWarps = kTilesThreads / kRowsUnitThreads;
constexpr int kTilesRowsPerHalfWarp = kColumnsTileRows / kTilesHalfWarps;  // 8 of the tile's 128
// Shared memory: d gate's and d up's bf16 tiles, and act's with kActColumns.
constexpr int tiles_shared_bytes(bool act_columns) { return (act_columns ? 3 : 2) * kColumnsTileRows * kColumnsTileCols * 2; }
static_assert(kColumnsTileCols == kFp8Block, "a tile's columns are one row block of d gate and one of d up");
static_assert(kTilesThreads == kColumnsThreads, "the columns step is quantize_columns_kernel's thread layout");
static_assert(kTilesRowsPerHalfWarp * kTilesHalfWarps == kColumnsTileRows, "every row of the tile, once");

// The 16-byte piece `piece` of row `row` of a tile (64 words a row, column pair p at word
// p ^ columns_swizzle(row), quant/quantize_columns_sm90.cuh): the swizzle moves bits 3-4 of the word,
// bits 1-2 of the piece, so a piece stays whole.
__device__ __forceinline__ uint4& tile_piece(uint4* tile, int row, int piece) {
  return tile[row * (kColumnsRowWords / 4) + (piece ^ (columns_swizzle(row) / 4))];
}

// The E4M3 bytes of this thread's two columns over rows 32 part .. 32 part + 31 of a tile, read again
// from shared memory, stored at `column_q` (the first column's 32 bytes; the second's padded_rows
// bytes on): the quad of a pair writes each column's 128 bytes of the row block. kDivides: the
// quantizers may divide (quad()); else neither does (quad_without_division()).
template <bool kDivides>
__device__ __forceinline__ void store_tile_columns(uint8_t* column_q, int64_t padded_rows, const uint32_t* words,
                                                   int pair, int part, const Fp8BlockQuantizer (&quantizer)[2]) {
  const int first_row = part * kColumnsRowsPerPart;
  uint32_t out[2][kColumnsRowsPerPart / 4];  // each column's 32 bytes, row first_row + 4j + i in byte i of word j
#pragma unroll
  for (int j = 0; j < kColumnsRowsPerPart / 4; ++j) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = columns_tile_pair(words, first_row + 4 * j + i, pair);
    float lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) lo[i] = __uint_as_float(w[i] << 16), hi[i] = __uint_as_float(w[i] & 0xFFFF0000u);
    if constexpr (kDivides) {
      out[0][j] = quantizer[0].quad(lo[0], lo[1], lo[2], lo[3]);
      out[1][j] = quantizer[1].quad(hi[0], hi[1], hi[2], hi[3]);
    } else {
      out[0][j] = quantizer[0].quad_without_division(lo[0], lo[1], lo[2], lo[3]);
      out[1][j] = quantizer[1].quad_without_division(hi[0], hi[1], hi[2], hi[3]);
    }
  }
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    uint4* dst = reinterpret_cast<uint4*>(column_q + c * padded_rows);
    dst[0] = make_uint4(out[c][0], out[c][1], out[c][2], out[c][3]);
    dst[1] = make_uint4(out[c][4], out[c][5], out[c][6], out[c][7]);
  }
}

// store_tile_columns where a quantizer divides (a block holding NaN, inf or only tiny values): out of
// line, so the common path's code stays small (scalar arguments: a reference to the kernel's params
// would copy them to the stack in every thread).
__device__ __noinline__ void store_tile_columns_dividing(uint8_t* column_q, int64_t padded_rows, const uint32_t* words,
                                                         int pair, int part, float scale_low, float scale_high) {
  const Fp8BlockQuantizer quantizer[2] = {Fp8BlockQuantizer(scale_low, /*bf16_values=*/true),
                                          Fp8BlockQuantizer(scale_high, /*bf16_values=*/true)};
  store_tile_columns<true>(column_q, padded_rows, words, pair, part, quantizer);
}

// The columns step for one tile: this thread's two columns (column, column + 1 of the column copy `q`,
// padded_rows bytes each; scales (padded_rows / 128, scale_cols) fp32) over rows 32 part .. 32 part + 31
// of the row block, read twice from shared memory (amax, then quantize): 32 words held across the
// quantization spill at this kernel's budget.
__device__ __forceinline__ void quantize_tile_columns(bool pow2, uint8_t* q, float* scales, int64_t scale_cols,
                                                      int64_t padded_rows, const uint32_t* words, int64_t row_block,
                                                      int64_t column, int pair, int part) {
  const int first_row = part * kColumnsRowsPerPart;
  float amax[2];
  columns_pair_amax(words, first_row, pair, amax);
  const float2 scale = columns_pair_scales(amax, pow2);
  if (part == 0) *reinterpret_cast<float2*>(scales + row_block * scale_cols + column) = scale;
  const Fp8BlockQuantizer quantizer[2] = {Fp8BlockQuantizer(scale.x, /*bf16_values=*/true),
                                          Fp8BlockQuantizer(scale.y, /*bf16_values=*/true)};
  uint8_t* column_q = q + column * padded_rows + row_block * kColumnsTileRows + first_row;
  if (quantizer[0].divides() || quantizer[1].divides()) {
    store_tile_columns_dividing(column_q, padded_rows, words, pair, part, scale.x, scale.y);
  } else {
    store_tile_columns<false>(column_q, padded_rows, words, pair, part, quantizer);
  }
}

// A row piece's E4M3 bytes of d gate and of d up (8 bf16 values each, packed) where a quantizer
// divides: out of line, as store_tile_columns_dividing (the values in registers: arrays would go
// through the stack on the common path too).
__device__ __noinline__ void store_row_pieces_dividing(uint8_t* gate_q, uint8_t* up_q, int piece, float scale_gate,
                                                       float scale_up, uint4 gate_packed, uint4 up_packed) {
  float grad_gate[8], grad_up[8];
  unpack_bf16x8(gate_packed, grad_gate);
  unpack_bf16x8(up_packed, grad_up);
  store_quantized_piece(gate_q, piece, scale_gate, grad_gate);
  store_quantized_piece(up_q, piece, scale_up, grad_up);
}

// One row of the rows step for this thread's piece (8 of the tile's 128 columns) of d gate and of d up,
// from its pieces of gate, up and d act (raw): the SwiGLU backward, rounded to bf16 and kept in the
// tiles, and the row copy's E4M3 bytes and GEMM-A scales (rows past num_rows: the tiles only).
// kActColumns: act = SwiGLU of the same gate and up values too (swiglu_values, rounded to bf16: the
// forward's act, as quantize_columns_kernel's SwiGLU form computes it), kept in act_tile.
template <bool kActColumns>
__device__ __forceinline__ void quantize_tile_row(const Fp8QuantizeSwigluBackwardCopiesParams& p, uint4* gate_tile,
                                                  uint4* up_tile, uint4* act_tile, int tile_row, int64_t row0,
                                                  int64_t block, int piece, const uint4 (&raw)[3]) {
  const int64_t row = row0 + tile_row, column0 = block * kFp8Block, blocks_per_half = p.ffn / kFp8Block;
  float gate[8], up[8], grad[8], grad_gate[8], grad_up[8];
  unpack_bf16x8(raw[0], gate);
  unpack_bf16x8(raw[1], up);
  unpack_bf16x8(raw[2], grad);
  if constexpr (kActColumns) {
    float act[8];
    swiglu_values(gate, up, act);
    tile_piece(act_tile, tile_row, piece) = pack_bf16x8(act);
  }
  swiglu_backward_values(gate, up, grad, grad_gate, grad_up);
  // Rounded to bf16 once (swiglu_backward's output), then quantized both ways from those values.
  const uint4 gate_packed = pack_bf16x8(grad_gate), up_packed = pack_bf16x8(grad_up);
  tile_piece(gate_tile, tile_row, piece) = gate_packed;
  tile_piece(up_tile, tile_row, piece) = up_packed;
  unpack_bf16x8(gate_packed, grad_gate);
  unpack_bf16x8(up_packed, grad_up);
  const float amax_gate = half_warp_block_amax(grad_gate);
  const float amax_up = half_warp_block_amax(grad_up);
  if (row >= p.num_rows) return;  // (the padding rows: zeros of the column copy only)
  const float scale_gate = fp8_block_scale(amax_gate, p.pow2 != 0);
  const float scale_up = fp8_block_scale(amax_up, p.pow2 != 0);
  uint8_t* q_row = p.rows_q + row * 2 * p.ffn;
  const Fp8BlockQuantizer gate_quantizer(scale_gate, /*bf16_values=*/true), up_quantizer(scale_up, true);
  if (gate_quantizer.divides() || up_quantizer.divides()) {
    store_row_pieces_dividing(q_row + column0, q_row + p.ffn + column0, piece, scale_gate, scale_up, gate_packed,
                              up_packed);
  } else {  // (store_quantized_piece's bytes)
    reinterpret_cast<uint2*>(q_row + column0)[piece] =
        make_uint2(gate_quantizer.quad_without_division(grad_gate[0], grad_gate[1], grad_gate[2], grad_gate[3]),
                   gate_quantizer.quad_without_division(grad_gate[4], grad_gate[5], grad_gate[6], grad_gate[7]));
    reinterpret_cast<uint2*>(q_row + p.ffn + column0)[piece] =
        make_uint2(up_quantizer.quad_without_division(grad_up[0], grad_up[1], grad_up[2], grad_up[3]),
                   up_quantizer.quad_without_division(grad_up[4], grad_up[5], grad_up[6], grad_up[7]));
  }
  if (piece == 0) {
    p.rows_scales[block * p.gemm_a_rows + row] = scale_gate;
    p.rows_scales[(blocks_per_half + block) * p.gemm_a_rows + row] = scale_up;
  }
}

template <bool kActColumns>
__global__ void __launch_bounds__(kTilesThreads, kActColumns ? 2 : 3)
    quantize_swiglu_backward_tiles_kernel(const Fp8QuantizeSwigluBackwardCopiesParams p) {
  extern __shared__ uint4 tiles_shared[];
  constexpr int kTilePieces = kColumnsTileRows * kColumnsRowWords / 4;  // (128 rows x 16 pieces) a tile
  uint4* gate_tile = tiles_shared;
  uint4* up_tile = tiles_shared + kTilePieces;
  uint4* act_tile = kActColumns ? tiles_shared + 2 * kTilePieces : nullptr;
  const int64_t blocks_per_half = p.ffn / kFp8Block;  // of F: d gate's blocks, then as many of d up
  const int64_t row_block = blockIdx.x / blocks_per_half, block = blockIdx.x % blocks_per_half;
  const int64_t row0 = row_block * kColumnsTileRows, column0 = block * kFp8Block;
  const int64_t end = min(int64_t(__ldg(p.expert_offsets + p.num_experts)), p.num_rows);

  fill_gemm_a_padding(p.rows_scales, 2 * blocks_per_half, p.num_rows, p.gemm_a_rows);

  // Rows: half-warp h takes rows h, h + 16, ..., h + 112 of the tile, one at a time, the next row's
  // pieces loaded before this row's are computed (their loads in flight through its SwiGLU math).
  const int piece = threadIdx.x % kRowsUnitThreads, half_warp = threadIdx.x / kRowsUnitThreads;
  const auto load_row = [&](int i, uint4 (&raw)[3]) {
    const int64_t row = row0 + half_warp + i * kTilesHalfWarps;
    raw[0] = raw[1] = raw[2] = make_uint4(0, 0, 0, 0);  // a zero triple gives +0 for both (and for act)
    if (row < end) {
      load_swiglu_backward_pieces(static_cast<const __nv_bfloat16*>(p.gate_up),
                                  static_cast<const __nv_bfloat16*>(p.grad_act), row, p.ffn, block, piece, raw[0],
                                  raw[1], raw[2]);
    }
  };
  uint4 next[3];
  load_row(0, next);
#pragma unroll 1
  for (int i = 0; i < kTilesRowsPerHalfWarp; ++i) {
    const uint4 raw[3] = {next[0], next[1], next[2]};
    if (i + 1 < kTilesRowsPerHalfWarp) load_row(i + 1, next);
    quantize_tile_row<kActColumns>(p, gate_tile, up_tile, act_tile, half_warp + i * kTilesHalfWarps, row0, block,
                                   piece, raw);
  }
  __syncthreads();  // every row of the tiles is in shared memory before any column is read

  // Columns: d gate's tile, then d up's (F columns on in the same copy), then act's (its own copy),
  // one copy of the step's code for all.
  const int pair = threadIdx.x / 4, part = threadIdx.x % 4;
#pragma unroll 1
  for (int t = 0; t < (kActColumns ? 3 : 2); ++t) {
    const bool act = kActColumns && t == 2;
    quantize_tile_columns(p.pow2 != 0, act ? p.act_columns_q : p.columns_q,
                          act ? p.act_columns_scales : p.columns_scales, act ? p.ffn : 2 * p.ffn, p.padded_rows,
                          reinterpret_cast<const uint32_t*>(tiles_shared + t * kTilePieces), row_block,
                          (t == 1 ? p.ffn : 0) + column0 + 2 * pair, pair, part);
  }
}

}  // namespace mok
