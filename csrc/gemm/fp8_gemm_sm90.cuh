// The FP8 blockwise grouped GEMM of the expert segments (sm_90a; docs/design.md §12.3): E4M3 A rows
// times E4M3 B_e^T with one fp32 scale per row and K block for A (1x128) and per 128 x 128 block for
// B, bf16 out. Forward fc1/fc2 take the weights as quantized; the dgrads take the transposed copies
// (sm90's FP8 wgmma reads K-major operands only).
//
// Persistent and warp-specialized like gemm/kernel_sm90_tma_wgmma_ws.cuh, whose kernel entry, tile
// scheduler, stage ring, staging buffers and bounded waits it shares; what differs is the unit of a
// stage and the promotion:
//   warpgroup 0, producer: thread 0 walks the CTA's tiles (ExpertTileScheduler) and per K block of
//     128 waits for a free stage and TMA-loads the tile's 128 A rows and 128 B rows (128 bytes of K
//     each, 128-byte swizzle) onto the stage's `full` barrier; with 2-CTA clusters each CTA loads half
//     of the shared B slice and multicasts it into both. Thread 32 is the watchdog.
//   warpgroups 1 and 2, consumers, 64 rows each: per K block four wgmma m64n128k32 E4M3 into a fresh
//     fp32 partial (the first with scale_d = 0, so a partial never spans two K blocks), wait for
//     them, hand the stage back, and promote: acc += (scale_a[row] * scale_b) * partial, in fp32
//     registers, ascending K blocks (bitwise reproducible). The scales are plain loads from global
//     memory issued one K block ahead (two A scales per thread, its two rows; one B scale per tile and
//     K block), so their latency hides behind a K block's MMAs. The two consumer warpgroups
//     alternate on the tensor cores: one promotes while the other's MMAs run.
// The epilogue rounds the accumulators once to bf16 and writes a warpgroup's 64 x 128 block through
// its staging buffer and two TMA stores, or with masked stores when its rows are not all inside
// the segment (gemm/epilogue_sm90_staging.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/failure_codes.h"
#include "common/limits.h"
#include "common/pipeline_sm90.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_fp8_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

struct Fp8GemmTile {
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kNumThreadsPerWarpGroup;
  static constexpr int kThreads = kNumThreadsPerWarpGroup + kConsumerThreads;
  static_assert(kThreads == ExpertGemmTile::kThreads, "gemm_kernel_sm90's launch bounds are ExpertGemmTile's");
  static constexpr int kM = 128;  // two consumer warpgroups x 64 rows (wgmma m64)
  static_assert(kM == ExpertGemmTile::kM, "the expert tile scheduler walks m-tiles of ExpertGemmTile::kM rows");
  // One weight scale block wide and one scale block of K deep: a stage is one promotion step, and a
  // tile has one B scale per K block.
  static constexpr int kN = kFp8Block;
  static constexpr int kK = kFp8Block;
  static constexpr int kMmaK = 32;  // K of one wgmma E4M3
  static constexpr int kMmasPerStage = kK / kMmaK;
  // fp32 registers per consumer thread for its warpgroup's 64 x kN outputs: the promoted sum and the
  // K block's partial each hold this many.
  static constexpr int kAccumulators = 64 * kN / kNumThreadsPerWarpGroup;
  static_assert(kAccumulators == 64, "wgmma_m64n128k32_e4m3 takes 64 accumulators");
  static constexpr uint32_t kABytes = kM * kK;  // E4M3: one byte per value; 128-byte K rows
  static constexpr uint32_t kBBytes = kN * kK;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr uint32_t kConsumerABytes = 64 * kK;  // a consumer warpgroup's 64 rows of a stage's A
  // The staging buffers of gemm/epilogue_sm90_staging.cuh's StagingRing: one holds a warpgroup's
  // 64 rows x 128 bf16 columns, its share of a tile.
  static constexpr int kStagingBuffers = ExpertGemmTile::kStagingBuffers;
  static constexpr uint32_t kStagingBytes = ExpertGemmTile::kStagingBytes;
  static_assert(kStagingBytes == 64 * kN * 2, "a staging buffer holds a consumer's 64 x kN bf16 outputs");
  // As many stages as fit beside the staging buffers in the 227 KB an sm90 block may opt into.
  static constexpr int kStages = kStagingBuffers == 1 ? 6 : 5;
  static constexpr int kProducerRegisters = ExpertGemmTile::kProducerRegisters;
  static constexpr int kConsumerRegisters = ExpertGemmTile::kConsumerRegisters;
  static constexpr int kSwizzleAlign = ExpertGemmTile::kSwizzleAlign;
  static constexpr int kRoles = 3;  // producer + two consumers, for the watchdog
};

