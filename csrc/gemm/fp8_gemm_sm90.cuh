// The FP8 blockwise grouped GEMM of the expert segments (sm_90a; docs/design.md §12.3): E4M3 A rows
// times E4M3 B_e^T with one fp32 scale per row and K block for A (1x128) and per 128 x 128 block for
// B. Forward fc1/fc2 take the weights as quantized; the dgrads take the transposed copies (sm90's
// FP8 wgmma reads K-major operands only). Three epilogues:
//   Fp8StoreEpilogue   out = the product rounded once to bf16 (fc2, the dgrads; fc1 without SwiGLU);
//   Fp8PushEpilogue    the same rows written into the sources' combine regions of the in-kernel
//                      exchange (fc2 and the gate/up dgrad there), where push_rows would put them;
//   Fp8SwigluEpilogue  gate_up (bf16), and act = SwiGLU of it quantized 1x128 along F (E4M3 + scales
//                      in the GEMM-A layout: the down projection's A).
//
// Persistent and warp-specialized like gemm/kernel_sm90_tma_wgmma_ws.cuh, whose kernel entry, tile
// scheduler, stage ring, staging buffers and bounded waits it shares; what differs is the unit of a
// stage and the promotion:
//   warpgroup 0, producer: thread 0 walks the CTA's tiles (ExpertTileScheduler) and per K block of
//     128 waits for a free stage and TMA-loads the tile's 128 A rows and its B slice, two halves of
//     64 rows the epilogue names (128 bytes of K each, 128-byte swizzle), onto the stage's `full`
//     barrier; with 2-CTA clusters each CTA loads one half of the shared B slice and multicasts it
//     into both. A tile takes Epilogue::kPasses passes over K, each with its own B slice (the SwiGLU
//     epilogue's 128 act columns are two passes of 64 gate + 64 up columns). Thread 32 is the watchdog.
//   warpgroups 1 and 2, consumers, 64 rows each: per K block four wgmma m64n128k32 E4M3 into a fresh
//     fp32 partial (the first with scale_d = 0, so a partial never spans two K blocks), wait for
//     them, hand the stage back, and promote: acc += (scale_a[row] * scale_b) * partial, in fp32
//     registers, ascending K blocks (bitwise reproducible). The scales are plain loads from global
//     memory issued one K block ahead (two A scales per thread, its two rows; one B scale per B half
//     and K block), so their latency hides behind a K block's MMAs. After each pass the epilogue
//     takes the accumulators. That is Fp8Mainloop::kDefault, where the tensor cores run one
//     warpgroup's MMAs while the other promotes only if the hardware's issue order happens to
//     stagger them; the other Fp8Mainloop variants (below) arrange it, with the same arithmetic.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "common/failure_codes.h"
#include "common/fp8_block_math.cuh"
#include "common/limits.h"
#include "common/pipeline_sm90.cuh"
#include "common/swiglu_math.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_fp8_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/epilogue_sm90_swiglu.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"
#include "moe/row_source_sm90.cuh"

namespace mok {

struct Fp8GemmTile {
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kNumThreadsPerWarpGroup;
  static constexpr int kThreads = kNumThreadsPerWarpGroup + kConsumerThreads;
  static_assert(kThreads == ExpertGemmTile::kThreads, "gemm_kernel_sm90's launch bounds are ExpertGemmTile's");
  static constexpr int kM = 128;  // two consumer warpgroups x 64 rows (wgmma m64)
  static_assert(kM == ExpertGemmTile::kM, "the expert tile scheduler walks m-tiles of ExpertGemmTile::kM rows");
  // 128 B rows (two halves of 64, each inside one 128-row weight scale block) and one scale block of
  // K deep: a stage is one promotion step, with one B scale per half.
  static constexpr int kN = kFp8Block;
  static constexpr int kK = kFp8Block;
  static constexpr int kMmaK = 32;  // K of one wgmma E4M3
  static constexpr int kMmasPerStage = kK / kMmaK;
  static_assert(kMmasPerStage == 4 && kN == 128,
                "a stage is four wgmma m64n128k32 per warpgroup (sm90::wgmma_block_m64n128k128_e4m3)");
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
//   turn     2 * 8                                 kPingpong's turns (mbarriers; unused by the others)
// (turn after watch: the other mainloops' addresses, and so their SASS, stay as they were.)
struct Fp8GemmSharedStorage {
  using Tile = Fp8GemmTile;
  static constexpr size_t kBytes = size_t(Tile::kStages) * Tile::kStageBytes +
                                   2 * Tile::kStagingBuffers * Tile::kStagingBytes +
                                   2 * Tile::kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch) +
                                   2 * sizeof(uint64_t);
  static constexpr size_t kSmemBytes = Tile::kSwizzleAlign + kBytes;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm90 block may opt into");

