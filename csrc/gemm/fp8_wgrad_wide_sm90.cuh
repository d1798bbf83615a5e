// The FP8 blockwise weight gradient in 128 x 192 tiles (sm_90a; op variant "wide" of
// ops.fp8_expert_wgrad): the out of gemm/fp8_wgrad_sm90.cuh's kernel, bit for bit, from a kernel shaped
// as gemm/fp8_gemm_wide_sm90.cuh is beside the 128-wide FP8 GEMM. Same problem, params, maps, windows,
// chains and rounding (that file's header says what each means); what differs:
//   - one wgmma m64n192k32 per 32 tokens: the grad box is read from shared memory once per 192
//     columns, not once per 128, and L2 -> SM bytes per FLOP fall by a sixth (40 KB of operands per
//     128 x 192 x 128 block against 32 KB per 128 x 128 x 128);
//   - one fp32 partial per warpgroup (96 registers beside the 96 promoted sums): a block's four
//     wgmmas, wait, promote, release, the next block issued. The tensor cores are kept busy by the two
//     consumer warpgroups drifting apart (one promotes while the other's wgmmas run), not by a second
//     partial, which at 96 columns a warpgroup would not fit the consumers' registers;
//   - the next tile's first block is issued before a tile's epilogue (as kOverlapAcrossTiles): the
//     partial is free once the tile's last block is promoted, and the tensor cores run that block
//     while the warpgroup stores;
//   - 4 stages of 41.25 KB and one 24 KB staging buffer per consumer (three 64 x 64 TMA store boxes);
//   - with kIssueOrder (op variant "wide_ordered") the two consumer warpgroups issue their blocks in
//     turn, as the wide FP8 GEMM's kIssueOrder (gemm/fp8_gemm_wide_sm90.cuh says why): warpgroup 0
//     issues block k only after warpgroup 1 has issued block k - 1, and warpgroup 1 retires block
//     k - 1 only after warpgroup 0 has come to issue block k (a named barrier before each block but a
//     tile's first). Both warpgroups have rows in every tile (m is a multiple of 128) and walk the
//     same tiles with the same blocks.
// n need not be a multiple of 192 (it is of 128, so n - n0 of an expert's last n-tile is 64 or 128):
// the inputs box's rows past n land as TMA zero fill, only the scales of columns inside n are loaded
// (the stage's others are stale, so the sums of columns past n are garbage, never stored), chain
// loads and stores are masked to n and TMA store boxes past n are skipped.
//
// Arithmetic as Fp8WgradMainloop::kDefault's: per 128-token block four wgmmas into a fresh partial
// (the first with scale_d = 0), then acc = fma(sa[i] * sb[j], partial, acc) with the scale product
// rounded to fp32 first, blocks ascending. An output's wgmma sums are the same at n128 and n192 (its
// row of grad, its row of inputs, the same 32 tokens per instruction), so every element equals the
// 128-wide kernel's (tests/ops/test_gpu_fp8_wgrad.py holds every variant to the default's bits).
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
#include "gemm/fp8_wgrad_sm90.cuh"
#include "gemm/fp8_wide_block_sm90.cuh"
#include "mok_params.h"

namespace mok {

// Fp8WgradTile's roles, rows, token block, scales of grad and registers; its own width, inputs box,
// staging and depth.
struct Fp8WgradWideTile : Fp8WgradTile {
  static constexpr int kN = 192;  // output columns (inputs rows) per tile: one wgmma m64n192
  static constexpr int kAccumulators = 64 * kN / kNumThreadsPerWarpGroup;  // 96: the sums and the partial each
  static constexpr int kGroups = kN / 8;  // 8-column groups of the accumulator fragment
  static constexpr uint32_t kBBytes = kN * kK;
  static constexpr uint32_t kBScaleBytes = kN * sizeof(float);
  static constexpr int kStoreBoxes = kN / ExpertGemmTile::kStoreBox;
  static constexpr uint32_t kStagingBytes = kStoreBoxes * ExpertGemmTile::kStoreBoxBytes;
  static constexpr int kStages = 4;  // 4 x 41.25 KB beside 48 KB of staging in the 227 KB a block may opt into
  static_assert(kABytes % kSwizzleAlign == 0 && kBBytes % kSwizzleAlign == 0 &&
                    kConsumerABytes % kSwizzleAlign == 0 && kStagingBytes % kSwizzleAlign == 0,
                "every operand box, wgmma base and staging buffer starts on a 1024-byte swizzle atom");
  static_assert(kAScaleBytes % 16 == 0 && kBScaleBytes % 16 == 0, "bulk copies of whole 16 bytes");
};

// The dynamic shared memory: Fp8WgradSharedStorageOf's layout, with 24 KB inputs boxes (192 rows),
// 24 KB staging buffers and 768-byte inputs scales (those of columns inside n loaded), 4 stages.
using Fp8WgradWideSharedStorage = Fp8WgradSharedStorageOf<Fp8WgradWideTile>;

// Launched through gemm_kernel_sm90<Fp8ExpertWgradWideKernel<kIssueOrder>, Fp8ExpertWgradMaps,
// Fp8ExpertWgradParams, CUtensorMap, CUtensorMap, CUtensorMap> without clusters, the inputs map in boxes
// of 192 rows. kIssueOrder: the consumers' blocks issued in turn (above); the same bits either way.
template <bool kIssueOrder = false>
struct Fp8ExpertWgradWideKernel {
  using Tile = Fp8WgradWideTile;
  using SharedStorage = Fp8WgradWideSharedStorage;
  using Scheduler = Fp8WgradTileScheduler<Tile::kN>;
  using Maps = Fp8ExpertWgradMaps;
  using Params = Fp8ExpertWgradParams;
  using Accumulators = float[Tile::kAccumulators];

