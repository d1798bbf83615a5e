// The FP8 blockwise grouped GEMM in 128 x 192 tiles (sm_90a; op variant "wide" of ops.fp8_expert_gemm
// and ops.fp8_expert_gemm_push): the product of gemm/fp8_gemm_sm90.cuh's Fp8StoreEpilogue (or its rows
// where Fp8PushEpilogue pushes them), bit for bit, from a kernel shaped the other way round. Where
// that kernel keeps the tensor cores fed by overlapping each warpgroup's promotion with its next K
// block (two partials of 64 columns), this one reads less per FLOP and relies on the two consumer
// warpgroups drifting apart on the shared tensor cores:
//   - one wgmma m64n192k32 per 32 of K: A is read from shared memory once per 192 columns, not once
//     per 128 (the B operand's share per FLOP is the same at any N);
//   - with 2-CTA clusters (vertically adjacent m-tiles of one expert) each CTA loads one 96-row half
//     of the B slice and multicasts it into both: L2 -> SM bytes per FLOP 28 KB / (128 x 192 x 128)
//     against 32 KB / (128 x 128 x 128), 42% fewer;
//   - one fp32 partial per warpgroup (96 registers beside the 96 promoted sums), its K block's four
//     wgmmas waited for, the stage released, then promoted; 4 stages of 40 KB;
//   - with kAcrossTiles (op variant "wide_across_tiles"), the next tile's first K block is issued
//     before a tile's epilogue, as the weight gradient's wide kernel does: the partial is free once
//     the tile's last block is promoted, and the tensor cores run that block while the warpgroup
//     stores or pushes (a tile's epilogue is its warpgroup's alone: per-warpgroup staging and
//     barriers).
//   - with kIssueOrder (op variant "wide_ordered"; with kAcrossTiles too, "wide_ordered_across_tiles"),
//     the two consumer warpgroups issue their K blocks in turn, as cuBLASLt's blockwise kernel orders
//     its own (docs/performance.md): in a tile both have rows of, warpgroup 0 issues block k only
//     after warpgroup 1 has issued block k - 1, and warpgroup 1 retires block k - 1 only after
//     warpgroup 0 has come to issue block k (fp8_wide_take_issue_turn: a 256-thread named barrier
//     before each block but a tile's first). Left to themselves the two wait on the same stage's
//     full barrier, issue together and promote together, the tensor cores idle meanwhile; in turn,
//     one promotes while the other's wgmmas run.
//   - with kStagedScales too (op variant "wide_ordered_staged_scales"), the A scales come with the
//     stage: the producer bulk-copies the tile's 128 rows' scales of the block beside its A and B, and
//     a consumer reads its two rows' from shared memory once the stage has landed. From global
//     memory each block's A scales are fresh cache lines (a K block's scales lie a_rows floats past
//     the previous block's), an L2 round trip a block ahead of its promotion; a stage lands kStages
//     blocks ahead.
//     A warp then hands the stage back itself (its scale reads are the generic proxy's, the next
//     copy into the stage the async proxy's: sm90::release_stage_after_shared_reads).
//   - a cluster tile's m-tile that lies wholly past its segment (2-CTA clusters over an expert with
//     an odd number of m-tiles) loads no A and issues no MMA: its CTA only passes its half of B on.
//     The same for a warpgroup whose 64 rows lie past the segment.
// A tile's 192 columns [n0, n0 + 192) span two 128-row weight scale blocks (n0 is a multiple of 192,
// so n0 % 128 is 0 or 64: the second block starts at tile column 128 or 64); the promotion takes a
// uniform branch per tile between two unrolled forms. N need not be a multiple of 192: in an
// expert's last n-tile the columns past N are computed from the next expert's B rows (or TMA zero
// fill) with the second scale block clamped inside the expert, and not stored (TMA stores of whole
// boxes past N are skipped; N is a multiple of 128, so a box is wholly inside or wholly past it).
//
// Arithmetic as Fp8Mainloop::kDefault's: per K block four wgmmas into a fresh partial (the first
// with scale_d = 0), then acc = fmaf(scale_a[row] * scale_b[block], partial, acc) in ascending K
// blocks. Each output's wgmma sums are the same at n128 and n192 (its row of A, its column of B, the
// same 32 of K per instruction), so the output equals the 128-wide kernel's bit for bit
// (tests/ops/test_gpu_fp8_gemm.py holds every variant to the default's).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "common/failure_codes.h"
#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/pipeline_sm90.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_fp8_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/fp8_gemm_sm90.cuh"
#include "gemm/fp8_wide_block_sm90.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// Fp8GemmTile's roles, rows, K block, registers and A operand; its own width, B, staging and depth.
struct Fp8WideGemmTile : Fp8GemmTile {
  static constexpr int kN = 192;  // output columns (B rows) per tile: one wgmma m64n192
  static constexpr int kAccumulators = 64 * kN / kNumThreadsPerWarpGroup;  // 96: the sum and the partial each
  static constexpr int kGroups = kN / 8;  // 8-column groups of the accumulator fragment
  static constexpr uint32_t kBBytes = kN * kK;
  static constexpr int kBPartRows = kN / 2;  // one TMA box of B: a CTA's share with 2-CTA clusters
  static constexpr uint32_t kBPartBytes = kBPartRows * kK;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  // One staging buffer per consumer: its 64 rows x 192 bf16 columns, three 64 x 64 TMA store boxes.
  static constexpr int kStoreBoxes = kN / ExpertGemmTile::kStoreBox;
  static constexpr int kStagingBuffers = 1;
  static constexpr uint32_t kStagingBytes = kStoreBoxes * ExpertGemmTile::kStoreBoxBytes;
  static constexpr int kStages = 4;  // 4 x 40 KB beside 48 KB of staging in the 227 KB an sm90 block may opt into
  // A stage's A scales (kStagedScales): the tile's 128 rows' from the 16-byte aligned row at or below
  // row0 (a bulk copy's source and size are whole 16 bytes; a_rows is a multiple of 4), so row0 % 4
  // rows before row0 and, where that is not 0, 4 - row0 % 4 past the tile's last: 132 at most.
  static constexpr int kAScaleRows = kM + 4;
  static constexpr uint32_t kAScaleBytes = kAScaleRows * sizeof(float);
  static_assert(kABytes % kSwizzleAlign == 0 && kBPartBytes % kSwizzleAlign == 0 &&
                    kConsumerABytes % kSwizzleAlign == 0 && kStagingBytes % kSwizzleAlign == 0,
                "every operand box, wgmma base and staging buffer starts on a 1024-byte swizzle atom");
  static_assert(kAScaleBytes % 16 == 0, "a bulk copy's destination and size are whole 16 bytes");
};

