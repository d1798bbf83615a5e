// The persistent, warp-specialized expert GEMM of the MoK forward (sm_90a): TMA loads into a
// 4-stage (or 3-stage, MOK_EXPERT_GEMM_STAGES) mbarrier pipeline, wgmma m64n256k16 from shared
// memory, TMA-store epilogue; the gate/up instance also runs the pull dispatch.
// Reference: segment_matmul_reference (store epilogue) and swiglu_reference over it (SwiGLU
// epilogue) in megatron_mok/reference.py.
//
// One CTA per SM, 384 threads, in clusters of kClusterM CTAs (1, or 2 that work on vertically
// adjacent tiles: same expert, same B slice, m-tiles 2i and 2i + 1):
//   warpgroup 0, producer: thread 0 walks this CTA's tiles and, per 64-wide K block, waits for a
//     stage every CTA of the cluster has released, then issues TMA loads completing on the
//     stage's `full` barrier: its own 128 rows of A and the 256-row B slice — with 2-CTA
//     clusters only its half of B (CTA 0 the first 128 rows, CTA 1 the second), multicast into
//     both CTAs, so each B byte leaves L2 once per cluster. It keeps 40 registers (setmaxnreg)
//     and hands the rest over. Warp 1 is the watchdog of the CTA's bounded waits
//     (sm90::watch_waits).
//   warpgroups 1 and 2, consumers: each owns 64 of the tile's 128 rows; per K block it waits on
//     `full`, issues four wgmma (K = 16 each) into 128 fp32 accumulators per thread, and releases
//     the stage of the previous K block on `empty` of every CTA of the cluster (a peer multicasts
//     into it) once at most one wgmma group is in flight.
//     Epilogue: the accumulators are rounded once to bf16 and written, 128 columns at a time, into
//     the warpgroup's 16 KB staging buffer (two with 3 stages, used in turn; 128-byte swizzle,
//     conflict-free), from which one thread starts TMA stores and the warpgroup goes on to the
//     next tile: the global writes drain in the background. (When every SM writes its tile at
//     once the epilogue costs 10-15% of the GEMM; docs/performance.md has what the variants
//     measured.) A warpgroup whose 64 rows are
//     not all inside the segment stores from registers with a row mask instead (a TMA box cannot
//     be masked, and those rows belong to the next expert).
//     Meanwhile the producer already fills the stages of the next tile.
//   Dispatching kernel (kDispatchA, the gate/up projection): warps 2 and 3 of warpgroup 0 run the
//     pull dispatch into the rows buffer, minibatch by minibatch, counting each minibatch's chunks
//     done (dispatch_rows_ahead); thread 0 waits for a tile's minibatches before loading its rows,
//     so the dispatch overlaps the GEMM instead of preceding it. The rows buffer is a ring of
//     ring_minibatches minibatches: before writing minibatch m the dispatchers wait until every tile
//     has finished loading minibatch m - ring_minibatches (consumed counters, counted in rows), so the
//     workspace is bounded whatever the routing. (Gathering the rows straight into
//     the stages instead — cp.async, or one TMA box per row — was measured 1.4-2.4x slower: every
//     row is read once per n-tile through the load path, docs/performance.md.)
//
// Tiles: the schedule's segments (rows of one expert, any alignment) split into cluster tiles of
// kClusterM 128-row m-tiles; rows past the segment's end (a short last tile, or with 2-CTA
// clusters a whole one when the segment has an odd number of m-tiles) are computed from the next segment's rows (or
// TMA zero fill) and not stored. Cluster tile order is expert-major, then groups of group_m
// m-tiles (a launch argument) with m fastest inside a group, so the clusters working at the same time share the
// expert's B slices and A rows in L2. Cluster c takes cluster tiles c, c + clusters, ...: a static
// schedule read from the device-side segment offsets, so the launch never needs the host to know
// the routing. Before exiting, each producer waits until every CTA of the cluster released every
// stage, so no CTA leaves while a peer may still arrive on its barriers.
//
// Accumulator layout of wgmma m64nNk16 (fp32), thread t of a consumer warpgroup, warp w = t / 32,
// lane l: acc[4 * j + 2 * h + c] is row 16 * w + l / 4 + 8 * h, column 8 * j + 2 * (l % 4) + c.
// In the SwiGLU epilogue B's first 128 rows are gate and the next 128 up, so gate column n sits in
// acc[4 * j + ...] and its up partner in acc[4 * (j + 16) + ...] of the same thread.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/failure_codes.h"
#include "common/limits.h"
#include "common/pipeline_sm90.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "mok_params.h"
#include "moe/swiglu_sm90.cuh"

