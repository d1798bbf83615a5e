// The store epilogue of the sm90 GEMMs: out = the product, rounded once to bf16. A warpgroup whose
// 64 rows all lie inside the segment writes through its staging buffer and TMA stores (columns
// past n_out fall outside the tensor map and are not written) and goes on to its next tile while
// the stores drain; one whose rows are not all inside it stores from registers with a row mask.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/tma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

struct StoreEpilogue : StagedOrDirectEpilogue<StoreEpilogue> {
  using Maps = StoreEpilogueMaps;
  using Params = StoreEpilogueParams;
  static constexpr int kTileCols = ExpertGemmTile::kN;  // output columns per tile
  static constexpr bool kGatedB = false;                // B's rows are output columns

  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& m) { sm90::prefetch_tensor_map(m.out); }

  // The 256 columns, 128 at a time through the staging buffer.
  static __device__ __forceinline__ void store_rows_staged(const Maps& m, const uint32_t (&packed)[64],
                                                           const TileCoord& c, StagingRing& ring, int consumer,
                                                           int thread) {
    const int row = c.row0 + 64 * consumer;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint8_t* staging = ring.acquire();
      stage_columns(staging, thread, 4 * half, [&](int j, int h) { return packed[2 * j + h]; });
      store_staged(m.out, staging, consumer, thread, c.n0 + 128 * half, row);
    }
  }

  static __device__ __forceinline__ void store_rows_direct(const Params& e, const OutputExtent& out_extent,
                                                           const uint32_t (&packed)[64], const TileCoord& c,
                                                           int consumer, int thread) {
    auto* out = static_cast<__nv_bfloat16*>(e.out);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      write_columns_direct(out, out_extent.n_out, c, out_extent, consumer, thread, 4 * half, c.n0 + 128 * half,
                           [&](int j, int h) { return packed[2 * j + h]; });
    }
  }
};

}  // namespace mok