// The dynamic shared memory, from a 1024-byte aligned base, S = kStages:
//   a        S * kABytes (16 KB)       the stages' A tiles
//   b        S * kBBytes (24 KB)       the stages' B tiles (two 96-row boxes each)
//   staging  2 * kStagingBytes (24 KB) each consumer warpgroup's staging buffer
//   full, empty  S * 8 each            the stage barriers
//   watch    the bounded waits' watch (WaitWatch)
//   a_scales S * kAScaleBytes (528 B)  the stages' A scales (kStagedScales; unused otherwise), from
//            the next 16-byte boundary (last, so the other variants' layout is the one without it)
struct Fp8WideGemmSharedStorage {
  using Tile = Fp8WideGemmTile;
  static constexpr size_t kBarrierBytes = 2 * Tile::kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch);
  static constexpr size_t kAScalesOffset = (kBarrierBytes + 15) / 16 * 16;  // from the barriers
  static constexpr size_t kBytes = size_t(Tile::kStages) * Tile::kStageBytes + 2 * Tile::kStagingBytes +
                                   kAScalesOffset + size_t(Tile::kStages) * Tile::kAScaleBytes;
  static constexpr size_t kSmemBytes = Tile::kSwizzleAlign + kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm90 block may opt into");

  __device__ explicit Fp8WideGemmSharedStorage(uint8_t* smem_raw)
      : a(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) &
                                     ~uintptr_t(Tile::kSwizzleAlign - 1))),
        b(a + Tile::kStages * Tile::kABytes),
        staging(b + Tile::kStages * Tile::kBBytes),
        full(reinterpret_cast<uint64_t*>(staging + 2 * Tile::kStagingBytes)),
        empty(full + Tile::kStages),
        watch(reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages)),
        a_scales(reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(full) + kAScalesOffset)) {}

  uint8_t* a;
  uint8_t* b;
  uint8_t* staging;
  uint64_t* full;
  uint64_t* empty;
  sm90::WaitWatch* watch;
  float* a_scales;
};

