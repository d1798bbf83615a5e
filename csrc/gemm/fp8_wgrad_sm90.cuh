// The FP8 blockwise weight gradient of the expert projections (sm_90a; docs/design.md §12.3), tokens
// as the reduction dimension, k-grouped by expert segment:
//   out[e] (m, n) = (accumulate ? out[e] : 0) + sum over the 128-row blocks b of e's rows, ascending,
//                   of grad_scales[b, i] * inputs_scales[b, j] * P_b[i, j],
//   P_b[i, j]     = sum over the 128 rows r of block b of grad[i, r] * inputs[j, r]  (E4M3, exact products)
// Both operands are column-wise (quantization.quantize_columnwise: the matrix transposed, tokens
// contiguous, one fp32 scale per column and 128-token block), which is K-major for this GEMM: what
// sm90's FP8 wgmma reads. d fc1 = (d gate_up column-wise, x rows column-wise); d fc2 = (w dY
// column-wise, act column-wise). mok_params.h Fp8ExpertWgradProblem has the window and the offsets.
//
// Persistent and warp-specialized like gemm/fp8_gemm_sm90.cuh (one CTA per SM, 384 threads), 128 x
// 128 output tiles:
//   warpgroup 0, producer: thread 0 walks the CTA's tiles (Fp8WgradTileScheduler) and per 128-token
//     block of the tile's segment waits for a free stage and loads it, all onto the stage's `full`
//     barrier: by TMA the 128 x 128-byte grad and inputs boxes (128-byte swizzle), and by bulk copy
//     the block's 128 grad scales and 128 inputs scales (contiguous in the column-wise scale
//     layout). A tile whose segment starts off a 128-row block is a failed check: the producer loads
//     nothing of it and the watchdog traps, naming it. Thread 32 is the watchdog.
//   warpgroups 1 and 2, consumers, 64 output rows each: per block four wgmma m64n128k32 E4M3 into a
//     fresh fp32 partial (the first with scale_d = 0, so a partial never spans two token blocks),
//     wait, and promote: acc = fma(sa[i] * sb[j], partial, acc), the scale product rounded to fp32
//     first, blocks ascending (bitwise reproducible), the scales read from the stage's shared
//     memory; each warp releases the stage once the MMAs and its reads are done. The mainloop
//     variants (Fp8WgradMainloop) differ in what overlaps the promotion.
//   With accumulate, acc starts as the tile's out (loaded before its first block, prefetched into L2
//   by the producer when it starts the tile) instead of zero:
//   a sequence of windows continues each expert's chain exactly where the previous window stored it,
//   so windows give out bitwise equal to one pass over all their rows. A tile whose expert has no
//   block in the window stores zeros, or (accumulate) is skipped. out is written from registers with
//   8-byte stores (a quad's four lanes cover one 32-byte sector of a row). With rounded_out, the sums
//   are rounded to bf16 there instead (out is then only read, with accumulate; a tile without blocks
//   stores its start rounded): one window, or a sequence's last, writes the bf16 gradient with no
//   fp32 copy of it, bitwise the fp32 result converted.
//   The windowed form decides per expert instead (mok_params.h Fp8ExpertWgradProblem::windowed): a
//   chain starts from the carry only for the expert whose segment began before the window, ends
//   rounded in the window that holds its segment's end, and is carried on only for the expert whose
//   segment goes on past the window; experts without rows in the window are not touched. So each
//   expert's sums are rounded once, by the window that ends its chain, no tile is read or written
//   by windows it has no rows in, and the fp32 state between windows is one (m, n) carry, not a total
//   of every expert; the rounded result is bitwise one pass's.
//   The rounded tile goes through the consumer warpgroup's staging buffer (stmatrix, 128-byte
//   swizzle) and two TMA stores, which run in the background while the warpgroup starts its next
//   tile; from registers, a quad's bf16 pairs would cover half a sector each and the tensor cores
//   would wait for the stores' issue.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

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
#include "gemm/fp8_gemm_sm90.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

