// The SwiGLU epilogue of the gate/up projection (sm90): the product's 256 columns are 128 gate
// columns and their 128 up partners (B's tile slice: gate rows [n0, n0 + 128) and the up rows
// n_out further), so gate column n sits in acc[4 * j + ...] and its up partner in
// acc[4 * (j + 16) + ...] of the same thread. Writes gate_up (the pre-activation, kept for backward)
// and act = silu(gate) * up from the bf16-rounded gate and up: exactly swiglu_forward_kernel over
// the written gate_up. Reference: swiglu over segment_matmul in megatron_mok/backends/reference.py.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/swiglu_math.cuh"
#include "common/tma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// act for a pair of gate and up values already rounded to bf16 (so act is exactly
// swiglu_forward_kernel(gate_up)).
__device__ __forceinline__ uint32_t swiglu_pair(uint32_t gate, uint32_t up) {
  const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(&up);
  return pack_bf16x2(swiglu_value(__low2float(g), __low2float(u)), swiglu_value(__high2float(g), __high2float(u)));
}

struct SwigluEpilogue : StagedOrDirectEpilogue<SwigluEpilogue> {
  using Maps = SwigluEpilogueMaps;
  using Params = SwigluEpilogueParams;
  static constexpr int kTileCols = ExpertGemmTile::kN / 2;  // act columns per tile
  static constexpr bool kGatedB = true;                     // B_e: n_out gate rows, then n_out up rows

  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& m) { sm90::prefetch_tensor_map(m.act); }

  // Gate, up, then act, each 128 columns through the staging buffer.
  static __device__ __forceinline__ void store_rows_staged(const Maps& m, const uint32_t (&packed)[64],
                                                           const TileCoord& c, StagingRing& ring, int consumer,
                                                           int thread) {
    const int row = c.row0 + 64 * consumer;
    uint8_t* staging = ring.acquire();
    stage_columns(staging, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
    store_staged(m.gate, staging, consumer, thread, c.n0, row);
    staging = ring.acquire();
    stage_columns(staging, thread, 0, [&](int j, int h) { return packed[2 * (j + 16) + h]; });
    store_staged(m.up, staging, consumer, thread, c.n0, row);
    staging = ring.acquire();
    stage_columns(staging, thread, 0,
                  [&](int j, int h) { return swiglu_pair(packed[2 * j + h], packed[2 * (j + 16) + h]); });
    store_staged(m.act, staging, consumer, thread, c.n0, row);
  }

  // out_extent: act's (gate_up has twice its columns).
  static __device__ __forceinline__ void store_rows_direct(const Params& e, const OutputExtent& out_extent,
                                                           const uint32_t (&packed)[64], const TileCoord& c,
                                                           int consumer, int thread) {
    auto* gate = static_cast<__nv_bfloat16*>(e.gate_up);
    auto* act = static_cast<__nv_bfloat16*>(e.act);
    const int64_t stride = 2 * int64_t(out_extent.n_out);
    write_columns_direct(gate, stride, c, out_extent, consumer, thread, 0, c.n0,
                         [&](int j, int h) { return packed[2 * j + h]; });
    write_columns_direct(gate + out_extent.n_out, stride, c, out_extent, consumer, thread, 0, c.n0,
                         [&](int j, int h) { return packed[2 * (j + 16) + h]; });
    write_columns_direct(act, out_extent.n_out, c, out_extent, consumer, thread, 0, c.n0,
                         [&](int j, int h) { return swiglu_pair(packed[2 * j + h], packed[2 * (j + 16) + h]); });
  }
};

}  // namespace mok
