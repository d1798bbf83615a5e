// The weight gradient's mainloop (sm90, TMA + wgmma, warp-specialized), tokens as the reduction
// dimension: out[e] (m, n) = grad[seg_e]^T (m x rows_e) . inputs[seg_e] (rows_e x n) (d fc1 =
// d gate_up^T . rows, d fc2 = d out^T . act). Both operands are MN-major, read as stored: grad
// (rows, m) and inputs (rows, n), in 64-row K blocks from the segment's first row, through TMA
// boxes of 64 columns x 64 rows (A: two, one per consumer's 64 rows of m; B: four, 256 columns of
// n), multiplied by transposed wgmma.
//
// Segments have any length: the rows of a segment's last K block past its end belong to the next
// expert (or were never written), so before that block's wgmma the consumers zero them in shared
// memory: each its own A box, and half of B's boxes each, then both meet at a named barrier. A
// tile's K loop runs its segment's rows in order, so the gradients are bitwise reproducible. An
// expert with no rows has no K block: its tiles are zeros.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// Zeroes rows [valid, 64) of a 64-row TMA box (each row 128 contiguous bytes whatever the swizzle)
// with the 128 threads of a warpgroup, this one being `thread`. A fixed trip count with predicated
// stores: a loop whose trip count differed between threads would leave the warpgroup diverged
// before its wgmma, which ptxas then serializes (C7518).
__device__ __forceinline__ void zero_box_rows(uint8_t* box, int valid, int thread) {
#pragma unroll
  for (int i = thread; i < 64 * 8; i += kNumThreadsPerWarpGroup) {
    if (i >= valid * 8) *reinterpret_cast<uint4*>(box + i * 16) = make_uint4(0, 0, 0, 0);
  }
}

class WgradMainloop {
 public:
  using Tile = ExpertGemmTile;
  static constexpr int kClusterM = 1;
  // Launched without clusters: no other CTA arrives on this CTA's barriers, so a __syncthreads
  // orders their setup and the producer need not wait for the stages' release before it exits.
  static constexpr bool kClusterLaunch = false;
  static constexpr uint32_t kEmptyArrivals = 2;  // the two consumer warpgroups
  static constexpr int kSideThreads = 0;
  static constexpr int kSideRoles = 0;
  static constexpr bool kKBlocksMayBeZero = true;  // an expert with no rows
  static constexpr bool kCarriesAccumulators = false;  // the windowed mainloop's (mainloop_wgrad_window_*)
  struct ProducerState {};
  struct Loads {};
  struct ConsumerTile {
    int k_blocks;
    int last_valid;  // rows of the last K block inside the segment
  };

  template <class Params>
  __device__ explicit WgradMainloop(const Params&) {}

  template <class Maps>
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& maps) {
    sm90::prefetch_tensor_map(maps.grad);
    sm90::prefetch_tensor_map(maps.inputs);
  }

  template <class Params>
  static __device__ __forceinline__ void run_side_threads(const Params&, int32_t*, int, int, sm90::WaitWatch*) {}

  // ---- producer (one thread) ----

  template <class Params>
  __device__ __forceinline__ Loads producer_tile(const Params&, const WgradTileCoord&, int, ProducerState&,
                                                 sm90::WaitWatch*) const {
    return Loads{};
  }

  __device__ __forceinline__ int k_blocks(const WgradTileCoord& c) const { return (c.rows + Tile::kK - 1) / Tile::kK; }

  template <class Maps, class Params>
  __device__ __forceinline__ void load_stage(const Maps& maps, const Params&, const WgradTileCoord& c, const Loads&, int,
                                             int kb, uint8_t* a, uint8_t* b, uint64_t* full) const {
    const int row = c.row_begin + kb * Tile::kK;
#pragma unroll
    for (int j = 0; j < Tile::kM / 64; ++j) {
      sm90::tma_load_2d(a + j * Tile::kBoxBytes, maps.grad, full, c.m0 + 64 * j, row);
    }
#pragma unroll
    for (int j = 0; j < Tile::kN / 64; ++j) {
      sm90::tma_load_2d(b + j * Tile::kBoxBytes, maps.inputs, full, c.n0 + 64 * j, row);
    }
  }

  // ---- consumers ----

  __device__ __forceinline__ ConsumerTile consumer_tile(const WgradTileCoord& c) const {
    const int k_blocks = this->k_blocks(c);
    return ConsumerTile{k_blocks, c.rows - (k_blocks - 1) * Tile::kK};
  }

  // A consumer's 64 columns of m: one of the stage's two A boxes.
  __device__ __forceinline__ uint8_t* consumer_a(uint8_t* a, int consumer) const { return a + consumer * Tile::kBoxBytes; }

  // Before the wgmma of K block kb (a: this warpgroup's A box): the last block's rows past the
  // segment become zeros.
  __device__ __forceinline__ void prepare_stage(const ConsumerTile& t, int kb, uint8_t* a, uint8_t* b, int consumer,
                                                int thread) const {
    if (kb == t.k_blocks - 1 && t.last_valid < Tile::kK) {
      // The rows past the segment: this consumer's A box and two of B's four boxes.
      zero_box_rows(a, t.last_valid, thread);
      zero_box_rows(b + (2 * consumer) * Tile::kBoxBytes, t.last_valid, thread);
      zero_box_rows(b + (2 * consumer + 1) * Tile::kBoxBytes, t.last_valid, thread);
      sm90::fence_async_shared();  // generic writes, read by wgmma through the async proxy
      // Both consumers take this branch at the same K block (same tile, same segment), so the
      // barrier always fills.
      sm90::named_barrier_sync(kConsumersBarrier, Tile::kConsumerThreads);
    }
  }

  // The tile's chain starts from zero: its first wgmma ignores acc.
  __device__ __forceinline__ void mma(Tile::Accumulators& acc, const ConsumerTile&, int kb, uint8_t* a,
                                      uint8_t* b) const {
    mma_k_block(acc, a, b, kb != 0);
  }

  template <class Params>
  static __device__ __forceinline__ void tile_loaded(const Params&, const WgradTileCoord&, int, int) {}

 protected:
  // One K block's four wgmma; accumulate = false: the first ignores acc (scale-d 0).
  static __device__ __forceinline__ void mma_k_block(Tile::Accumulators& acc, uint8_t* a, uint8_t* b, bool accumulate) {
    const uint64_t a_desc = sm90::smem_descriptor_sw128_mn(a, Tile::kBoxBytes);
    const uint64_t b_desc = sm90::smem_descriptor_sw128_mn(b, Tile::kBoxBytes);
    sm90::wgmma_fence();
    sm90::fence_accumulators(acc);
#pragma unroll
    for (int kk = 0; kk < Tile::kK / 16; ++kk) {
      // +16 K rows of 128 bytes per wgmma, in 16-byte descriptor units.
      sm90::wgmma_m64n256k16_bf16<1, 1>(acc, a_desc + 128 * kk, b_desc + 128 * kk, kk != 0 || accumulate);
    }
    sm90::wgmma_commit_group();
    sm90::fence_accumulators(acc);
  }
};

}  // namespace mok