// The FP8 GEMM's tile (gemm/fp8_gemm_sm90.cuh: 128 x 128 outputs, two consumer warpgroups of 64 rows,
// one 128-deep scale block per stage, wgmma m64n128k32 into 64 fp32 registers per thread), with the
// stage's scales in shared memory and no staging buffers. The promoted sums and the block's partial
// (64 registers each) live through the K loop: 128 of the 168 registers ptxas allocates per thread at
// 384 threads, whatever setmaxnreg hands the warpgroup at run time (a 128 x 256 tile would need 192
// and spill).
struct Fp8WgradTile : Fp8GemmTile {
  static_assert(kM == 128 && kN == 128 && kK == kFp8Block, "128 x 128 tiles, one scale block (128 tokens) per stage");
  static constexpr uint32_t kAScaleBytes = kM * sizeof(float);
  static constexpr uint32_t kBScaleBytes = kN * sizeof(float);
  static constexpr uint32_t kStageBytes = kABytes + kBBytes + kAScaleBytes + kBScaleBytes;
  // One staging buffer per consumer warpgroup (its 64 x 128 bf16 share of a rounded tile): the TMA
  // stores that read it were committed a whole tile earlier, so a second buffer would not be waited
  // for less.
  static constexpr uint32_t kStagingBytes = ExpertGemmTile::kStagingBytes;
  static_assert(kStagingBytes == 64 * kN * 2, "a staging buffer holds a consumer's 64 x kN bf16 outputs");
  // As many stages as fit beside the staging buffers in the 227 KB an sm90 block may opt into:
  // 5 x 33 KB + 2 x 16 KB.
  static constexpr int kStages = 5;
  // Each consumer warp releases a stage on its own (after its own scale reads).
  static constexpr uint32_t kEmptyArrivals = kConsumerThreads / 32;
};

// The dynamic shared memory of a weight-gradient kernel whose tile is TileT, carved from a 1024-byte
// aligned base (128-byte swizzled TMA boxes), in bytes, S = kStages (Fp8WgradTile's sizes in
// brackets):
//   a         S * kABytes (16 KB)          the stages' grad boxes: kM rows x 128 tokens
//   b         S * kBBytes (16 KB)          the stages' inputs boxes: kN rows x 128 tokens
//   staging   2 * kStagingBytes (16 KB)    each consumer warpgroup's staging buffer (rounded_out)
//   a_scales  S * kAScaleBytes (512)       the stages' grad scales: kM floats
//   b_scales  S * kBScaleBytes (512)       the stages' inputs scales: kN floats
//   full      S * 8                        a stage's loads landed (mbarriers)
//   empty     S * 8                        every consumer warp released a stage
//   watch     8                            the bounded waits' watch (WaitWatch)
template <class TileT>
struct Fp8WgradSharedStorageOf {
  using Tile = TileT;
  static constexpr size_t kBytes =
      size_t(Tile::kStages) * (Tile::kABytes + Tile::kBBytes + Tile::kAScaleBytes + Tile::kBScaleBytes) +
      2 * Tile::kStagingBytes + 2 * Tile::kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch);
  static constexpr size_t kSmemBytes = Tile::kSwizzleAlign + kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm90 block may opt into");
  static_assert(Tile::kABytes % Tile::kSwizzleAlign == 0 && Tile::kBBytes % Tile::kSwizzleAlign == 0 &&
                    Tile::kStagingBytes % Tile::kSwizzleAlign == 0,
                "every stage's operand boxes and every staging buffer start on a 1024-byte swizzle atom");
  static_assert(Tile::kAScaleBytes % 16 == 0 && Tile::kBScaleBytes % 16 == 0, "bulk copies of whole 16 bytes");

  __device__ explicit Fp8WgradSharedStorageOf(uint8_t* smem_raw)
      : a(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) &
                                     ~uintptr_t(Tile::kSwizzleAlign - 1))),
        b(a + Tile::kStages * Tile::kABytes),
        staging(b + Tile::kStages * Tile::kBBytes),
        a_scales(reinterpret_cast<float*>(staging + 2 * Tile::kStagingBytes)),
        b_scales(a_scales + Tile::kStages * Tile::kM),
        full(reinterpret_cast<uint64_t*>(b_scales + Tile::kStages * Tile::kN)),
        empty(full + Tile::kStages),
        watch(reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages)) {}

  uint8_t* a;
  uint8_t* b;
  uint8_t* staging;
  float* a_scales;
  float* b_scales;
  uint64_t* full;
  uint64_t* empty;
  sm90::WaitWatch* watch;
};
using Fp8WgradSharedStorage = Fp8WgradSharedStorageOf<Fp8WgradTile>;

