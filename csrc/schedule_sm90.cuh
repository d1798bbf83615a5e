// The MoK schedule on the device, in one single-block launch (reference: megatron_mok/schedule.py).
//
// Routes (src_rank, token, k) are numbered route = (src_rank * num_tokens + token) * topk + k.
// Rows of local expert e are rows [offsets[e], offsets[e+1]); inside a segment, routes keep their
// route order (stable), and segments are padded to `alignment` rows marked -1.
//
// Determinism without a sort: warp w owns the contiguous route range [w*chunk, (w+1)*chunk).
//   pass 1: each warp counts its range per expert (integer atomics on its own smem row: the
//           totals do not depend on the order of the additions);
//   scan:   base[w][e] = offsets[e] + sum of counts[w' < w][e]  (fixed loops);
//   pass 2: each warp walks its range 32 routes at a time; a route's place among equal experts
//           inside the 32 is popc(match_any(expert) & lanes-below), so ranges and lanes keep order.
#pragma once

#include "mok_params.h"

namespace mok {

constexpr int kScheduleWarps = 32;
constexpr int kUnroll = 4;  // groups of 32 routes whose ids each warp loads ahead

template <typename Id>
__global__ void __launch_bounds__(kScheduleWarps * 32, 1) build_schedule_kernel(const ScheduleParams p) {
  extern __shared__ int smem[];
  int* warp_counts = smem;  // [kScheduleWarps][num_local_experts], then reused as bases
  int* offsets = smem + kScheduleWarps * p.num_local_experts;  // [num_local_experts + 1]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t num_experts = p.num_local_experts;
  const int64_t first_expert = int64_t(p.rank) * num_experts;
  const int64_t chunk = (p.num_routes + kScheduleWarps - 1) / kScheduleWarps;
  const int64_t begin = min(int64_t(warp) * chunk, p.num_routes);
  const int64_t end = min(begin + chunk, p.num_routes);
  const Id* ids = static_cast<const Id*>(p.topk_ids);

  auto local_expert = [&](int64_t route) -> int {
    const int64_t id = static_cast<int64_t>(ids[route]);
    const int64_t local = id - first_expert;
    return (id >= 0 && local >= 0 && local < num_experts) ? static_cast<int>(local) : -1;
  };

  for (int64_t i = threadIdx.x; i < kScheduleWarps * num_experts; i += blockDim.x) warp_counts[i] = 0;
  for (int64_t i = threadIdx.x; i < p.capacity; i += blockDim.x) p.slot_to_route[i] = -1;
  __syncthreads();  // counts zeroed before pass 1

  // The local experts of kUnroll groups of 32 routes from `first`, -1 where not owned or past
  // the range: independent loads in flight per lane hide their latency.
  auto load_experts = [&](int64_t first, int (&e)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t route = first + u * 32 + lane;
      e[u] = route < end ? local_expert(route) : -1;
    }
  };

  // Pass 1.
  for (int64_t first = begin; first < end; first += 32 * kUnroll) {
    int e[kUnroll];
    load_experts(first, e);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e[u] >= 0) atomicAdd(&warp_counts[warp * num_experts + e[u]], 1);
    }
  }
  __syncthreads();  // every warp's counts complete before the totals

  // Per-expert totals in parallel, padded segment sizes into offsets[e + 1].
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int count = 0;
    for (int w = 0; w < kScheduleWarps; ++w) count += warp_counts[w * num_experts + e];
    p.expert_counts[e] = count;
    offsets[e + 1] = static_cast<int>((count + p.alignment - 1) / p.alignment * p.alignment);
  }
  __syncthreads();  // padded sizes complete before the prefix sum
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();  // offsets visible to every thread
  for (int64_t e = threadIdx.x; e <= num_experts; e += blockDim.x) p.expert_offsets[e] = offsets[e];

  // Turn counts into each warp's first row per expert (exclusive scan over warps).
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int base = offsets[e];
    for (int w = 0; w < kScheduleWarps; ++w) {
      const int count = warp_counts[w * num_experts + e];
      warp_counts[w * num_experts + e] = base;
      base += count;
    }
  }
  __syncthreads();  // bases complete before pass 2

  // Pass 2. Ids of kUnroll groups are loaded first; the groups are then placed in order.
  int* base = warp_counts + warp * num_experts;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t first = begin; first < end; first += 32 * kUnroll) {
    int e[kUnroll];
    load_experts(first, e);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t route = first + u * 32 + lane;
      const unsigned same = __match_any_sync(0xffffffffu, e[u]);
      if (route < end) {
        if (e[u] >= 0) {
          const int64_t slot = base[e[u]] + __popc(same & lanes_below);
          p.route_to_slot[route] = slot;
          p.slot_to_route[slot] = route;
        } else {
          p.route_to_slot[route] = p.capacity;
        }
      }
      __syncwarp();  // every lane read base[e] before the leader of each expert group advances it
      if (e[u] >= 0 && (same & lanes_below) == 0) base[e[u]] += __popc(same);
      __syncwarp();  // base updated before the next group reads it
    }
  }
}

}  // namespace mok
