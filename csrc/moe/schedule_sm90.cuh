// The MoK schedule on the device, in two launches over many blocks (reference:
// megatron_mok/schedule.py).
//
// Routes (src_rank, token, k) are numbered route = (src_rank * num_tokens + token) * topk + k.
// Rows of local expert e are rows [offsets[e], offsets[e+1]); inside a segment, routes keep their
// route order (stable), and segments are padded to `alignment` rows marked -1.
//
// Determinism without a sort: block b owns the contiguous route range [b*chunk, (b+1)*chunk), and
// warp w of a block the w-th contiguous part of it.
//   count_routes_kernel: each block counts its range per expert (integer atomics in shared memory:
//           the totals do not depend on the order of the additions) into block_counts[b][e], and
//           the grid marks every row padding (-1);
//   place_routes_kernel: each block sums block_counts over all blocks (expert totals, padded
//           offsets) and over the blocks before it (its first row per expert), counts its warps'
//           parts per expert, scans them (fixed loops), then each warp walks its part 32 routes at
//           a time; a route's place among equal experts inside the 32 is
//           popc(match_any(expert) & lanes-below), so blocks, warps and lanes keep route order.
// (One block doing everything took 80-200 us on an H200 for 65-131k routes: one SM's loads.)
#pragma once

#include "common/failure_codes.h"
#include "common/watchdog_sm90.cuh"
#include "mok_params.h"

namespace mok {

constexpr int kScheduleWarps = 32;
constexpr int kUnroll = 4;  // groups of 32 routes whose ids each warp loads ahead
// Routes per block: one unrolled pass of every warp, so a block's loads are all in flight at once.
constexpr int64_t kRoutesPerScheduleBlock = int64_t(kScheduleWarps) * 32 * kUnroll;
constexpr int kMaxScheduleBlocks = 256;  // bounds each block's pass over block_counts

__host__ __device__ inline int schedule_blocks(int64_t num_routes) {
  const int64_t blocks = (num_routes + kRoutesPerScheduleBlock - 1) / kRoutesPerScheduleBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxScheduleBlocks ? kMaxScheduleBlocks : blocks));
}

// An expert id outside [-1, num_experts_checked): record which block saw it, then trap (the ids
// are the caller's input; a wrong one must not become a silently dropped route).
__device__ __noinline__ void fail_expert_id_check(const ScheduleParams& p) {
  record_failure(p.failure_record, kScheduleKernel, kCheckExpertIds, -1, -1);
  asm volatile("trap;");
}

// The local expert of a route, -1 if dropped or owned by another rank. kCheck: the count kernel,
// which reads every id first, checks it (MoKConfig.check_expert_ids) when num_experts_checked > 0.
template <typename Id, bool kCheck = false>
__device__ __forceinline__ int local_expert_of(const ScheduleParams& p, int64_t route) {
  const int64_t id = static_cast<int64_t>(static_cast<const Id*>(p.topk_ids)[route]);
  if (kCheck && p.num_experts_checked > 0 && (id < -1 || id >= p.num_experts_checked)) fail_expert_id_check(p);
  const int64_t local = id - int64_t(p.rank) * p.num_local_experts;
  return (id >= 0 && local >= 0 && local < p.num_local_experts) ? static_cast<int>(local) : -1;
}

// [begin, end) of a part when `total` routes from `first` are split into `parts` equal parts.
__device__ __forceinline__ void part_range(int64_t first, int64_t total_end, int64_t chunk, int part, int64_t& begin,
                                           int64_t& end) {
  begin = min(first + int64_t(part) * chunk, total_end);
  end = min(begin + chunk, total_end);
}

// The local experts of kUnroll groups of 32 routes from `first`, -1 where not owned or past
// `end`: independent loads in flight per lane hide their latency.
template <typename Id, bool kCheck = false>
__device__ __forceinline__ void load_experts(const ScheduleParams& p, int64_t first, int64_t end, int lane,
                                             int (&e)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t route = first + u * 32 + lane;
    e[u] = route < end ? local_expert_of<Id, kCheck>(p, route) : -1;
  }
}

