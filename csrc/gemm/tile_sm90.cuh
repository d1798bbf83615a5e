// The tile, roles and shared-memory budget every sm90 GEMM kernel of megatron_mok shares
// (gemm/kernel_sm90_tma_wgmma_ws.cuh composes them): 128 x 256 output tiles, 64-wide K blocks,
// 384 threads = a producer warpgroup and two consumer warpgroups of 64 rows each.
//
// Accumulator layout of wgmma m64nNk16 (fp32), thread t of a consumer warpgroup, warp w = t / 32,
// lane l: acc[4 * j + 2 * h + c] is row 16 * w + l / 4 + 8 * h, column 8 * j + 2 * (l % 4) + c.
// The epilogues round it once into packed[2 * j + h] (a bf16 pair: columns 8 * j + 2 * (l % 4) +
// {0, 1} of row half h).
#pragma once

#include <cstdint>

#include "common/limits.h"

namespace mok {

// Threads of one warpgroup (four warps): what issues one wgmma, what setmaxnreg resizes, and the
// unit of the kernels' roles (a producer warpgroup, two consumer warpgroups).
constexpr int kNumThreadsPerWarpGroup = 128;

// This thread's warpgroup, as a value the compiler knows to be the same in every lane of the warp
// (lane 0's, by shuffle): what a consumer derives from it and from its loop counters (the stages'
// shared-memory descriptors, their barriers' addresses) then lives in uniform registers, so each
// wgmma takes its descriptors as they are instead of after register-to-uniform moves.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, int(threadIdx.x / kNumThreadsPerWarpGroup), 0);
}

struct ExpertGemmTile {
  static constexpr int kConsumerWarpGroups = 2;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * kNumThreadsPerWarpGroup;
  static constexpr int kM = 128;  // rows: two consumer warpgroups x 64
  static_assert(kM == kConsumerWarpGroups * 64, "each consumer warpgroup owns 64 rows of a tile (wgmma m64)");
  static_assert(kM == kExpertGemmTileM, "megatron_mok/limits.py EXPERT_GEMM_TILE_M is this tile's rows");
  static constexpr int kN = 256;  // B rows per tile (SwiGLU: 128 gate + 128 up)
  static_assert(kN == kExpertGemmTileN, "megatron_mok/limits.py EXPERT_GEMM_TILE_N is this tile's B rows");
  // fp32 accumulators per consumer thread: its warpgroup's 64 x kN outputs (wgmma m64n256, layout above).
  static constexpr int kAccumulators = 64 * kN / kNumThreadsPerWarpGroup;
  using Accumulators = float[kAccumulators];
  static constexpr int kK = 64;   // one 128-byte swizzle row of bf16
  static_assert(kK == kExpertWgradKRows, "megatron_mok/limits.py EXPERT_WGRAD_K_ROWS is the weight gradient's K block");
  // Pipeline stages and staging buffers per consumer share the shared memory: 4 stages leave room
  // for one 16 KB staging buffer per consumer (each store of an epilogue waits until the TMA
  // store before it has read the buffer); 3 stages for two (an epilogue's stores alternate, so
  // they rarely wait). MOK_EXPERT_GEMM_STAGES picks at build time (docs/log/performance_2026-11.md compares).
#ifndef MOK_EXPERT_GEMM_STAGES
#define MOK_EXPERT_GEMM_STAGES 4
#endif
  static constexpr int kStages = MOK_EXPERT_GEMM_STAGES;
  static_assert(kStages == 3 || kStages == 4, "MOK_EXPERT_GEMM_STAGES must be 3 or 4");
  static constexpr int kStagingBuffers = kStages == 3 ? 2 : 1;
  static constexpr int kThreads = kNumThreadsPerWarpGroup + kConsumerThreads;  // + the producer warpgroup
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  // setmaxnreg moves registers inside the CTA's launch allocation (384 threads x 168, the most a
  // thread can have at one CTA per SM, in steps of 8): a consumer's increase waits until the
  // producer's decrease has freed enough, so asking for more than the allocation hangs.
  static_assert(kNumThreadsPerWarpGroup * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                    kThreads * ((65536 / kThreads) / 8 * 8),
                "setmaxnreg budgets exceed the CTA's register allocation");
  static constexpr uint32_t kABytes = kM * kK * 2;
  static constexpr uint32_t kBHalfBytes = (kN / 2) * kK * 2;
  static constexpr uint32_t kBBytes = kN * kK * 2;
  // MN-major operands (the dgrad GEMMs' B, both of the weight gradient's): TMA boxes of 64 MN x 64 K,
  // each K row 128 bytes, the boxes kBoxBytes apart along MN.
  static constexpr uint32_t kBoxBytes = 64 * kK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kStoreBox = 64;  // TMA store boxes: 64 rows x 64 bf16 columns
  static constexpr uint32_t kStoreBoxBytes = kStoreBox * kStoreBox * 2;
  static constexpr uint32_t kStagingBytes = 2 * kStoreBoxBytes;  // one buffer: 64 rows x 128 columns
  static constexpr int kSwizzleAlign = 1024;
  static constexpr int kRoles = 3;  // producer + two consumers, for the watchdog (+ a mainloop's side roles)
};

// Named barriers (0 is __syncthreads'): one per consumer warpgroup for its epilogue, one for the
// producer warpgroup's side threads (the in-kernel dispatch), one for both consumer warpgroups, and
// one for both consumer warpgroups' turns at issuing (the wide FP8 kernels' kIssueOrder).
enum NamedBarrier : int {
  kConsumerBarrier = 1,     // + consumer (0 or 1): the 128 threads of one consumer warpgroup
  kSideThreadsBarrier = 3,  // a mainloop's side threads in the producer warpgroup
  kConsumersBarrier = 4,    // the 256 threads of both consumer warpgroups
  kIssueOrderBarrier = 5,   // both consumer warpgroups' turns at issuing a K block (the wide FP8 GEMM and wgrad)
};

}  // namespace mok
