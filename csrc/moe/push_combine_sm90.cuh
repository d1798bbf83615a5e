// The push combine of the in-kernel exchange and the region pull: plain copies between this rank's
// memory and its peers' symmetric regions (comm/symmetric.py), no arithmetic, so any element type
// moves as its bytes. Each kernel is a template on its copy unit U: 16 bytes (uint4) where every
// row and base allows it, else the element's size.
//   push_rows_kernel       one owner's per-row results into the sources' combine tables, each row
//                          to the unique slot t * topk + k of its route (PushRowsParams): written by
//                          exactly one thread of one rank, so nothing is summed across ranks and
//                          the sources' fixed-order combine stays bitwise that of EP = 1.
//   gather_regions_kernel  every rank's copy of one small region (the top-k ids) into one tensor.
#pragma once

#include <cstdint>

#include "common/limits.h"
#include "mok_params.h"
#include "moe/row_source_sm90.cuh"

namespace mok {

constexpr int kPushThreads = 128;
// Loads of a thread in flight before its stores: the loads are this rank's (HBM, ~1 us), the stores
// go to a peer and are posted, so only the loads' latency has to be covered.
constexpr int kPushUnroll = 4;

// One block per row of the schedule (grid-stride): the row's bytes to the slot of its route.
template <typename U>
__global__ void __launch_bounds__(kPushThreads) push_rows_kernel(const PushRowsParams p) {
  const int64_t group_routes = p.num_ranks * p.routes_per_rank;
  for (int64_t slot = blockIdx.x; slot < p.num_slots; slot += gridDim.x) {
    const int64_t route = p.slot_to_route[slot];  // (uniform over the block)
    if (route < 0) continue;                      // padding: no route, nothing to return
    if (route >= group_routes) __trap();          // a route past the group's is a schedule bug
    const BlockRow at = locate_block_row(route, p.routes_per_rank, p.num_ranks);  // (source rank, t * topk + k)
    U* dst = static_cast<U*>(pick_rank(p.peer_tables, at.block)) + at.row * p.row_units;
    const U* src = static_cast<const U*>(p.slot_rows) + slot * p.row_units;
    for (int64_t u0 = threadIdx.x; u0 < p.row_units; u0 += kPushUnroll * kPushThreads) {
      U v[kPushUnroll];
#pragma unroll
      for (int j = 0; j < kPushUnroll; ++j) {
        const int64_t u = u0 + j * kPushThreads;
        if (u < p.row_units) v[j] = src[u];
      }
#pragma unroll
      for (int j = 0; j < kPushUnroll; ++j) {
        const int64_t u = u0 + j * kPushThreads;
        if (u < p.row_units) dst[u] = v[j];
      }
    }
  }
}

// out[r] = rank r's copy: blockIdx.y is the rank, blocks along x stride over its units.
template <typename U>
__global__ void gather_regions_kernel(const GatherRegionsParams p) {
  const int rank = int(blockIdx.y);
  const U* src = static_cast<const U*>(pick_rank(p.peer_regions, rank));
  U* dst = static_cast<U*>(p.out) + rank * p.units;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.units; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

}  // namespace mok