  __device__ explicit Fp8GemmSharedStorage(uint8_t* smem_raw)
      : a(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) &
                                     ~uintptr_t(Tile::kSwizzleAlign - 1))),
        b(a + Tile::kStages * Tile::kABytes),
        staging(b + Tile::kStages * Tile::kBBytes),
        full(reinterpret_cast<uint64_t*>(staging + 2 * Tile::kStagingBuffers * Tile::kStagingBytes)),
        empty(full + Tile::kStages),
        watch(reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages)),
        turn(reinterpret_cast<uint64_t*>(watch + 1)) {}

  uint8_t* a;
  uint8_t* b;
  uint8_t* staging;
  uint64_t* full;
  uint64_t* empty;
  sm90::WaitWatch* watch;
  uint64_t* turn;
};


// ---- epilogues: which B rows a pass multiplies, and what becomes of its accumulators ----------
// b_row(problem, c, pass, half): the first of the 64 B rows (of expert c.expert's n_weight_rows)
// that give accumulator columns [64 * half, 64 * half + 64) in pass `pass`; each half lies inside one
// 128-row weight scale block. after_pass(...) takes a pass's accumulators (fragment layout of
// gemm/tile_sm90.cuh: acc[4 * j + 2 * h + c] is row 16 * warp + lane / 4 + 8 * h of the warpgroup's
// 64, column 8 * j + 2 * (lane % 4) + c); State carries what a later pass needs.

// out (num_rows, n_out) bf16 = the product rounded once; 128 output columns per tile, one pass.
// What the epilogues that write the product's 128 columns of a tile in one pass share: B rows n0 ..
// n0 + 127 (both halves inside one 128-row weight scale block), no state between passes.
struct Fp8OnePassColumns {
  static constexpr int kPasses = 1;
  struct State {
    __device__ explicit State(uint8_t*) {}
  };

  static __device__ __forceinline__ int b_row(const ExpertGemmProblem&, const TileCoord& c, int, int half) {
    return c.n0 + 64 * half;
  }

  // The accumulators rounded once to bf16 pairs: packed[2 * j + h] holds columns 8 * j + 2 * (l % 4)
  // + {0, 1} of row half h (the pair(j, h) of stage_columns and write_columns_direct).
  static __device__ __forceinline__ void pack(const float (&acc)[Fp8GemmTile::kAccumulators],
                                              uint32_t (&packed)[Fp8GemmTile::kAccumulators / 2]) {
#pragma unroll
    for (int j = 0; j < Fp8GemmTile::kAccumulators / 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
};

struct Fp8StoreEpilogue : Fp8OnePassColumns {
  using Maps = StoreEpilogueMaps;
  using Params = StoreEpilogueParams;
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps& m) { sm90::prefetch_tensor_map(m.out); }

  // Through the warpgroup's staging buffer and two TMA stores when its 64 rows lie inside the
  // segment, else from registers with a row mask (as gemm/epilogue_sm90_store.cuh writes a half).
  static __device__ __forceinline__ void after_pass(const Maps& m, const Params& e, const OutputExtent& out_extent,
                                                    const float (&acc)[Fp8GemmTile::kAccumulators], const TileCoord& c,
                                                    int, State&, StagingRing& staging, int consumer, int thread) {
    uint32_t packed[Fp8GemmTile::kAccumulators / 2];
    pack(acc, packed);
    const auto pair = [&](int j, int h) { return packed[2 * j + h]; };
    if (c.rows >= 64 * (consumer + 1)) {
      uint8_t* buffer = staging.acquire();
      stage_columns(buffer, thread, 0, pair);
      store_staged(m.out, buffer, consumer, thread, c.n0, c.row0 + 64 * consumer);
    } else if (c.rows > 64 * consumer) {
      write_columns_direct(static_cast<__nv_bfloat16*>(e.out), out_extent.n_out, c, out_extent, consumer, thread, 0,
                           c.n0, pair);
    }
  }
};

// What the push epilogues (Fp8PushEpilogue and the wide kernel's) share. Lane l < 16 of warp w of a
// consumer warpgroup owns row 2 w + l % 2 + 8 (l / 2) of the warpgroup's 64 (a warp's 16 rows): it
// finds that row's destination once, its route loaded before the tile is staged so that the load's
// latency passes meanwhile, and the threads that copy the row's chunks take it by shuffle.

// The group route of the row lane (< 16) of warp owns; -1 for none, or for a row outside the segment
// or the product, or of a padding slot (not written).
__device__ __forceinline__ int64_t push_owned_route(const Fp8PushEpilogueParams& e, const OutputExtent& out_extent,
                                                    const TileCoord& c, int consumer, int warp, int lane) {
  const int row_in_tile = 64 * consumer + 2 * warp + lane % 2 + 8 * (lane / 2);
  const int64_t row = int64_t(c.row0) + row_in_tile;
  return row_in_tile < c.rows && row < out_extent.num_rows ? e.slot_to_route[row] : -1;
}

// The address of column col0 of a group route's row in its source rank's combine region, 0 for none
// (group_route < 0). A route past the group's is a schedule bug: trap, as push_rows does (out of line:
// an inline trap holds ptxas to the launch's 168 registers in this code). Past the check the route is
// 32-bit: the op refuses a group of 2^31 routes or more.
__device__ __forceinline__ uint64_t push_owned_address(const Fp8PushEpilogueParams& e, int64_t group_route,
                                                       int n_out, int col0) {
  if (group_route >= int64_t(e.num_ranks) * e.routes_per_rank) sm90::trap_out_of_line();
  if (group_route < 0) return 0;
  const BlockRow32 at = locate_block_row(int(group_route), e.routes_per_rank, e.num_ranks);
  return reinterpret_cast<uint64_t>(static_cast<__nv_bfloat16*>(pick_rank(e.peer_tables, at.block)) +
                                    int64_t(at.row) * n_out + col0);
}

// The owned address of lane `owner` of this warp (every lane of the warp calls it).
__device__ __forceinline__ uint64_t push_owner_address(uint64_t owned, int owner) {
  return (uint64_t(__shfl_sync(0xffffffffu, uint32_t(owned >> 32), owner)) << 32) |
         __shfl_sync(0xffffffffu, uint32_t(owned), owner);
}

// Chunk `chunk` (16 bytes: columns 8 chunk .. + 7 of the box) of row r of a 64 x 64 staged box
// (stage_columns' swizzled layout).
__device__ __forceinline__ uint4 staged_chunk(const uint8_t* box, int r, int chunk) {
  return *reinterpret_cast<const uint4*>(box + r * 128 + ((chunk ^ (r & 7)) << 4));
}

// The product's rows straight into the sources' combine regions (mok_params.h Fp8PushEpilogueParams):
// the push of the in-kernel exchange (moe/push_combine_sm90.cuh push_rows_kernel) in the epilogue,
// so the (rows, n_out) bf16 product is never written to this rank's memory and read back. Row r of
// the tile goes to row at.row of rank at.block's region, at = locate_block_row(slot_to_route[r]),
// rounded once to bf16 as the store epilogue rounds it; a route is the destination of exactly one
// row of one rank, so the sources' fixed-order combine reads what push_rows would have written, bit
// for bit.
struct Fp8PushEpilogue : Fp8OnePassColumns {
  using Maps = Fp8PushEpilogueMaps;
  using Params = Fp8PushEpilogueParams;
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps&) {}

