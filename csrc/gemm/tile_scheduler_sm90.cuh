// Tile schedulers of the sm90 GEMM kernels: which output tiles a CTA computes, in which order, and
// where in the output the epilogue writes each. Both are static (a CTA's tiles follow from its
// index and the device-side segment offsets), so a launch never needs the host to know the
// routing. The kernel walks
//   for (tile = first_tile(); at(tile, c); tile += tile_step())
// in its producer and in each consumer alike, so all roles of a CTA see the same tiles in order.
#pragma once

#include <cstdint>

#include "common/sync_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

struct TileCoord {
  int expert;
  int row0;  // first row of this CTA's tile in A and the output
  int rows;  // rows of the tile inside the segment (<= kM; <= 0 when the tile is past its end)
  int n0;    // first output column
};

// The output an epilogue writes, as a row-major matrix: rows and columns (its row stride, or half
// of it for gate_up), the bounds of its masked stores.
struct OutputExtent {
  int num_rows;
  int n_out;
};

// Walks the expert GEMM's segments: maps increasing linear cluster-tile indices to this CTA's tiles,
// reading the segment offsets from global memory as it moves forward through the experts (no
// table, so any expert count). A cluster tile is kClusterM vertically adjacent m-tiles; CTA r of
// the cluster takes the r-th.
template <int kClusterM>
class TileWalker {
 public:
  __device__ TileWalker(const int32_t* offsets, int num_experts, int n_tiles, int n_tile_cols, int group_m,
                        int cta_rank)
      : offsets_(offsets), num_experts_(num_experts), n_tiles_(n_tiles), n_tile_cols_(n_tile_cols),
        group_pairs_(max(1, group_m / kClusterM)), cta_rank_(cta_rank) {
    load_expert();
  }

  // False once `tile` is past the last expert's tiles. Tiles must increase from call to call.
  __device__ bool at(int64_t tile, TileCoord& c) {
    using Tile = ExpertGemmTile;
    while (expert_ < num_experts_ && tile >= first_ + int64_t(pairs_) * n_tiles_) {
      first_ += int64_t(pairs_) * n_tiles_;
      ++expert_;
      load_expert();
    }
    if (expert_ >= num_experts_) return false;
    const int local = int(tile - first_);
    const int group = local / (group_pairs_ * n_tiles_);
    const int group_first = group * group_pairs_;
    const int group_size = min(group_pairs_, pairs_ - group_first);
    const int in_group = local - group * group_pairs_ * n_tiles_;
    const int pair = group_first + in_group % group_size;
    const int n_tile = in_group / group_size;
    c.expert = expert_;
    c.row0 = seg_begin_ + (pair * kClusterM + cta_rank_) * Tile::kM;
    c.rows = min(Tile::kM, seg_end_ - c.row0);
    c.n0 = n_tile * n_tile_cols_;
    return true;
  }

 private:
  __device__ void load_expert() {
    if (expert_ >= num_experts_) return;
    constexpr int kRows = ExpertGemmTile::kM * kClusterM;
    seg_begin_ = __ldg(offsets_ + expert_);
    seg_end_ = __ldg(offsets_ + expert_ + 1);
    const int rows = seg_end_ - seg_begin_;
    pairs_ = rows > 0 && seg_begin_ >= 0 ? (rows + kRows - 1) / kRows : 0;
  }

  const int32_t* offsets_;
  int num_experts_;
  int n_tiles_;
  int n_tile_cols_;
  int group_pairs_;
  int cta_rank_;
  int expert_ = 0;
  int64_t first_ = 0;  // cluster tiles of the experts before expert_
  int seg_begin_ = 0, seg_end_ = 0, pairs_ = 0;
};

// The expert GEMM's tiles: the schedule's segments (rows of one expert, any alignment) split into
// cluster tiles of kClusterM 128-row m-tiles and kTileCols output columns. Rows past the segment's
// end (a short last tile, or with 2-CTA clusters a whole one when the segment has an odd number of
// m-tiles) are computed from the next segment's rows (or TMA zero fill) and not stored. Cluster
// tile order is expert-major, then groups of group_m m-tiles with m fastest inside a group, so the
// clusters working at the same time share the expert's B slices and A rows in L2. Cluster c takes
// cluster tiles c, c + clusters, ...
template <int kClusterM, int kTileCols>
class ExpertTileScheduler {
 public:
  using Coord = TileCoord;

