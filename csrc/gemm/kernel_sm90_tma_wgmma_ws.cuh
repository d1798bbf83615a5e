// The one kernel skeleton of megatron_mok's sm90 GEMMs: persistent, warp-specialized, a TMA
// producer and two wgmma consumer warpgroups around a ring of shared-memory stages, composed of
//   Mainloop  (gemm/mainloop_*): what a stage holds, how the producer loads it, the consumers' MMAs;
//   Epilogue  (gemm/epilogue_*): what becomes of a tile's accumulators;
//   Scheduler (gemm/tile_scheduler_sm90.cuh): which tiles a CTA computes, in which order.
// The roles, barriers, register reallocation and stage ring are written here once.
//
// One CTA per SM, 384 threads (clusters of Mainloop::kClusterM CTAs when kClusterLaunch):
//   warpgroup 0, producer: keeps 40 registers (setmaxnreg) and hands the rest over. Thread 0 walks
//     the CTA's tiles and, per K block, waits for a stage every consumer (of the cluster) has
//     released, then issues the mainloop's TMA loads completing on the stage's `full` barrier.
//     Thread 32 is the watchdog of the CTA's bounded waits (common/watchdog_sm90.cuh). The top
//     Mainloop::kSideThreads threads run the mainloop's side work (the in-kernel dispatch).
//   warpgroups 1 and 2, consumers: per K block each waits on `full`, issues the mainloop's wgmma
//     into 128 fp32 accumulators per thread, and releases the stage of the previous K block on
//     `empty` once at most one wgmma group is in flight. Then the epilogue writes the tile, from the
//     warpgroup's staging buffers, and the warpgroup goes on to its next tile while the stores drain;
//     meanwhile the producer already fills the stages of the next tile.
//     A mainloop with Mainloop::kCarriesAccumulators splits a tile's K chain across launches (the
//     windowed weight gradient): resume_accumulators seeds acc before the first K block, and
//     suspend_accumulators, true when the chain goes on in a later launch, takes the accumulators
//     instead of the epilogue. For every other mainloop both hooks compile away (if constexpr).
#pragma once

#include <cstdint>

#include "common/failure_codes.h"
#include "common/pipeline_sm90.cuh"
#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/epilogue_sm90_staging.cuh"
#include "gemm/tile_sm90.cuh"

namespace mok {

// The dynamic shared memory of every sm90 GEMM kernel, carved from a 1024-byte aligned base
// (128-byte swizzled TMA boxes need it), in bytes, S = kStages:
//   a               S * kABytes                      the stages' A tiles (stage s at s * kABytes)
//   b               S * kBBytes                      the stages' B tiles
//   staging         2 * kStagingBuffers * kStagingBytes  each consumer warpgroup's staging buffers
//   full            S * 8                            a stage's loads landed (mbarriers)
//   empty           S * 8                            every consumer released a stage (mbarriers)
//   watch           8                                the bounded waits' watch (WaitWatch)
//   dispatch_claim  4                                the in-kernel dispatchers' claimed chunk, broadcast
// (Pointers carved in this order, not declared as a struct: the addresses are the table's, the
// layout the kernels' SASS was measured with.)
struct ExpertGemmSharedStorage {
  using Tile = ExpertGemmTile;
  static constexpr size_t kBytes = size_t(Tile::kStages) * Tile::kStageBytes +
                                   2 * Tile::kStagingBuffers * Tile::kStagingBytes +
                                   2 * Tile::kStages * sizeof(uint64_t) + sizeof(sm90::WaitWatch) + sizeof(int32_t);
  // What a launch asks for: the layout and the slack to align its base.
  static constexpr size_t kSmemBytes = Tile::kSwizzleAlign + kBytes;