  // Through the warpgroup's staging buffer (stage_columns: the store epilogue's stmatrix layout),
  // then out of it in 16-byte chunks: thread t copies chunk t % 16 of rows r_i = t / 16 + 8 i
  // (i < 8), so a warp's stores cover two whole rows (512 contiguous bytes of the two destinations);
  // row r_i's owner is lane t % 32 / 16 + 2 i (push_owned_route). The accumulators die in the
  // staging, before any of this takes registers.
  static __device__ __forceinline__ void after_pass(const Maps&, const Params& e, const OutputExtent& out_extent,
                                                    const float (&acc)[Fp8GemmTile::kAccumulators], const TileCoord& c,
                                                    int, State&, StagingRing& staging, int consumer, int thread) {
    if (c.rows <= 64 * consumer) return;  // none of this warpgroup's rows lies in the segment
    uint32_t packed[Fp8GemmTile::kAccumulators / 2];
    pack(acc, packed);
    const int warp = thread / 32, lane = thread % 32;
    const int64_t group_route = lane < 16 ? push_owned_route(e, out_extent, c, consumer, warp, lane) : -1;
    uint8_t* buffer = staging.acquire();
    stage_columns(buffer, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
    sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);  // every row staged
    const uint64_t owned = push_owned_address(e, group_route, out_extent.n_out, c.n0);
    const int chunk = lane % 16;  // 16-byte chunk of a row: columns 8 * chunk .. + 7
    // (A generic pointer: a 32-bit shared address here is formed before the K loop and held across
    // it, which spills.)
    const uint8_t* box = buffer + (chunk / 8) * ExpertGemmTile::kStoreBoxBytes;  // stage_columns' box
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = thread / 16 + 8 * i;  // row of the warpgroup's 64, owned by lane lane / 16 + 2 i
      const uint64_t destination = push_owner_address(owned, lane / 16 + 2 * i);
      if (destination == 0) continue;
      *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(destination) + 8 * chunk) =
          staged_chunk(box, r, chunk % 8);
    }
  }
};

// The gate/up projection with SwiGLU, act quantized 1x128 along F (mok_params.h
// Fp8SwigluEpilogueParams). A tile is 128 act columns [n0, n0 + 128): pass p multiplies gate rows
// [n0 + 64p, +64) (accumulator columns 0-63) and their up partners n_out rows further (64-127).
// Each pass writes its gate and up columns of gate_up (bf16) and rounds act = silu(gate) * up from
// the rounded values (swiglu_pair: swiglu_forward_kernel's arithmetic); pass 0 keeps its act in
// registers. After pass 1 a row's 128 act columns lie in the four threads of its quad: the amax is
// a quad reduction, then scale = amax / 448 (1 for an all-zero block; IEEE division) and q =
// e4m3(act / scale) (common/fp8_block_math.cuh), exactly quantization.quantize_rowwise of the bf16
// act (docs/design.md §12.1).
// Plain stores with a row mask (rows inside the segment and the schedule).
struct Fp8SwigluEpilogue {
  using Maps = Fp8SwigluEpilogueMaps;
  using Params = Fp8SwigluEpilogueParams;
  static constexpr int kPasses = 2;
  static constexpr int kGroups = 8;  // 8-column groups of a half (64 columns)
  // Pass 0's act as bf16 pairs, kept in the warpgroup's staging buffer (this epilogue stores
  // without it) rather than in registers, which the accumulators and the partial fill: pair
  // (group j, row half h) of thread t at word (2 * j + h) * 128 + t, so a warp's words are
  // consecutive (no bank conflict). Each thread reads back only what it wrote: no barrier.
  struct State {
    __device__ explicit State(uint8_t* staging) : act(reinterpret_cast<uint32_t*>(staging)) {}
    uint32_t* act;
  };
  static_assert(2 * kGroups * kNumThreadsPerWarpGroup * 4 <= Fp8GemmTile::kStagingBytes,
                "pass 0's act fits in a staging buffer");