// A tile: output rows [m0, m0 + kM) and columns [n0, n0 + kN) of expert `expert`, and the
// expert's rows inside the window (relative to its first row).
struct Fp8WgradTileCoord {
  int expert, m0, n0;
  int row_begin;    // the expert's first row in the window
  int k_blocks;     // its 128-row blocks in the window (the last may end in padding rows)
  bool aligned;     // row_begin is a multiple of 128, or the expert has no row here
  bool skip;        // nothing to do: its chain neither starts, continues nor ends here
  bool from_chain;  // the chain continues from chain_in (else it starts from zero)
  bool rounded;     // the sums end rounded in rounded_out (else stored into chain_out)
};

// The tiles, expert-major, then n-tiles, m fastest (the CTAs working at once share the expert's
// operands in L2); CTA c takes tiles c, c + grid, ... The tile count does not depend on the routing:
// a tile of an expert with no rows in the window stores zeros or its start, or is skipped. kTileN:
// the tile's columns (128, or 192 for gemm/fp8_wgrad_wide_sm90.cuh, whose last n-tile may reach past n).
template <int kTileN>
class Fp8WgradTileScheduler {
 public:
  using Tile = Fp8WgradTile;

  __device__ explicit Fp8WgradTileScheduler(const Fp8ExpertWgradProblem& problem)
      : p_(problem), m_tiles_(problem.m / Tile::kM), per_expert_(m_tiles_ * ((problem.n + kTileN - 1) / kTileN)) {}

  __device__ unsigned first_tile() const { return blockIdx.x; }
  __device__ unsigned tile_step() const { return gridDim.x; }

  __device__ bool at(int64_t tile, Fp8WgradTileCoord& c) const {
    if (tile >= int64_t(per_expert_) * p_.num_experts) return false;
    c.expert = int(tile / per_expert_);
    const int local = int(tile - int64_t(per_expert_) * c.expert);
    c.m0 = (local % m_tiles_) * Tile::kM;
    c.n0 = (local / m_tiles_) * kTileN;
    // The segment [o, o_next) of the whole schedule, clamped to the window's rows.
    const int begin = p_.window_begin, end = p_.window_begin + p_.num_rows;
    const int o = __ldg(p_.expert_offsets + c.expert), o_next = __ldg(p_.expert_offsets + c.expert + 1);
    const int first = min(max(o, begin), end);
    const int last = min(max(o_next, first), end);
    c.row_begin = first - begin;
    c.k_blocks = (last - first + Tile::kK - 1) / Tile::kK;
    c.aligned = last == first || c.row_begin % Tile::kK == 0;
    if (p_.windowed != 0) {
      // (mok_params.h Fp8ExpertWgradProblem: at most one expert crosses each window edge)
      const bool empty = o == o_next;
      c.skip = c.k_blocks == 0 && !(empty && begin == 0);
      c.from_chain = o < begin;
      c.rounded = empty || o_next <= end;
    } else {
      // A tile nobody adds to: accumulate leaves out[e] as it is when out is the result.
      c.skip = p_.accumulate != 0 && c.k_blocks == 0 && p_.rounded == 0;
      c.from_chain = p_.accumulate != 0;
      c.rounded = p_.rounded != 0;
    }
    return true;
  }

 private:
  Fp8ExpertWgradProblem p_;
  int m_tiles_, per_expert_;
};