// kClusterM: 1, or 2 CTAs sharing each B slice through TMA multicast. Epilogue: Fp8StoreEpilogue (the
// rows stored through TMA) or Fp8PushEpilogue (pushed into the sources' combine regions); only its
// Maps, Params and tensor-map prefetch are taken, the 192-column forms are this kernel's (store, push).
// kAcrossTiles: the next tile's block 0 issued before a tile's epilogue (above); kIssueOrder: the
// consumers' blocks issued in turn (above), either way (a tile's first block is issued without a
// turn, so the turns never span a tile's end); kStagedScales: the A scales through the stages (above).
// The same bits in every form.
// Launched through gemm_kernel_sm90<Fp8ExpertGemmWideKernel<kClusterM, Epilogue, kAcrossTiles, kIssueOrder, kStagedScales>,
// Maps, Params, CUtensorMap...> (A in boxes of 128 rows, B in boxes of 96 rows, then the store's out
// in 64 x 64 boxes) with a cluster dimension of kClusterM.
template <int kClusterM, class Epilogue = Fp8StoreEpilogue, bool kAcrossTiles = false, bool kIssueOrder = false,
          bool kStagedScales = false>
struct Fp8ExpertGemmWideKernel {
  using Tile = Fp8WideGemmTile;
  using SharedStorage = Fp8WideGemmSharedStorage;
  using Scheduler = ExpertTileScheduler<kClusterM, Tile::kN>;
  using Maps = Fp8ExpertGemmMaps<typename Epilogue::Maps>;
  using Params = Fp8ExpertGemmParams<typename Epilogue::Params>;
  static constexpr bool kPush = std::is_same_v<Epilogue, Fp8PushEpilogue>;
  static_assert(kPush || std::is_same_v<Epilogue, Fp8StoreEpilogue>, "the store or the push epilogue");
  static_assert(kClusterM == 1 || kClusterM == 2, "clusters of 1 or 2 CTAs");
  // Each consumer warpgroup of the cluster hands a stage back (thread 0 for it); with kStagedScales
  // each consumer warp (lane 0 for it, after the warp's scale reads: sm90::release_stage_after_shared_reads).
  static constexpr uint32_t kReleasesPerWarpGroup = kStagedScales ? kNumThreadsPerWarpGroup / 32 : 1;
  static constexpr uint32_t kEmptyArrivals = 2 * kReleasesPerWarpGroup * kClusterM;

  static __device__ __forceinline__ void run(const Maps& maps, const Params& p, uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    if (threadIdx.x == 0) {
      sm90::init_stage_barriers<Tile::kStages>(shared.full, shared.empty, kEmptyArrivals);
      shared.watch->failed = 0;
      shared.watch->finished = 0;
    }
    if (threadIdx.x == 32) {
      sm90::prefetch_tensor_map(maps.a);
      sm90::prefetch_tensor_map(maps.b);
      Epilogue::prefetch_tensor_maps(maps.epilogue);
    }
    // Every CTA's barriers exist before a peer multicasts into or arrives on them.
    sm90::cluster_sync();
    // Each role builds its own scheduler: nothing computed before the register split stays live
    // across it (the consumers need every register of their budget).
    const int warpgroup = warpgroup_index();
    if (warpgroup == 0) {
      sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
      if (threadIdx.x == 32) sm90::watch_waits(shared.watch, Tile::kRoles, p.failure_record, kFp8ExpertGemmKernel);
      if (threadIdx.x == 0) {
        Scheduler scheduler(p.problem);
        produce(maps, p, scheduler, shared);
      }
      return;
    }
    sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
    Scheduler scheduler(p.problem);
    consume(maps, p, scheduler, shared, warpgroup - 1, threadIdx.x % kNumThreadsPerWarpGroup);
  }