  static __device__ __forceinline__ int b_row(const ExpertGemmProblem& g, const TileCoord& c, int pass, int half) {
    return (half == 1 ? g.n_out : 0) + c.n0 + 64 * pass;
  }
  static __device__ __forceinline__ void prefetch_tensor_maps(const Maps&) {}

  static __device__ __forceinline__ void after_pass(const Maps&, const Params& e, const OutputExtent& out_extent,
                                                    const float (&acc)[Fp8GemmTile::kAccumulators], const TileCoord& c,
                                                    int pass, State& state, StagingRing&, int consumer, int thread) {
    const int lane = thread % 32, quad_lane = lane % 4;
    const int64_t n_out = out_extent.n_out;
    int64_t rows[2];
    bool row_in[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row_in_tile = 64 * consumer + 16 * (thread / 32) + lane / 4 + 8 * h;
      rows[h] = int64_t(c.row0) + row_in_tile;
      row_in[h] = row_in_tile < c.rows && rows[h] < out_extent.num_rows;
    }
    uint32_t act[2 * kGroups];
    auto* gate_up = static_cast<__nv_bfloat16*>(e.gate_up);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t gate = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        const uint32_t up = pack_bf16x2(acc[4 * (j + kGroups) + 2 * h], acc[4 * (j + kGroups) + 2 * h + 1]);
        act[2 * j + h] = swiglu_pair(gate, up);
        if (row_in[h]) {
          const int64_t col = c.n0 + 64 * pass + 8 * j + 2 * quad_lane;
          *reinterpret_cast<uint32_t*>(gate_up + rows[h] * 2 * n_out + col) = gate;
          *reinterpret_cast<uint32_t*>(gate_up + rows[h] * 2 * n_out + n_out + col) = up;
        }
      }
    }
    if (pass == 0) {
#pragma unroll
      for (int i = 0; i < 2 * kGroups; ++i) state.act[i * kNumThreadsPerWarpGroup + thread] = act[i];
      return;
    }
    uint32_t first[2 * kGroups];  // pass 0's act
#pragma unroll
    for (int i = 0; i < 2 * kGroups; ++i) first[i] = state.act[i * kNumThreadsPerWarpGroup + thread];
    auto* act_q = static_cast<uint8_t*>(e.act);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t pair = p == 0 ? first[2 * j + h] : act[2 * j + h];
          const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&pair);
          amax = max_nan(amax, max_nan(fabsf(__low2float(v)), fabsf(__high2float(v))));
        }
      }
      // The row's other 96 columns: the other three threads of its quad (every lane shuffles).
      amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float scale = fp8_block_scale(amax, false);
      if (!row_in[h]) continue;
      const Fp8BlockQuantizer quantizer(scale, /*bf16_values=*/true);  // act is rounded to bf16 first
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t pair = p == 0 ? first[2 * j + h] : act[2 * j + h];
          const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&pair);
          const int64_t col = c.n0 + 64 * p + 8 * j + 2 * quad_lane;
          *reinterpret_cast<uint16_t*>(act_q + rows[h] * n_out + col) =
              uint16_t(quantizer.pair(__low2float(v), __high2float(v)));
        }
      }
      if (quad_lane == 0) e.act_scales[int64_t(c.n0 / kFp8Block) * e.act_scale_rows + rows[h]] = scale;
    }
  }
};

// Whether an epilogue has work to start when the producer starts a tile (before_tile(maps, out_extent, c),
// called by the producer thread before the tile's first load, so a few K blocks
// ahead of the consumers): the SwiGLU-backward epilogue's L2 prefetch of the rows its epilogue
// reads. The other epilogues have none (the consumers' registers are all taken: it runs there).
template <class Epilogue>
constexpr bool kFp8EpilogueStartsTiles = requires(const typename Epilogue::Maps& m, const OutputExtent& o,
                                                  const TileCoord& c) { Epilogue::before_tile(m, o, c); };

// Whether an epilogue's two B halves of a pass lie in one 128-row weight scale block (one B scale
// per K block, not two): Fp8OnePassColumns' halves (the store and push epilogues') are rows n0 ..
// n0 + 127 of a 128-aligned n0.
template <class Epilogue>
constexpr bool kFp8HalvesShareScaleBlock = std::is_base_of_v<Fp8OnePassColumns, Epilogue>;