// The pieces both weight-gradient kernels take (this file's and gemm/fp8_wgrad_wide_sm90.cuh's
// 128 x 192 one): the CTA's setup, the producer, the fragment layout, the tile's offset and the
// promotion. Tile: the kernel's tile (kM rows, kN columns, kStages, the stage's bytes);
// SharedStorage: its stages (a, b, a_scales, b_scales), barriers (full, empty) and watch.

// The stage barriers and the watch initialized, the tensor maps prefetched, then a CTA barrier (no
// clusters: no other CTA arrives on this CTA's barriers, so a CTA barrier orders their setup, and
// the producer need not wait for the stages' release before it exits).
template <class Tile, class SharedStorage>
__device__ __forceinline__ void fp8_wgrad_setup(const Fp8ExpertWgradMaps& maps, const Fp8ExpertWgradParams& p,
                                                const SharedStorage& shared) {
  if (threadIdx.x == 0) {
    sm90::init_stage_barriers<Tile::kStages>(shared.full, shared.empty, Tile::kEmptyArrivals);
    shared.watch->failed = 0;
    shared.watch->finished = 0;
  }
  if (threadIdx.x == 32) {
    sm90::prefetch_tensor_map(maps.grad);
    sm90::prefetch_tensor_map(maps.inputs);
    if (p.rounded_out != nullptr) sm90::prefetch_tensor_map(maps.rounded_out);
  }
  __syncthreads();
}

// The tile's columns inside n: Tile::kN, or fewer in an expert's last n-tile where kN does not
// divide n (n and n0 are multiples of 64 when kN is 128 or 192, so this is too).
template <class Tile>
__device__ __forceinline__ int fp8_wgrad_columns_inside(const Fp8ExpertWgradParams& p, const Fp8WgradTileCoord& c) {
  return min(Tile::kN, p.problem.n - c.n0);
}

// Thread 0 of the producer warpgroup: per tile and 128-token block, a free stage, then by TMA the
// grad box (kM rows) and the inputs box (kN rows; those past n are zero fill), and by bulk copy the
// block's grad scales of the tile's rows and inputs scales of its columns inside n, all onto the
// stage's full barrier (a box's zero-filled rows count towards its bytes). A tile whose segment
// starts off a 128-row block is a failed check: nothing of it is loaded and the watchdog traps.
template <class Tile, class Scheduler, class SharedStorage>
__device__ __forceinline__ void fp8_wgrad_produce(const Fp8ExpertWgradMaps& maps, const Fp8ExpertWgradParams& p,
                                                  const Scheduler& scheduler, const SharedStorage& shared) {
  sm90::WaitWatch* watch = shared.watch;
  const int64_t m = p.problem.m, n = p.problem.n;
  Fp8WgradTileCoord c;
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
    // A block that straddled two segments would mix two experts' tokens: stop, name it, trap.
    if (!c.aligned) sm90::fail_check(kCheckFp8WgradSegmentAlignment, watch);
    // fp32 bytes of the tile's columns inside n: a block's inputs scales, a row of its chain.
    const uint32_t column_bytes = uint32_t(fp8_wgrad_columns_inside<Tile>(p, c)) * sizeof(float);
    if (c.from_chain && c.k_blocks > 0) {
      // The consumers start this tile's chain from chain_in: bring its rows into L2 while they
      // finish the previous tile (the producer runs up to kStages blocks ahead).
      const float* in = p.chain_in + c.expert * p.chain_expert_stride + int64_t(c.m0) * n + c.n0;
      for (int r = 0; r < Tile::kM; ++r) sm90::prefetch_l2_bulk(in + r * n, column_bytes);
    }
    const int first_block = c.row_begin / Tile::kK;
    for (int kb = 0; kb < c.k_blocks; ++kb) {
      sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
      uint64_t* full = &shared.full[stage];
      sm90::mbarrier_arrive_expect_tx(full, Tile::kABytes + Tile::kBBytes + Tile::kAScaleBytes + column_bytes);
      const int row = c.row_begin + kb * Tile::kK;
      sm90::tma_load_2d(shared.a + stage * Tile::kABytes, maps.grad, full, row, c.m0);
      sm90::tma_load_2d(shared.b + stage * Tile::kBBytes, maps.inputs, full, row, c.n0);
      const int64_t block = first_block + kb;
      sm90::bulk_load(shared.a_scales + stage * Tile::kM, p.grad_scales + block * m + c.m0, Tile::kAScaleBytes, full);
      sm90::bulk_load(shared.b_scales + stage * Tile::kN, p.inputs_scales + block * n + c.n0, column_bytes, full);
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
  }
  sm90::mark_finished(watch);
}

