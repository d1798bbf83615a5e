// The stage ring of the sm90 pipelines: kStages shared-memory stages, each with a `full` barrier
// (the producer's loads landed) and an `empty` barrier (every consumer released it).
#pragma once

#include <cstdint>

#include "common/failure_codes.h"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"

namespace mok::sm90 {

// The barriers of a ring of kStages stages, by one thread before any use: `full` completes on the
// producer's one expect_tx arrival and the TMA bytes it announced; `empty` once `empty_arrivals`
// consumers released the stage (every consumer warpgroup of the cluster: a peer CTA's consumers
// release the stages its multicast loads wrote into). The fence makes them visible to the async
// proxy (TMA) and to the cluster before the caller's barrier (cluster_sync or __syncthreads).
template <int kStages>
__device__ __forceinline__ void init_stage_barriers(uint64_t* full, uint64_t* empty, uint32_t empty_arrivals) {
  for (int s = 0; s < kStages; ++s) {
    mbarrier_init(&full[s], 1);
    mbarrier_init(&empty[s], empty_arrivals);
  }
  fence_barrier_init();
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

// A consumer warpgroup is done reading a stage: tell the producers of every CTA of the cluster.
template <int kClusterM>
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  if constexpr (kClusterM == 1) {
    mbarrier_arrive(empty);
  } else {
#pragma unroll
    for (int r = 0; r < kClusterM; ++r) mbarrier_arrive_in_cta(empty, r);
  }
}

// A consumer warp is done reading a stage, its MMAs' and its lanes' own loads from it (scales): lane 0
// tells the producers of every CTA of the cluster for the warp. The stage's next contents arrive by
// the async proxy (TMA, bulk copies), and nothing in the arrival depends on the loads, so ptxas may
// issue it while the last of them are in flight (it did in the FP8 weight gradient, and a few of a
// warp's sums came out wrong now and then): the proxy fence orders this thread's loads of the stage
// first, and __syncwarp the other lanes' before lane 0's arrival.
template <int kClusterM>
__device__ __forceinline__ void release_stage_after_shared_reads(uint64_t* empty, int lane) {
  fence_async_shared();
  __syncwarp();
  if (lane == 0) release_stage<kClusterM>(empty);
}

// The producer's last wait before its CTA exits: every stage released by all consumers of the
// cluster, from `stage` (the next the producer would fill, at `phase`) once round the ring, so that
// no remote arrival or multicast is still to come into this CTA's shared memory.
template <int kStages>
__device__ __forceinline__ void wait_all_stages_released(uint64_t* empty, int stage, uint32_t phase,
                                                         WaitWatch* watch) {
  for (int i = 0; i < kStages; ++i) {
    mbarrier_wait(&empty[stage], phase ^ 1, kWaitFreeStage, watch);
    advance_stage<kStages>(stage, phase);
  }
}

}  // namespace mok::sm90