// The consumers' mainloops, chosen per launch (the op's `variant`, megatron_mok/ops/fp8_gemm.py
// FP8_GEMM_VARIANTS names them in this order). Every one computes bitwise the same output: the same
// four wgmmas per K block into a fresh fp32 partial, the same acc = fma(sa * sb, partial, acc) in
// ascending K blocks; they differ only in what the tensor cores can do while a warpgroup promotes.
enum class Fp8Mainloop : int {
  // Per K block: wait for the stage, issue, wait for the block's wgmmas, release, promote. The two
  // consumer warpgroups issue whenever they are ready.
  kDefault = 0,
  // kDefault with the two warpgroups issuing in strict turns (turn mbarriers, warpgroup 0 first).
  // If the tensor cores interleave two warpgroups' wgmmas issued together, both finish together
  // and both promote while the tensor cores idle; in turns, warpgroup 0's block runs first and it
  // promotes while warpgroup 1's runs.
  kPingpong = 1,
  // Two partial sums per warpgroup used in turn: block k + 1's wgmmas are issued before block k's
  // are waited for (wgmma.wait_group 1), so each warpgroup promotes block k while its next block
  // runs. The scales are loaded two K blocks ahead; stage descriptors and barrier addresses are
  // formed once per launch. 3 x 64 fp32 registers per thread for the sums.
  kOverlap = 2,
  // kOverlap with each block's scale products made after the wait that retires the block. In
  // kOverlap ptxas is free to form block k's products sa * sb anywhere after their loads, and it
  // places them among block k + 1's wgmma issues: an FMUL whose scale load is still in flight then
  // holds back the MMAs issued after it (PC sampling, docs/log/gpu_2026-12-04_fp8_gemm_scale_stall.log).
  // Here the A scales pass through after_wait_identity(., partial[0]) first: the same bits, but a
  // value ptxas must take as depending on a register the wait defines.
  kOverlapLateScales = 3,
  // kOverlap, but where block k + 1's stage has not landed when block k's are issued and done
  // with, block k is retired (waited for, its stage released, promoted) before the wait for the
  // stage, so its promotion runs while the load is late instead of after it (mbarrier test_wait:
  // the probe does not suspend). Where the stage has landed it runs as kOverlap.
  kOverlapEagerRetire = 4,
  // Not a mainloop of this kernel: the store epilogue's product from gemm/fp8_gemm_wide_sm90.cuh's
  // 128 x 192 tiles (one partial per warpgroup, B multicast at 2-CTA clusters), the same bits.
  kWide = 5,
  // kWide with the next tile's first K block issued before a tile's epilogue, the same bits.
  kWideAcrossTiles = 6,
  // kWide with the two consumer warpgroups issuing their K blocks in turn, the same bits.
  kWideOrdered = 7,
  // kWideOrdered with the next tile's first K block issued before a tile's epilogue, the same bits.
  kWideOrderedAcrossTiles = 8,
  // kWideOrdered with the A scales brought into each stage beside its operands, the same bits.
  kWideOrderedStagedScales = 9,
};
constexpr int kFp8MainloopCount = 10;  // the op checks 0 <= variant < this

// x, bit for bit, as a value that depends on `anchor`: prmt.b32 of the byte pair (x, anchor) with
// the selector 0x3210, which takes x's four bytes in order and none of anchor's. ptxas keeps the
// PRMT and its operand (the SASS of kOverlapLateScales reads PRMT R, R_x, 0x3210, R_anchor), so it
// cannot schedule the result before anchor is defined; an empty asm, by contrast, orders only the
// compiler's IR, and ptxas schedules the SASS afresh.
__device__ __forceinline__ float after_wait_identity(float x, float anchor) {
  uint32_t out;
  asm volatile("prmt.b32 %0, %1, %2, 0x3210;" : "=r"(out) : "r"(__float_as_uint(x)), "r"(__float_as_uint(anchor)));
  return __uint_as_float(out);
}

// kPingpong's turns: mbarrier turn[w] (Fp8GemmSharedStorage) completes a phase when each of the
// 128 threads of warpgroup 1 - w has arrived, after issuing its block's wgmmas: it hands warpgroup w
// the turn. Warpgroup w waits for the phases in order, with the bounded wait (kWaitPingpongTurn),
// so a turn that never comes traps with a record naming it instead of hanging the launch, as a
// named barrier (bar.sync) would. A barrier never runs a phase ahead of its waiter: warpgroup
// 1 - w hands over turn k + 1 only after its own turn k, which warpgroup w handed over after
// waiting for turn k.

