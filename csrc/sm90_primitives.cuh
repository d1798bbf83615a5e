// Hopper (sm_90a) building blocks of the persistent MoK kernels: mbarriers with bounded waits,
// TMA tile loads, wgmma descriptors and instructions, register reallocation.
// Every wait here ends: past kWaitTimeoutNs the watchdog records which wait failed and traps, so a
// broken pipeline surfaces as a CUDA error instead of a hang.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include "mok_params.h"

namespace mok::sm90 {

constexpr uint64_t kWaitTimeoutNs = 10ull * 1000 * 1000 * 1000;

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
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

// A wait that can time out reports through a watchdog thread of the same CTA. No printf: a
// function call anywhere in a kernel with wgmma makes ptxas serialize every wgmma (C7510). The
// waiting thread records which wait failed in shared memory; the watchdog copies it, with the
// kernel and block, into a host-mapped WaitTimeoutRecord (which outlives the trap) and traps.
// The host reads it back: torch.ops.megatron_mok.last_wait_timeout(), printed at exit.
struct WaitWatch {
  int failed;    // 0, or 1 + the index of the wait that timed out
  int finished;  // roles that have finished their work
};

// A wait past its timeout tells the watchdog which wait failed, then traps.
__device__ __forceinline__ void fail_if_timed_out(int wait_id, WaitWatch* watch, uint64_t start) {
  if (global_timer_ns() - start > kWaitTimeoutNs) {
    *reinterpret_cast<volatile int*>(&watch->failed) = 1 + wait_id;
    // The watchdog traps within a microsecond or so; should it not, trap here.
    while (global_timer_ns() - start < 2 * kWaitTimeoutNs) __nanosleep(1000000);
    asm volatile("trap;");
  }
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, int wait_id, WaitWatch* watch) {
  const uint32_t addr = smem_u32(bar);
  if (mbarrier_try_wait(addr, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait(addr, parity)) fail_if_timed_out(wait_id, watch, start);
}

// ---- counters between CTAs (global memory, GPU scope) -----------------------------------------

__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// The next use of a ring of kStages pipeline stages: the stage index, and the parity its barriers
// complete with (it flips each time the ring wraps).
template <int kStages>
__device__ __forceinline__ void advance_stage(int& stage, uint32_t& phase) {
  if (++stage == kStages) {
    stage = 0;
    phase ^= 1;
  }
}

// Adds to a counter, ordered after this thread's earlier writes (and what it observed before them).
__device__ __forceinline__ void red_release_gpu_add(int32_t* ptr, int32_t value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
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

// Starts fetching `bytes` (a multiple of 16) at a 16-byte aligned global address into L2, in the
// background: one instruction puts a whole row's reads in flight.
__device__ __forceinline__ void prefetch_l2_bulk(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

// Orders this thread's generic global-memory accesses with its later async-proxy ones (TMA): after
// observing rows another SM wrote with ordinary stores, before loading them with TMA.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ void mark_finished(WaitWatch* watch) { atomicAdd(&watch->finished, 1); }

// Run by one thread until `roles` roles have called mark_finished.
__device__ __forceinline__ void watch_waits(WaitWatch* watch, int roles, WaitTimeoutRecord* record, int kernel_id) {
  volatile WaitWatch* w = watch;
  while (w->finished < roles) {
    const int failed = w->failed;
    if (failed > 0) {
      volatile WaitTimeoutRecord* r = record;
      if (r != nullptr) {
        r->kernel = kernel_id;
        r->wait = failed - 1;
        r->block = int(blockIdx.x);
        __threadfence_system();
        r->recorded = 1;
        __threadfence_system();
      }
      asm volatile("trap;");
    }
    // Every CTA is resident for the whole launch and the kernel ends when the last one exits, so
    // this poll interval is added to the kernel's time: keep it short (the sleeping warp costs
    // no issue slots).
    __nanosleep(1000);
  }
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

// Four 8x8 bf16 matrices from the mma accumulator fragment (lane l holds row l / 4, columns
// 2 * (l % 4) + {0, 1} of matrix i in r_i) to shared memory; lane 8 * i + j gives the address of
// matrix i's row j (16 contiguous bytes), so any row swizzle is the caller's addressing.
__device__ __forceinline__ void stmatrix_x4(void* row_address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(row_address)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Orders this thread's generic shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A barrier for the `threads` threads (whole warps) that use this id; 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- wgmma -----------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a K-major tile written by TMA with 128-byte swizzle:
// rows of 64 bf16 (128 B), 8-row swizzle atoms 1024 B apart (the stride byte offset).
// The tile must start 1024-byte aligned; advancing K by 16 elements adds 32 B to the start.
__device__ __forceinline__ uint64_t smem_descriptor_sw128(const void* tile) {
  const uint64_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFF) >> 4;  // start address, 16-byte units
  desc |= uint64_t(16 >> 4) << 16;        // leading byte offset (unused with 128-byte swizzle)
  desc |= uint64_t(1024 >> 4) << 32;      // stride byte offset between 8-row atoms
  desc |= uint64_t(1) << 62;              // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across wgmma fences and waits.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor for an MN-major tile (N contiguous) written by TMA boxes of 64
// MN-elements x K rows with 128-byte swizzle: each K row of a box is 128 bytes, 8-row atoms 1024 B
// apart (stride byte offset), boxes `mn_block_bytes` apart along MN (leading byte offset). The
// canonical layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) of the PTX ISA. Advancing K by 16
// elements adds 16 rows = 2048 bytes to the start.
__device__ __forceinline__ uint64_t smem_descriptor_sw128_mn(const void* tile, uint32_t mn_block_bytes) {
  const uint64_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t((mn_block_bytes >> 4) & 0x3FFF) << 16;  // leading byte offset: next 64 MN-elements
  desc |= uint64_t(1024 >> 4) << 32;                         // stride byte offset: next 8 K rows
  desc |= uint64_t(1) << 62;                                 // 128-byte swizzle
  return desc;
}

// wgmma.mma_async m64n256k16, bf16 x bf16 -> fp32, A and B in shared memory, each K-major
// (kTrans = 0) or MN-major (kTrans = 1).
// d: this thread's 128 accumulators (layout in expert_gemm_sm90.cuh); scale_d = 0 zeroes them first.
template <int kTransB = 0, int kTransA = 0>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %132, %131;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA));
}

// ---- register reallocation between warpgroups -------------------------------------------------

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace mok::sm90