namespace mok {

// kStore: out = the product. kSwiglu (gate/up forward): the product is gate_up; writes gate_up and
// act = silu(gate) * up. kSwigluBackward (dgrad of down): the product is grad_act; reads gate_up
// and writes grad_gate_up = swiglu_backward(gate_up, grad_act) (never grad_act itself).
enum class GemmEpilogue { kStore, kSwiglu, kSwigluBackward };

struct ExpertGemmTile {
  static constexpr int kM = 128;  // rows: two consumer warpgroups x 64
  static_assert(kM == kExpertGemmTileM, "megatron_mok/limits.py EXPERT_GEMM_TILE_M is this tile's rows");
  static constexpr int kN = 256;  // B rows per tile (SwiGLU: 128 gate + 128 up)
  static constexpr int kK = 64;   // one 128-byte swizzle row of bf16
  // Pipeline stages and staging buffers per consumer share the shared memory: 4 stages leave room
  // for one 16 KB staging buffer per consumer (each store of an epilogue waits until the TMA
  // store before it has read the buffer); 3 stages for two (an epilogue's stores alternate, so
  // they rarely wait). MOK_EXPERT_GEMM_STAGES picks at build time (docs/performance.md compares).
#ifndef MOK_EXPERT_GEMM_STAGES
#define MOK_EXPERT_GEMM_STAGES 4
#endif
  static constexpr int kStages = MOK_EXPERT_GEMM_STAGES;
  static_assert(kStages == 3 || kStages == 4, "MOK_EXPERT_GEMM_STAGES must be 3 or 4");
  static constexpr int kStagingBuffers = kStages == 3 ? 2 : 1;
  static constexpr int kThreads = 384;
  // Dispatching kernels: warps 2 and 3 of the producer warpgroup copy the dispatched rows, in
  // chunks of kDispatchChunkRows claimed from a counter (dispatch_rows_ahead).
  static constexpr int kDispatchThreads = 64;
  static constexpr int kDispatchChunkRows = 8;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  // setmaxnreg moves registers inside the CTA's launch allocation (384 threads x 168, the most a
  // thread can have at one CTA per SM, in steps of 8): a consumer's increase waits until the
  // producer's decrease has freed enough, so asking for more than the allocation hangs.
  static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <= kThreads * ((65536 / kThreads) / 8 * 8),
                "setmaxnreg budgets exceed the CTA's register allocation");
  static constexpr uint32_t kABytes = kM * kK * 2;
  static constexpr uint32_t kBHalfBytes = (kN / 2) * kK * 2;
  static constexpr uint32_t kBBytes = kN * kK * 2;
  // MN-major B (the dgrad GEMMs: weight stored (K, N), N contiguous): four TMA boxes of 64 N x 64 K,
  // each K row 128 bytes, the boxes kBBoxBytes apart along N.
  static constexpr uint32_t kBBoxBytes = 64 * kK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kStoreBox = 64;  // TMA store boxes: 64 rows x 64 bf16 columns
  static constexpr uint32_t kStoreBoxBytes = kStoreBox * kStoreBox * 2;
  static constexpr uint32_t kStagingBytes = 2 * kStoreBoxBytes;  // one buffer: 64 rows x 128 columns
  static constexpr int kSwizzleAlign = 1024;
  static constexpr int kRoles = 3;  // producer + two consumers, for the watchdog (+ the dispatchers)

  // Output columns per tile.
  template <GemmEpilogue kEpilogue>
  __host__ __device__ static constexpr int n_out() {
    return kEpilogue == GemmEpilogue::kSwiglu ? kN / 2 : kN;
  }

  // Dynamic shared memory: stages, the consumers' staging buffers, barriers, the wait watch, the
  // dispatchers' claimed chunk.
  static constexpr size_t kSmemBytes = kSwizzleAlign + size_t(kStages) * kStageBytes +
                                       2 * kStagingBuffers * kStagingBytes +
                                       2 * kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch) + sizeof(int32_t);
};

struct TileCoord {
  int expert;
  int row0;  // first row of this CTA's tile in A and the output
  int rows;  // rows of the tile inside the segment (<= kM; <= 0 when the tile is past its end)
  int n0;    // first output column
};

// Maps increasing linear cluster-tile indices to this CTA's tiles, reading the segment offsets
// from global memory as it moves forward through the experts (no table, so any expert count).
// A cluster tile is kClusterM vertically adjacent m-tiles; CTA r of the cluster takes the r-th.
template <int kClusterM>
class TileWalker {
 public:
  __device__ TileWalker(const int32_t* offsets, int num_experts, int n_tiles, int n_tile_cols, int group_m,
                        int cta_rank)
      : offsets_(offsets), num_experts_(num_experts), n_tiles_(n_tiles), n_tile_cols_(n_tile_cols),
        group_pairs_(max(1, group_m / kClusterM)), cta_rank_(cta_rank) {
    load_expert();
  }

  // False once `tile` is past the last expert's tiles.
  __device__ bool at(int64_t tile, TileCoord& c) {
    using Tile = ExpertGemmTile;
    while (expert_ < num_experts_ && tile >= first_ + int64_t(pairs_) * n_tiles_) {
      first_ += int64_t(pairs_) * n_tiles_;
      ++expert_;
      load_expert();
    }
    if (expert_ >= num_experts_) return false;
    const int local = int(tile - first_);
    const int group = local / (group_pairs_ * n_tiles_);
    const int group_first = group * group_pairs_;
    const int group_size = min(group_pairs_, pairs_ - group_first);
    const int in_group = local - group * group_pairs_ * n_tiles_;
    const int pair = group_first + in_group % group_size;
    const int n_tile = in_group / group_size;
    c.expert = expert_;
    c.row0 = seg_begin_ + (pair * kClusterM + cta_rank_) * Tile::kM;
    c.rows = min(Tile::kM, seg_end_ - c.row0);
    c.n0 = n_tile * n_tile_cols_;
    return true;
  }

 private:
  __device__ void load_expert() {
    if (expert_ >= num_experts_) return;
    constexpr int kRows = ExpertGemmTile::kM * kClusterM;
    seg_begin_ = __ldg(offsets_ + expert_);
    seg_end_ = __ldg(offsets_ + expert_ + 1);
    const int rows = seg_end_ - seg_begin_;
    pairs_ = rows > 0 && seg_begin_ >= 0 ? (rows + kRows - 1) / kRows : 0;
  }