  __device__ explicit ExpertGemmSharedStorage(uint8_t* smem_raw)
      : a(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) &
                                     ~uintptr_t(Tile::kSwizzleAlign - 1))),
        b(a + Tile::kStages * Tile::kABytes),
        staging(b + Tile::kStages * Tile::kBBytes),
        full(reinterpret_cast<uint64_t*>(staging + 2 * Tile::kStagingBuffers * Tile::kStagingBytes)),
        empty(full + Tile::kStages),
        watch(reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages)),
        dispatch_claim(reinterpret_cast<int32_t*>(watch + 1)) {}

  uint8_t* a;
  uint8_t* b;
  uint8_t* staging;
  uint64_t* full;
  uint64_t* empty;
  sm90::WaitWatch* watch;
  int32_t* dispatch_claim;
};

template <class Mainloop, class Epilogue, class Scheduler, FailingKernel kKernel>
struct GemmKernelSm90 {
  using Tile = ExpertGemmTile;
  using SharedStorage = ExpertGemmSharedStorage;

  template <class Maps, class Params>
  static __device__ __forceinline__ void run(const Maps& maps, const Params& p, uint8_t* smem_raw) {
    SharedStorage shared(smem_raw);
    sm90::WaitWatch* watch = shared.watch;
    if (threadIdx.x == 0) {
      sm90::init_stage_barriers<Tile::kStages>(shared.full, shared.empty, Mainloop::kEmptyArrivals);
      watch->failed = 0;
      watch->finished = 0;
    }
    if (threadIdx.x == 32) {
      Mainloop::prefetch_tensor_maps(maps);
      Epilogue::prefetch_tensor_maps(maps.epilogue);
    }
    if constexpr (Mainloop::kClusterLaunch) {
      // Every CTA's barriers exist before a peer multicasts into or arrives on them.
      sm90::cluster_sync();
    } else {
      __syncthreads();
    }

    Scheduler scheduler(p.problem);
    const Mainloop mainloop(p);
    const int cta_rank = scheduler.cta_rank();
    const int warpgroup = threadIdx.x / kNumThreadsPerWarpGroup;

    if (warpgroup == 0) {
      sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
      if (threadIdx.x == 32) sm90::watch_waits(watch, Tile::kRoles + Mainloop::kSideRoles, p.failure_record, kKernel);
      if constexpr (Mainloop::kSideThreads > 0) {
        if (threadIdx.x >= kNumThreadsPerWarpGroup - Mainloop::kSideThreads) {
          Mainloop::run_side_threads(p, shared.dispatch_claim, scheduler.n_tiles(),
                                     threadIdx.x - (kNumThreadsPerWarpGroup - Mainloop::kSideThreads), watch);
          return;
        }
      }
      if (threadIdx.x != 0) return;
      produce(maps, p, mainloop, scheduler, shared, cta_rank);
      return;
    }
    sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
    consume(maps, p, mainloop, scheduler, shared, warpgroup - 1, threadIdx.x % kNumThreadsPerWarpGroup);
  }

