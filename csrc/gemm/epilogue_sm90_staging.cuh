// The epilogue building blocks of the sm90 GEMMs: the accumulators (rounded once to bf16 pairs)
// go either through a consumer warpgroup's staging buffer in shared memory and TMA stores, or, for a
// warpgroup whose rows are not all inside its segment, straight to global memory with a row mask.
// (When every SM writes its tile at once the epilogue costs 10-15% of the GEMM;
// docs/log/performance_2026-11.md has what the variants measured.)
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"

namespace mok {

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
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

// Visits this thread's share of kColumns (128 or 192) columns of its two rows: 8-column groups
// 4 * first_group .. + kColumns / 8 - 1, as 16-byte chunks after the quad transpose (a quad's four
// chunks cover 32 columns). pair(j, h) gives the bf16 pair of group j, row half h; write(r, column,
// chunk) gets row r of the warpgroup's 64 and the chunk's first column counted from the first group's.
template <int kColumns = 128, typename PairFn, typename WriteFn>
__device__ __forceinline__ void for_each_chunk(int thread, int first_group, PairFn pair, WriteFn write) {
  static_assert(kColumns % 32 == 0, "whole quads of 8-column groups");
  const int warp = thread / 32, lane = thread % 32, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
    for (int g = 0; g < kColumns / 32; ++g) {
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
// kColumns (128 or 192): the columns staged, in kColumns / 64 boxes.
template <int kColumns = 128, typename PairFn>
__device__ __forceinline__ void stage_columns(uint8_t* staging, int thread, int first_group, PairFn pair) {
  static_assert(kColumns % 64 == 0, "whole 64-column boxes");
  const int warp = thread / 32, lane = thread % 32;
  const int matrix = lane / 8;  // the matrix whose row this lane addresses: (group + matrix / 2, half matrix % 2)
  const int r = 16 * warp + 8 * (matrix % 2) + lane % 8;
#pragma unroll
  for (int g = 0; g < kColumns / 8; g += 2) {
    const int group = g + matrix / 2;  // 8-column group inside the staged columns
    const int box = group / 8, chunk = group % 8;
    uint8_t* row_address = staging + box * ExpertGemmTile::kStoreBoxBytes + r * 128 + ((chunk ^ (r & 7)) << 4);
    const int j = 4 * first_group + g;
    sm90::stmatrix_x4(row_address, pair(j, 0), pair(j, 1), pair(j + 1, 0), pair(j + 1, 1));
  }
}

// Straight to global memory, masked to the rows inside the segment and the output and the columns < n_out: the
// epilogue of a warpgroup whose rows are not all inside the segment (a TMA box cannot be masked,
// and the rows past the segment belong to the next expert). Every lane runs the shuffles.
// kColumns: for_each_chunk's.
template <int kColumns = 128, typename PairFn>
__device__ __forceinline__ void write_columns_direct(__nv_bfloat16* base, int64_t row_stride, const TileCoord& c,
                                                     const OutputExtent& out, int consumer, int thread,
                                                     int first_group, int col0, PairFn pair) {
  for_each_chunk<kColumns>(thread, first_group, pair, [&](int r, int column, uint4 chunk) {
    const int row_in_tile = 64 * consumer + r;
    const int64_t row = int64_t(c.row0) + row_in_tile;
    const int col = col0 + column;
    if (row_in_tile < c.rows && row >= 0 && row < out.num_rows && col < out.n_out) {
      *reinterpret_cast<uint4*>(base + row * row_stride + col) = chunk;
    }
  });
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
    sm90::named_barrier_sync(kConsumerBarrier + consumer_, kNumThreadsPerWarpGroup);
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
  sm90::named_barrier_sync(kConsumerBarrier + consumer, kNumThreadsPerWarpGroup);
  if (thread == 0) {
    sm90::tma_store_2d(map, staging, col, row);
    sm90::tma_store_2d(map, staging + ExpertGemmTile::kStoreBoxBytes, col + ExpertGemmTile::kStoreBox, row);
    sm90::bulk_commit_group();
  }
}

// The epilogues that write a warpgroup's 64 rows through its staging buffer and TMA stores when all
// lie inside the segment, and straight from registers with a row mask otherwise (a TMA box cannot be
// masked, and the rows past the segment belong to the next expert). Epilogue provides
// store_rows_staged(maps, packed, c, ring, consumer, thread) and store_rows_direct(params,
// out_extent, packed, c, consumer, thread).
template <class Epilogue>
struct StagedOrDirectEpilogue {
  template <class Params>
  static __device__ __forceinline__ void before_mainloop(const Params&, const OutputExtent&, const TileCoord&, int,
                                                         int) {}

  template <class Maps, class Params>
  static __device__ __forceinline__ void store(const Maps& m, const Params& e, const OutputExtent& out_extent,
                                               const uint32_t (&packed)[64], const TileCoord& c, StagingRing& ring,
                                               int consumer, int thread) {
    if (c.rows >= 64 * (consumer + 1)) {
      Epilogue::store_rows_staged(m, packed, c, ring, consumer, thread);
    } else if (c.rows > 64 * consumer) {
      Epilogue::store_rows_direct(e, out_extent, packed, c, consumer, thread);
    }
  }
};

// The tile's accumulators rounded once to bf16 pairs: packed[2 * j + h] holds columns
// 8 * j + 2 * (l % 4) + {0, 1} of row half h; half the registers of the fp32 accumulators for the
// rest of the epilogue.
__device__ __forceinline__ void pack_accumulators(const ExpertGemmTile::Accumulators& acc, uint32_t (&packed)[64]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
}

}  // namespace mok