  const int32_t* offsets_;
  int num_experts_;
  int n_tiles_;
  int n_tile_cols_;
  int group_pairs_;
  int cta_rank_;
  int expert_ = 0;
  int64_t first_ = 0;  // cluster tiles of the experts before expert_
  int seg_begin_ = 0, seg_end_ = 0, pairs_ = 0;
};

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// act for a pair of gate and up values already rounded to bf16 (so act is exactly
// swiglu_forward_kernel(gate_up)).
__device__ __forceinline__ uint32_t swiglu_pair(uint32_t gate, uint32_t up) {
  const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(&up);
  return pack_bf16x2(swiglu_value(__low2float(g), __low2float(u)), swiglu_value(__high2float(g), __high2float(u)));
}

// The four lanes of a quad hold one row's bf16 pairs of four 8-column groups: lane s has v[i] =
// columns 8 * i + 2 * s, + 1 (i = 0..3). A 4x4 transpose across the quad gives lane q all of group
// q: 16 contiguous bytes, so the row is written with 16-byte stores covering whole sectors
// instead of 4-byte stores covering halves. In round r lane q reads lane (q - r) & 3, which sends
// its pair for group q; register indices are selected, never computed, to stay in registers.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&v)[4], int q) {
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int send_index = (q + r) & 3;
    const uint32_t send = send_index == 0 ? v[0] : send_index == 1 ? v[1] : send_index == 2 ? v[2] : v[3];
    const int source = (q - r) & 3;
    const uint32_t got = __shfl_sync(0xffffffffu, send, source, 4);
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = source == t ? got : w[t];
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

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

struct EpilogueMaps {
  const CUtensorMap* out;   // store: (num_rows, n_out); SwiGLU: act (num_rows, n_out)
  const CUtensorMap* gate;  // SwiGLU: the gate half of gate_up, (num_rows, n_out) with row stride 2 n_out
  const CUtensorMap* up;    // SwiGLU: the up half
};

// Visits this thread's share of 128 columns of its two rows: 8-column groups first_group ..
// first_group + 3, as 16-byte chunks after the quad transpose. pair(j, h) gives the bf16 pair of
// group j, row half h; write(h, r, column, chunk) gets row r of the warpgroup's 64 and the chunk's
// first column counted from the first group's.
template <typename PairFn, typename WriteFn>
__device__ __forceinline__ void for_each_chunk(int thread, int first_group, PairFn pair, WriteFn write) {
  const int warp = thread / 32, lane = thread % 32, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      uint32_t v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = pair(4 * (first_group + g) + i, h);
      write(r, 32 * g + 8 * q, quad_transpose(v, q));
    }
  }
}

// Into the staging buffer: two 64 x 64 boxes with 128-byte swizzle, the layout the TMA store reads
// (row r's 16-byte chunk c sits at chunk c ^ (r % 8), so the eight rows a stmatrix phase writes
// spread over all banks). The accumulator fragment is the stmatrix fragment: the 8x8 matrix of
// column group j, row half h is pair(j, h) in every lane, so one stmatrix.x4 writes groups j and
// j + 1 of the warp's 16 rows, without shuffles. first_group counts 32-column blocks (0 or 4).
template <typename PairFn>
__device__ __forceinline__ void stage_columns(uint8_t* staging, int thread, int first_group, PairFn pair) {
  const int warp = thread / 32, lane = thread % 32;
  const int matrix = lane / 8;  // the matrix whose row this lane addresses: (group + matrix / 2, half matrix % 2)
  const int r = 16 * warp + 8 * (matrix % 2) + lane % 8;
#pragma unroll
  for (int g = 0; g < 16; g += 2) {
    const int group = g + matrix / 2;  // 8-column group inside the 128 columns
    const int box = group / 8, chunk = group % 8;
    uint8_t* row_address = staging + box * ExpertGemmTile::kStoreBoxBytes + r * 128 + ((chunk ^ (r & 7)) << 4);
    const int j = 4 * first_group + g;
    sm90::stmatrix_x4(row_address, pair(j, 0), pair(j, 1), pair(j + 1, 0), pair(j + 1, 1));
  }
}

// Straight to global memory, masked to the rows inside the segment and the columns < n_out: the
// epilogue of a warpgroup whose rows are not all inside the segment (a TMA box cannot be masked,
// and the rows past the segment belong to the next expert). Every lane runs the shuffles.
template <typename PairFn>
__device__ __forceinline__ void write_columns_direct(__nv_bfloat16* base, int64_t row_stride, const TileCoord& c,
                                                     const ExpertGemmParams& p, int consumer, int thread,
                                                     int first_group, int col0, PairFn pair) {
  for_each_chunk(thread, first_group, pair, [&](int r, int column, uint4 chunk) {
    const int row_in_tile = 64 * consumer + r;
    const int64_t row = int64_t(c.row0) + row_in_tile;
    const int col = col0 + column;
    if (row_in_tile < c.rows && row >= 0 && row < p.num_rows && col < p.n_out) {
      *reinterpret_cast<uint4*>(base + row * row_stride + col) = chunk;
    }
  });
}