 private:
  // Thread 0 of the producer warpgroup: per tile and K block, a free stage, then the tile's A rows
  // (none for an m-tile wholly past its segment; with kStagedScales their scales too) and its B
  // slice, whole (cluster 1) or this CTA's half multicast into both CTAs (cluster 2), onto the
  // stage's full barrier.
  static __device__ __forceinline__ void produce(const Maps& maps, const Params& p, Scheduler& scheduler,
                                                 const SharedStorage& shared) {
    sm90::WaitWatch* watch = shared.watch;
    const int cta_rank = scheduler.cta_rank();
    const int k_blocks = p.problem.k / Tile::kK;
    TileCoord c;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      const bool load_a = c.rows > 0;
      const int b_row0 = c.expert * p.problem.n_weight_rows + c.n0;
      const StagedScaleRows scale_rows(p, c);
      const uint32_t a_bytes = load_a ? Tile::kABytes + (kStagedScales ? scale_rows.bytes : 0u) : 0u;
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
        // The whole B slice lands in every CTA of the cluster (its own half and the peer's multicast).
        sm90::mbarrier_arrive_expect_tx(&shared.full[stage], a_bytes + Tile::kBBytes);
        uint8_t* b = shared.b + stage * Tile::kBBytes;
        if (load_a) {
          sm90::tma_load_2d(shared.a + stage * Tile::kABytes, maps.a, &shared.full[stage], kb * Tile::kK, c.row0);
          if constexpr (kStagedScales) {
            sm90::bulk_load(shared.a_scales + stage * Tile::kAScaleRows,
                            p.scales.a + (int64_t(kb) * p.scales.a_rows + scale_rows.first), scale_rows.bytes,
                            &shared.full[stage]);
          }
        }
        if constexpr (kClusterM == 1) {
          sm90::tma_load_2d(b, maps.b, &shared.full[stage], kb * Tile::kK, b_row0);
          sm90::tma_load_2d(b + Tile::kBPartBytes, maps.b, &shared.full[stage], kb * Tile::kK,
                            b_row0 + Tile::kBPartRows);
        } else {
          sm90::tma_load_2d_multicast(b + cta_rank * Tile::kBPartBytes, maps.b, &shared.full[stage], kb * Tile::kK,
                                      b_row0 + cta_rank * Tile::kBPartRows, (1u << kClusterM) - 1);
        }
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    sm90::wait_all_stages_released<Tile::kStages>(shared.empty, stage, phase, watch);
    sm90::mark_finished(watch);
  }

  // A tile's scales (the thread's two rows' A scales and the tile's two weight scale blocks), read
  // from the params (constant memory) by 32-bit indices: block kb's raw scales are loaded a block
  // ahead of their use, and multiplied into the promotion's four products. With kStagedScales the A
  // scales are read from the block's stage instead, once it has landed.
  struct TileScales {
    int rows[2];  // rows of the (K / 128, a_rows) A scales, clamped inside the schedule
    int b_block0, b_block1;
    bool second_block_at_128;  // the tile's second weight scale block starts at tile column 128 (else 64)
    uint32_t staged_row;  // kStagedScales: the thread's first row's A scale in stage 0's (shared address)

