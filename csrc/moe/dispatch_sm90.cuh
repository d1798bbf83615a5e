// Row dispatch (token-major) for one rank's schedule: the rows of the schedule pulled from the
// gathered tokens, and the reverse-combine pull of dY (the same gather, scaled by the routing
// weights). Reference: dispatch_rows_reference / pull_route_grads_reference in
// megatron_mok/reference.py. Every output row is written by exactly one thread; no atomics.
#pragma once

#include "common/vec_utils.cuh"
#include "mok_params.h"
#include "moe/row_source.cuh"

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

__global__ void invert_slots_kernel(const GatherRowsParams p) {
  for (int64_t slot = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; slot < p.num_slots;
       slot += int64_t(gridDim.x) * blockDim.x) {
    const int64_t route = p.slot_to_route[slot];
    if (route >= 0 && route < p.num_routes) p.route_slot[route] = slot;
  }
}

// A pack of a dispatched row: as read without weights, else times the route's weight (an fp32
// multiply rounded once, the reference's arithmetic).
template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> weighted_pack(const Pack<T, kVec>& value, const float* weights, float w) {
  if (weights == nullptr) return value;
  Pack<T, kVec> out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) out.v[j] = from_float<T>(__fmul_rn(to_float(value.v[j]), w));
  return out;
}

// The row of `route` (a valid route index) into dst, scaled by its weight when given; by one warp.
template <typename T, int kVec>
__device__ __forceinline__ void copy_route_row(const GatherRowsParams& p, int64_t route, Pack<T, kVec>* dst, int lane) {
  using P = Pack<T, kVec>;
  const int64_t num_packs = p.hidden / kVec;
  const P* src = reinterpret_cast<const P*>(static_cast<const T*>(p.src) + route_source_row(route, p.topk) * p.hidden);
  const float w = p.weights != nullptr ? p.weights[route] : 1.f;
  for (int64_t i = lane; i < num_packs; i += 32) dst[i] = weighted_pack<T, kVec>(src[i], p.weights, w);
}

// The rows scatter_rows_kernel does not write: zeros where the route is -1, and a pulled copy
// where another row holds the same route (only a malformed slot_to_route repeats a route; both
// rows then get the same values). A route past the source rows traps, like combine's bad index.
template <typename T, int kVec>
__global__ void fill_unscattered_rows_kernel(const GatherRowsParams p) {
  using P = Pack<T, kVec>;
  const int64_t num_packs = p.hidden / kVec;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int64_t warp = blockIdx.x * int64_t(warps) + threadIdx.x / 32;
  for (int64_t first = warp * 32; first < p.num_slots; first += int64_t(gridDim.x) * warps * 32) {
    const int64_t slot = first + lane;
    const int64_t route = slot < p.num_slots ? p.slot_to_route[slot] : 0;
    const bool valid = route >= 0 && route < p.num_routes;
    const bool unscattered = slot < p.num_slots && (!valid || p.route_slot[route] != slot);
    unsigned todo = __ballot_sync(0xffffffffu, unscattered);
    while (todo != 0) {  // the warp fills each such row of these 32 together
      const int bit = __ffs(todo) - 1;
      todo &= todo - 1;
      const int64_t row_route = __shfl_sync(0xffffffffu, route, bit);
      P* dst = reinterpret_cast<P*>(static_cast<T*>(p.rows) + (first + bit) * p.hidden);
      if (row_route >= p.num_routes) __trap();  // a route past the source rows is a schedule bug
      if (row_route >= 0) {
        copy_route_row<T, kVec>(p, row_route, dst, lane);
      } else {
        const P zero = zero_pack<T, kVec>();
        for (int64_t i = lane; i < num_packs; i += 32) dst[i] = zero;
      }
    }
  }
}

template <typename T, int kVec>
__global__ void scatter_rows_kernel(const GatherRowsParams p) {
  using P = Pack<T, kVec>;
  extern __shared__ int64_t token_slots[];  // [topk]: the rows this block's token goes to, -1 if none
  const int64_t num_packs = p.hidden / kVec;
  const int64_t num_tokens = p.num_routes / p.topk;
  for (int64_t token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    __syncthreads();  // the previous token's slots are no longer read
    for (int64_t k = threadIdx.x; k < p.topk; k += blockDim.x) token_slots[k] = p.route_slot[token * p.topk + k];
    __syncthreads();
    bool routed = false;
    for (int64_t k = 0; k < p.topk; ++k) routed |= token_slots[k] >= 0;
    if (!routed) continue;  // (uniform over the block)
    // (Token-major: the source row `token` feeds routes token * topk + k, route_source_row's inverse.)
    const P* src = reinterpret_cast<const P*>(static_cast<const T*>(p.src) + token * p.hidden);
    // One pack per thread per pass, written to every route's row. (Two packs in flight per thread
    // measured no faster: 618 -> 626 us per gather on DeepSeek-V3.)
    for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
      const P value = src[i];
      for (int64_t k = 0; k < p.topk; ++k) {
        const int64_t slot = token_slots[k];
        if (slot < 0) continue;
        const float w = p.weights != nullptr ? p.weights[token * p.topk + k] : 1.f;
        reinterpret_cast<P*>(static_cast<T*>(p.rows) + slot * p.hidden)[i] = weighted_pack<T, kVec>(value, p.weights, w);
      }
    }
  }
}

}  // namespace mok