template <GemmEpilogue kEpilogue>
__device__ __forceinline__ void store_rows_direct(const uint32_t (&packed)[64], const TileCoord& c,
                                                  const ExpertGemmParams& p, int consumer, int thread) {
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  if constexpr (kEpilogue == GemmEpilogue::kStore) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      write_columns_direct(out, p.n_out, c, p, consumer, thread, 4 * half, c.n0 + 128 * half,
                           [&](int j, int h) { return packed[2 * j + h]; });
    }
  } else {
    auto* gate = static_cast<__nv_bfloat16*>(p.gate_up);
    const int64_t stride = 2 * int64_t(p.n_out);
    write_columns_direct(gate, stride, c, p, consumer, thread, 0, c.n0, [&](int j, int h) { return packed[2 * j + h]; });
    write_columns_direct(gate + p.n_out, stride, c, p, consumer, thread, 0, c.n0,
                         [&](int j, int h) { return packed[2 * (j + 16) + h]; });
    write_columns_direct(out, p.n_out, c, p, consumer, thread, 0, c.n0,
                         [&](int j, int h) { return swiglu_pair(packed[2 * j + h], packed[2 * (j + 16) + h]); });
  }
}

// The warpgroup's staging buffers, used in turn; a buffer is free once the TMA store that last read
// it has read it (with two buffers: every store but the newest).
class StagingRing {
 public:
  __device__ StagingRing(uint8_t* buffers, int consumer, int thread)
      : buffers_(buffers), consumer_(consumer), thread_(thread) {}

  __device__ uint8_t* acquire() {
    using Tile = ExpertGemmTile;
    if (thread_ == 0) sm90::bulk_wait_read<Tile::kStagingBuffers - 1>();
    sm90::named_barrier_sync(1 + consumer_, 128);
    uint8_t* buffer = buffers_ + next_ * Tile::kStagingBytes;
    next_ = (next_ + 1) % Tile::kStagingBuffers;
    return buffer;
  }

 private:
  uint8_t* buffers_;
  int consumer_, thread_;
  int next_ = 0;
};

// Hands the staged 64 x 128 block to two TMA stores at (col, row) of `map`.
__device__ __forceinline__ void store_staged(const CUtensorMap* map, const uint8_t* staging, int consumer, int thread,
                                             int col, int row) {
  sm90::fence_async_shared();
  sm90::named_barrier_sync(1 + consumer, 128);
  if (thread == 0) {
    sm90::tma_store_2d(map, staging, col, row);
    sm90::tma_store_2d(map, staging + ExpertGemmTile::kStoreBoxBytes, col + ExpertGemmTile::kStoreBox, row);
    sm90::bulk_commit_group();
  }
}

// The epilogue of a warpgroup whose 64 rows all lie inside the segment, through TMA stores
// (columns past n_out fall outside the tensor maps and are not written).
template <GemmEpilogue kEpilogue>
__device__ __forceinline__ void store_rows_staged(const uint32_t (&packed)[64], const TileCoord& c, const EpilogueMaps& maps,
                                                  StagingRing& ring, int consumer, int thread) {
  const int row = c.row0 + 64 * consumer;
  if constexpr (kEpilogue == GemmEpilogue::kStore) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint8_t* staging = ring.acquire();
      stage_columns(staging, thread, 4 * half, [&](int j, int h) { return packed[2 * j + h]; });
      store_staged(maps.out, staging, consumer, thread, c.n0 + 128 * half, row);
    }
  } else {
    uint8_t* staging = ring.acquire();
    stage_columns(staging, thread, 0, [&](int j, int h) { return packed[2 * j + h]; });
    store_staged(maps.gate, staging, consumer, thread, c.n0, row);
    staging = ring.acquire();
    stage_columns(staging, thread, 0, [&](int j, int h) { return packed[2 * (j + 16) + h]; });
    store_staged(maps.up, staging, consumer, thread, c.n0, row);
    staging = ring.acquire();
    stage_columns(staging, thread, 0, [&](int j, int h) { return swiglu_pair(packed[2 * j + h], packed[2 * (j + 16) + h]); });
    store_staged(maps.out, staging, consumer, thread, c.n0, row);
  }
}

// The SwiGLU-backward epilogue (dgrad of down): grad_gate_up = swiglu_backward(gate_up, grad_act)
// for the warpgroup's rows inside the segment. Per 128 columns the rounded grad_act goes through
// the staging buffer, so each thread then takes whole 16-byte chunks of a row: grad_act from shared
// memory, gate and up with 16-byte loads, d gate and d up with 16-byte stores (16 threads cover
// 256 contiguous bytes of a row). Rows past the segment or the rows, and columns past n_out, are
// neither read nor written.
__device__ __forceinline__ void swiglu_backward_epilogue(const uint32_t (&packed)[64], const TileCoord& c,
                                                         const ExpertGemmParams& p, StagingRing& ring, int consumer,
                                                         int thread) {
  using Tile = ExpertGemmTile;
  constexpr int kChunksPerRow = 128 / 8;
  const auto* gate_up = static_cast<const __nv_bfloat16*>(p.gate_up);
  auto* grad_gate_up = static_cast<__nv_bfloat16*>(p.out);
  const int64_t row_stride = 2 * int64_t(p.n_out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint8_t* staging = ring.acquire();  // also: every thread is done with the previous half's block
    stage_columns(staging, thread, 4 * half, [&](int j, int h) { return packed[2 * j + h]; });
    sm90::named_barrier_sync(1 + consumer, 128);
    // Unrolled: all eight chunks' gate and up loads in flight at once.
#pragma unroll
    for (int i = 0; i < 64 * kChunksPerRow / 128; ++i) {
      const int chunk = thread + 128 * i;
      const int r = chunk / kChunksPerRow, cc = chunk % kChunksPerRow;
      const int64_t row = int64_t(c.row0) + 64 * consumer + r;
      const int col = c.n0 + 128 * half + 8 * cc;
      if (64 * consumer + r >= c.rows || row >= p.num_rows || col >= p.n_out) continue;
      const int box = cc / 8, box_chunk = cc % 8;
      const uint4 d = *reinterpret_cast<const uint4*>(staging + box * Tile::kStoreBoxBytes + r * 128 +
                                                      ((box_chunk ^ (r & 7)) << 4));
      const auto* source = gate_up + row * row_stride + col;
      const uint4 g = __ldg(reinterpret_cast<const uint4*>(source));
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(source + p.n_out));
      uint4 dg, du;
      swiglu_backward_pair(d.x, g.x, u.x, dg.x, du.x);
      swiglu_backward_pair(d.y, g.y, u.y, dg.y, du.y);
      swiglu_backward_pair(d.z, g.z, u.z, dg.z, du.z);
      swiglu_backward_pair(d.w, g.w, u.w, dg.w, du.w);
      auto* target = grad_gate_up + row * row_stride + col;
      *reinterpret_cast<uint4*>(target) = dg;
      *reinterpret_cast<uint4*>(target + p.n_out) = du;
    }
  }
}