 private:
  template <class Maps, class Params>
  static __device__ __forceinline__ void produce(const Maps& maps, const Params& p, const Mainloop& mainloop,
                                                 Scheduler& scheduler, const SharedStorage& shared, int cta_rank) {
    sm90::WaitWatch* watch = shared.watch;
    typename Scheduler::Coord c;
    int stage = 0;
    uint32_t phase = 0;
    typename Mainloop::ProducerState state{};
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      const typename Mainloop::Loads loads = mainloop.producer_tile(p, c, cta_rank, state, watch);
      const int k_blocks = mainloop.k_blocks(c);
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&shared.empty[stage], phase ^ 1, kWaitFreeStage, watch);
        sm90::mbarrier_arrive_expect_tx(&shared.full[stage], Tile::kStageBytes);
        mainloop.load_stage(maps, p, c, loads, cta_rank, kb, shared.a + stage * Tile::kABytes,
                            shared.b + stage * Tile::kBBytes, &shared.full[stage]);
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    if constexpr (Mainloop::kClusterLaunch) {
      sm90::wait_all_stages_released<Tile::kStages>(shared.empty, stage, phase, watch);
    }
    sm90::mark_finished(watch);
  }

  template <class Maps, class Params>
  static __device__ __forceinline__ void consume(const Maps& maps, const Params& p, const Mainloop& mainloop,
                                                 Scheduler& scheduler, const SharedStorage& shared, int consumer,
                                                 int thread) {
    sm90::WaitWatch* watch = shared.watch;
    typename Scheduler::Coord c;
    float acc[Tile::kAccumulators];
    int stage = 0;
    uint32_t phase = 0;
    StagingRing staging(shared.staging + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
    const OutputExtent out_extent = scheduler.output_extent();
    for (int64_t tile = scheduler.first_tile(); scheduler.at(tile, c); tile += scheduler.tile_step()) {
      const typename Mainloop::ConsumerTile mma_tile = mainloop.consumer_tile(c);
      int previous_stage = 0;
      // Defined afresh per tile (the first wgmma ignores them anyway), so the compiler does not keep
      // the previous tile's accumulators alive through its epilogue.
#pragma unroll
      for (int i = 0; i < Tile::kAccumulators; ++i) acc[i] = 0.f;
      if constexpr (Mainloop::kCarriesAccumulators) mainloop.resume_accumulators(acc, mma_tile, consumer, thread);
      Epilogue::before_mainloop(p.epilogue, out_extent, scheduler.output_tile(c), consumer, thread);
      for (int kb = 0; kb < mma_tile.k_blocks; ++kb) {
        sm90::mbarrier_wait(&shared.full[stage], phase, kWaitLoadedStage, watch);
        uint8_t* a = mainloop.consumer_a(shared.a + stage * Tile::kABytes, consumer);  // this warpgroup's rows
        uint8_t* b = shared.b + stage * Tile::kBBytes;
        mainloop.prepare_stage(mma_tile, kb, a, b, consumer, thread);
        mainloop.mma(acc, mma_tile, kb, a, b);
        // The previous K block's wgmma group has finished reading its stage: hand it back.
        sm90::wgmma_wait_group<1>();
        if (kb > 0 && thread == 0) sm90::release_stage<Mainloop::kClusterM>(&shared.empty[previous_stage]);
        previous_stage = stage;
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
      // (Unconditional: a wgmma wait on a path only some tiles take makes ptxas serialize every
      // wgmma, C7518. With no K block there is nothing to wait for and no stage to release.)
      sm90::wgmma_wait_group<0>();
      sm90::fence_accumulators(acc);
      if ((!Mainloop::kKBlocksMayBeZero || mma_tile.k_blocks > 0) && thread == 0) {
        sm90::release_stage<Mainloop::kClusterM>(&shared.empty[previous_stage]);
      }
      Mainloop::tile_loaded(p, c, consumer, thread);
      if constexpr (Mainloop::kCarriesAccumulators) {
        if (mainloop.suspend_accumulators(acc, mma_tile, consumer, thread)) continue;  // no product yet
      }
      uint32_t packed[64];
      pack_accumulators(acc, packed);
      Epilogue::store(maps.epilogue, p.epilogue, out_extent, packed, scheduler.output_tile(c), staging,
                      consumer, thread);
    }
    if (thread == 0) {
      sm90::bulk_wait_all();  // the last tile's stores are complete before the CTA exits
      sm90::mark_finished(watch);
    }
  }
};

// The kernel: TensorMaps are CUtensorMap, one per pointer of Maps in its order (mok_params.h). The
// maps stay where the launch put them (TMA reads them there); the params are copied in.
template <class Kernel, class Maps, class Params, class... TensorMaps>
__global__ void __launch_bounds__(ExpertGemmTile::kThreads, 1)
    gemm_kernel_sm90(const __grid_constant__ TensorMaps... tensor_maps, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  Kernel::run(Maps{&tensor_maps...}, p, smem_raw);
}

}  // namespace mok
