// Row dispatch (token-major) for one rank's schedule: the rows of the schedule pulled from the
// gathered tokens, and the reverse-combine pull of dY (the same gather, scaled by the routing
// weights). Reference: dispatch_rows / pull_route_grads in megatron_mok/backends/reference.py.
// Every output row is written by exactly one thread; no atomics.
//
// The group's rows come from one tensor (GatherRowsParams: src, weights) or straight from the
// ranks' symmetric regions (PeerGatherRowsParams: a RowSource, moe/row_source_sm90.cuh): each
// kernel is one template with an instantiation per form, and the one-tensor form reads its tensor
// directly (no region lookup). Peer reads take a microsecond or more over NVLink, so what keeps the link busy is bytes
// in flight: a launch of these kernels fills the GPU (16 blocks of 128 threads per SM, one 16-byte
// load each in flight per pass), ~32 KB per SM, ~4 MB over 132 SMs, against the ~0.7 MB that
// ~370 GB/s at ~2 us needs.
#pragma once

#include "common/vec_utils.cuh"
#include "mok_params.h"
#include "moe/row_source_sm90.cuh"

namespace mok {

// Dispatch (no weights) and the reverse-combine pull of dY (weights): row s of the schedule takes
// the row of its route's token, scaled by the route's weight when `weights` is given (fp32
// multiply, rounded once); padding rows are zero. Three launches, each output row written by one:
//   invert_slots_kernel: route_slot[route] = s for every routed row s (route_slot starts at -1);
//   fill_unscattered_rows_kernel: rows whose route is -1 become zeros (a route past the source
//     rows traps);
//   scatter_rows_kernel: token-major, one block per source row: the row is read once and written
//     to the rows of all its routes. (Walking the rows in schedule order instead read each token's
//     row once per route at scattered times, mostly from DRAM: 8x the read traffic at top-8.)

// The rows a gather writes: [0, num_slots), or up to the schedule's end row when it is given.
__device__ __forceinline__ int64_t written_slots(const GatherRowsParams& p) {
  if (p.row_end == nullptr) return p.num_slots;
  return min(p.num_slots, int64_t(max(0, __ldg(p.row_end))));
}

__global__ void invert_slots_kernel(const GatherRowsParams p) {
  const int64_t num_slots = written_slots(p);
  for (int64_t slot = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; slot < num_slots;
       slot += int64_t(gridDim.x) * blockDim.x) {
    const int64_t route = p.slot_to_route[slot];
    if (route >= 0 && route < p.num_routes) p.route_slot[route] = slot;
  }
}

// Where the gathers read: row g of the group's rows (g = route / topk), whether there are routing
// weights, and route `route`'s (= token * topk + k) weight; one overload per source form.
template <typename T>
__device__ __forceinline__ const T* gathered_row(const GatherRowsParams& p, int64_t g) {
  return static_cast<const T*>(p.src) + g * p.hidden;
}
template <typename T>
__device__ __forceinline__ const T* gathered_row(const PeerGatherRowsParams& p, int64_t g) {
  return source_row<T>(p.source, g, p.hidden);
}
__device__ __forceinline__ bool is_weighted(const GatherRowsParams& p) { return p.weights != nullptr; }
__device__ __forceinline__ bool is_weighted(const PeerGatherRowsParams& p) { return p.source.weight_bases[0] != nullptr; }
__device__ __forceinline__ float token_route_weight(const GatherRowsParams& p, int64_t token, int64_t k) {
  return p.weights[token * p.topk + k];
}
__device__ __forceinline__ float token_route_weight(const PeerGatherRowsParams& p, int64_t token, int64_t k) {
  return source_route_weights(p.source, token, p.topk)[k];
}
__device__ __forceinline__ float route_weight(const GatherRowsParams& p, int64_t route) { return p.weights[route]; }
__device__ __forceinline__ float route_weight(const PeerGatherRowsParams& p, int64_t route) {
  const int64_t token = route / p.topk;
  return token_route_weight(p, token, route - token * p.topk);
}

// (scatter_rows_kernel writes only the rows invert_slots_kernel recorded, so it needs no row_end.)

// A pack of a dispatched row: as read without weights, else times the route's weight (scaled_pack:
// an fp32 multiply rounded once, the reference's arithmetic).
template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> weighted_pack(const Pack<T, kVec>& value, bool weighted, float w) {
  return weighted ? scaled_pack<T, kVec>(value, w) : value;
}

// The row of `route` (a valid route index) into dst, scaled by its weight when given; by one warp.
template <typename T, int kVec, class Params>
__device__ __forceinline__ void copy_route_row(const Params& p, int64_t route, Pack<T, kVec>* dst, int lane) {
  using P = Pack<T, kVec>;
  const int64_t num_packs = p.hidden / kVec;
  const P* src = reinterpret_cast<const P*>(gathered_row<T>(p, route / p.topk));
  const float w = is_weighted(p) ? route_weight(p, route) : 1.f;
  for (int64_t i = lane; i < num_packs; i += 32) dst[i] = weighted_pack<T, kVec>(src[i], is_weighted(p), w);
}

// The rows scatter_rows_kernel does not write: zeros where the route is -1, and a pulled copy
// where another row holds the same route (only a malformed slot_to_route repeats a route; both
// rows then get the same values). A route past the source rows traps, like combine's bad index.
template <typename T, int kVec, class Params = GatherRowsParams>
__global__ void fill_unscattered_rows_kernel(const Params p) {
  using P = Pack<T, kVec>;
  const int64_t num_packs = p.hidden / kVec;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int64_t warp = blockIdx.x * int64_t(warps) + threadIdx.x / 32;
  const int64_t num_slots = written_slots(p);
  for (int64_t first = warp * 32; first < num_slots; first += int64_t(gridDim.x) * warps * 32) {
    const int64_t slot = first + lane;
    const int64_t route = slot < num_slots ? p.slot_to_route[slot] : 0;
    const bool valid = route >= 0 && route < p.num_routes;
    const bool unscattered = slot < num_slots && (!valid || p.route_slot[route] != slot);
    unsigned todo = __ballot_sync(0xffffffffu, unscattered);
    while (todo != 0) {  // the warp fills each such row of these 32 together
      const int bit = __ffs(todo) - 1;
      todo &= todo - 1;
      const int64_t row_route = __shfl_sync(0xffffffffu, route, bit);
      P* dst = reinterpret_cast<P*>(static_cast<T*>(p.rows) + (first + bit) * p.hidden);
      if (row_route >= p.num_routes) __trap();  // a route past the source rows is a schedule bug
      if (row_route >= 0) {
        copy_route_row<T, kVec, Params>(p, row_route, dst, lane);
      } else {
        const P zero = zero_pack<T, kVec>();
        for (int64_t i = lane; i < num_packs; i += 32) dst[i] = zero;
      }
    }
  }
}

template <typename T, int kVec, class Params = GatherRowsParams>
__global__ void scatter_rows_kernel(const Params p) {
  using P = Pack<T, kVec>;
  extern __shared__ int64_t token_slots[];  // [topk]: the rows this block's token goes to, -1 if none
  const int64_t num_packs = p.hidden / kVec;
  const int64_t num_tokens = p.num_routes / p.topk;
  for (int64_t token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    __syncthreads();  // every thread is done reading the previous token's slots
    for (int64_t k = threadIdx.x; k < p.topk; k += blockDim.x) token_slots[k] = p.route_slot[token * p.topk + k];
    __syncthreads();
    bool routed = false;
    for (int64_t k = 0; k < p.topk; ++k) routed |= token_slots[k] >= 0;
    if (!routed) continue;  // (uniform over the block)
    const P* src = reinterpret_cast<const P*>(gathered_row<T>(p, token));
    // One pack per thread per pass, written to every route's row. (Two packs in flight per thread
    // measured no faster: 618 -> 626 us per gather on DeepSeek-V3.)
    for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
      const P value = src[i];
      for (int64_t k = 0; k < p.topk; ++k) {
        const int64_t slot = token_slots[k];
        if (slot < 0) continue;
        const float w = is_weighted(p) ? token_route_weight(p, token, k) : 1.f;
        reinterpret_cast<P*>(static_cast<T*>(p.rows) + slot * p.hidden)[i] = weighted_pack<T, kVec>(value, is_weighted(p), w);
      }
    }
  }
}

}  // namespace mok
