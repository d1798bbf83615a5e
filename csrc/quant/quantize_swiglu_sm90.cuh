// SwiGLU of the gate/up rows quantized 1x128 along F (mok_params.h Fp8QuantizeSwigluParams): act =
// silu(gate) * up in fp32 rounded to bf16 (swiglu_forward_kernel's arithmetic, common/swiglu_math.cuh),
// then quantization.quantize_rowwise of that bf16 act, its scales in the GEMM-A layout: bit for bit
// what the SwiGLU epilogue of gemm/fp8_gemm_sm90.cuh writes, and what swiglu_forward followed by
// fp8_quantize_rows writes, without the bf16 act in memory. Memory-bound: gate_up read once, act and
// its scales written once.
//
// The block layout of quant/quantize_rows_sm90.cuh: a 1x128 block is 16 threads of 8 columns each
// (one 16-byte load of gate, one of up), its amax four shuffles inside a half-warp; the two halves of
// a warp take neighbouring blocks, kRowsUnroll blocks per thread per pass with every load issued
// before the first is used. The blocks of all rows form one sequence (grid-stride), not a warp per
// row: F / 128 need not be a multiple of the 2 * kRowsUnroll blocks a warp takes at once (Qwen3's
// 6). Rows at or past the schedule's end (expert_offsets[E], read on the device) are never read: the
// GEMM did not write them; they quantize as zero rows (E4M3 zeros, scale 1), what fp8_quantize_rows
// makes of swiglu_forward's zero rows there.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/swiglu_math.cuh"
#include "mok_params.h"
#include "quant/quantize_rows_sm90.cuh"

namespace mok {

__global__ void __launch_bounds__(kQuantizeThreads) quantize_swiglu_kernel(const Fp8QuantizeSwigluParams p) {
  const int64_t blocks_per_row = p.ffn / kFp8Block;
  const HalfWarpLane lane;
  const int piece = lane.piece, half = lane.half;
  const int64_t end = min(int64_t(__ldg(p.expert_offsets + p.num_experts)), p.num_rows);

  fill_gemm_a_padding(p.gemm_a_scales, blocks_per_row, p.num_rows, p.gemm_a_rows);

  const auto* gate_up = static_cast<const __nv_bfloat16*>(p.gate_up);
  const int64_t up_packs = p.ffn / 8;  // the up half starts F columns (F / 8 packs) into the row
  // The (row, block) units in one sequence, so that every lane has a block whatever F / 128 is: a
  // warp takes 2 * kRowsUnroll consecutive units per pass, unit base + 2 u + half in half `half`.
  // The loop is warp-uniform (every lane takes part in the shuffles); a unit past the last computes
  // on zeros and stores nothing.
  const int64_t units = p.num_rows * blocks_per_row;
  for (int64_t base = lane.warp * 2 * kRowsUnroll; base < units; base += lane.num_warps * 2 * kRowsUnroll) {
    uint4 gate_raw[kRowsUnroll], up_raw[kRowsUnroll];
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t unit = base + 2 * u + half;
      const int64_t row = unit / blocks_per_row, block = unit - row * blocks_per_row;
      gate_raw[u] = up_raw[u] = make_uint4(0, 0, 0, 0);
      if (unit < units && row < end) {
        const uint4* packs = reinterpret_cast<const uint4*>(gate_up + row * 2 * p.ffn);
        gate_raw[u] = __ldg(packs + block * kRowsUnitThreads + piece);
        up_raw[u] = __ldg(packs + up_packs + block * kRowsUnitThreads + piece);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t unit = base + 2 * u + half;
      const int64_t row = unit / blocks_per_row, block = unit - row * blocks_per_row;
      float gate[8], up[8], v[8];
      unpack_bf16x8(gate_raw[u], gate);
      unpack_bf16x8(up_raw[u], up);
      swiglu_values(gate, up, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // act rounded to bf16 first (swiglu_forward's output), then quantized; SwiGLU of a zero
        // pair is +0, so a row past the end quantizes as zeros.
        v[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
      }
      const float amax = half_warp_block_amax(v);
      if (unit >= units) continue;
      const float scale = fp8_block_scale(amax, p.pow2 != 0);
      store_quantized_piece(p.q + row * p.ffn + block * kFp8Block, piece, scale, v);
      if (piece == 0) p.gemm_a_scales[block * p.gemm_a_rows + row] = scale;
    }
  }
}

}  // namespace mok