// The dynamic shared memory, carved from a 1024-byte aligned base (128-byte swizzled TMA boxes),
// in bytes, S = kStages:
//   a        S * kABytes (16 KB)                   the stages' A tiles
//   b        S * kBBytes (16 KB)                   the stages' B tiles
//   staging  2 * kStagingBuffers * kStagingBytes   each consumer warpgroup's staging buffers
//   full     S * 8                                 a stage's loads landed (mbarriers)
//   empty    S * 8                                 every consumer of the cluster released a stage
//   watch    8                                     the bounded waits' watch (WaitWatch)
struct Fp8GemmSharedStorage {
  using Tile = Fp8GemmTile;
  static constexpr size_t kBytes = size_t(Tile::kStages) * Tile::kStageBytes +
                                   2 * Tile::kStagingBuffers * Tile::kStagingBytes +
                                   2 * Tile::kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch);
  static constexpr size_t kSmemBytes = Tile::kSwizzleAlign + kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm90 block may opt into");

  __device__ explicit Fp8GemmSharedStorage(uint8_t* smem_raw)
      : a(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) &
                                     ~uintptr_t(Tile::kSwizzleAlign - 1))),
        b(a + Tile::kStages * Tile::kABytes),
        staging(b + Tile::kStages * Tile::kBBytes),
        full(reinterpret_cast<uint64_t*>(staging + 2 * Tile::kStagingBuffers * Tile::kStagingBytes)),
        empty(full + Tile::kStages),
        watch(reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages)) {}

  uint8_t* a;
  uint8_t* b;
  uint8_t* staging;
  uint64_t* full;
  uint64_t* empty;
  sm90::WaitWatch* watch;
};

// kClusterM: 1, or 2 CTAs (vertically adjacent m-tiles of one expert) sharing each B slice through
// TMA multicast. Launched through gemm_kernel_sm90<Fp8ExpertGemmKernel<kClusterM>, Fp8ExpertGemmMaps,
// Fp8ExpertGemmParams, CUtensorMap x 3> with a cluster dimension (even of 1).
template <int kClusterM>
struct Fp8ExpertGemmKernel {
  using Tile = Fp8GemmTile;
  using SharedStorage = Fp8GemmSharedStorage;
  using Scheduler = ExpertTileScheduler<kClusterM, Tile::kN>;
  static_assert(kClusterM == 1 || kClusterM == 2, "clusters of 1 or 2 CTAs");
  static constexpr uint32_t kEmptyArrivals = 2 * kClusterM;  // each consumer warpgroup of the cluster
  static_assert(Tile::kABytes % Tile::kSwizzleAlign == 0 && (Tile::kBBytes / kClusterM) % Tile::kSwizzleAlign == 0 &&
                    Tile::kConsumerABytes % Tile::kSwizzleAlign == 0,
                "every operand box and wgmma base starts on a 1024-byte swizzle atom");

