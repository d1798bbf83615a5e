// Weight gradients of the expert projections (sm_90a), tokens as the reduction dimension:
//   out[e] (m, n) = grad[seg_e]^T (m x rows_e) . inputs[seg_e] (rows_e x n)
// (d fc1 = d gate_up^T . rows, d fc2 = d out^T . act). Reference: segment_weight_grad_reference.
//
// The same persistent warp-specialized structure as gemm/expert_gemm_sm90.cuh (one CTA per SM, a TMA
// producer thread, two wgmma consumer warpgroups, the store epilogue), with both operands MN-major:
// grad (rows, m) and inputs (rows, n) are read as stored, in 64-row K blocks from the segment's
// first row, through TMA boxes of 64 columns x 64 rows (A: two, one per consumer's 64 rows of m;
// B: four, 256 columns of n), and multiplied by transposed wgmma.
//
// Segments have any length: the rows of a segment's last K block past its end belong to the next
// expert (or were never written), so before that block's wgmma the consumers zero them in shared
// memory: each its own A box, and half of B's boxes each, then both meet at a named barrier.
// A tile's K loop runs its segment's rows in order, so the gradients are bitwise reproducible. An
// expert with no rows gets zeros. Tiles: expert-major, then n-tiles, m fastest; CTA c takes tiles
// c, c + grid, ... (static: the tile count does not depend on the routing).
#pragma once

#include "gemm/expert_gemm_sm90.cuh"