// The SwiGLU-backward epilogue reads the tile's gate and up values: row r of the warpgroup's 64
// starts fetching its two spans into L2 when the tile starts, so they arrive during the mainloop
// instead of stalling the epilogue on DRAM.
__device__ __forceinline__ void prefetch_gate_up_row(const TileCoord& c, const ExpertGemmParams& p, int consumer, int r) {
  const int64_t row = int64_t(c.row0) + 64 * consumer + r;
  if (64 * consumer + r >= c.rows || row < 0 || row >= p.num_rows) return;
  const auto* gate = static_cast<const __nv_bfloat16*>(p.gate_up) + row * 2 * int64_t(p.n_out) + c.n0;
  const uint32_t bytes = uint32_t(min(ExpertGemmTile::kN, p.n_out - c.n0)) * 2;  // n_out % 8 == 0
  sm90::prefetch_l2_bulk(gate, bytes);
  sm90::prefetch_l2_bulk(gate + p.n_out, bytes);
}

// A consumer warpgroup is done reading a stage: tell the producers of every CTA of the cluster.
template <int kClusterM>
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  if constexpr (kClusterM == 1) {
    sm90::mbarrier_arrive(empty);
  } else {
#pragma unroll
    for (int r = 0; r < kClusterM; ++r) sm90::mbarrier_arrive_in_cta(empty, r);
  }
}

// The rows the dispatch writes: those below the last segment's end (no tile stores a row past it).
// Row indices fit in 32 bits (the op checks rows < 2^31).
__device__ __forceinline__ int dispatched_rows_end(const ExpertGemmParams& p) {
  return min(p.num_rows, max(0, __ldg(p.expert_offsets + p.num_experts)));
}

// Chunks of minibatch m: its rows below rows_end, in kDispatchChunkRows-row pieces.
__device__ __forceinline__ int minibatch_chunks(const ExpertGemmDispatch& d, int m, int rows_end) {
  const int begin = m * d.minibatch_rows;
  const int end = min(begin + d.minibatch_rows, rows_end);
  return end > begin ? (end - begin + ExpertGemmTile::kDispatchChunkRows - 1) / ExpertGemmTile::kDispatchChunkRows : 0;
}

// The counters of the dispatch, each (num_minibatches,): chunks claimed, chunks written, and rows
// loaded by the GEMM's tiles (once per n-tile: the ring slot is free when it reaches
// n_tiles * the minibatch's segment rows).
__device__ __forceinline__ int32_t* claimed_chunks(const ExpertGemmDispatch& d) { return d.counters; }
__device__ __forceinline__ int32_t* done_chunks(const ExpertGemmDispatch& d) { return d.counters + d.num_minibatches; }
__device__ __forceinline__ int32_t* consumed_rows(const ExpertGemmDispatch& d) {
  return d.counters + 2 * d.num_minibatches;
}

// Where dispatched row `row` sits in the ring. Ring positions [0, kM) are also mirrored at
// [ring_rows, ring_rows + kM), so a tile's 128-row TMA box that starts near the ring's end reads
// the rows that follow it (the next minibatch's, at the ring's start) instead of running off it.
__device__ __forceinline__ int ring_position(const ExpertGemmDispatch& d, int row) { return row % d.ring_rows; }

// Rows of [begin, end) inside the segments: with non-decreasing offsets from offsets[0] >= 0 (the
// ops' contract, as the schedule makes them) the segments tile [offsets[0], rows_end), and the
// walker's tiles cover each of those rows once per n-tile. What a minibatch's consumed counter
// reaches. (Offsets outside the contract are the caller's bug, as for the GEMM itself: gaps leave
// the counter short, and the bounded wait names kWaitRingSlot; overlapping segments count rows
// twice and may free a slot early, when their outputs are ill-defined anyway.)
__device__ __forceinline__ int segment_rows_in(const ExpertGemmParams& p, int begin, int end) {
  return max(0, end - max(begin, __ldg(p.expert_offsets)));
}