    __device__ __forceinline__ TileScales(const Params& p, const TileCoord& c, int fragment_row,
                                          uint32_t staged_scales0) {
      staged_row = staged_scales0 + (fragment_row + (c.row0 - StagedScaleRows(p, c).first)) * sizeof(float);
      // A row past the schedule is computed and not stored; the clamp keeps its scale read inside
      // the scales' rows.
      const int row = c.row0 + fragment_row;
      const int last_row = p.problem.num_rows - 1;
      rows[0] = min(row, last_row);
      rows[1] = min(row + 8, last_row);
      // Rows of the (experts * N / 128, K / 128) weight scales, the second clamped inside the
      // expert (its columns past N are not stored).
      const int expert_row0 = c.expert * p.problem.n_weight_rows;
      b_block0 = (expert_row0 + c.n0) / kFp8Block;
      b_block1 = min(b_block0 + 1, (expert_row0 + p.problem.n_weight_rows) / kFp8Block - 1);
      second_block_at_128 = c.n0 % kFp8Block == 0;
    }

    // to: block kb's raw scales, A of the two rows (not with kStagedScales) then B of the two blocks.
    __device__ __forceinline__ void load(const Params& p, int kb, int k_blocks, float (&to)[4]) const {
      if constexpr (!kStagedScales) {
#pragma unroll
        for (int h = 0; h < 2; ++h) to[h] = __ldg(p.scales.a + (int64_t(kb) * p.scales.a_rows + rows[h]));
      }
      to[2] = __ldg(p.scales.b + (int64_t(b_block0) * k_blocks + kb));
      to[3] = __ldg(p.scales.b + (int64_t(b_block1) * k_blocks + kb));
    }

    // to[0], to[1]: the two rows' A scales of the block in stage `stage` (kStagedScales; landed, and
    // not yet handed back).
    __device__ __forceinline__ void read_staged(int stage, float (&to)[4]) const {
      const uint32_t row = staged_row + stage * Tile::kAScaleBytes;
      to[0] = sm90::ld_shared_f32(row);
      to[1] = sm90::ld_shared_f32(row + 8 * sizeof(float));
    }
  };

  // kStagedScales: the rows of the (K / 128, a_rows) A scales a stage holds for tile c, `bytes` of
  // them from row `first` (row0 rounded down to a multiple of 4) to the tile's end or a_rows, rounded
  // up to a multiple of 4 (at most a_rows, itself one): a bulk copy's source and size are whole 16
  // bytes. Row r of the tile is the stage's r + row0 - first. Rows of the tile past a_rows (computed
  // and not stored) read what the buffer held before. Used for tiles with rows only (row0 < a_rows).
  struct StagedScaleRows {
    int first;
    uint32_t bytes;

    __device__ __forceinline__ StagedScaleRows(const Params& p, const TileCoord& c) : first(c.row0 & ~3) {
      const int end = (min(c.row0 + Tile::kM, p.scales.a_rows) + 3) & ~3;
      bytes = uint32_t(max(end - first, 0)) * sizeof(float);
    }
  };