  __device__ explicit ExpertTileScheduler(const ExpertGemmProblem& problem)
      : n_tiles_((problem.n_out + kTileCols - 1) / kTileCols), cta_rank_(int(sm90::cluster_cta_rank())),
        first_tile_(int(sm90::cluster_index())), tile_step_(int(sm90::cluster_count())),
        out_extent_{problem.num_rows, problem.n_out},
        walker_(problem.expert_offsets, problem.num_experts, n_tiles_, kTileCols, problem.group_m, cta_rank_) {}

  // This CTA's rank in its cluster: which m-tile of a cluster tile it takes.
  __device__ int cta_rank() const { return cta_rank_; }
  __device__ int first_tile() const { return first_tile_; }
  __device__ int tile_step() const { return tile_step_; }
  // Output tiles per m-tile (the dispatching GEMM's ring counts rows once per n-tile).
  __device__ int n_tiles() const { return n_tiles_; }

  // False once `tile` is past the last expert's tiles.
  __device__ bool at(int64_t tile, TileCoord& c) { return walker_.at(tile, c); }

  // Where the epilogue writes the tile: the same rows of the output. (By value: handed a reference
  // to the walker's coordinate, nvcc compiles the tile loop into other SASS than the measured one.)
  __device__ TileCoord output_tile(const TileCoord& c) const { return c; }
  // The output: the schedule's rows, n_out columns.
  __device__ OutputExtent output_extent() const { return out_extent_; }

 private:
  int n_tiles_;
  int cta_rank_;
  int first_tile_, tile_step_;
  OutputExtent out_extent_;
  TileWalker<kClusterM> walker_;
};

// A weight-gradient tile: (m0, n0) of expert `expert`'s output, and its K range, the rows of the
// expert's segment.
struct WgradTileCoord {
  int expert, m0, n0;
  int row_begin, rows;  // the segment; k blocks = ceil(rows / 64)
};

// The weight gradient's tiles: expert-major, then n-tiles, m fastest; CTA c takes tiles c,
// c + grid, ... (the tile count does not depend on the routing).
class WgradTileScheduler {
 public:
  using Coord = WgradTileCoord;

  __device__ explicit WgradTileScheduler(const ExpertWgradProblem& problem) : p_(problem) {}

  __device__ int cta_rank() const { return 0; }  // no clusters
  __device__ unsigned first_tile() const { return blockIdx.x; }
  __device__ unsigned tile_step() const { return gridDim.x; }

  __device__ bool at(int64_t tile, WgradTileCoord& c) const {
    const ExpertWgradProblem& p = p_;
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

  // Where the epilogue writes the tile: rows of out viewed as (num_experts * m, n), the expert's m
  // rows (a tile's rows past m belong to the next expert and are not stored).
  __device__ TileCoord output_tile(const WgradTileCoord& c) const {
    return TileCoord{c.expert, c.expert * p_.m + c.m0, min(ExpertGemmTile::kM, p_.m - c.m0), c.n0};
  }
  // The output: out (num_experts, m, n) as (num_experts * m, n).
  __device__ OutputExtent output_extent() const { return OutputExtent{p_.num_experts * p_.m, p_.n}; }

 private:
  ExpertWgradProblem p_;
};

// A tile of the windowed weight gradient: the WgradTileCoord of the expert's rows inside the window
// (row_begin relative to the window's first row), and where its K chain comes from and goes on.
struct WgradWindowTileCoord : WgradTileCoord {
  int segment_begin;  // o_e - window_begin: K blocks of the whole schedule start here (may be < 0)
  int carry_tile;     // the tile's index among its expert's, its place in a carry buffer
  bool carry_in;      // the chain continues from the previous window
  bool carry_out;     // the chain goes on in the next window
};

// The windowed weight gradient's tiles (mok_params.h ExpertWgradWindowProblem): those of the
// experts the window touches, [first_expert, end_expert), in WgradTileScheduler's order (expert-major,
// then n-tiles, m fastest); CTA c takes tiles c, c + grid, ..., so the tile count depends on the
// routing and CTAs past the last tile have none. Each CTA finds the experts from expert_offsets
// when constructed: by every thread of the CTA at once (the kernel skeleton does), one offset per
// thread and round, counted with __syncthreads_count, so the search costs one pass of loads.
class WgradWindowTileScheduler {
 public:
  using Coord = WgradWindowTileCoord;