// kClusterM: 1, or 2 CTAs (vertically adjacent m-tiles of one expert) sharing each B slice through
// TMA multicast (each loads one half). Launched through gemm_kernel_sm90<Fp8ExpertGemmKernel<...>,
// Fp8ExpertGemmMaps<Epilogue::Maps>, Fp8ExpertGemmParams<Epilogue::Params>, CUtensorMap...> with a
// cluster dimension (even of 1).
template <int kClusterM, class Epilogue, Fp8Mainloop kMainloop = Fp8Mainloop::kDefault>
struct Fp8ExpertGemmKernel {
  using Tile = Fp8GemmTile;
  using SharedStorage = Fp8GemmSharedStorage;
  using Scheduler = ExpertTileScheduler<kClusterM, Tile::kN>;
  using Maps = Fp8ExpertGemmMaps<typename Epilogue::Maps>;
  using Params = Fp8ExpertGemmParams<typename Epilogue::Params>;
  static_assert(kClusterM == 1 || kClusterM == 2, "clusters of 1 or 2 CTAs");
  static constexpr bool kLateScales = kMainloop == Fp8Mainloop::kOverlapLateScales;
  static constexpr bool kEagerRetire = kMainloop == Fp8Mainloop::kOverlapEagerRetire;
  static constexpr bool kOverlapMainloop = kMainloop == Fp8Mainloop::kOverlap || kLateScales || kEagerRetire;
  static constexpr uint32_t kEmptyArrivals = 2 * kClusterM;  // each consumer warpgroup of the cluster
  static constexpr uint32_t kBHalfBytes = Tile::kBBytes / 2;  // one 64-row half of a stage's B
  // kOverlap's scales per K block held in registers: two A rows, then one B scale per B half or one
  // for both.
  static constexpr int kBScales = kFp8HalvesShareScaleBlock<Epilogue> ? 1 : 2;
  static constexpr int kScales = 2 + kBScales;
  static_assert(Tile::kABytes % Tile::kSwizzleAlign == 0 && kBHalfBytes % Tile::kSwizzleAlign == 0 &&
                    Tile::kConsumerABytes % Tile::kSwizzleAlign == 0,
                "every operand box and wgmma base starts on a 1024-byte swizzle atom");