  static __device__ __forceinline__ void run(const Fp8ExpertGemmMaps& maps, const Fp8ExpertGemmParams& p,
                                             uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    if (threadIdx.x == 0) {
      sm90::init_stage_barriers<Tile::kStages>(shared.full, shared.empty, kEmptyArrivals);
      shared.watch->failed = 0;
      shared.watch->finished = 0;
    }
    if (threadIdx.x == 32) {
      sm90::prefetch_tensor_map(maps.a);
      sm90::prefetch_tensor_map(maps.b);
      sm90::prefetch_tensor_map(maps.epilogue.out);
    }
    // Every CTA's barriers exist before a peer multicasts into or arrives on them.
    sm90::cluster_sync();

    Scheduler scheduler(p.problem);
    const int warpgroup = threadIdx.x / kNumThreadsPerWarpGroup;
    if (warpgroup == 0) {
      sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
      if (threadIdx.x == 32) sm90::watch_waits(shared.watch, Tile::kRoles, p.failure_record, kFp8ExpertGemmKernel);
      if (threadIdx.x == 0) produce(maps, p, scheduler, shared);
      return;
    }
    sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
    consume(maps, p, scheduler, shared, warpgroup - 1, threadIdx.x % kNumThreadsPerWarpGroup);
  }

 private:
  static __device__ __forceinline__ void produce(const Fp8ExpertGemmMaps& maps, const Fp8ExpertGemmParams& p,
                                                 Scheduler& scheduler, const SharedStorage& shared) {
    sm90::WaitWatch* watch = shared.watch;
    const int cta_rank = scheduler.cta_rank();
    const int k_blocks = p.problem.k / Tile::kK;
    constexpr uint32_t kBPartBytes = Tile::kBBytes / kClusterM;  // the B rows this CTA loads
    TileCoord c;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      const int b_row = c.expert * p.problem.n_weight_rows + c.n0 + cta_rank * (Tile::kN / kClusterM);
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
        // The whole B slice lands in every CTA of the cluster (its own part and the peer's multicast).
        sm90::mbarrier_arrive_expect_tx(&shared.full[stage], Tile::kStageBytes);
        uint8_t* b = shared.b + stage * Tile::kBBytes + cta_rank * kBPartBytes;
        sm90::tma_load_2d(shared.a + stage * Tile::kABytes, maps.a, &shared.full[stage], kb * Tile::kK, c.row0);
        if constexpr (kClusterM == 1) {
          sm90::tma_load_2d(b, maps.b, &shared.full[stage], kb * Tile::kK, b_row);
        } else {
          sm90::tma_load_2d_multicast(b, maps.b, &shared.full[stage], kb * Tile::kK, b_row, (1u << kClusterM) - 1);
        }
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    // Every stage released by all consumers of the cluster: no remote arrival or multicast is still
    // to come into this CTA's shared memory when it exits.
    for (int i = 0; i < Tile::kStages; ++i) {
      sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
    sm90::mark_finished(watch);
  }

  static __device__ __forceinline__ void consume(const Fp8ExpertGemmMaps& maps, const Fp8ExpertGemmParams& p,
                                                 Scheduler& scheduler, const SharedStorage& shared, int consumer,
                                                 int thread) {
    sm90::WaitWatch* watch = shared.watch;
    const int k_blocks = p.problem.k / Tile::kK;
    const int n_blocks = p.problem.n_weight_rows / Tile::kN;
    const int64_t a_rows = p.scales.a_rows;
    const int num_rows = p.problem.num_rows;
    // This thread's first row in its warpgroup's 64 (the second is 8 further): the fragment layout.
    const int fragment_row = 64 * consumer + 16 * (thread / 32) + (thread % 32) / 4;
    StagingRing staging(shared.staging + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
    const OutputExtent out_extent = scheduler.output_extent();
    float acc[Tile::kAccumulators];
    float partial[Tile::kAccumulators];
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; ++i) partial[i] = 0.f;  // (overwritten: scale_d = 0)
    int stage = 0;
    uint32_t phase = 0;
    TileCoord c;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      // The scales of this thread's two rows (rows past the schedule's read none: their outputs are
      // not stored) and of the tile's B block, K block by K block.
      const int row = c.row0 + fragment_row;
      const bool row_in[2] = {row < num_rows, row + 8 < num_rows};
      const float* a_scales = p.scales.a + row;
      const float* b_scales = p.scales.b + (int64_t(c.expert) * n_blocks + c.n0 / Tile::kN) * k_blocks;
      float next_a[2], next_b = __ldg(b_scales);
#pragma unroll
      for (int h = 0; h < 2; ++h) next_a[h] = row_in[h] ? __ldg(a_scales + 8 * h) : 0.f;
      // Defined afresh per tile, so the compiler does not keep the previous tile's alive.
#pragma unroll
      for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = 0.f;
#pragma unroll 1
      for (int kb = 0; kb < k_blocks; ++kb) {
        const float scale_a[2] = {next_a[0], next_a[1]};
        const float scale_b = next_b;
        if (kb + 1 < k_blocks) {  // the next K block's scales, in flight during this one's MMAs
          next_b = __ldg(b_scales + kb + 1);
#pragma unroll
          for (int h = 0; h < 2; ++h) next_a[h] = row_in[h] ? __ldg(a_scales + (kb + 1) * a_rows + 8 * h) : 0.f;
        }
        sm90::mbarrier_wait(&shared.full[stage], phase, kWaitLoadedStage, watch);
        const uint64_t a_desc =
            sm90::smem_descriptor_sw128(shared.a + stage * Tile::kABytes + consumer * Tile::kConsumerABytes);
        const uint64_t b_desc = sm90::smem_descriptor_sw128(shared.b + stage * Tile::kBBytes);
        sm90::wgmma_fence();
        sm90::fence_accumulators(partial);
#pragma unroll
        for (int kk = 0; kk < Tile::kMmasPerStage; ++kk) {
          // +32 bytes of the swizzled K row (2 in descriptor units) per wgmma; the first restarts
          // the partial sum.
          sm90::wgmma_m64n128k32_e4m3(partial, a_desc + 2 * kk, b_desc + 2 * kk, kk != 0);
        }
        sm90::wgmma_commit_group();
        sm90::wgmma_wait_group<0>();
        sm90::fence_accumulators(partial);
        // The MMAs have read the stage: hand it back before promoting.
        if (thread == 0) sm90::release_stage<kClusterM>(&shared.empty[stage]);
        sm90::advance_stage<Tile::kStages>(stage, phase);
        const float scale[2] = {scale_a[0] * scale_b, scale_a[1] * scale_b};
#pragma unroll
        for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = fmaf(scale[(i / 2) % 2], partial[i], acc[i]);
      }
      store(maps, p, out_extent, acc, c, staging, consumer, thread);
    }
    if (thread == 0) {
      sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
      sm90::mark_finished(watch);
    }
  }