// A tile has loaded all its rows (its last K block's stage is full): count its rows, per minibatch
// they lie in, so the dispatchers may reuse the ring slots. Rows past the segment are not counted
// (nothing stored depends on them; they may be overwritten while loading).
__device__ __forceinline__ void count_consumed_rows(const ExpertGemmParams& p, const TileCoord& c) {
  const ExpertGemmDispatch& d = p.dispatch;
  const int rows_end = dispatched_rows_end(p);
  const int end = min(c.row0 + c.rows, rows_end);
  // The loads are complete (this thread saw every stage of the tile full); a release add carries
  // that to the dispatchers' acquire, after which they fence the async proxy and overwrite the slot.
  // (A relaxed add measured the same.)
  for (int row = c.row0; row < end;) {
    const int m = row / d.minibatch_rows;
    const int next = min(end, (m + 1) * d.minibatch_rows);
    sm90::red_release_gpu_add(consumed_rows(d) + m, next - row);
    row = next;
  }
}

// The token whose row x holds for dispatched row `row`, or -1 (padding, or a route past x).
__device__ __forceinline__ int64_t dispatched_token(const ExpertGemmDispatch& d, int row) {
  const int64_t route = d.slot_to_route[row];
  const int64_t token = route >= 0 ? route / d.topk : -1;
  return token < d.x_rows ? token : -1;
}

// Copies one dispatched row (`units` 16-byte units; zeros when src is null) with the 64 dispatch
// threads, unrolled four deep (at the producer's 40 registers ptxas keeps two loads in flight).
__device__ __forceinline__ void copy_row(const uint4* src, uint4* dst, int units, int g) {
  constexpr int kThreads = ExpertGemmTile::kDispatchThreads, kUnroll = 4;
  for (int u0 = g; u0 < units; u0 += kUnroll * kThreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = u0 + j * kThreads;
      v[j] = src != nullptr && u < units ? __ldg(src + u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = u0 + j * kThreads;
      if (u < units) dst[u] = v[j];
    }
  }
}

// The dispatch threads (warps 2 and 3 of warpgroup 0) of every CTA: minibatch after minibatch,
// wait until the minibatch's ring slot is free, claim a chunk of kDispatchChunkRows rows, copy them
// (the pull dispatch: ring[position(r)] = x[slot_to_route[r] / topk], zeros for -1), and count the
// chunk done. Only rows below the last segment's end are written; no tile stores a row past it.
//
// Progress: chunks are claimed, not assigned, so a tile only ever waits for chunks that running
// CTAs claimed. A dispatcher waits for a ring slot only before claiming in a new minibatch m, when
// every chunk of minibatches < m is claimed and therefore written; the slot waits for the tiles of
// minibatch m - ring_minibatches, and every tile a CTA runs before those lies in minibatches
// < m when ring_minibatches exceeds the minibatches one raster group spans (the op checks it).
// So the dispatch never waits on itself. Without the ring (ring_minibatches = num_minibatches) the
// launch need not be co-resident at all; with it, the CTAs holding the tiles of an old minibatch
// must get an SM eventually (a CTA waits at most for the GPU's other work, then the bounded wait
// reports kWaitRingSlot).
__device__ __forceinline__ void dispatch_rows_ahead(const ExpertGemmParams& p, int32_t* claimed_chunk, int n_tiles,
                                                    int g, sm90::WaitWatch* watch) {
  using Tile = ExpertGemmTile;
  constexpr int kDispatchBarrier = 3;  // named barriers 1 and 2 are the consumers'
  const ExpertGemmDispatch& d = p.dispatch;
  const int rows_end = dispatched_rows_end(p);
  const int units = p.k / 8;
  const auto* x = static_cast<const uint4*>(d.x);
  auto* rows = static_cast<uint4*>(d.rows);
  volatile int32_t* claimed = claimed_chunk;
  for (int m = 0; m < d.num_minibatches; ++m) {
    const int begin = m * d.minibatch_rows;
    const int end = min(begin + d.minibatch_rows, rows_end);
    const int chunks = minibatch_chunks(d, m, rows_end);
    if (m >= d.ring_minibatches && chunks > 0) {
      const int old = m - d.ring_minibatches;
      if (g == 0) {
        const int old_begin = old * d.minibatch_rows;
        const int old_rows = segment_rows_in(p, old_begin, min(old_begin + d.minibatch_rows, rows_end));
        sm90::wait_counter_at_least(consumed_rows(d) + old, n_tiles * old_rows, kWaitRingSlot, watch);
      }
      sm90::named_barrier_sync(kDispatchBarrier, Tile::kDispatchThreads);
      // The tiles' TMA reads of the slot are done; every writing thread orders them before its
      // ordinary writes.
      sm90::fence_proxy_async_global();
    }
    while (true) {
      if (g == 0) *claimed = atomicAdd(claimed_chunks(d) + m, 1);
      sm90::named_barrier_sync(kDispatchBarrier, Tile::kDispatchThreads);
      const int chunk = *claimed;
      sm90::named_barrier_sync(kDispatchBarrier, Tile::kDispatchThreads);  // read before the next claim
      if (chunk >= chunks) break;
      const int first = begin + chunk * Tile::kDispatchChunkRows;
      const int last = min(first + Tile::kDispatchChunkRows, end);
      // Every source row of the chunk in flight to L2 at once; the copy below then reads from L2
      // (64 threads with a few loads each in flight could not keep DRAM busy on their own).
      if (g < last - first) {
        const int64_t token = dispatched_token(d, first + g);
        if (token >= 0) sm90::prefetch_l2_bulk(x + token * units, uint32_t(units) * 16);
      }
      for (int row = first; row < last; ++row) {
        const int64_t token = dispatched_token(d, row);
        copy_row(token >= 0 ? x + token * units : nullptr, rows + int64_t(ring_position(d, row)) * units, units, g);
      }
      // The ring's first m-tile again past its end (a separate pass: the copy loop above has no
      // registers to spare for a second destination; these are 128 rows per turn of the ring).
      for (int row = first; row < last && d.ring_mirrored; ++row) {
        const int position = ring_position(d, row);
        if (position >= Tile::kM) continue;
        const int64_t token = dispatched_token(d, row);
        copy_row(token >= 0 ? x + token * units : nullptr, rows + int64_t(d.ring_rows + position) * units, units, g);
      }
      // Other SMs read these rows with TMA (async proxy) once the chunk is counted.
      sm90::fence_proxy_async_global();
      sm90::named_barrier_sync(kDispatchBarrier, Tile::kDispatchThreads);
      if (g == 0) {
        __threadfence();
        sm90::red_release_gpu_add(done_chunks(d) + m, 1);
      }
    }
  }
  // The watchdog stays up until the dispatchers are done too (their ring waits are bounded waits).
  if (g == 0) sm90::mark_finished(watch);
}