  static __device__ __forceinline__ void run(const Maps& maps, const Params& p, uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    if (threadIdx.x == 0) {
      if constexpr (kMainloop == Fp8Mainloop::kPingpong) {
        // (Before the stage barriers: their init fence covers these too.)
        sm90::mbarrier_init(&shared.turn[0], kNumThreadsPerWarpGroup);
        sm90::mbarrier_init(&shared.turn[1], kNumThreadsPerWarpGroup);
      }
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

    if constexpr (kOverlapMainloop) {
      run_roles_overlap(maps, p, shared);
      return;
    }
    Scheduler scheduler(p.problem);
    const int warpgroup = warpgroup_index();
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
  // The first B row (of the whole (num_experts * n_weight_rows, k) matrix) of half `half` in `pass`.
  static __device__ __forceinline__ int b_row(const Params& p, const TileCoord& c, int pass, int half) {
    return c.expert * p.problem.n_weight_rows + Epilogue::b_row(p.problem, c, pass, half);
  }

  static __device__ __forceinline__ void produce(const Maps& maps, const Params& p, Scheduler& scheduler,
                                                 const SharedStorage& shared) {
    sm90::WaitWatch* watch = shared.watch;
    const int cta_rank = scheduler.cta_rank();
    const int k_blocks = p.problem.k / Tile::kK;
    TileCoord c;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      if constexpr (kFp8EpilogueStartsTiles<Epilogue>) {
        Epilogue::before_tile(maps.epilogue, scheduler.output_extent(), c);
      }
      for (int pass = 0; pass < Epilogue::kPasses; ++pass) {
        const int b_row0 = b_row(p, c, pass, 0), b_row1 = b_row(p, c, pass, 1);
        for (int kb = 0; kb < k_blocks; ++kb) {
          sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
          // The whole B slice lands in every CTA of the cluster (its own half and the peer's multicast).
          sm90::mbarrier_arrive_expect_tx(&shared.full[stage], Tile::kStageBytes);
          uint8_t* b = shared.b + stage * Tile::kBBytes;
          sm90::tma_load_2d(shared.a + stage * Tile::kABytes, maps.a, &shared.full[stage], kb * Tile::kK, c.row0);
          if constexpr (kClusterM == 1) {
            sm90::tma_load_2d(b, maps.b, &shared.full[stage], kb * Tile::kK, b_row0);
            sm90::tma_load_2d(b + kBHalfBytes, maps.b, &shared.full[stage], kb * Tile::kK, b_row1);
          } else {
            sm90::tma_load_2d_multicast(b + cta_rank * kBHalfBytes, maps.b, &shared.full[stage], kb * Tile::kK,
                                        cta_rank == 0 ? b_row0 : b_row1, (1u << kClusterM) - 1);
          }
          sm90::advance_stage<Tile::kStages>(stage, phase);
        }
      }
    }
    sm90::wait_all_stages_released<Tile::kStages>(shared.empty, stage, phase, watch);
    sm90::mark_finished(watch);
  }

  // kDefault and kPingpong.
  static __device__ __forceinline__ void consume(const Maps& maps, const Params& p, Scheduler& scheduler,
                                                 const SharedStorage& shared, int consumer, int thread) {
    constexpr bool kTurns = kMainloop == Fp8Mainloop::kPingpong;
    if constexpr (kTurns) {
      if (consumer == 1) sm90::mbarrier_arrive(&shared.turn[0]);  // 0 goes first
    }
    uint32_t turn_phase = 0;  // the parity of this warpgroup's next turn (kTurns)
    sm90::WaitWatch* watch = shared.watch;
    const int k_blocks = p.problem.k / Tile::kK;
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
      // not stored) and of the pass's two B halves, K block by K block.
      const int row = c.row0 + fragment_row;
      const bool row_in[2] = {row < num_rows, row + 8 < num_rows};
      const float* a_scales = p.scales.a + row;
      typename Epilogue::State state(shared.staging + consumer * Tile::kStagingBuffers * Tile::kStagingBytes);
#pragma unroll 1
      for (int pass = 0; pass < Epilogue::kPasses; ++pass) {
        const float* b_scales[2];
        float next_a[2], next_b[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          b_scales[h] = p.scales.b + int64_t(b_row(p, c, pass, h) / Tile::kN) * k_blocks;
          next_b[h] = __ldg(b_scales[h]);
          next_a[h] = row_in[h] ? __ldg(a_scales + 8 * h) : 0.f;
        }
        // Defined afresh per pass, so the compiler does not keep the previous one's alive.
#pragma unroll
        for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = 0.f;
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb) {
          // scale[h][half]: row half h (the thread's two rows), B half (accumulator columns 64 * half ..).
          float scale[2][2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int half = 0; half < 2; ++half) scale[h][half] = next_a[h] * next_b[half];
          }
          if (kb + 1 < k_blocks) {  // the next K block's scales, in flight during this one's MMAs
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              next_b[h] = __ldg(b_scales[h] + kb + 1);
              next_a[h] = row_in[h] ? __ldg(a_scales + (kb + 1) * a_rows + 8 * h) : 0.f;
            }
          }
          sm90::mbarrier_wait(&shared.full[stage], phase, kWaitLoadedStage, watch);
          if constexpr (kTurns) {
            sm90::mbarrier_wait(&shared.turn[consumer], turn_phase, kWaitPingpongTurn, watch);
            turn_phase ^= 1;
          }
          const uint64_t a_desc =
              sm90::smem_descriptor_sw128(shared.a + stage * Tile::kABytes + consumer * Tile::kConsumerABytes);
          const uint64_t b_desc = sm90::smem_descriptor_sw128(shared.b + stage * Tile::kBBytes);
          sm90::wgmma_block_m64n128k128_e4m3(partial, a_desc, b_desc);
          // The block's wgmmas are issued: the other warpgroup's turn.
          if constexpr (kTurns) sm90::mbarrier_arrive(&shared.turn[consumer ^ 1]);
          sm90::wgmma_wait_group<0>();
          sm90::fence_accumulators(partial);
          // The MMAs have read the stage: hand it back before promoting.
          if (thread == 0) sm90::release_stage<kClusterM>(&shared.empty[stage]);
          sm90::advance_stage<Tile::kStages>(stage, phase);
#pragma unroll
          for (int i = 0; i < Tile::kAccumulators; ++i) {
            // i = 4 * j + 2 * h + c: column group j (B half j / 8), row half h.
            acc[i] = fmaf(scale[(i / 2) % 2][i / 32], partial[i], acc[i]);
          }
        }
        Epilogue::after_pass(maps.epilogue, p.epilogue, out_extent, acc, c, pass, state, staging, consumer, thread);
      }
    }
    // (kTurns: warpgroup 1's last hand-over completes a phase of turn[0] nobody waits for; an
    // mbarrier, unlike a named barrier, needs no matching wait before the CTA exits.)
    if (thread == 0) {
      sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
      sm90::mark_finished(watch);
    }
  }

  // The roles as run() gives them, each with its own scheduler: nothing computed before the
  // register split stays live across it (the consumers need every register of their budget).
  static __device__ __forceinline__ void run_roles_overlap(const Maps& maps, const Params& p,
                                                           const SharedStorage& shared) {
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
    consume_overlap(maps, p, scheduler, shared, warpgroup - 1, threadIdx.x % kNumThreadsPerWarpGroup);
  }

  // kOverlap, kOverlapLateScales and kOverlapEagerRetire. Per pass of k_blocks K blocks: block 0
  // issued into p0, then for each block k, block k + 1 issued into the other partial (once its stage landed),
  // wait_group 1 (block k's wgmmas done, k + 1's may run), release k's stage, promote k. The
  // partials alternate by the parity of k, so the K loop is unrolled by two and every register
  // index is static (wgmma accumulators must be); a warpgroup holds two stages at a time.
  static __device__ __forceinline__ void consume_overlap(const Maps& maps, const Params& p, Scheduler& scheduler,
                                                         const SharedStorage& shared, int consumer, int thread) {
    sm90::WaitWatch* watch = shared.watch;
    const int k_blocks = p.problem.k / Tile::kK;
    const int num_rows = p.problem.num_rows;
    const int fragment_row = 64 * consumer + 16 * (thread / 32) + (thread % 32) / 4;
    StagingRing staging(shared.staging + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
    const OutputExtent out_extent = scheduler.output_extent();
    // Registers are the constraint here: the scales are addressed from the params (constant memory)
    // by 32-bit indices, and the stage to release follows from the stage to issue.
    // Stage s's descriptors are stage 0's plus s stages of bytes in their 16-byte address units (the
    // 14-bit field holds every shared address of the block: < 256 KB), its full barrier 8 s bytes on.
    // The bounded waits trap out of line: three partials need the setmaxnreg budget.
    const uint64_t a_desc0 = sm90::smem_descriptor_sw128(shared.a + consumer * Tile::kConsumerABytes);
    const uint64_t b_desc0 = sm90::smem_descriptor_sw128(shared.b);
    const uint32_t full0 = sm90::smem_u32(shared.full);
    int stage = 0;  // of the next block to issue
    uint32_t phase = 0;
    float acc[Tile::kAccumulators];
    float p0[Tile::kAccumulators], p1[Tile::kAccumulators];  // written by each block's first wgmma
    TileCoord c;
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      const int row = c.row0 + fragment_row;
      const bool row_in[2] = {row < num_rows, row + 8 < num_rows};
      typename Epilogue::State state(shared.staging + consumer * Tile::kStagingBuffers * Tile::kStagingBytes);
#pragma unroll 1
      for (int pass = 0; pass < Epilogue::kPasses; ++pass) {
        int b_block[kBScales];  // the weight scale block row of each B half (of both, if shared)
#pragma unroll
        for (int half = 0; half < kBScales; ++half) b_block[half] = b_row(p, c, pass, half) / Tile::kN;
        // s0 / s1: the raw scales of the block promoted from p0 / p1: A of the thread's two rows,
        // then B (multiplied when promoting, so the loads are waited for there).
        float s0[kScales], s1[kScales];
        const auto load_scales = [&](int kb, float (&s)[kScales]) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            s[h] = row_in[h] ? __ldg(p.scales.a + (int64_t(kb) * p.scales.a_rows + row + 8 * h)) : 0.f;
          }
#pragma unroll
          for (int half = 0; half < kBScales; ++half) {
            s[2 + half] = __ldg(p.scales.b + (int64_t(b_block[half]) * k_blocks + kb));
          }
        };
        const auto issue = [&](float (&partial)[Tile::kAccumulators]) {
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
        // After the wait that retired the oldest block in flight, issued `back` blocks before the
        // next to issue: its stage back, its partial into acc.
        const auto retire = [&](float (&partial)[Tile::kAccumulators], const float (&s)[kScales], int back) {
          sm90::fence_accumulators(partial);
          const int oldest = stage >= back ? stage - back : stage - back + Tile::kStages;
          if (thread == 0) sm90::release_stage<kClusterM>(&shared.empty[oldest]);
          promote_block(acc, partial, s);
        };
        // The next block issued into `next` and the oldest in flight (in `oldest`, scales s) retired:
        // after the issue (kOverlap), or, in kOverlapEagerRetire where the next stage has not landed
        // yet, before the wait for it.
        const auto issue_next_retire_oldest = [&](float (&next)[Tile::kAccumulators],
                                                  float (&oldest)[Tile::kAccumulators], const float (&s)[kScales]) {
          if constexpr (kEagerRetire) {
            if (!sm90::mbarrier_test_wait(full0 + 8 * stage, phase)) {
              sm90::wgmma_wait_group<0>();
              retire(oldest, s, 1);
              issue(next);
              return;
            }
          }
          issue(next);
          sm90::wgmma_wait_group<1>();
          retire(oldest, s, 2);
        };
#pragma unroll
        for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = 0.f;
        load_scales(0, s0);
        if (k_blocks > 1) load_scales(1, s1);
        issue(p0);
        int kb = 0;  // the oldest block in flight, in p0
#pragma unroll 1
        for (; kb + 2 < k_blocks; kb += 2) {
          issue_next_retire_oldest(p1, p0, s0);
          load_scales(kb + 2, s0);
          issue_next_retire_oldest(p0, p1, s1);
          if (kb + 3 < k_blocks) load_scales(kb + 3, s1);
        }
        if (kb + 1 < k_blocks) {  // two blocks left: kb in p0, kb + 1 into p1
          issue_next_retire_oldest(p1, p0, s0);
          sm90::wgmma_wait_group<0>();
          retire(p1, s1, 1);
        } else {
          sm90::wgmma_wait_group<0>();
          retire(p0, s0, 1);
        }
        Epilogue::after_pass(maps.epilogue, p.epilogue, out_extent, acc, c, pass, state, staging, consumer, thread);
      }
    }
    if (thread == 0) {
      sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
      sm90::mark_finished(watch);
    }
  }

  // acc += (scale_a[row] * scale_b[half]) * partial, s = {scale_a of the thread's two rows, scale_b
  // of the B halves (one if they share it)}: the products and their rounding as kDefault forms them.
  // kLateScales: the A scales (a factor of every product) taken through after_wait_identity first
  // (with the B scales instead, ptxas spilled 16 bytes around the loop).
  static __device__ __forceinline__ void promote_block(float (&acc)[Tile::kAccumulators],
                                                       const float (&partial)[Tile::kAccumulators],
                                                       const float (&s)[kScales]) {
    float a[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) a[h] = kLateScales ? after_wait_identity(s[h], partial[0]) : s[h];
    float scale[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int half = 0; half < 2; ++half) scale[h][half] = a[h] * s[2 + (kBScales == 1 ? 0 : half)];
    }
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = fmaf(scale[(i / 2) % 2][i / 32], partial[i], acc[i]);
  }
};

}  // namespace mok