  // scale[h][block]: row half h (the thread's two rows), weight scale block of the columns.
  static __device__ __forceinline__ void scale_products(const float (&s)[4], float (&scale)[2][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int block = 0; block < 2; ++block) scale[h][block] = s[h] * s[2 + block];
    }
  }

  // Consumer warpgroup `consumer` (rows 64 * consumer .. + 63 of each tile), thread `thread` of it.
  // Per tile with rows of this warpgroup: block 0 issued (before the previous tile's epilogue with
  // kAcrossTiles, after it without), then per block: wait for its wgmmas, release its stage,
  // promote it, issue the next (with kIssueOrder, in turn with the other warpgroup: the K loop
  // below says how). Registers are the constraint (96 promoted sums and a 96-register
  // partial of the 232): as in the overlap mainloop, the scales are addressed from the params by
  // 32-bit indices, the stage's descriptors and barrier are stage 0's plus an offset, and the
  // bounded waits trap out of line.
  static __device__ __forceinline__ void consume(const Maps& maps, const Params& p, Scheduler& scheduler,
                                                 const SharedStorage& shared, int consumer, int thread) {
    sm90::WaitWatch* watch = shared.watch;
    const int k_blocks = p.problem.k / Tile::kK;
    const int fragment_row = 64 * consumer + 16 * (thread / 32) + (thread % 32) / 4;
    const OutputExtent out_extent = scheduler.output_extent();
    const uint64_t a_desc0 = sm90::smem_descriptor_sw128(shared.a + consumer * Tile::kConsumerABytes);
    const uint64_t b_desc0 = sm90::smem_descriptor_sw128(shared.b);
    const uint32_t full0 = sm90::smem_u32(shared.full);
    int stage = 0;  // of the next block to issue (or stage to pass on)
    uint32_t phase = 0;
    float acc[Tile::kAccumulators];
    float partial[Tile::kAccumulators];  // (written by each block's first wgmma)
    const uint32_t staged_scales0 = sm90::smem_u32(shared.a_scales);
    const auto issue = [&]() { fp8_wide_issue_block<Tile>(partial, full0, a_desc0, b_desc0, stage, phase, watch); };
    // The stage of the block issued last (stage has moved on to the next).
    const auto issued_stage = [&]() { return stage >= 1 ? stage - 1 : Tile::kStages - 1; };
    // Stage `s` handed back by this warpgroup: by thread 0 once the MMAs have read it, or with
    // kStagedScales by each warp once its lanes' scale reads of it are done too.
    const auto hand_back = [&](int s) {
      if constexpr (kStagedScales) {
        sm90::release_stage_after_shared_reads<kClusterM>(&shared.empty[s], thread % 32);
      } else if (thread == 0) {
        sm90::release_stage<kClusterM>(&shared.empty[s]);
      }
    };
    // The block in flight (issued last, one stage back): waited for, its stage handed back (the MMAs
    // have read it), then promoted with its scale products.
    const auto retire = [&](const TileScales& tile_scales, const float (&scale)[2][2]) {
      sm90::wgmma_wait_group<0>();
      sm90::fence_accumulators(partial);
      hand_back(issued_stage());
      if (tile_scales.second_block_at_128) {
        promote<Tile::kGroups * 2 / 3>(acc, partial, scale);
      } else {
        promote<Tile::kGroups / 3>(acc, partial, scale);
      }
    };
    // From tile `tile` on, the next tile with rows of this warpgroup, into c. The tiles passed over
    // have none of this warpgroup's rows: each of their stages is handed back once it landed (the
    // producer may refill a stage only after its loads completed). Called with no block in flight,
    // so the stages passed on are never the one a block in flight reads.
    int64_t tile = scheduler.first_tile();
    const auto next_tile_with_rows = [&](TileCoord& c) {
      for (; scheduler.at(tile, c); tile += scheduler.tile_step()) {
        if (c.rows > 64 * consumer) return true;
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb) {
          sm90::mbarrier_wait<true>(full0 + 8 * stage, phase, kWaitLoadedStage, watch);
          hand_back(stage);
          sm90::advance_stage<Tile::kStages>(stage, phase);
        }
      }
      return false;
    };
    const auto epilogue = [&](const TileCoord& done) {
      uint8_t* staging = shared.staging + consumer * Tile::kStagingBytes;
      if constexpr (kPush) {
        push(p.epilogue, out_extent, acc, done, staging, consumer, thread);
      } else {
        store(maps, p, out_extent, acc, done, staging, consumer, thread);
      }
    };
    // kStagedScales: the products of the block issued last, its A scales read from its stage (landed:
    // the issue waited for it) while its MMAs run, its B scales in s since a block before.
    const auto issued_block_products = [&](const TileScales& tile_scales, float (&s)[4], float (&scale)[2][2]) {
      tile_scales.read_staged(issued_stage(), s);
      scale_products(s, scale);
    };
    TileCoord c;
    if (next_tile_with_rows(c)) {
      TileScales tile_scales(p, c, fragment_row, staged_scales0);
      // Raw scales of the block after the one issued last (its products formed before its issue);
      // with kStagedScales its B scales only, and its A scales once it has been issued.
      float s[4];
      // Tile c's start: its scales, block 0's raw scales loaded, block 0 issued.
      const auto start_tile = [&]() {
        tile_scales = TileScales(p, c, fragment_row, staged_scales0);
        tile_scales.load(p, 0, k_blocks, s);
        issue();
      };
      start_tile();  // the first tile's
      while (true) {  // c has rows of this warpgroup, its block 0 is in flight and s holds its raw scales
        float scale[2][2];
        if constexpr (kStagedScales) {
          issued_block_products(tile_scales, s, scale);
        } else {
          scale_products(s, scale);
        }
        if (k_blocks > 1) tile_scales.load(p, 1, k_blocks, s);  // in flight during block 0's MMAs
#pragma unroll
        for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = 0.f;
        // Both warpgroups take the order's barrier k_blocks - 1 times in a tile with rows of both
        // (c.rows > 64, the same c for both), warpgroup 1 after issuing blocks 0 .. k_blocks - 2 and
        // warpgroup 0 before issuing blocks 1 .. k_blocks - 1; in a tile of warpgroup 0 alone neither.
        const bool in_turn = kIssueOrder && c.rows > 64;
#pragma unroll 1
        for (int kb = 1; kb < k_blocks; ++kb) {
          if (in_turn && consumer == 1) fp8_wide_take_issue_turn();
          retire(tile_scales, scale);  // block kb - 1
          if constexpr (!kStagedScales) {
            scale_products(s, scale);
            if (kb + 1 < k_blocks) tile_scales.load(p, kb + 1, k_blocks, s);
          }
          if (in_turn && consumer == 0) fp8_wide_take_issue_turn();
          issue();  // block kb
          if constexpr (kStagedScales) {
            issued_block_products(tile_scales, s, scale);
            if (kb + 1 < k_blocks) tile_scales.load(p, kb + 1, k_blocks, s);
          }
        }
        retire(tile_scales, scale);
        const TileCoord done = c;
        tile += scheduler.tile_step();
        if constexpr (kAcrossTiles) {
          // The partial is free (every block of the tile retired): the next tile's block 0 runs on
          // the tensor cores while this warpgroup stores. The epilogue sits on both paths, each with
          // its own copy: ptxas then knows on each whether a wgmma is in flight (one copy where the
          // paths meet would make it wait for the wgmma before the epilogue).
          if (!next_tile_with_rows(c)) {
            epilogue(done);
            break;
          }
          start_tile();
          epilogue(done);
        } else {
          epilogue(done);
          if (!next_tile_with_rows(c)) break;
          start_tile();
        }
      }
    }
    if (thread == 0) {
      sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
      sm90::mark_finished(watch);
    }
  }

  // acc += scale[h][block] * partial: kFirstGroups 8-column groups in the first weight scale block,
  // the rest in the second. i = 4 * j + 2 * h + c: column group j, row half h.
  template <int kFirstGroups>
  static __device__ __forceinline__ void promote(float (&acc)[Tile::kAccumulators],
                                                 const float (&partial)[Tile::kAccumulators],
                                                 const float (&scale)[2][2]) {
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; ++i) {
      acc[i] = fmaf(scale[(i / 2) % 2][i / 4 < kFirstGroups ? 0 : 1], partial[i], acc[i]);
    }
  }

  // The accumulators rounded once to bf16 pairs, as Fp8OnePassColumns::pack rounds 128 columns:
  // packed[2 * j + h] holds columns 8 * j + 2 * (lane % 4) + {0, 1} of row half h.
  static __device__ __forceinline__ void pack(const float (&acc)[Tile::kAccumulators],
                                              uint32_t (&packed)[Tile::kAccumulators / 2]) {
#pragma unroll
    for (int j = 0; j < Tile::kGroups; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }

  // Fp8PushEpilogue's rows over 192 columns: the warpgroup's 64 rows staged as store() stages them
  // (three 64 x 64 boxes), then copied out in 16-byte chunks to each row's route in its source's
  // combine region (push_owned_route, push_owned_address): boxes 0 and 1 as Fp8PushEpilogue copies
  // its two (thread t: chunk t % 16 of rows t / 16 + 8 i, i < 8), box 2 eight chunks a row (thread t:
  // chunk t % 8 of the warp's row q = 4 i + lane / 8, i < 4, owned by lane q). Boxes past N are not
  // copied (N is a multiple of 128 and n0 of 192, so a box lies wholly inside or wholly past N).
  static __device__ __forceinline__ void push(const Fp8PushEpilogueParams& e, const OutputExtent& out_extent,
                                              const float (&acc)[Tile::kAccumulators], const TileCoord& c,
                                              uint8_t* staging, int consumer, int thread) {
    uint32_t packed[Tile::kAccumulators / 2];
    pack(acc, packed);
    const int warp = thread / 32, lane = thread % 32;
    const int64_t group_route = lane < 16 ? push_owned_route(e, out_extent, c, consumer, warp, lane) : -1;
    // The buffer is free once every thread of the warpgroup has copied the previous tile's rows out.
    sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
    stage_columns<Tile::kN>(staging, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
    sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);  // every row staged
    const uint64_t owned = push_owned_address(e, group_route, out_extent.n_out, c.n0);
    const int chunk = lane % 16;
    const uint8_t* box = staging + (chunk / 8) * ExpertGemmTile::kStoreBoxBytes;
    const bool chunk_inside = c.n0 + 8 * chunk < out_extent.n_out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint64_t destination = push_owner_address(owned, lane / 16 + 2 * i);
      if (destination == 0 || !chunk_inside) continue;
      *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(destination) + 8 * chunk) =
          staged_chunk(box, thread / 16 + 8 * i, chunk % 8);
    }
    if (c.n0 + 2 * ExpertGemmTile::kStoreBox >= out_extent.n_out) return;  // box 2 past N (uniform)
    const uint8_t* last_box = staging + 2 * ExpertGemmTile::kStoreBoxBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = 4 * i + lane / 8;  // the warp's row, owned by lane q
      const uint64_t destination = push_owner_address(owned, q);
      if (destination == 0) continue;
      *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(destination) + 2 * ExpertGemmTile::kStoreBox +
                                8 * (lane % 8)) = staged_chunk(last_box, 2 * warp + q % 2 + 8 * (q / 2), lane % 8);
    }
  }

  // Fp8StoreEpilogue's rounding and layout over 192 columns: through the warpgroup's staging buffer
  // and up to three TMA stores (boxes past N skipped) when its 64 rows lie inside the segment, else
  // from registers with row and column masks.
  static __device__ __forceinline__ void store(const Maps& maps, const Params& p, const OutputExtent& out_extent,
                                               const float (&acc)[Tile::kAccumulators], const TileCoord& c,
                                               uint8_t* staging, int consumer, int thread) {
    uint32_t packed[Tile::kAccumulators / 2];
    pack(acc, packed);
    const auto pair = [&](int j, int h) { return packed[2 * j + h]; };
    if (c.rows >= 64 * (consumer + 1)) {
      // The buffer is free once the previous tile's stores have read it.
      if (thread == 0) sm90::bulk_wait_read<0>();
      sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
      stage_columns<Tile::kN>(staging, thread, 0, pair);
      sm90::fence_async_shared();
      sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
      if (thread == 0) {
#pragma unroll
        for (int box = 0; box < Tile::kStoreBoxes; ++box) {
          const int col = c.n0 + box * ExpertGemmTile::kStoreBox;
          if (col < out_extent.n_out) {
            sm90::tma_store_2d(maps.epilogue.out, staging + box * ExpertGemmTile::kStoreBoxBytes, col,
                               c.row0 + 64 * consumer);
          }
        }
        sm90::bulk_commit_group();
      }
    } else {
      write_columns_direct<Tile::kN>(static_cast<__nv_bfloat16*>(p.epilogue.out), out_extent.n_out, c, out_extent,
                                     consumer, thread, 0, c.n0, pair);
    }
  }
};

}  // namespace mok