// The producer's wait before loading a tile's rows: every minibatch up to the one holding the tile's
// last stored row is done (rows past the segment are loaded but never stored, so need not be).
// `ready` counts the minibatches already seen done; they complete in order of minibatch almost
// always, and waiting in order costs nothing otherwise.
__device__ __forceinline__ void wait_for_dispatched_rows(const ExpertGemmParams& p, const TileCoord& c, int& ready,
                                                         sm90::WaitWatch* watch) {
  if (c.rows <= 0) return;
  const ExpertGemmDispatch& d = p.dispatch;
  // (Clamped: offsets past the rows are a caller's bug the op does not check on the device; they
  // must not send this wait past the counters.)
  const int last = min((c.row0 + c.rows - 1) / d.minibatch_rows, d.num_minibatches - 1);
  if (last < ready) return;
  const int rows_end = dispatched_rows_end(p);
  for (; ready <= last; ++ready) {
    sm90::wait_counter_at_least(done_chunks(d) + ready, minibatch_chunks(d, ready, rows_end),
                                kWaitDispatchedRows, watch);
  }
  sm90::fence_proxy_async_global();
}

// kClusterM: 1, or 2 CTAs sharing each B slice through TMA multicast (see the file comment).
// kDispatchA: the kernel also dispatches A's rows (p.dispatch) and loads each tile's once they are written.
// kTransB: B is MN-major, (experts, K, N) with N contiguous, through a 3-D tensor map (the dgrad
// GEMMs: d act = d out . fc2[e], d rows = d gate_up . fc1[e]); clusters of 1 only.
template <GemmEpilogue kEpilogue, int kClusterM, bool kDispatchA, bool kTransB = false>
__global__ void __launch_bounds__(ExpertGemmTile::kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                       const __grid_constant__ CUtensorMap out_map, const __grid_constant__ CUtensorMap gate_map,
                       const __grid_constant__ CUtensorMap up_map, const ExpertGemmParams p) {
  using Tile = ExpertGemmTile;
  static_assert(!kTransB || (kClusterM == 1 && !kDispatchA && kEpilogue != GemmEpilogue::kSwiglu),
                "MN-major B: the dgrad GEMMs, clusters of 1");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) & ~uintptr_t(Tile::kSwizzleAlign - 1));
  uint8_t* a_stages = smem;
  uint8_t* b_stages = a_stages + Tile::kStages * Tile::kABytes;
  uint8_t* staging_buffers = b_stages + Tile::kStages * Tile::kBBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging_buffers + 2 * Tile::kStagingBuffers * Tile::kStagingBytes);
  uint64_t* empty = full + Tile::kStages;
  sm90::WaitWatch* watch = reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages);
  int32_t* claimed_chunk = reinterpret_cast<int32_t*>(watch + 1);  // the dispatchers' claim, broadcast

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);  // the producer's expect_tx arrival (+ TMA bytes)
      sm90::mbarrier_init(&empty[s], 2 * kClusterM);  // each consumer warpgroup of the cluster
    }
    sm90::fence_barrier_init();
    watch->failed = 0;
    watch->finished = 0;
  }
  if (threadIdx.x == 32) {
    sm90::prefetch_tensor_map(&a_map);
    sm90::prefetch_tensor_map(&b_map);
    sm90::prefetch_tensor_map(&out_map);
  }
  // Both CTAs' barriers exist before either multicasts into or arrives on the other's.
  sm90::cluster_sync();

  constexpr int kTileCols = Tile::n_out<kEpilogue>();
  const int n_tiles = (p.n_out + kTileCols - 1) / kTileCols;
  const int k_blocks = (p.k + Tile::kK - 1) / Tile::kK;
  const int cta_rank = int(sm90::cluster_cta_rank());
  const int first_tile = int(sm90::cluster_index()), tile_step = int(sm90::cluster_count());
  TileWalker<kClusterM> walker(p.expert_offsets, p.num_experts, n_tiles, kTileCols, p.group_m, cta_rank);
  TileCoord c;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
    if (threadIdx.x == 32) {
      sm90::watch_waits(watch, Tile::kRoles + (kDispatchA ? 1 : 0), p.failure_record, kExpertGemmKernel);
    }
    if constexpr (kDispatchA) {
      if (threadIdx.x >= 128 - Tile::kDispatchThreads) {
        dispatch_rows_ahead(p, claimed_chunk, n_tiles, threadIdx.x - (128 - Tile::kDispatchThreads), watch);
        return;
      }
    }
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    constexpr uint16_t kClusterMask = (1u << kClusterM) - 1;
    int dispatched_minibatches = 0;
    for (int64_t tile = first_tile; walker.at(tile, c); tile += tile_step) {
      if constexpr (kDispatchA) wait_for_dispatched_rows(p, c, dispatched_minibatches, watch);
      const int a_row = kDispatchA ? ring_position(p.dispatch, c.row0) : c.row0;
      // This CTA's half of B: the first 128 rows of the slice, or the second (SwiGLU: the up rows
      // partnering gate rows [n0, n0 + 128), n_out rows further).
      int b_row = c.expert * p.n_weight_rows + c.n0;
      if (cta_rank == 1) b_row += kEpilogue == GemmEpilogue::kSwiglu ? p.n_out : Tile::kN / 2;
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&empty[stage], phase ^ 1, kWaitFreeStage, watch);
        sm90::mbarrier_arrive_expect_tx(&full[stage], Tile::kStageBytes);
        sm90::tma_load_2d(a_stages + stage * Tile::kABytes, &a_map, &full[stage], kb * Tile::kK, a_row);
        uint8_t* b = b_stages + stage * Tile::kBBytes;
        if constexpr (kTransB) {
          // Boxes of 64 N x 64 K at (n, k, expert); K rows past the expert's are zeros.
#pragma unroll
          for (int j = 0; j < Tile::kN / 64; ++j) {
            sm90::tma_load_3d(b + j * Tile::kBBoxBytes, &b_map, &full[stage], c.n0 + 64 * j, kb * Tile::kK, c.expert);
          }
        } else if constexpr (kClusterM == 1) {
          const int b_row_second = b_row + (kEpilogue == GemmEpilogue::kSwiglu ? p.n_out : Tile::kN / 2);
          sm90::tma_load_2d(b, &b_map, &full[stage], kb * Tile::kK, b_row);
          sm90::tma_load_2d(b + Tile::kBHalfBytes, &b_map, &full[stage], kb * Tile::kK, b_row_second);
        } else {
          sm90::tma_load_2d_multicast(b + cta_rank * Tile::kBHalfBytes, &b_map, &full[stage], kb * Tile::kK, b_row,
                                      kClusterMask);
        }
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    // Every stage released by all consumers of the cluster: no remote arrival is still to come.
    for (int i = 0; i < Tile::kStages; ++i) {
      sm90::mbarrier_wait(&empty[stage], phase ^ 1, kWaitFreeStage, watch);
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
    sm90::mark_finished(watch);
    return;
  }

  sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % 128;
  float acc[128];
  int stage = 0;
  uint32_t phase = 0;
  StagingRing staging(staging_buffers + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
  const EpilogueMaps maps{&out_map, &gate_map, &up_map};
  for (int64_t tile = first_tile; walker.at(tile, c); tile += tile_step) {
    int previous_stage = 0;
    // Defined afresh per tile (the first wgmma ignores them anyway), so the compiler does not keep
    // the previous tile's accumulators alive through its epilogue.
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    if constexpr (kEpilogue == GemmEpilogue::kSwigluBackward) {
      if (thread < 64) prefetch_gate_up_row(c, p, consumer, thread);
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
      sm90::mbarrier_wait(&full[stage], phase, kWaitLoadedStage, watch);
      const uint64_t a_desc = sm90::smem_descriptor_sw128(a_stages + stage * Tile::kABytes + consumer * 64 * 128);
      const uint64_t b_desc = kTransB ? sm90::smem_descriptor_sw128_mn(b_stages + stage * Tile::kBBytes, Tile::kBBoxBytes)
                                      : sm90::smem_descriptor_sw128(b_stages + stage * Tile::kBBytes);
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
      // The previous K block's wgmma group has finished reading its stage: hand it back.
      sm90::wgmma_wait_group<1>();
      if (kb > 0 && thread == 0) release_stage<kClusterM>(&empty[previous_stage]);
      previous_stage = stage;
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
    sm90::wgmma_wait_group<0>();
    sm90::fence_accumulators(acc);
    if (thread == 0) release_stage<kClusterM>(&empty[previous_stage]);
    if constexpr (kDispatchA) {
      // Every stage of the tile was full: all its rows were loaded, and their ring slot may be refilled.
      if (consumer == 0 && thread == 0) count_consumed_rows(p, c);
    }
    // Rounded once to bf16 pairs: packed[2 * j + h] holds columns 8 * j + 2 * (l % 4) + {0, 1} of
    // row half h; half the registers of the fp32 accumulators for the rest of the epilogue.
    uint32_t packed[64];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
    if constexpr (kEpilogue == GemmEpilogue::kSwigluBackward) {
      if (c.rows > 64 * consumer) swiglu_backward_epilogue(packed, c, p, staging, consumer, thread);
    } else if (c.rows >= 64 * (consumer + 1)) {
      store_rows_staged<kEpilogue>(packed, c, maps, staging, consumer, thread);
    } else if (c.rows > 64 * consumer) {
      store_rows_direct<kEpilogue>(packed, c, p, consumer, thread);
    }
  }
  if (thread == 0) {
    sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
    sm90::mark_finished(watch);
  }
}

}  // namespace mok