  static __device__ __forceinline__ void run(const Maps& maps, const Params& p, uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    fp8_wgrad_setup<Tile>(maps, p, shared);
    const Scheduler scheduler(p.problem);
    const int warpgroup = warpgroup_index();
    if (warpgroup == 0) {
      sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
      if (threadIdx.x == 32) sm90::watch_waits(shared.watch, Tile::kRoles, p.failure_record, kFp8ExpertWgradKernel);
      if (threadIdx.x == 0) fp8_wgrad_produce<Tile>(maps, p, scheduler, shared);
      return;
    }
    sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
    const int thread = threadIdx.x % kNumThreadsPerWarpGroup;
    consume(maps, p, scheduler, shared, warpgroup - 1, thread);
    // The warpgroup's last rounded tile is read out of its staging buffer before the CTA exits.
    if (thread == 0) sm90::bulk_wait_all();
  }

 private:
  using Fragment = Fp8WgradFragment;

  // acc = the tile's chain_in or 0; columns past n start at 0 (never stored).
  static __device__ __forceinline__ void start_chain(const Params& p, const Fp8WgradTileCoord& c, int64_t offset,
                                                     Accumulators& acc) {
    const int64_t n = p.problem.n;
    const int inside = fp8_wgrad_columns_inside<Tile>(p, c);
    const float* in = p.chain_in + offset;
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; i += 2) {
      float2 v = make_float2(0.f, 0.f);
      if (c.from_chain && 8 * (i / 4) < inside) {
        v = *reinterpret_cast<const float2*>(in + 8 * ((i / 2) % 2) * n + 8 * (i / 4));
      }
      acc[i] = v.x;
      acc[i + 1] = v.y;
    }
  }

  // The tile's sums into chain_out (8-byte stores of the columns inside n), or rounded to bf16 into
  // rounded_out through the warpgroup's staging buffer and a TMA store per 64-column box inside n, at
  // rows expert * m + m0 + 64 * consumer of rounded_out seen as (E * m, n). The buffer is free once
  // the previous tile's stores have read it (thread 0 waits for that before the warpgroup's barrier).
  static __device__ __forceinline__ void store_tile(const Maps& maps, const Params& p, const SharedStorage& shared,
                                                    const Fp8WgradTileCoord& c, int64_t offset, const Accumulators& acc,
                                                    int consumer, int thread) {
    const int64_t n = p.problem.n;
    const int inside = fp8_wgrad_columns_inside<Tile>(p, c);
    if (c.rounded) {
      uint32_t packed[Tile::kAccumulators / 2];
#pragma unroll
      for (int j = 0; j < Tile::kGroups; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
      uint8_t* buffer = shared.staging + consumer * Tile::kStagingBytes;
      if (thread == 0) sm90::bulk_wait_read<0>();
      sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
      stage_columns<Tile::kN>(buffer, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
      sm90::fence_async_shared();
      sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);  // every row staged
      if (thread == 0) {
        const int row = c.expert * p.problem.m + c.m0 + 64 * consumer;
#pragma unroll
        for (int box = 0; box < Tile::kStoreBoxes; ++box) {
          if (box * ExpertGemmTile::kStoreBox < inside) {
            sm90::tma_store_2d(maps.rounded_out, buffer + box * ExpertGemmTile::kStoreBoxBytes,
                               c.n0 + box * ExpertGemmTile::kStoreBox, row);
          }
        }
        sm90::bulk_commit_group();
      }
      return;
    }
    float* out = p.chain_out + offset;
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; i += 2) {
      if (8 * (i / 4) < inside) {
        *reinterpret_cast<float2*>(out + 8 * ((i / 2) % 2) * n + 8 * (i / 4)) = make_float2(acc[i], acc[i + 1]);
      }
    }
  }