  __device__ explicit WgradWindowTileScheduler(const ExpertWgradWindowProblem& problem) : p_(problem) {
    using Tile = ExpertGemmTile;
    m_tiles_ = (p_.m + Tile::kM - 1) / Tile::kM;
    per_expert_ = m_tiles_ * ((p_.n + Tile::kN - 1) / Tile::kN);
    // The segments are ordered, so the experts before the window (started before it and ended at
    // its first row at the latest) and those after it (starting at its end or later; none on the
    // last window, where such a segment is empty and stored) are a prefix and a suffix.
    const int begin = p_.window_begin, end = p_.window_begin + p_.num_rows;
    int before = 0, after = 0;
    for (int first = 0; first < p_.num_experts; first += int(blockDim.x)) {
      const int e = first + int(threadIdx.x);
      bool is_before = false, is_after = false;
      if (e < p_.num_experts) {
        const int o = __ldg(p_.expert_offsets + e), o_next = __ldg(p_.expert_offsets + e + 1);
        is_before = o < begin && o_next <= begin;
        is_after = !p_.last_window && o >= end;
      }
      before += __syncthreads_count(is_before);
      after += __syncthreads_count(is_after);
    }
    first_expert_ = before;
    end_expert_ = max(first_expert_, p_.num_experts - after);  // (max: offsets out of order)
  }

  __device__ int cta_rank() const { return 0; }  // no clusters
  __device__ unsigned first_tile() const { return blockIdx.x; }
  __device__ unsigned tile_step() const { return gridDim.x; }

  __device__ bool at(int64_t tile, WgradWindowTileCoord& c) const {
    using Tile = ExpertGemmTile;
    if (tile >= int64_t(per_expert_) * (end_expert_ - first_expert_)) return false;
    const int relative = int(tile / per_expert_);
    const int local = int(tile - int64_t(per_expert_) * relative);
    c.expert = first_expert_ + relative;
    c.m0 = (local % m_tiles_) * Tile::kM;
    c.n0 = (local / m_tiles_) * Tile::kN;
    // The segment in window rows; on the last window it ends at the window's end at the latest
    // (the whole-schedule kernel clamps the offsets to its rows).
    const int begin = p_.window_begin, end = p_.window_begin + p_.num_rows;
    int o = __ldg(p_.expert_offsets + c.expert), o_next = __ldg(p_.expert_offsets + c.expert + 1);
    if (p_.last_window) {
      o = min(o, end);
      o_next = min(o_next, end);
    }
    const int first_row = min(max(o, begin), end);
    c.row_begin = first_row - begin;
    c.rows = max(first_row, min(o_next, end)) - first_row;
    c.segment_begin = o - begin;
    c.carry_tile = local;
    c.carry_in = o < begin && begin < o_next;
    c.carry_out = o < end && end < o_next;
    return true;
  }

  // As WgradTileScheduler's: rows of out viewed as (num_experts * m, n).
  __device__ TileCoord output_tile(const WgradTileCoord& c) const {
    return TileCoord{c.expert, c.expert * p_.m + c.m0, min(ExpertGemmTile::kM, p_.m - c.m0), c.n0};
  }
  __device__ OutputExtent output_extent() const { return OutputExtent{p_.num_experts * p_.m, p_.n}; }

 private:
  ExpertWgradWindowProblem p_;
  int m_tiles_, per_expert_;
  int first_expert_, end_expert_;
};

}  // namespace mok
