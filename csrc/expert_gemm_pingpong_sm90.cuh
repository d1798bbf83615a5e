// The expert GEMM with ping-pong consumers (sm_90a), store epilogue; an alternative to the
// cooperative kernel, not used by the layer yet. On the H200 (2026-11-29, docs/performance.md) it
// passes the same tests and, against the cooperative kernel on the down projection, wins where K is
// short (Qwen3-30B, K = 768: 541 vs 523 TFLOP/s) and loses where it is long (DeepSeek-V3, K = 2048:
// 593 vs 627): it hides the epilogue but reads 20% more shared memory per FLOP (m64n128).
// Reference: segment_matmul_reference in megatron_mok/reference.py (the same contract as
// expert_gemm_kernel<kStore>).
//
// Why: in the cooperative kernel (expert_gemm_sm90.cuh) both consumer warpgroups share a 128x256
// tile, so both run the epilogue at once and the tensor cores idle meanwhile (docs/megakernel_plan.md).
// Here each consumer warpgroup owns whole 128x128 tiles: warpgroup 1 takes this CTA's tiles 0, 2,
// 4, ..., warpgroup 2 tiles 1, 3, 5, ... Their mainloops take turns at the tensor cores (a turn
// barrier per warpgroup), so one's epilogue runs under the other's MMAs.
//
// One CTA per SM, 384 threads:
//   warpgroup 0: thread 0 is the TMA producer. It walks all of the CTA's tiles in order and, per
//     64-wide K block, waits for a free stage and loads the tile's 128 rows of A and 128 rows of B
//     (the weight rows n0 .. n0 + 127 of the tile's expert: one K-major box of 128 rows; MN-major
//     B, kTransB: two 64 N x 64 K boxes).
//     Thread 32 is the watchdog.
//   warpgroups 1 and 2: per own tile, two wgmma m64n128k16 per 16 K (rows 0-63 and 64-127), 2 x 64
//     fp32 accumulators per thread. Tile j of the CTA's sequence uses ring positions
//     [j * k_blocks, (j + 1) * k_blocks) of the stage ring (every tile has the same K), which gives
//     each warpgroup its stages and phases without talking to the other.
//   Turns: a warpgroup waits on its turn barrier before its mainloop (not before the CTA's first
//     tile) and, once its last K block is issued, arrives on the other's turn barrier if the CTA
//     has a next tile. Arrivals and waits pair up one to one, and the waits are bounded (watchdog).
//     The turns are needed for correctness, not only for speed: an mbarrier parity wait tells only
//     adjacent phases apart, and a warpgroup running ahead could wait on a stage's use two phases
//     past the last completed one and pass at once on stale data. Before tile i, the other
//     warpgroup has passed every full wait below position i * k_blocks, so no full barrier is
//     more than one phase behind the use a consumer waits for.
//   Epilogue: each 64-row half through the warpgroup's 16 KB staging buffer and two TMA store
//     boxes (stmatrix, as in expert_gemm_sm90.cuh), or masked direct stores for a half that is not
//     entirely inside the segment.
#pragma once

#include "expert_gemm_sm90.cuh"

