// Hopper (sm_90a) bulk copies: TMA tile loads (also multicast into a cluster) and stores, bulk
// L2 prefetch, and the proxy fences that order them with ordinary loads and stores.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/sync_sm90.cuh"

namespace mok::sm90 {

// ---- TMA -------------------------------------------------------------------------------------

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at (col, row) of a 2-D tensor map into shared memory, completing on `bar`.
// Out-of-bounds elements arrive as zeros and still count toward the barrier's bytes.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t col,
                                            int32_t row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(col), "r"(row)
      : "memory");
}

// Loads the box at (c0, c1, c2) of a 3-D tensor map (c0 the contiguous dimension).
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                                            int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Copies `bytes` (a multiple of 16) from a 16-byte aligned global address into shared memory,
// completing on `bar` like a tensor load (counted toward the bytes its arrival announced).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// The same box into the same shared-memory offset of every CTA in `cta_mask`, each completing on
// its own barrier at `bar`'s offset: one L2 read feeds several SMs.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t col,
                                                      int32_t row, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(col), "r"(row), "h"(cta_mask)
      : "memory");
}

// Stores a box from shared memory to the tensor at (col, row) in the background; out-of-bounds
// parts of the box are not written. The source must be made visible to the async proxy first
// (fence_async_shared) and stay untouched until bulk_wait_read says the copy has read it.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int32_t col, int32_t row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(col), "r"(row)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// All but the newest kPending store groups committed by this thread have finished reading shared
// memory (they may still be writing).
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// The stores committed by this thread are complete.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Starts fetching `bytes` (a multiple of 16) at a 16-byte aligned global address into L2, in the
// background: one instruction puts a whole row's reads in flight.
// Brings the box at (col, row) of `map` into L2 (no shared memory, no barrier; a box past the
// tensor's edge is clipped as a load's would be).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int32_t col, int32_t row) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" ::"l"(map), "r"(col), "r"(row)
               : "memory");
}

__device__ __forceinline__ void prefetch_l2_bulk(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

// Orders this thread's generic global-memory accesses with its later async-proxy ones (TMA): after
// observing rows another SM wrote with ordinary stores, before loading them with TMA.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Orders this thread's generic shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace mok::sm90