  // Per tile of k_blocks blocks: block 0 in flight in the partial (issued before the previous tile's
  // epilogue, or first), then for each block: wait for it, promote it with its stage's scales,
  // release its stage, issue the next. Every tile's sums start from its chain or zero and add its
  // blocks in ascending order. Stage s's descriptors, barrier and scales are stage 0's plus s stages
  // of bytes (registers are the constraint: 96 sums and a 96-register partial of the 232); the
  // bounded waits trap out of line.
  static __device__ __forceinline__ void consume(const Maps& maps, const Params& p, const Scheduler& scheduler,
                                                 const SharedStorage& shared, int consumer, int thread) {
    sm90::WaitWatch* watch = shared.watch;
    const int lane = thread % 32;
    const Fragment f(consumer, thread);
    const uint64_t a_desc0 = sm90::smem_descriptor_sw128(shared.a + consumer * Tile::kConsumerABytes);
    const uint64_t b_desc0 = sm90::smem_descriptor_sw128(shared.b);
    const uint32_t full0 = sm90::smem_u32(shared.full);
    const uint32_t a_scales0 = sm90::smem_u32(shared.a_scales + f.row);
    const uint32_t b_scales0 = sm90::smem_u32(shared.b_scales + f.col);
    int stage = 0;  // of the next block to issue
    uint32_t phase = 0;
    Accumulators acc, partial;  // (the partial is written by each block's first wgmma)
    const auto issue = [&]() { fp8_wide_issue_block<Tile>(partial, full0, a_desc0, b_desc0, stage, phase, watch); };
    // The block in flight (issued last, one stage back): waited for, promoted with its stage's
    // scales, its stage handed back (lane 0 for the warp, once the warp's reads of it are done).
    const auto retire = [&]() {
      sm90::wgmma_wait_group<0>();
      sm90::fence_accumulators(partial);
      const int oldest = stage >= 1 ? stage - 1 : Tile::kStages - 1;
      fp8_wgrad_promote(acc, partial, a_scales0 + oldest * Tile::kAScaleBytes, b_scales0 + oldest * Tile::kBScaleBytes);
      sm90::release_stage_after_shared_reads<1>(&shared.empty[oldest], lane);
    };
    // The CTA's tiles in order. A skipped tile is neither loaded nor stored; a tile without blocks
    // (its sums are its start) is stored on the way with the partial for its sums (no block is in
    // flight then), so the loop below sees only tiles with blocks.
    int64_t tile = scheduler.first_tile();
    const auto next_tile_with_blocks = [&](Fp8WgradTileCoord& c) {
      return fp8_wgrad_next_tile_with_blocks(scheduler, tile, c, [&](const Fp8WgradTileCoord& start) {
        const int64_t offset = fp8_wgrad_tile_offset(p, start, f);
        start_chain(p, start, offset, partial);
        store_tile(maps, p, shared, start, offset, partial, consumer, thread);
      });
    };
    Fp8WgradTileCoord c;
    if (next_tile_with_blocks(c)) {
      // Block 0 of the first tile; every later tile's is issued before the epilogue of the one
      // before (the 128-wide kernel's consume_overlap says why the issue sits where it does).
      issue();
      while (true) {  // c has blocks, and its block 0 is in flight
        const int64_t offset = fp8_wgrad_tile_offset(p, c, f);
        start_chain(p, c, offset, acc);
        // In turn: each warpgroup takes the order's barrier c.k_blocks - 1 times a tile, warpgroup 1
        // after issuing blocks 0 .. k_blocks - 2, warpgroup 0 before issuing blocks 1 .. k_blocks - 1.
#pragma unroll 1
        for (int kb = 1; kb < c.k_blocks; ++kb) {
          if (kIssueOrder && consumer == 1) fp8_wide_take_issue_turn();
          retire();  // block kb - 1
          if (kIssueOrder && consumer == 0) fp8_wide_take_issue_turn();
          issue();   // block kb
        }
        retire();
        const Fp8WgradTileCoord done = c;
        tile += scheduler.tile_step();
        if (!next_tile_with_blocks(c)) {
          store_tile(maps, p, shared, done, offset, acc, consumer, thread);
          break;
        }
        issue();  // the next tile's block 0: the partial is free, every block of this tile retired
        store_tile(maps, p, shared, done, offset, acc, consumer, thread);
      }
    }
    if (thread == 0) sm90::mark_finished(watch);
  }
};

}  // namespace mok