// This thread's place in a tile: its first row (the second is 8 further) and the first column of
// each of its 8-column groups, the fragment layout; acc[4 j + 2 h + {0, 1}] is element
// (row + 8 h, 8 j + col + {0, 1}) of the tile.
struct Fp8WgradFragment {
  int row, col;
  __device__ Fp8WgradFragment(int consumer, int thread)
      : row(64 * consumer + 16 * (thread / 32) + (thread % 32) / 4), col(2 * ((thread % 32) % 4)) {}
};

// The offset of this thread's first element of the tile in chain_in / chain_out.
__device__ __forceinline__ int64_t fp8_wgrad_tile_offset(const Fp8ExpertWgradParams& p, const Fp8WgradTileCoord& c,
                                                         const Fp8WgradFragment& f) {
  return c.expert * p.chain_expert_stride + int64_t(c.m0 + f.row) * p.problem.n + c.n0 + f.col;
}

// acc += (sa[h] * sb[j]) * partial for the thread's two rows h and kAccumulators / 2 columns (column
// pair j: 8 j + col + {0, 1}), the scale product rounded to fp32 first; a_scales / b_scales: the
// shared addresses of the thread's first row's and first column's scales in the block's stage.
template <int kAccumulators>
__device__ __forceinline__ void fp8_wgrad_promote(float (&acc)[kAccumulators], const float (&partial)[kAccumulators],
                                                  uint32_t a_scales, uint32_t b_scales) {
  const float sa[2] = {sm90::ld_shared_f32(a_scales), sm90::ld_shared_f32(a_scales + 8 * sizeof(float))};
#pragma unroll
  for (int j = 0; j < kAccumulators / 4; ++j) {
    const float2 sb = sm90::ld_shared_f32x2(b_scales + 8 * j * sizeof(float));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 4 * j + 2 * h;
      acc[i] = __fmaf_rn(__fmul_rn(sa[h], sb.x), partial[i], acc[i]);
      acc[i + 1] = __fmaf_rn(__fmul_rn(sa[h], sb.y), partial[i + 1], acc[i + 1]);
    }
  }
}

// Advances `tile` to the CTA's next tile with blocks in the window (c: its coordinates; false past
// the last). A skipped tile is passed over; a tile without blocks, whose sums are its start (zero,
// or its chain), goes to store_start(c) on the way, while no block is in flight.
template <class Scheduler, class StoreStart>
__device__ __forceinline__ bool fp8_wgrad_next_tile_with_blocks(const Scheduler& scheduler, int64_t& tile,
                                                                 Fp8WgradTileCoord& c, StoreStart store_start) {
  for (; scheduler.at(tile, c); tile += scheduler.tile_step()) {
    if (c.skip) continue;
    if (c.k_blocks > 0) return true;
    store_start(c);
  }
  return false;
}

// The consumers' mainloops, chosen per launch (the op's `variant`, megatron_mok/ops/fp8_wgrad.py
// FP8_WGRAD_VARIANTS names them in this order). Both compute bitwise the same out: the same four
// wgmmas per token block into a fresh fp32 partial, the same acc = fma(sa * sb, partial, acc) in
// ascending blocks; they differ only in what the tensor cores can do while a warpgroup promotes.
enum class Fp8WgradMainloop : int {
  // Per block: wait for the stage, issue, wait for the block's wgmmas, promote with the stage's
  // scales, release. The two consumer warpgroups issue whenever they are ready.
  kDefault = 0,
  // Two partial sums per warpgroup used in turn: block k + 1's wgmmas are issued before block k's
  // are waited for (wgmma.wait_group 1), so each warpgroup promotes block k while its next block
  // runs. The scales are read from the stage during the promotion, so a stage is released after its
  // block is promoted (a warpgroup holds two stages at a time). 3 x 64 fp32 registers per thread for
  // the sums: the consumers' setmaxnreg budget, not the 168 of the whole launch.
  kOverlap = 1,
  // kOverlap, with the next tile's block 0 issued before this tile's epilogue instead of after it,
  // so the tensor cores run it while the warpgroup stores.
  kOverlapAcrossTiles = 2,
};
constexpr int kFp8WgradMainloopCount = 3;  // the op checks 0 <= variant < this

