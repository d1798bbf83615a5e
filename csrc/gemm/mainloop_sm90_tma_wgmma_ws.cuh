// The expert GEMM's mainloop (sm90, TMA + wgmma, warp-specialized): what the producer thread loads
// into a stage per 64-wide K block, and the wgmma a consumer warpgroup issues on it.
//   Producer: its own 128 rows of A (K-major) and the tile's 256-row B slice: K-major, either both
//     128-row halves (clusters of 1) or, with 2-CTA clusters (vertically adjacent tiles: same
//     expert, same B slice), only its half (CTA 0 the first 128 rows, CTA 1 the second) multicast
//     into both CTAs, so each B byte leaves L2 once per cluster; or MN-major (kTransB, the dgrad
//     GEMMs: the weight as stored, (experts, K, N)), four 64 N x 64 K boxes through a 3-D map.
//   Consumers: each owns 64 of the tile's 128 rows; per K block four wgmma m64n256k16 (K = 16 each)
//     into 128 fp32 accumulators per thread.
// Where A's rows come from is the ASource's business: RowsInMemoryA below (the rows are in memory
// already), or the in-kernel dispatch (moe/dispatch_ring_sm90_ws.cuh), which writes them while the
// GEMM runs and has the producer wait for them.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// The A source of a GEMM whose rows are in memory before it starts.
struct RowsInMemoryA {
  using Params = RowsInMemoryParams;
  static constexpr int kSideThreads = 0;  // threads of the producer warpgroup it runs on the side
  static constexpr int kSideRoles = 0;    // of them, roles the watchdog waits for
  struct ProducerState {};

  template <class KernelParams>
  static __device__ __forceinline__ void run_side_threads(const KernelParams&, int32_t*, int, int, sm90::WaitWatch*) {}
  // Before the producer loads a tile's rows.
  template <class KernelParams>
  static __device__ __forceinline__ void wait_for_rows(const KernelParams&, const TileCoord&, ProducerState&,
                                                       sm90::WaitWatch*) {}
  // The row of the a map that holds the tile's first row.
  template <class KernelParams>
  static __device__ __forceinline__ int a_row(const KernelParams&, const TileCoord& c) {
    return c.row0;
  }
  // After every stage of the tile was full (its rows are all loaded), by each consumer thread.
  template <class KernelParams>
  static __device__ __forceinline__ void tile_loaded(const KernelParams&, const TileCoord&, int, int) {}
};

// kClusterM: 1, or 2 CTAs sharing each B slice through TMA multicast. kTransB: B is MN-major
// (clusters of 1 only). kGatedB: B_e holds n_out gate rows, then n_out up rows; a tile's B slice is
// gate rows [n0, n0 + 128) and their up partners (the SwiGLU epilogue).
template <int kClusterM_, bool kTransB, bool kGatedB, class ASource>
class ExpertGemmMainloop {
 public:
  using Tile = ExpertGemmTile;
  static constexpr int kClusterM = kClusterM_;
  static_assert(!kTransB || (kClusterM == 1 && !kGatedB && ASource::kSideThreads == 0),
                "MN-major B: the dgrad GEMMs, clusters of 1");
  // Launched with a cluster dimension (even of 1): barriers are set up before and released after
  // every CTA of the cluster uses them.
  static constexpr bool kClusterLaunch = true;
  static constexpr uint32_t kEmptyArrivals = 2 * kClusterM;  // each consumer warpgroup of the cluster
  static constexpr int kSideThreads = ASource::kSideThreads;
  static constexpr int kSideRoles = ASource::kSideRoles;
  static constexpr bool kKBlocksMayBeZero = false;  // K > 0 (the op checks it)
  static constexpr bool kCarriesAccumulators = false;  // every tile's K chain is whole
  using ProducerState = typename ASource::ProducerState;

  struct Loads {
    int a_row;  // the a map's row of the tile's first row
    int b_row;  // the B rows this CTA loads start here (multicast: its half)
  };
  struct ConsumerTile {
    int k_blocks;
  };

  template <class Params>
  __device__ explicit ExpertGemmMainloop(const Params& p) : k_blocks_((p.problem.k + Tile::kK - 1) / Tile::kK) {}

