// The SwiGLU backward with its row-wise quantization as the epilogue of the FP8 down-projection dgrad
// (gemm/fp8_gemm_sm90.cuh Fp8ExpertGemmKernel; mok_params.h Fp8SwigluBackwardEpilogueParams): the
// product is d act, rounded once to bf16 (the store epilogue's rounding) and never written; the
// epilogue reads the tile's gate and up columns and writes d gate_up in bf16 (the fc1 weight
// gradient's column quantization reads it) and as E4M3 1x128 along 2F with its scales (the gate/up
// dgrad's A operand). Bit for bit fp8_expert_gemm then quant/quantize_swiglu_backward_sm90.cuh on the
// rows of the segments, without d act's write and read and without that launch. Rows outside the
// segments are not written (nobody reads them: the gate/up dgrad stores none of them, the column
// quantization reads rows before the schedule's end only).
//
// A tile's 128 d act columns [n0, n0 + 128) are one 1x128 block of d gate (columns n0 ..) and one of
// d up (n_out + n0 ..). The warpgroup's 64 rows go through its staging buffer (stage_columns), so
// each thread then takes whole 16-byte chunks: chunk t + 128 i is row (t + 128 i) / 16, columns
// 8 * (t % 16) .. + 7, so the 16 threads of a half-warp hold one row's 128 columns and a block's amax
// is half_warp_block_amax's four shuffles, as in the standalone kernel.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_block_math.cuh"
#include "common/swiglu_math.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/fp8_gemm_sm90.cuh"
#include "mok_params.h"
#include "quant/row_block_sm90.cuh"

namespace mok {

struct Fp8SwigluBackwardEpilogue : Fp8OnePassColumns {
  using Maps = Fp8SwigluBackwardEpilogueMaps;
  using Params = Fp8SwigluBackwardEpilogueParams;
  static constexpr int kChunksPerRow = kFp8Block / 8;  // 16-byte chunks of a row's 128 bf16 columns
  static_assert(kChunksPerRow == kRowsUnitThreads, "a half-warp holds one row's block (half_warp_block_amax)");
  static constexpr int kRounds = 64 * kChunksPerRow / kNumThreadsPerWarpGroup;  // 8 rows per round
  static constexpr int kBatch = kRounds / 2;
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& m) { sm90::prefetch_tensor_map(m.gate_up); }

  // The tile's gate and up spans (its 128 rows x 128 columns of each) start coming into L2 when the
  // producer starts the tile, a few K blocks ahead of the epilogue, so that its loads find them there
  // instead of waiting on DRAM with the tensor cores idle: four box prefetches, no registers held.
  static __device__ __forceinline__ void before_tile(const Maps& m, const OutputExtent& out_extent,
                                                     const TileCoord& c) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // gate columns n0 .., then up columns n_out + n0 ..
#pragma unroll
      for (int box = 0; box < kFp8Block / 64; ++box) {
        sm90::tma_prefetch_2d(m.gate_up, half * out_extent.n_out + c.n0 + 64 * box, c.row0);
      }
    }
  }

  // out_extent: d act's (num_rows, n_out); gate_up and its gradient have 2 n_out columns.
  static __device__ __forceinline__ void after_pass(const Maps&, const Params& e, const OutputExtent& out_extent,
                                                    const float (&acc)[Fp8GemmTile::kAccumulators], const TileCoord& c,
                                                    int, State&, StagingRing& staging, int consumer, int thread) {
    if (c.rows <= 64 * consumer) return;  // none of this warpgroup's rows lies in the segment
    uint8_t* buffer = staging.acquire();  // also: every thread is done with the buffer's last use
    {
      uint32_t packed[Fp8GemmTile::kAccumulators / 2];
      pack(acc, packed);
      stage_columns(buffer, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
    }
    sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);  // every row staged
    const int64_t n_out = out_extent.n_out, row_stride = 2 * n_out;
    const int cc = thread % kChunksPerRow;  // this thread's chunk of every row it takes
    const int64_t gate_block = c.n0 / kFp8Block, up_block = (n_out + c.n0) / kFp8Block;
    const auto* gate_up = static_cast<const __nv_bfloat16*>(e.gate_up);
    // In two batches of rounds, each batch's gate and up loads issued first, then its arithmetic
    // (the whole tile's loads at once spill in the default mainloop).
#pragma unroll
    for (int batch = 0; batch < kRounds; batch += kBatch) {
      uint4 gate_raw[kBatch], up_raw[kBatch];
      bool row_in[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = (thread + kNumThreadsPerWarpGroup * (batch + b)) / kChunksPerRow;
        const int64_t row = int64_t(c.row0) + 64 * consumer + r;
        row_in[b] = 64 * consumer + r < c.rows && row < out_extent.num_rows;
        gate_raw[b] = up_raw[b] = make_uint4(0, 0, 0, 0);
        if (row_in[b]) {
          const auto* source = reinterpret_cast<const uint4*>(gate_up + row * row_stride + c.n0) + cc;
          gate_raw[b] = __ldg(source);
          up_raw[b] = __ldg(source + n_out / 8);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = (thread + kNumThreadsPerWarpGroup * (batch + b)) / kChunksPerRow;
        const int64_t row = int64_t(c.row0) + 64 * consumer + r;
        const int box = cc / 8, box_chunk = cc % 8;  // stage_columns' layout
        const uint4 grad_raw = *reinterpret_cast<const uint4*>(buffer + box * ExpertGemmTile::kStoreBoxBytes + r * 128 +
                                                               ((box_chunk ^ (r & 7)) << 4));
        float gate[8], up[8], grad[8], grad_gate[8], grad_up[8];
        unpack_bf16x8(gate_raw[b], gate);
        unpack_bf16x8(up_raw[b], up);
        unpack_bf16x8(grad_raw, grad);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          // Rounded to bf16 first (swiglu_backward's output), then quantized, as the standalone kernel.
          swiglu_backward_value(gate[v], up[v], grad[v], grad_gate[v], grad_up[v]);
          grad_gate[v] = __bfloat162float(__float2bfloat16_rn(grad_gate[v]));
          grad_up[v] = __bfloat162float(__float2bfloat16_rn(grad_up[v]));
        }
        // Every lane takes part in the shuffles; a row outside the segment reduces zeros.
        const float amax_gate = half_warp_block_amax(grad_gate);
        const float amax_up = half_warp_block_amax(grad_up);
        if (!row_in[b]) continue;
        uint4* out_row =
            reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(e.grad_gate_up) + row * row_stride + c.n0);
        out_row[cc] = pack_bf16x8(grad_gate);
        out_row[n_out / 8 + cc] = pack_bf16x8(grad_up);
        const float scale_gate = fp8_block_scale(amax_gate, e.pow2 != 0);
        const float scale_up = fp8_block_scale(amax_up, e.pow2 != 0);
        uint8_t* q_row = e.rows_q + row * row_stride;
        store_quantized_piece(q_row + c.n0, cc, scale_gate, grad_gate);
        store_quantized_piece(q_row + n_out + c.n0, cc, scale_up, grad_up);
        if (cc == 0) {
          e.rows_scales[gate_block * e.gemm_a_rows + row] = scale_gate;
          e.rows_scales[up_block * e.gemm_a_rows + row] = scale_up;
        }
      }
    }
  }
};

}  // namespace mok