namespace mok {

struct WgradTile {
  static constexpr uint32_t kBoxBytes = 64 * ExpertGemmTile::kK * 2;  // 64 columns x 64 rows
  static constexpr int kZeroBarrier = 4;  // named barriers 1 and 2: the consumers' epilogues
};

// A tile's K range: the rows of its expert's segment.
struct WgradTileCoord {
  int expert, m0, n0;
  int row_begin, rows;  // the segment; k blocks = ceil(rows / 64)
};

__device__ __forceinline__ bool wgrad_tile(const ExpertWgradParams& p, int64_t tile, WgradTileCoord& c) {
  using Tile = ExpertGemmTile;
  const int m_tiles = (p.m + Tile::kM - 1) / Tile::kM, n_tiles = (p.n + Tile::kN - 1) / Tile::kN;
  const int64_t per_expert = int64_t(m_tiles) * n_tiles;
  if (tile >= per_expert * p.num_experts) return false;
  c.expert = int(tile / per_expert);
  const int local = int(tile - per_expert * c.expert);
  c.m0 = (local % m_tiles) * Tile::kM;
  c.n0 = (local / m_tiles) * Tile::kN;
  const int begin = max(0, min(p.num_rows, __ldg(p.expert_offsets + c.expert)));
  const int end = max(begin, min(p.num_rows, __ldg(p.expert_offsets + c.expert + 1)));
  c.row_begin = begin;
  c.rows = end - begin;
  return true;
}

// Zeroes rows [valid, 64) of a 64-row TMA box (each row 128 contiguous bytes whatever the swizzle)
// with the 128 threads of a warpgroup, this one being `thread`. A fixed trip count with predicated
// stores: a loop whose trip count differed between threads would leave the warpgroup diverged
// before its wgmma, which ptxas then serializes (C7518).
__device__ __forceinline__ void zero_box_rows(uint8_t* box, int valid, int thread) {
#pragma unroll
  for (int i = thread; i < 64 * 8; i += 128) {
    if (i >= valid * 8) *reinterpret_cast<uint4*>(box + i * 16) = make_uint4(0, 0, 0, 0);
  }
}

__global__ void __launch_bounds__(ExpertGemmTile::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap grad_map, const __grid_constant__ CUtensorMap inputs_map,
                        const __grid_constant__ CUtensorMap out_map, const ExpertWgradParams p) {
  using Tile = ExpertGemmTile;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + Tile::kSwizzleAlign - 1) & ~uintptr_t(Tile::kSwizzleAlign - 1));
  uint8_t* a_stages = smem;
  uint8_t* b_stages = a_stages + Tile::kStages * Tile::kABytes;
  uint8_t* staging_buffers = b_stages + Tile::kStages * Tile::kBBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging_buffers + 2 * Tile::kStagingBuffers * Tile::kStagingBytes);
  uint64_t* empty = full + Tile::kStages;
  sm90::WaitWatch* watch = reinterpret_cast<sm90::WaitWatch*>(empty + Tile::kStages);

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      sm90::mbarrier_init(&full[s], 1);
      sm90::mbarrier_init(&empty[s], 2);
    }
    sm90::fence_barrier_init();
    watch->failed = 0;
    watch->finished = 0;
  }
  if (threadIdx.x == 32) {
    sm90::prefetch_tensor_map(&grad_map);
    sm90::prefetch_tensor_map(&inputs_map);
    sm90::prefetch_tensor_map(&out_map);
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  WgradTileCoord c;
  if (warpgroup == 0) {
    sm90::setmaxnreg_decrease<Tile::kProducerRegisters>();
    if (threadIdx.x == 32) sm90::watch_waits(watch, Tile::kRoles, p.failure_record, kExpertWgradKernel);
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t tile = blockIdx.x; wgrad_tile(p, tile, c); tile += gridDim.x) {
      const int k_blocks = (c.rows + Tile::kK - 1) / Tile::kK;
      for (int kb = 0; kb < k_blocks; ++kb) {
        sm90::mbarrier_wait(&empty[stage], phase ^ 1, kWaitFreeStage, watch);
        sm90::mbarrier_arrive_expect_tx(&full[stage], Tile::kStageBytes);
        const int row = c.row_begin + kb * Tile::kK;
        uint8_t* a = a_stages + stage * Tile::kABytes;
        uint8_t* b = b_stages + stage * Tile::kBBytes;
#pragma unroll
        for (int j = 0; j < Tile::kM / 64; ++j) {
          sm90::tma_load_2d(a + j * WgradTile::kBoxBytes, &grad_map, &full[stage], c.m0 + 64 * j, row);
        }
#pragma unroll
        for (int j = 0; j < Tile::kN / 64; ++j) {
          sm90::tma_load_2d(b + j * WgradTile::kBoxBytes, &inputs_map, &full[stage], c.n0 + 64 * j, row);
        }
        sm90::advance_stage<Tile::kStages>(stage, phase);
      }
    }
    // Done after the last load, without waiting for the stages' release: no other CTA arrives on
    // this CTA's barriers (the kernel is never launched in clusters).
    sm90::mark_finished(watch);
    return;
  }

  sm90::setmaxnreg_increase<Tile::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % 128;
  float acc[128];
  int stage = 0;
  uint32_t phase = 0;
  StagingRing staging(staging_buffers + consumer * Tile::kStagingBuffers * Tile::kStagingBytes, consumer, thread);
  const EpilogueMaps maps{&out_map, &out_map, &out_map};
  // The store epilogue's view of the output: (num_experts * m, n).
  ExpertGemmParams out_params{};
  out_params.out = p.out;
  out_params.num_rows = p.num_experts * p.m;
  out_params.n_out = p.n;
  for (int64_t tile = blockIdx.x; wgrad_tile(p, tile, c); tile += gridDim.x) {
    const int k_blocks = (c.rows + Tile::kK - 1) / Tile::kK;
    const int last_valid = c.rows - (k_blocks - 1) * Tile::kK;  // rows of the last K block in the segment
    int previous_stage = 0;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      sm90::mbarrier_wait(&full[stage], phase, kWaitLoadedStage, watch);
      uint8_t* a = a_stages + stage * Tile::kABytes + consumer * WgradTile::kBoxBytes;
      uint8_t* b = b_stages + stage * Tile::kBBytes;
      if (kb == k_blocks - 1 && last_valid < Tile::kK) {
        // The rows past the segment: this consumer's A box and two of B's four boxes.
        zero_box_rows(a, last_valid, thread);
        zero_box_rows(b + (2 * consumer) * WgradTile::kBoxBytes, last_valid, thread);
        zero_box_rows(b + (2 * consumer + 1) * WgradTile::kBoxBytes, last_valid, thread);
        sm90::fence_async_shared();  // generic writes, read by wgmma through the async proxy
        // Both consumers take this branch at the same K block (same tile, same segment), so the
        // barrier always fills.
        sm90::named_barrier_sync(WgradTile::kZeroBarrier, 256);
      }
      const uint64_t a_desc = sm90::smem_descriptor_sw128_mn(a, WgradTile::kBoxBytes);
      const uint64_t b_desc = sm90::smem_descriptor_sw128_mn(b, WgradTile::kBoxBytes);
      sm90::wgmma_fence();
      sm90::fence_accumulators(acc);
#pragma unroll
      for (int kk = 0; kk < Tile::kK / 16; ++kk) {
        // +16 K rows of 128 bytes per wgmma, in 16-byte descriptor units.
        sm90::wgmma_m64n256k16_bf16<1, 1>(acc, a_desc + 128 * kk, b_desc + 128 * kk, (kb | kk) != 0);
      }
      sm90::wgmma_commit_group();
      sm90::fence_accumulators(acc);
      sm90::wgmma_wait_group<1>();
      if (kb > 0 && thread == 0) sm90::mbarrier_arrive(&empty[previous_stage]);
      previous_stage = stage;
      sm90::advance_stage<Tile::kStages>(stage, phase);
    }
    // (Unconditional: a wgmma wait on a path only some tiles take makes ptxas serialize every
    // wgmma, C7518. With no K block there is nothing to wait for and no stage to release.)
    sm90::wgmma_wait_group<0>();
    sm90::fence_accumulators(acc);
    if (k_blocks > 0 && thread == 0) sm90::mbarrier_arrive(&empty[previous_stage]);
    uint32_t packed[64];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
    // Rows of out: the expert's m rows; a tile's rows past m belong to the next expert.
    TileCoord out_tile{c.expert, c.expert * p.m + c.m0, min(Tile::kM, p.m - c.m0), c.n0};
    if (out_tile.rows >= 64 * (consumer + 1)) {
      store_rows_staged<GemmEpilogue::kStore>(packed, out_tile, maps, staging, consumer, thread);
    } else if (out_tile.rows > 64 * consumer) {
      store_rows_direct<GemmEpilogue::kStore>(packed, out_tile, out_params, consumer, thread);
    }
  }
  if (thread == 0) {
    sm90::bulk_wait_all();
    sm90::mark_finished(watch);
  }
}

}  // namespace mok
