// The K-block issue both 128 x 192 FP8 kernels share (gemm/fp8_gemm_wide_sm90.cuh,
// gemm/fp8_wgrad_wide_sm90.cuh): one partial per warpgroup, a block issued into it once the
// previous block's promotion has read it; and, with their kIssueOrder, the consumers' turn at it.
#pragma once

#include <cstdint>

#include "common/failure_codes.h"
#include "common/pipeline_sm90.cuh"
#include "common/sync_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "common/wgmma_fp8_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gemm/tile_sm90.cuh"

namespace mok {

// The block of stage `stage` (a bounded wait for its loads on the full barrier at full0 + 8 * stage),
// its four m64n192k32 wgmmas into the fresh partial, committed as one group; stage and phase
// advanced. The stage's descriptors are stage 0's (a_desc0, b_desc0) plus its operands' bytes.
template <class Tile>
__device__ __forceinline__ void fp8_wide_issue_block(float (&partial)[Tile::kAccumulators], uint32_t full0,
                                                     uint64_t a_desc0, uint64_t b_desc0, int& stage, uint32_t& phase,
                                                     sm90::WaitWatch* watch) {
  static_assert(Tile::kMmasPerStage == 4 && Tile::kAccumulators == 96,
                "a stage is one 128-deep K block of 192 columns");
  sm90::mbarrier_wait<true>(full0 + 8 * stage, phase, kWaitLoadedStage, watch);
  sm90::wgmma_block_m64n192k128_e4m3_fresh(partial, sm90::descriptor_plus(a_desc0, stage * (Tile::kABytes >> 4)),
                                           sm90::descriptor_plus(b_desc0, stage * (Tile::kBBytes >> 4)));
  sm90::advance_stage<Tile::kStages>(stage, phase);
}

// A consumer warpgroup's turn at issuing (the wide kernels' kIssueOrder): both consumer warpgroups
// meet at one named barrier, warpgroup 1 after issuing a block (before retiring it) and warpgroup 0
// before issuing its next, so warpgroup 0's block k follows warpgroup 1's block k - 1. Each must take
// it as often as the other: the kernels take it k_blocks - 1 times in a tile both work, never at a
// tile's first block.
__device__ __forceinline__ void fp8_wide_take_issue_turn() {
  sm90::named_barrier_sync(kIssueOrderBarrier, 2 * kNumThreadsPerWarpGroup);
}

}  // namespace mok