namespace mok {

struct PingPongTile {
  static constexpr int kM = 128;  // rows per tile (one warpgroup: two m64 halves)
  static constexpr int kN = 128;  // output columns per tile
  static constexpr int kK = 64;
  // The consumers' staging buffers are StagingRing's (ExpertGemmTile::kStagingBuffers each, two in
  // the 3-stage build of the cooperative kernel); the stages get the rest of the shared memory.
  static constexpr int kStagingBuffers = ExpertGemmTile::kStagingBuffers;
  static constexpr int kStages = kStagingBuffers == 1 ? 6 : 5;
  static constexpr int kThreads = 384;
  static constexpr uint32_t kABytes = kM * kK * 2;
  static constexpr uint32_t kBBytes = kN * kK * 2;
  static constexpr uint32_t kBBoxBytes = 64 * kK * 2;  // MN-major B: boxes of 64 N x 64 K
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr uint32_t kStagingBytes = ExpertGemmTile::kStagingBytes;  // 64 rows x 128 columns
  static constexpr int kRoles = 3;
  static constexpr size_t kSmemBytes = ExpertGemmTile::kSwizzleAlign + size_t(kStages) * kStageBytes +
                                       2 * size_t(kStagingBuffers) * kStagingBytes + (2 * kStages + 2) * sizeof(uint64_t) +
                                       sizeof(sm90::WaitWatch);
  static_assert(ExpertGemmTile::kM == kM, "TileWalker walks 128-row m-tiles");

};

template <bool kTransB>
__global__ void __launch_bounds__(PingPongTile::kThreads, 1)
    expert_gemm_pingpong_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                                const __grid_constant__ CUtensorMap out_map, const ExpertGemmParams p) {
  using Tile = PingPongTile;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + ExpertGemmTile::kSwizzleAlign - 1) &
                                             ~uintptr_t(ExpertGemmTile::kSwizzleAlign - 1));
  uint8_t* a_stages = smem;
  uint8_t* b_stages = a_stages + Tile::kStages * Tile::kABytes;
  uint8_t* staging_buffers = b_stages + Tile::kStages * Tile::kBBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging_buffers + 2 * Tile::kStagingBuffers * Tile::kStagingBytes);
  uint64_t* empty = full + Tile::kStages;
  uint64_t* turn = empty + Tile::kStages;  // [2]: consumer c may start its next mainloop
  sm90::WaitWatch* watch = reinterpret_cast<sm90::WaitWatch*>(turn + 2);

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);   // the producer's expect_tx arrival (+ TMA bytes)
      sm90::mbarrier_init(&empty[s], 1);  // the one consumer warpgroup that read the stage
    }
    sm90::mbarrier_init(&turn[0], 1);
    sm90::mbarrier_init(&turn[1], 1);
    sm90::fence_barrier_init();
    watch->failed = 0;
    watch->finished = 0;
  }
  if (threadIdx.x == 32) {
    sm90::prefetch_tensor_map(&a_map);
    sm90::prefetch_tensor_map(&b_map);
    sm90::prefetch_tensor_map(&out_map);
  }
  __syncthreads();

  const int n_tiles = (p.n_out + Tile::kN - 1) / Tile::kN;
  const int k_blocks = (p.k + Tile::kK - 1) / Tile::kK;
  const int64_t first_tile = blockIdx.x, tile_step = gridDim.x;
  TileWalker<1> walker(p.expert_offsets, p.num_experts, n_tiles, Tile::kN, p.group_m, 0);
  TileCoord c;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    sm90::setmaxnreg_decrease<ExpertGemmTile::kProducerRegisters>();
    if (threadIdx.x == 32) sm90::watch_waits(watch, Tile::kRoles, p.timeout_record, kExpertGemmKernel);
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t i = 0; walker.at(first_tile + i * tile_step, c); ++i) {
      const int b_row = c.expert * p.n_weight_rows + c.n0;
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&empty[stage], phase ^ 1, kWaitFreeStage, watch);
        sm90::mbarrier_arrive_expect_tx(&full[stage], Tile::kStageBytes);
        sm90::tma_load_2d(a_stages + stage * Tile::kABytes, &a_map, &full[stage], kb * Tile::kK, c.row0);
        uint8_t* b = b_stages + stage * Tile::kBBytes;
        if constexpr (kTransB) {
#pragma unroll
          for (int j = 0; j < Tile::kN / 64; ++j) {
            sm90::tma_load_3d(b + j * Tile::kBBoxBytes, &b_map, &full[stage], c.n0 + 64 * j, kb * Tile::kK, c.expert);
          }
        } else {
          sm90::tma_load_2d(b, &b_map, &full[stage], kb * Tile::kK, b_row);
        }
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    sm90::mark_finished(watch);
    return;
  }

  sm90::setmaxnreg_increase<ExpertGemmTile::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % 128;
  float acc_top[64], acc_bottom[64];  // rows 0-63 and 64-127 of the tile
  StagingRing staging(staging_buffers + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
  TileWalker<1> lookahead(p.expert_offsets, p.num_experts, n_tiles, Tile::kN, p.group_m, 0);
  TileCoord next;
  uint32_t turn_phase = 0;
  const EpilogueMaps maps{&out_map, &out_map, &out_map};
  for (int64_t i = consumer; walker.at(first_tile + i * tile_step, c); i += 2) {
    // Ring position of this tile's first K block: tile i of the CTA's sequence follows i tiles of
    // k_blocks stages each.
    const int64_t position = i * k_blocks;
    int stage = int(position % Tile::kStages);
    uint32_t phase = uint32_t(position / Tile::kStages) & 1;
    if (i > 0) {
      sm90::mbarrier_wait(&turn[consumer], turn_phase, kWaitTensorCoreTurn, watch);
      turn_phase ^= 1;
    }
#pragma unroll
    for (int r = 0; r < 64; ++r) acc_top[r] = acc_bottom[r] = 0.f;
    int previous_stage = 0;
    for (int kb = 0; kb < k_blocks; ++kb) {
      sm90::mbarrier_wait(&full[stage], phase, kWaitLoadedStage, watch);
      const uint64_t a_desc = sm90::smem_descriptor_sw128(a_stages + stage * Tile::kABytes);
      const uint64_t b_desc = kTransB ? sm90::smem_descriptor_sw128_mn(b_stages + stage * Tile::kBBytes, Tile::kBBoxBytes)
                                      : sm90::smem_descriptor_sw128(b_stages + stage * Tile::kBBytes);
      constexpr uint64_t kBStep = kTransB ? 2048 / 16 : 2;
      constexpr uint64_t kBottomRows = 64 * 128 / 16;  // rows 64-127 of A: 8 KB further, descriptor units
      sm90::wgmma_fence();
      sm90::fence_accumulators(acc_top);
      sm90::fence_accumulators(acc_bottom);
#pragma unroll
      for (int kk = 0; kk < Tile::kK / 16; ++kk) {
        const int accumulate = (kb | kk) != 0;
        sm90::wgmma_m64n128k16_bf16<kTransB ? 1 : 0>(acc_top, a_desc + 2 * kk, b_desc + kBStep * kk, accumulate);
        sm90::wgmma_m64n128k16_bf16<kTransB ? 1 : 0>(acc_bottom, a_desc + kBottomRows + 2 * kk, b_desc + kBStep * kk,
                                                      accumulate);
      }
      sm90::wgmma_commit_group();
      sm90::fence_accumulators(acc_top);
      sm90::fence_accumulators(acc_bottom);
      sm90::wgmma_wait_group<1>();
      if (kb > 0 && thread == 0) sm90::mbarrier_arrive(&empty[previous_stage]);
      previous_stage = stage;
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
    // Every MMA of the tile is issued: the other warpgroup's turn, if the CTA has a next tile.
    if (thread == 0 && lookahead.at(first_tile + (i + 1) * tile_step, next)) sm90::mbarrier_arrive(&turn[1 - consumer]);
    sm90::wgmma_wait_group<0>();
    sm90::fence_accumulators(acc_top);
    sm90::fence_accumulators(acc_bottom);
    if (thread == 0) sm90::mbarrier_arrive(&empty[previous_stage]);

    // Epilogue, one 64-row half at a time: packed[2 * j + h] holds columns 8 * j + 2 * (l % 4) +
    // {0, 1} of row half h of the warp's 16 rows (the accumulator layout of expert_gemm_sm90.cuh).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float(&acc)[64] = half == 0 ? acc_top : acc_bottom;
      uint32_t packed[32];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
      auto pair = [&](int j, int h) { return packed[2 * j + h]; };
      if (c.rows >= 64 * (half + 1)) {
        uint8_t* buffer = staging.acquire();
        stage_columns(buffer, thread, 0, pair);
        store_staged(maps.out, buffer, consumer, thread, c.n0, c.row0 + 64 * half);
      } else if (c.rows > 64 * half) {
        // (write_columns_direct's `consumer` selects the 64-row half of the tile.)
        write_columns_direct(static_cast<__nv_bfloat16*>(p.out), p.n_out, c, p, half, thread, 0, c.n0, pair);
      }
    }
  }
  if (thread == 0) {
    sm90::bulk_wait_all();
    sm90::mark_finished(watch);
  }
}

}  // namespace mok