template <typename Id>
__global__ void __launch_bounds__(kScheduleWarps * 32) count_routes_kernel(const ScheduleParams p) {
  extern __shared__ int counts[];  // [num_local_experts]
  const int lane = threadIdx.x % 32;
  const int64_t num_experts = p.num_local_experts;
  const int64_t chunk = (p.num_routes + gridDim.x - 1) / gridDim.x;
  int64_t begin, end;
  part_range(0, p.num_routes, chunk, blockIdx.x, begin, end);
  for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) counts[i] = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.capacity; i += int64_t(gridDim.x) * blockDim.x) {
    p.slot_to_route[i] = -1;
  }
  __syncthreads();  // counts zeroed
  const int warp = threadIdx.x / 32;
  for (int64_t first = begin + int64_t(warp) * 32 * kUnroll; first < end; first += int64_t(kScheduleWarps) * 32 * kUnroll) {
    int e[kUnroll];
    load_experts<Id, true>(p, first, end, lane, e);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e[u] >= 0) atomicAdd(&counts[e[u]], 1);
    }
  }
  __syncthreads();  // the block's counts complete
  for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) p.block_counts[blockIdx.x * num_experts + i] = counts[i];
}

template <typename Id>
__global__ void __launch_bounds__(kScheduleWarps * 32, 1) place_routes_kernel(const ScheduleParams p) {
  extern __shared__ int smem[];
  int* warp_counts = smem;  // [kScheduleWarps][num_local_experts], then reused as bases
  int* offsets = smem + kScheduleWarps * p.num_local_experts;  // [num_local_experts + 1]
  int* block_first = offsets + p.num_local_experts + 1;         // [num_local_experts]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t num_experts = p.num_local_experts;
  const int64_t block_chunk = (p.num_routes + gridDim.x - 1) / gridDim.x;
  int64_t block_begin, block_end, begin, end;
  part_range(0, p.num_routes, block_chunk, blockIdx.x, block_begin, block_end);
  part_range(block_begin, block_end, (block_end - block_begin + kScheduleWarps - 1) / kScheduleWarps, warp, begin, end);

  for (int64_t i = threadIdx.x; i < kScheduleWarps * num_experts; i += blockDim.x) warp_counts[i] = 0;
  __syncthreads();  // counts zeroed before pass 1

  // Pass 1: each warp's part, per expert.
  for (int64_t first = begin; first < end; first += 32 * kUnroll) {
    int e[kUnroll];
    load_experts<Id>(p, first, end, lane, e);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e[u] >= 0) atomicAdd(&warp_counts[warp * num_experts + e[u]], 1);
    }
  }

  // Per expert: the total over all blocks (padded into offsets[e + 1]) and the rows of the blocks
  // before this one, both summed in block order.
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int total = 0, before = 0;
    for (int b = 0; b < int(gridDim.x); ++b) {
      const int count = p.block_counts[b * num_experts + e];
      before += b < int(blockIdx.x) ? count : 0;
      total += count;
    }
    if (blockIdx.x == 0) p.expert_counts[e] = total;
    block_first[e] = before;
    offsets[e + 1] = static_cast<int>((total + p.alignment - 1) / p.alignment * p.alignment);
  }
  __syncthreads();  // padded sizes and pass 1 complete before the prefix sum
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();  // offsets visible to every thread
  if (blockIdx.x == 0) {
    for (int64_t e = threadIdx.x; e <= num_experts; e += blockDim.x) p.expert_offsets[e] = offsets[e];
  }

  // Turn counts into each warp's first row per expert (exclusive scan over warps).
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int base = offsets[e] + block_first[e];
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
    load_experts<Id>(p, first, end, lane, e);
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