  // The tile's accumulators rounded once to bf16 pairs (packed[2 * j + h]: columns 8 * j + 2 * (l % 4)
  // + {0, 1} of row half h), written as gemm/epilogue_sm90_store.cuh writes one 128-column half.
  static __device__ __forceinline__ void store(const Fp8ExpertGemmMaps& maps, const Fp8ExpertGemmParams& p,
                                               const OutputExtent& out_extent, const float (&acc)[Tile::kAccumulators],
                                               const TileCoord& c, StagingRing& staging, int consumer, int thread) {
    uint32_t packed[Tile::kAccumulators / 2];
#pragma unroll
    for (int j = 0; j < Tile::kAccumulators / 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
    const auto pair = [&](int j, int h) { return packed[2 * j + h]; };
    if (c.rows >= 64 * (consumer + 1)) {
      uint8_t* buffer = staging.acquire();
      stage_columns(buffer, thread, 0, pair);
      store_staged(maps.epilogue.out, buffer, consumer, thread, c.n0, c.row0 + 64 * consumer);
    } else if (c.rows > 64 * consumer) {
      write_columns_direct(static_cast<__nv_bfloat16*>(p.epilogue.out), out_extent.n_out, c, out_extent, consumer,
                           thread, 0, c.n0, pair);
    }
  }
};

}  // namespace mok
