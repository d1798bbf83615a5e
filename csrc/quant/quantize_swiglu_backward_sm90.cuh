// The SwiGLU backward with its row-wise quantization (mok_params.h Fp8QuantizeSwigluBackwardParams):
// d gate_up = the SwiGLU backward of gate_up with d act, each value as swiglu_backward_kernel computes
// it (fp32, common/swiglu_math.cuh, rounded once to bf16), written in bf16 and quantized 1x128 along
// 2F with its scales in the GEMM-A layout: bit for bit swiglu_backward then fp8_quantize_rows, with
// d gate_up read back by nobody for the gate/up dgrad. Memory-bound: gate_up and d act read once,
// d gate_up, its E4M3 copy and the scales written once.
//
// The block layout of quant/quantize_swiglu_sm90.cuh: a unit is a row and a block of 128 of F's
// columns, 16 threads of 8 columns each (one 16-byte load each of gate, up and d act); it yields the
// same columns of d gate (a 1x128 block of the output) and of d up (another, F columns on), each
// block's amax four shuffles inside a half-warp. The units of all rows form one grid-stride sequence
// (F / 128 need not be a multiple of the units a warp takes at once). Rows at or past the schedule's
// end (expert_offsets[E], read on the device) are not read: their d gate_up is written as zeros (what
// swiglu_backward_kernel writes there) and quantizes as zero rows (E4M3 zeros, scale 1).
//
// The column-wise copy the fc1 weight gradient needs is not made here: a 1x128 block along the rows
// spans 128 rows, which this layout's units do not hold together (quant/quantize_columns_sm90.cuh
// makes it from the bf16 d gate_up written here). Both copies from one kernel, with no bf16 d
// gate_up: quant/quantize_swiglu_backward_tiles_sm90.cuh (a CTA per 128 x 128 tile of d gate and of
// d up in shared memory; its first form, 2026-12-04, was issue-bound and slower than this kernel and
// the column kernel).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/swiglu_math.cuh"
#include "mok_params.h"
#include "quant/quantize_rows_sm90.cuh"
#include "quant/row_block_sm90.cuh"

namespace mok {

// A thread's three 16-byte pieces of a row for the 128 of F's columns in `block`: gate's, up's (F
// columns on in gate_up's row) and d act's, piece `piece` of each (8 columns).
__device__ __forceinline__ void load_swiglu_backward_pieces(const __nv_bfloat16* gate_up, const __nv_bfloat16* grad_act,
                                                            int64_t row, int64_t ffn, int64_t block, int piece,
                                                            uint4& gate, uint4& up, uint4& grad) {
  const uint4* packs = reinterpret_cast<const uint4*>(gate_up + row * 2 * ffn);
  gate = __ldg(packs + block * kRowsUnitThreads + piece);
  up = __ldg(packs + ffn / 8 + block * kRowsUnitThreads + piece);
  grad = __ldg(reinterpret_cast<const uint4*>(grad_act + row * ffn) + block * kRowsUnitThreads + piece);
}

__global__ void __launch_bounds__(kQuantizeThreads) quantize_swiglu_backward_kernel(
    const Fp8QuantizeSwigluBackwardParams p) {
  const int64_t blocks_per_half = p.ffn / kFp8Block;  // of F: d gate's blocks, then as many of d up
  const HalfWarpLane lane;
  const int piece = lane.piece, half = lane.half;
  const int64_t end = min(int64_t(__ldg(p.expert_offsets + p.num_experts)), p.num_rows);

  fill_gemm_a_padding(p.rows_scales, 2 * blocks_per_half, p.num_rows, p.gemm_a_rows);

  const auto* gate_up = static_cast<const __nv_bfloat16*>(p.gate_up);
  const auto* grad_act = static_cast<const __nv_bfloat16*>(p.grad_act);
  auto* grad_gate_up = static_cast<__nv_bfloat16*>(p.grad_gate_up);
  const int64_t up_packs = p.ffn / 8;  // the up half starts F columns (F / 8 packs) into the row
  // A warp takes 2 * kRowsUnroll consecutive units per pass, unit base + 2 u + half in half `half`.
  // The loop is warp-uniform (every lane takes part in the shuffles); a unit past the last computes
  // on zeros and stores nothing.
  const int64_t units = p.num_rows * blocks_per_half;
  for (int64_t base = lane.warp * 2 * kRowsUnroll; base < units; base += lane.num_warps * 2 * kRowsUnroll) {
    uint4 gate_raw[kRowsUnroll], up_raw[kRowsUnroll], grad_raw[kRowsUnroll];
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t unit = base + 2 * u + half;
      const int64_t row = unit / blocks_per_half, block = unit - row * blocks_per_half;
      gate_raw[u] = up_raw[u] = grad_raw[u] = make_uint4(0, 0, 0, 0);
      if (unit < units && row < end) {
        load_swiglu_backward_pieces(gate_up, grad_act, row, p.ffn, block, piece, gate_raw[u], up_raw[u], grad_raw[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
      const int64_t unit = base + 2 * u + half;
      const int64_t row = unit / blocks_per_half, block = unit - row * blocks_per_half;
      float gate[8], up[8], grad[8], grad_gate[8], grad_up[8];
      unpack_bf16x8(gate_raw[u], gate);
      unpack_bf16x8(up_raw[u], up);
      unpack_bf16x8(grad_raw[u], grad);
      swiglu_backward_values(gate, up, grad, grad_gate, grad_up);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // Rounded to bf16 first (swiglu_backward's output), then quantized; a zero triple gives +0
        // for both, so a row past the end is a zero row.
        grad_gate[i] = __bfloat162float(__float2bfloat16_rn(grad_gate[i]));
        grad_up[i] = __bfloat162float(__float2bfloat16_rn(grad_up[i]));
      }
      const float amax_gate = half_warp_block_amax(grad_gate);
      const float amax_up = half_warp_block_amax(grad_up);
      if (unit >= units) continue;
      const int64_t gate_column = block * kFp8Block, up_column = p.ffn + gate_column;
      uint4* out_row = reinterpret_cast<uint4*>(grad_gate_up + row * 2 * p.ffn);
      out_row[block * kRowsUnitThreads + piece] = pack_bf16x8(grad_gate);
      out_row[up_packs + block * kRowsUnitThreads + piece] = pack_bf16x8(grad_up);
      const float scale_gate = fp8_block_scale(amax_gate, p.pow2 != 0);
      const float scale_up = fp8_block_scale(amax_up, p.pow2 != 0);
      uint8_t* q_row = p.rows_q + row * 2 * p.ffn;
      store_quantized_piece(q_row + gate_column, piece, scale_gate, grad_gate);
      store_quantized_piece(q_row + up_column, piece, scale_up, grad_up);
      if (piece == 0) {
        p.rows_scales[block * p.gemm_a_rows + row] = scale_gate;
        p.rows_scales[(blocks_per_half + block) * p.gemm_a_rows + row] = scale_up;
      }
    }
  }
}

}  // namespace mok
