// Where a dispatched row comes from, for every dispatch (the row gathers of moe/dispatch_sm90.cuh,
// the dispatching GEMM's ring in moe/dispatch_ring_sm90_ws.cuh, the push combine): the group's row
// of a route, and where that row lives when the rows are spread over several equal blocks (the
// ranks' symmetric regions): RowSource (mok_params.h) and its lookups. Usable by any kernel, GEMM dispatch warps included: no division (a 64-bit integer
// division is a subroutine call in SASS, and a call anywhere in a wgmma kernel serializes its
// wgmmas, C7510) and no dynamic index into a by-value parameter array (that copies the parameters
// to local memory; the compare-and-select chains below keep the table in the constant bank).
#pragma once

#include <cstdint>

#include "common/limits.h"
#include "mok_params.h"

namespace mok {

// Row s of a schedule holds route slot_to_route[s] = (src_rank * num_tokens + token) * topk + k
// (-1: padding, a zero row); its source is row route / topk of the group's rows, which
// locate_block_row / source_row below find in the ranks' blocks.
__device__ __forceinline__ int64_t route_source_row(int64_t route, int64_t topk) { return route / topk; }

// Row g of rows laid out in num_blocks blocks of rows_per_block rows each: the block and the row's
// index in it. 7 compares and selects at 8 ranks.
// Index: int64_t in general; int for rows that fit 32 bits (num_blocks * rows_per_block < 2^31), as
// in the dispatching GEMM's dispatch warps, which live on the producer's 40 registers (the 64-bit
// compares measured 20 bytes more spill stores there, 60 more loads).
template <typename Index>
struct BlockRowOf {
  int block;
  Index row;
};
using BlockRow = BlockRowOf<int64_t>;
using BlockRow32 = BlockRowOf<int>;

template <typename Index>
__device__ __forceinline__ BlockRowOf<Index> locate_block_row(Index g, Index rows_per_block, int num_blocks) {
  int block = 0;
  Index first = 0;
#pragma unroll
  for (int b = 1; b < kMaxEpRanks; ++b) {
    if (b < num_blocks && g >= b * rows_per_block) {
      block = b;
      first = b * rows_per_block;
    }
  }
  return {block, g - first};
}

// table[index] for an index in [0, kMaxEpRanks), with static indices only.
template <typename Ptr>
__device__ __forceinline__ Ptr pick_rank(const Ptr (&table)[kMaxEpRanks], int index) {
  Ptr out = table[0];
#pragma unroll
  for (int b = 1; b < kMaxEpRanks; ++b) {
    if (b == index) out = table[b];
  }
  return out;
}

// The first of the `hidden` elements of row g of the group's rows.
template <typename T>
__device__ __forceinline__ const T* source_row(const RowSource& s, int64_t g, int64_t hidden) {
  const BlockRow at = locate_block_row(g, s.rows_per_base, s.num_bases);
  return static_cast<const T*>(pick_rank(s.bases, at.block)) + at.row * hidden;
}

// The routing weights of row g's routes, (topk,) fp32 (the source has weights).
__device__ __forceinline__ const float* source_route_weights(const RowSource& s, int64_t g, int64_t topk) {
  const BlockRow at = locate_block_row(g, s.rows_per_base, s.num_bases);
  return pick_rank(s.weight_bases, at.block) + at.row * topk;
}

}  // namespace mok
