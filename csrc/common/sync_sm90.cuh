// Hopper (sm_90a) synchronization of the persistent kernels: mbarriers with bounded waits, named
// barriers, cluster barriers and ranks, and counters between CTAs in global memory. Every wait
// here is bounded (common/watchdog_sm90.cuh).
#pragma once

#include <cstdint>

#include "common/watchdog_sm90.cuh"

namespace mok::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Loads from shared memory by its 32-bit address: LDS, where a generic pointer into the dynamic
// shared memory would compile to a generic load (slower; the compiler cannot prove the space).
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// ---- mbarriers -------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}

// Makes the initialized barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// One arrival that also announces `bytes` of TMA traffic completing on this barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Whether the phase of `parity` has completed, at once (test_wait never suspends the thread, where
// try_wait may for a while): for a caller with other work to do while the barrier is pending.
__device__ __forceinline__ bool mbarrier_test_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// bar: the barrier's shared-memory address (smem_u32), for loops that keep it in a register.
// kTrapOutOfLine: fail_if_timed_out's.
template <bool kTrapOutOfLine = false>
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity, int wait_id, WaitWatch* watch) {
  if (mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait(bar, parity)) fail_if_timed_out<kTrapOutOfLine>(wait_id, watch, start);
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, int wait_id, WaitWatch* watch) {
  mbarrier_wait(smem_u32(bar), parity, wait_id, watch);
}


// A barrier for the `threads` threads (whole warps) that use this id; 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts the calling warps toward barrier `id`'s `threads` without waiting for the others (whoever
// waits on it with named_barrier_sync and the same count goes on once all have arrived).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- clusters ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ uint32_t cluster_index() {
  uint32_t index;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(index));
  return index;
}

__device__ __forceinline__ uint32_t cluster_count() {
  uint32_t count;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(count));
  return count;
}

// Every thread of every CTA of the cluster; orders barrier initialization before remote use.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrives on the barrier at the same shared-memory offset in CTA `cta_rank` of this cluster.
__device__ __forceinline__ void mbarrier_arrive_in_cta(uint64_t* bar, uint32_t cta_rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(cta_rank));
  // Release at CTA scope, as for a local arrival: the consumer only promises it stopped reading the
  // stage (its wgmma completed); a cluster-scope release would also wait for its global stores.
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// ---- counters between CTAs (global memory, GPU scope) -----------------------------------------

__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// Adds to a counter, ordered after this thread's earlier writes (and what it observed before them).
__device__ __forceinline__ void red_release_gpu_add(int32_t* ptr, int32_t value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// ---- counters between GPUs (global memory, system scope: the exchange's signals) ---------------

// Acquire at system scope: what the signalling rank wrote before its release (its regions, its
// pushes into this rank's memory, over NVLink on a real node) is visible after this load.
__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* ptr) {
  int64_t value;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

// A release add at system scope into a counter that may live on another GPU.
__device__ __forceinline__ void red_release_sys_add(int64_t* ptr, int64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Waits until *counter >= target; the writes released before the counter reached it are visible.
__device__ __forceinline__ void wait_counter_at_least(const int32_t* counter, int32_t target, int wait_id,
                                                      WaitWatch* watch) {
  if (ld_acquire_gpu(counter) >= target) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_gpu(counter) < target) {
    __nanosleep(128);
    fail_if_timed_out(wait_id, watch, start);
  }
}

}  // namespace mok::sm90