  template <class Maps>
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& maps) {
    sm90::prefetch_tensor_map(maps.a);
    sm90::prefetch_tensor_map(maps.b);
  }

  template <class Params>
  static __device__ __forceinline__ void run_side_threads(const Params& p, int32_t* claim, int n_tiles, int thread,
                                                          sm90::WaitWatch* watch) {
    ASource::run_side_threads(p, claim, n_tiles, thread, watch);
  }

  // ---- producer (one thread) ----

  template <class Params>
  __device__ __forceinline__ Loads producer_tile(const Params& p, const TileCoord& c, int cta_rank,
                                                 ProducerState& state, sm90::WaitWatch* watch) const {
    ASource::wait_for_rows(p, c, state, watch);
    Loads loads;
    loads.a_row = ASource::a_row(p, c);
    // This CTA's half of B: the first 128 rows of the slice, or the second (gated B: the up rows
    // partnering gate rows [n0, n0 + 128), n_out rows further).
    loads.b_row = c.expert * p.problem.n_weight_rows + c.n0;
    if (cta_rank == 1) loads.b_row += kGatedB ? p.problem.n_out : Tile::kN / 2;
    return loads;
  }

  __device__ __forceinline__ int k_blocks(const TileCoord&) const { return k_blocks_; }

  // The loads of K block kb into stage (a, b), completing on `full`.
  template <class Maps, class Params>
  __device__ __forceinline__ void load_stage(const Maps& maps, const Params& p, const TileCoord& c, const Loads& loads,
                                             int cta_rank, int kb, uint8_t* a, uint8_t* b, uint64_t* full) const {
    constexpr uint16_t kClusterMask = (1u << kClusterM) - 1;
    sm90::tma_load_2d(a, maps.a, full, kb * Tile::kK, loads.a_row);
    if constexpr (kTransB) {
      // Boxes of 64 N x 64 K at (n, k, expert); K rows past the expert's are zeros.
#pragma unroll
      for (int j = 0; j < Tile::kN / 64; ++j) {
        sm90::tma_load_3d(b + j * Tile::kBoxBytes, maps.b, full, c.n0 + 64 * j, kb * Tile::kK, c.expert);
      }
    } else if constexpr (kClusterM == 1) {
      const int b_row_second = loads.b_row + (kGatedB ? p.problem.n_out : Tile::kN / 2);
      sm90::tma_load_2d(b, maps.b, full, kb * Tile::kK, loads.b_row);
      sm90::tma_load_2d(b + Tile::kBHalfBytes, maps.b, full, kb * Tile::kK, b_row_second);
    } else {
      sm90::tma_load_2d_multicast(b + cta_rank * Tile::kBHalfBytes, maps.b, full, kb * Tile::kK, loads.b_row,
                                  kClusterMask);
    }
  }

  // ---- consumers ----

  __device__ __forceinline__ ConsumerTile consumer_tile(const TileCoord&) const { return ConsumerTile{k_blocks_}; }

  // A consumer's 64 rows of a stage's A tile: 64 K-major rows of 128 bytes.
  __device__ __forceinline__ uint8_t* consumer_a(uint8_t* a, int consumer) const { return a + consumer * 64 * 128; }

  __device__ __forceinline__ void prepare_stage(const ConsumerTile&, int, uint8_t*, uint8_t*, int, int) const {}

  // The four wgmma of K block kb on stage (a: this warpgroup's rows, b), one wgmma group.
  __device__ __forceinline__ void mma(Tile::Accumulators& acc, const ConsumerTile&, int kb, uint8_t* a,
                                      uint8_t* b) const {
    const uint64_t a_desc = sm90::smem_descriptor_sw128(a);
    const uint64_t b_desc =
        kTransB ? sm90::smem_descriptor_sw128_mn(b, Tile::kBoxBytes) : sm90::smem_descriptor_sw128(b);
    // +16 K per wgmma, in 16-byte descriptor units: 32 bytes inside a K-major row, 16 rows of
    // 128 bytes in an MN-major box.
    constexpr uint64_t kBStep = kTransB ? 2048 / 16 : 2;
    sm90::wgmma_fence();
    sm90::fence_accumulators(acc);
#pragma unroll
    for (int kk = 0; kk < Tile::kK / 16; ++kk) {
      // +32 bytes (2 in descriptor units) per 16 elements of K inside the swizzled row.
      sm90::wgmma_m64n256k16_bf16<kTransB ? 1 : 0>(acc, a_desc + 2 * kk, b_desc + kBStep * kk, (kb | kk) != 0);
    }
    sm90::wgmma_commit_group();
    sm90::fence_accumulators(acc);
  }

  template <class Params>
  static __device__ __forceinline__ void tile_loaded(const Params& p, const TileCoord& c, int consumer, int thread) {
    ASource::tile_loaded(p, c, consumer, thread);
  }

 private:
  int k_blocks_;
};

}  // namespace mok