// Launched through gemm_kernel_sm90<Fp8ExpertWgradKernel<...>, Fp8ExpertWgradMaps, Fp8ExpertWgradParams,
// CUtensorMap, CUtensorMap> without clusters.
template <Fp8WgradMainloop kMainloop = Fp8WgradMainloop::kDefault>
struct Fp8ExpertWgradKernel {
  using Tile = Fp8WgradTile;
  using SharedStorage = Fp8WgradSharedStorage;
  using Scheduler = Fp8WgradTileScheduler<Tile::kN>;
  using Maps = Fp8ExpertWgradMaps;
  using Params = Fp8ExpertWgradParams;
  using Accumulators = float[Tile::kAccumulators];

  static __device__ __forceinline__ void run(const Maps& maps, const Params& p, uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    fp8_wgrad_setup<Tile>(maps, p, shared);
    const Scheduler scheduler(p.problem);
    const int warpgroup = threadIdx.x / kNumThreadsPerWarpGroup;
    if (warpgroup == 0) {
      sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
      if (threadIdx.x == 32) sm90::watch_waits(shared.watch, Tile::kRoles, p.failure_record, kFp8ExpertWgradKernel);
      if (threadIdx.x == 0) fp8_wgrad_produce<Tile>(maps, p, scheduler, shared);
      return;
    }
    sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
    const int consumer = warpgroup - 1, thread = threadIdx.x % kNumThreadsPerWarpGroup;
    if constexpr (kMainloop != Fp8WgradMainloop::kDefault) {
      consume_overlap(maps, p, scheduler, shared, consumer, thread);
    } else {
      consume(maps, p, scheduler, shared, consumer, thread);
    }
    // The warpgroup's last rounded tile is read out of its staging buffer before the CTA exits.
    if (thread == 0) sm90::bulk_wait_all();
  }

 private:
  using Fragment = Fp8WgradFragment;

