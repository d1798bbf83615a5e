// The SwiGLU-backward epilogue of the down projection's dgrad (sm90): the product is grad_act, which
// is rounded to bf16 (as the unfused pipeline does) and never written; the epilogue reads gate_up
// and writes grad_gate_up = swiglu_backward(gate_up, grad_act): exactly swiglu_backward_kernel.
// Reference: swiglu_backward over segment_matmul in megatron_mok/backends/reference.py.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/swiglu_math.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// d gate and d up of a pair of columns, from grad_act rounded to bf16 (so the result is exactly
// swiglu_backward_kernel(gate_up, grad_act)) and the gate and up pairs read from gate_up.
__device__ __forceinline__ void swiglu_backward_pair(uint32_t grad_act, uint32_t gate, uint32_t up, uint32_t& grad_gate,
                                                     uint32_t& grad_up) {
  const __nv_bfloat162 d = *reinterpret_cast<const __nv_bfloat162*>(&grad_act);
  const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(&up);
  float dg[2], du[2];
  swiglu_backward_value(__low2float(g), __low2float(u), __low2float(d), dg[0], du[0]);
  swiglu_backward_value(__high2float(g), __high2float(u), __high2float(d), dg[1], du[1]);
  grad_gate = pack_bf16x2(dg[0], dg[1]);
  grad_up = pack_bf16x2(du[0], du[1]);
}

// The SwiGLU-backward epilogue (dgrad of down): grad_gate_up = swiglu_backward(gate_up, grad_act)
// for the warpgroup's rows inside the segment. Per 128 columns the rounded grad_act goes through
// the staging buffer, so each thread then takes whole 16-byte chunks of a row: grad_act from shared
// memory, gate and up with 16-byte loads, d gate and d up with 16-byte stores (16 threads cover
// 256 contiguous bytes of a row). Rows past the segment or the rows, and columns past n_out, are
// neither read nor written.
__device__ __forceinline__ void swiglu_backward_epilogue(const uint32_t (&packed)[64], const TileCoord& c,
                                                         const SwigluBackwardEpilogueParams& p, const OutputExtent& e,
                                                         StagingRing& ring, int consumer, int thread) {
  using Tile = ExpertGemmTile;
  constexpr int kChunksPerRow = 128 / 8;
  const auto* gate_up = static_cast<const __nv_bfloat16*>(p.gate_up);
  auto* grad_gate_up = static_cast<__nv_bfloat16*>(p.grad_gate_up);
  const int64_t row_stride = 2 * int64_t(e.n_out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint8_t* staging = ring.acquire();  // also: every thread is done with the previous half's block
    stage_columns(staging, thread, 4 * half, [&](int j, int h) { return packed[2 * j + h]; });
    sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
    // Unrolled: all eight chunks' gate and up loads in flight at once.
#pragma unroll
    for (int i = 0; i < 64 * kChunksPerRow / kNumThreadsPerWarpGroup; ++i) {
      const int chunk = thread + kNumThreadsPerWarpGroup * i;
      const int r = chunk / kChunksPerRow, cc = chunk % kChunksPerRow;
      const int64_t row = int64_t(c.row0) + 64 * consumer + r;
      const int col = c.n0 + 128 * half + 8 * cc;
      if (64 * consumer + r >= c.rows || row >= e.num_rows || col >= e.n_out) continue;
      const int box = cc / 8, box_chunk = cc % 8;
      const uint4 d = *reinterpret_cast<const uint4*>(staging + box * Tile::kStoreBoxBytes + r * 128 +
                                                      ((box_chunk ^ (r & 7)) << 4));
      const auto* source = gate_up + row * row_stride + col;
      const uint4 g = __ldg(reinterpret_cast<const uint4*>(source));
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(source + e.n_out));
      uint4 dg, du;
      swiglu_backward_pair(d.x, g.x, u.x, dg.x, du.x);
      swiglu_backward_pair(d.y, g.y, u.y, dg.y, du.y);
      swiglu_backward_pair(d.z, g.z, u.z, dg.z, du.z);
      swiglu_backward_pair(d.w, g.w, u.w, dg.w, du.w);
      auto* target = grad_gate_up + row * row_stride + col;
      *reinterpret_cast<uint4*>(target) = dg;
      *reinterpret_cast<uint4*>(target + e.n_out) = du;
    }
  }
}

// The SwiGLU-backward epilogue reads the tile's gate and up values: row r of the warpgroup's 64
// starts fetching its two spans into L2 when the tile starts, so they arrive during the mainloop
// instead of stalling the epilogue on DRAM.
__device__ __forceinline__ void prefetch_gate_up_row(const TileCoord& c, const SwigluBackwardEpilogueParams& p,
                                                     const OutputExtent& e, int consumer, int r) {
  const int64_t row = int64_t(c.row0) + 64 * consumer + r;
  if (64 * consumer + r >= c.rows || row < 0 || row >= e.num_rows) return;
  const auto* gate = static_cast<const __nv_bfloat16*>(p.gate_up) + row * 2 * int64_t(e.n_out) + c.n0;
  const uint32_t bytes = uint32_t(min(ExpertGemmTile::kN, e.n_out - c.n0)) * 2;  // n_out % 8 == 0
  sm90::prefetch_l2_bulk(gate, bytes);
  sm90::prefetch_l2_bulk(gate + e.n_out, bytes);
}

struct SwigluBackwardEpilogue {
  using Maps = SwigluBackwardEpilogueMaps;
  using Params = SwigluBackwardEpilogueParams;
  static constexpr int kTileCols = ExpertGemmTile::kN;  // grad_act columns per tile
  static constexpr bool kGatedB = false;

  // (No tensor map: the stores are plain 16-byte stores.)
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps&) {}

  // out_extent: grad_act's (gate_up and grad_gate_up have twice its columns).
  static __device__ __forceinline__ void before_mainloop(const Params& e, const OutputExtent& out_extent,
                                                         const TileCoord& c, int consumer, int thread) {
    if (thread < 64) prefetch_gate_up_row(c, e, out_extent, consumer, thread);
  }

  static __device__ __forceinline__ void store(const Maps&, const Params& e, const OutputExtent& out_extent,
                                               const uint32_t (&packed)[64], const TileCoord& c, StagingRing& ring,
                                               int consumer, int thread) {
    if (c.rows > 64 * consumer) swiglu_backward_epilogue(packed, c, e, out_extent, ring, consumer, thread);
  }
};

}  // namespace mok