  // acc = the tile's chain_in (the chain continues where the previous window stored it) or 0.
  static __device__ __forceinline__ void start_chain(const Params& p, const Fp8WgradTileCoord& c, int64_t offset,
                                                     Accumulators& acc) {
    const int64_t n = p.problem.n;
    const float* in = p.chain_in + offset;
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; i += 2) {
      float2 v = make_float2(0.f, 0.f);
      if (c.from_chain) v = *reinterpret_cast<const float2*>(in + 8 * ((i / 2) % 2) * n + 8 * (i / 4));
      acc[i] = v.x;
      acc[i + 1] = v.y;
    }
  }

  // The tile's sums into chain_out (8-byte stores: a quad's four lanes cover one 32-byte sector of a
  // row), or rounded to bf16 into rounded_out (each value rounded once, to nearest even: the bits of
  // the fp32 value converted) through the warpgroup's staging buffer and two TMA stores of 64 x 64 at rows
  // expert * m + m0 + 64 * consumer of rounded_out seen as (E * m, n). The buffer is free once the
  // previous tile's stores have read it (committed by thread 0, which waits for that before the
  // warpgroup's barrier).
  static __device__ __forceinline__ void store_tile(const Maps& maps, const Params& p, const SharedStorage& shared,
                                                    const Fp8WgradTileCoord& c, int64_t offset, const Accumulators& acc,
                                                    int consumer, int thread) {
    const int64_t n = p.problem.n;
    if (c.rounded) {
      uint32_t packed[Tile::kAccumulators / 2];
#pragma unroll
      for (int j = 0; j < Tile::kAccumulators / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
      uint8_t* buffer = shared.staging + consumer * Tile::kStagingBytes;
      if (thread == 0) sm90::bulk_wait_read<0>();
      sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
      stage_columns(buffer, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
      store_staged(maps.rounded_out, buffer, consumer, thread, c.n0, c.expert * p.problem.m + c.m0 + 64 * consumer);
      return;
    }
    float* out = p.chain_out + offset;
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; i += 2) {
      *reinterpret_cast<float2*>(out + 8 * ((i / 2) % 2) * n + 8 * (i / 4)) = make_float2(acc[i], acc[i + 1]);
    }
  }

  static __device__ __forceinline__ void consume(const Maps& maps, const Params& p, const Scheduler& scheduler,
                                                 const SharedStorage& shared, int consumer, int thread) {
    sm90::WaitWatch* watch = shared.watch;
    const int lane = thread % 32;
    const Fragment f(consumer, thread);
    Accumulators acc, partial;
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; ++i) partial[i] = 0.f;  // (overwritten: scale_d = 0)
    int stage = 0;
    uint32_t phase = 0;
    Fp8WgradTileCoord c;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      if (c.skip) continue;
      const int64_t offset = fp8_wgrad_tile_offset(p, c, f);
      start_chain(p, c, offset, acc);
#pragma unroll 1
      for (int kb = 0; kb < c.k_blocks; ++kb) {
        sm90::mbarrier_wait(&shared.full[stage], phase, kWaitLoadedStage, watch);
        const uint64_t a_desc =
            sm90::smem_descriptor_sw128(shared.a + stage * Tile::kABytes + consumer * Tile::kConsumerABytes);
        const uint64_t b_desc = sm90::smem_descriptor_sw128(shared.b + stage * Tile::kBBytes);
        sm90::wgmma_block_m64n128k128_e4m3(partial, a_desc, b_desc);
        sm90::wgmma_wait_group<0>();
        sm90::fence_accumulators(partial);
        fp8_wgrad_promote(acc, partial, sm90::smem_u32(shared.a_scales + stage * Tile::kM + f.row),
                sm90::smem_u32(shared.b_scales + stage * Tile::kN + f.col));
        sm90::release_stage_after_shared_reads<1>(&shared.empty[stage], lane);
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
      store_tile(maps, p, shared, c, offset, acc, consumer, thread);
    }
    if (thread == 0) sm90::mark_finished(watch);
  }

  // kOverlap and kOverlapAcrossTiles. Per tile of k_blocks blocks: block 0 issued into p0, then for
  // each block k, block k + 1 issued into the other partial (once its stage landed), wait_group 1
  // (block k's wgmmas done, k + 1's may run), promote k with its stage's scales, release k's stage.
  // The partials alternate by the parity of k, so the block loop is unrolled by two and every
  // register index is static (wgmma accumulators must be). kOverlapAcrossTiles issues the next
  // tile's block 0 into p0 before this tile's epilogue, so the tensor cores run it while the
  // warpgroup stores (both consumer warpgroups reach their epilogues together), kOverlap after it;
  // either way each tile's sums start from its chain or zero and add its blocks in ascending order.
  // Stage s's descriptors, barrier and scales are stage 0's plus s stages of bytes, formed once per
  // launch (registers are the constraint here); the bounded waits trap out of line.
  static __device__ __forceinline__ void consume_overlap(const Maps& maps, const Params& p, const Scheduler& scheduler,
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
    Accumulators acc, p0, p1;  // (the partials are written by each block's first wgmma)
    const auto issue = [&](Accumulators& partial) {
      sm90::mbarrier_wait<true>(full0 + 8 * stage, phase, kWaitLoadedStage, watch);
      const uint32_t a_units = stage * (Tile::kABytes >> 4), b_units = stage * (Tile::kBBytes >> 4);
      sm90::wgmma_fence();  // the promotion's reads of `partial` come before the wgmmas' writes
      sm90::wgmma_m64n128k32_e4m3_fresh(partial, sm90::descriptor_plus(a_desc0, a_units),
                                        sm90::descriptor_plus(b_desc0, b_units));
#pragma unroll
      for (int kk = 1; kk < Tile::kMmasPerStage; ++kk) {
        sm90::wgmma_m64n128k32_e4m3(partial, sm90::descriptor_plus(a_desc0, a_units + 2 * kk),
                                    sm90::descriptor_plus(b_desc0, b_units + 2 * kk), 1);
      }
      sm90::wgmma_commit_group();
      sm90::advance_stage<Tile::kStages>(stage, phase);
    };
    // After the wait that retired the oldest block in flight, issued `back` blocks before the next
    // to issue: its partial into acc with its stage's scales, then the stage back (lane 0 for the
    // warp, once the warp's reads of it are done).
    const auto retire = [&](Accumulators& partial, int back) {
      sm90::fence_accumulators(partial);
      const int oldest = stage >= back ? stage - back : stage - back + Tile::kStages;
      fp8_wgrad_promote(acc, partial, a_scales0 + oldest * Tile::kAScaleBytes, b_scales0 + oldest * Tile::kBScaleBytes);
      sm90::release_stage_after_shared_reads<1>(&shared.empty[oldest], lane);
    };
    // The CTA's tiles in order. A skipped tile is neither loaded nor stored; a tile without blocks
    // (its sums are its start: zero, or its chain) is stored on the way, with p1 for its sums (no
    // block is in flight in p1 then), so the loop below sees only tiles with blocks.
    int64_t tile = scheduler.first_tile();
    const auto next_tile_with_blocks = [&](Fp8WgradTileCoord& c) {
      return fp8_wgrad_next_tile_with_blocks(scheduler, tile, c, [&](const Fp8WgradTileCoord& start) {
        const int64_t offset = fp8_wgrad_tile_offset(p, start, f);
        start_chain(p, start, offset, p1);
        store_tile(maps, p, shared, start, offset, p1, consumer, thread);
      });
    };
    Fp8WgradTileCoord c;
    if (next_tile_with_blocks(c)) {
      // Block 0 of the first tile; every later tile's is issued beside the epilogue of the one before.
      // (No wgmma is issued on a path that may skip it: with this block issued under a condition
      // (another tile, with blocks), ptxas injected waits for the accumulators (C7514, C7517), and in
      // the FP8 GEMM's form of this mainloop serialized its wgmmas (C7518).)
      issue(p0);
      while (true) {  // c has blocks, and its block 0 is in flight in p0
        const int64_t offset = fp8_wgrad_tile_offset(p, c, f);
        start_chain(p, c, offset, acc);
        const int k_blocks = c.k_blocks;
        int kb = 0;  // the oldest block in flight, in p0
#pragma unroll 1
        for (; kb + 2 < k_blocks; kb += 2) {
          issue(p1);
          sm90::wgmma_wait_group<1>();
          retire(p0, 2);
          issue(p0);
          sm90::wgmma_wait_group<1>();
          retire(p1, 2);
        }
        if (kb + 1 < k_blocks) {  // two blocks left: kb in p0, kb + 1 into p1
          issue(p1);
          sm90::wgmma_wait_group<1>();
          retire(p0, 2);
          sm90::wgmma_wait_group<0>();
          retire(p1, 1);
        } else {
          sm90::wgmma_wait_group<0>();
          retire(p0, 1);
        }
        const Fp8WgradTileCoord done = c;
        tile += scheduler.tile_step();
        if (!next_tile_with_blocks(c)) {
          store_tile(maps, p, shared, done, offset, acc, consumer, thread);
          break;
        }
        // kOverlapAcrossTiles: the next tile's block 0 goes to the tensor cores before this tile's
        // epilogue (p0 is free: every block of this tile retired), kOverlap after it.
        if constexpr (kMainloop == Fp8WgradMainloop::kOverlapAcrossTiles) {
          issue(p0);
          store_tile(maps, p, shared, done, offset, acc, consumer, thread);
        } else {
          store_tile(maps, p, shared, done, offset, acc, consumer, thread);
          issue(p0);
        }
      }
    }
    if (thread == 0) sm90::mark_finished(watch);
  }
};

}  // namespace mok
