// The dispatching expert GEMM's A source (sm90, warp-specialized): the pull dispatch runs inside
// the gate/up GEMM, on warps 2 and 3 of every CTA's producer warpgroup, into a ring buffer the GEMM
// loads its A rows from (DispatchRingParams in mok_params.h has the layout and the counters).
//   Dispatchers (dispatch_rows_ahead): minibatch by minibatch of kDispatchMinibatchRows rows, wait
//     until the minibatch's ring slot is free, claim chunks of kDispatchChunkRows rows, copy them
//     and count each minibatch's chunks done.
//   Producer (wait_for_dispatched_rows): before loading a tile's rows, waits until every minibatch
//     they touch is done, so the dispatch overlaps the GEMM instead of preceding it.
//   Consumers (count_consumed_rows): once a tile's stages were all full, count its rows consumed,
//     so the dispatchers may refill the slot: the workspace is bounded whatever the routing.
// (Gathering the rows straight into the stages instead — cp.async, or one TMA box per row — was
// measured 1.4-2.4x slower: every row is read once per n-tile through the load path,
// docs/log/performance_2026-11.md.) Where a row comes from: one tensor x (DispatchRingA) or the ranks' symmetric
// regions (PeerDispatchRingA, the lookups of moe/row_source_sm90.cuh), one instantiation each.
#pragma once

#include <cstdint>

#include "common/sync_sm90.cuh"
#include "common/tma_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"
#include "moe/row_source_sm90.cuh"

namespace mok {

// Warps 2 and 3 of the producer warpgroup copy the dispatched rows, in chunks of kDispatchChunkRows
// rows claimed from a counter.
constexpr int kDispatchThreads = 64;
constexpr int kDispatchChunkRows = 8;

// The rows the dispatch writes: those below the last segment's end (no tile stores a row past it).
// Row indices fit in 32 bits (the op checks rows < 2^31).
__device__ __forceinline__ int dispatched_rows_end(const ExpertGemmProblem& problem) {
  return min(problem.num_rows, max(0, __ldg(problem.expert_offsets + problem.num_experts)));
}

// Chunks of minibatch m: its rows below rows_end, in kDispatchChunkRows-row pieces.
__device__ __forceinline__ int minibatch_chunks(const DispatchRingParams& d, int m, int rows_end) {
  const int begin = m * d.minibatch_rows;
  const int end = min(begin + d.minibatch_rows, rows_end);
  return end > begin ? (end - begin + kDispatchChunkRows - 1) / kDispatchChunkRows : 0;
}

// The counters of the dispatch, each (num_minibatches,): chunks claimed, chunks written, and rows
// loaded by the GEMM's tiles (once per n-tile: the ring slot is free when it reaches
// n_tiles * the minibatch's segment rows).
__device__ __forceinline__ int32_t* claimed_chunks(const DispatchRingParams& d) { return d.counters; }
__device__ __forceinline__ int32_t* done_chunks(const DispatchRingParams& d) { return d.counters + d.num_minibatches; }
__device__ __forceinline__ int32_t* consumed_rows(const DispatchRingParams& d) {
  return d.counters + 2 * d.num_minibatches;
}

// Where dispatched row `row` sits in the ring. Ring positions [0, kM) are also mirrored at
// [ring_rows, ring_rows + kM), so a tile's 128-row TMA box that starts near the ring's end reads
// the rows that follow it (the next minibatch's, at the ring's start) instead of running off it.
__device__ __forceinline__ int ring_position(const DispatchRingParams& d, int row) { return row % d.ring_rows; }

// Rows of [begin, end) inside the segments: with non-decreasing offsets from offsets[0] >= 0 (the
// ops' contract, as the schedule makes them) the segments tile [offsets[0], rows_end), and the
// walker's tiles cover each of those rows once per n-tile. What a minibatch's consumed counter
// reaches. (Offsets outside the contract are the caller's bug, as for the GEMM itself: gaps leave
// the counter short, and the bounded wait names kWaitRingSlot; overlapping segments count rows
// twice and may free a slot early, when their outputs are ill-defined anyway.)
__device__ __forceinline__ int segment_rows_in(const ExpertGemmProblem& problem, int begin, int end) {
  return max(0, end - max(begin, __ldg(problem.expert_offsets)));
}

// A tile has loaded all its rows (its last K block's stage is full): count its rows, per minibatch
// they lie in, so the dispatchers may reuse the ring slots. Rows past the segment are not counted
// (nothing stored depends on them; they may be overwritten while loading).
__device__ __forceinline__ void count_consumed_rows(const ExpertGemmProblem& problem, const DispatchRingParams& d,
                                                    const TileCoord& c) {
  const int rows_end = dispatched_rows_end(problem);
  const int end = min(c.row0 + c.rows, rows_end);
  // The loads are complete (this thread saw every stage of the tile full); a release add carries
  // that to the dispatchers' acquire, after which they fence the async proxy and overwrite the slot.
  // (A relaxed add measured the same.)
  for (int row = c.row0; row < end;) {
    const int m = row / d.minibatch_rows;
    const int next = min(end, (m + 1) * d.minibatch_rows);
    sm90::red_release_gpu_add(consumed_rows(d) + m, next - row);
    row = next;
  }
}

// The token whose row x holds for dispatched row `row`, or -1 (padding, or a route past x).
__device__ __forceinline__ int64_t dispatched_token(const DispatchRingParams& d, int row) {
  const int64_t route = d.slot_to_route[row];
  const int64_t token = route >= 0 ? route_source_row(route, d.topk) : -1;
  return token < d.x_rows ? token : -1;
}

// Where the ring reads token `token`'s row of `units` 16-byte units: one overload per source form
// (the gathers' scheme, moe/dispatch_sm90.cuh). The one-tensor form is a plain indexed load (no
// lookup); the peer form finds the rank's region with the compare-and-select lookups of
// moe/row_source_sm90.cuh, so the table stays in the constant bank.
__device__ __forceinline__ const uint4* dispatched_row(const DispatchRingParams& d, int64_t token, int units) {
  return static_cast<const uint4*>(d.x) + token * units;
}
__device__ __forceinline__ const uint4* dispatched_row(const PeerDispatchRingParams& d, int64_t token, int units) {
  // (In 32 bits: the op checks that the group's rows, num_bases * rows_per_base, are below 2^31.)
  const BlockRow32 at = locate_block_row(int(token), int(d.source.rows_per_base), d.source.num_bases);
  return static_cast<const uint4*>(pick_rank(d.source.bases, at.block)) + int64_t(at.row) * units;
}

// Copies one dispatched row (`units` 16-byte units; zeros when src is null) with the 64 dispatch
// threads, unrolled four deep (at the producer's 40 registers ptxas keeps two loads in flight).
__device__ __forceinline__ void copy_row(const uint4* src, uint4* dst, int units, int g) {
  constexpr int kThreads = kDispatchThreads, kUnroll = 4;
  for (int u0 = g; u0 < units; u0 += kUnroll * kThreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = u0 + j * kThreads;
      v[j] = src != nullptr && u < units ? __ldg(src + u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = u0 + j * kThreads;
      if (u < units) dst[u] = v[j];
    }
  }
}

// The dispatch threads (warps 2 and 3 of warpgroup 0) of every CTA: minibatch after minibatch,
// wait until the minibatch's ring slot is free, claim a chunk of kDispatchChunkRows rows, copy them
// (the pull dispatch: ring[position(r)] = x[slot_to_route[r] / topk], zeros for -1), and count the
// chunk done. Only rows below the last segment's end are written; no tile stores a row past it.
//
// Progress: chunks are claimed, not assigned, so a tile only ever waits for chunks that running
// CTAs claimed. A dispatcher waits for a ring slot only before claiming in a new minibatch m, when
// every chunk of minibatches < m is claimed and therefore written; the slot waits for the tiles of
// minibatch m - ring_minibatches, and every tile a CTA runs before those lies in minibatches
// < m when ring_minibatches exceeds the minibatches one raster group spans (the op checks it).
// So the dispatch never waits on itself. Without the ring (ring_minibatches = num_minibatches) the
// launch need not be co-resident at all; with it, the CTAs holding the tiles of an old minibatch
// must get an SM eventually (a CTA waits at most for the GPU's other work, then the bounded wait
// reports kWaitRingSlot).
//
// From the peers (PeerDispatchRingParams), each read crosses NVLink at a microsecond or two. What
// keeps the link busy is bytes in flight: the copy below holds 2 of its 4 unrolled 16-byte loads per
// thread in flight (ptxas, at the producer's 40 registers), 1 KB per dispatch warp, 2 KB per CTA,
// ~0.26 MB over 132 SMs: about a third of the ~0.7 MB that ~370 GB/s at ~2 us needs, so on its own
// it would hold the pull to roughly a third of the link. The chunk's bulk L2 prefetch issued first
// asks for all its rows at once (8 rows, 8 * 2K bytes: 112 KB per CTA at K = 7168); whether that
// prefetch of a peer address brings the rows over the link ahead of the copy, or only warms the
// owner's L2, is to be measured before the copy loop is restructured (docs/design.md §7.1).
template <class RingParams>
__device__ __forceinline__ void dispatch_rows_ahead(const ExpertGemmProblem& problem, const RingParams& d,
                                                    int32_t* claimed_chunk, int n_tiles, int g, sm90::WaitWatch* watch) {
  const int rows_end = dispatched_rows_end(problem);
  const int units = problem.k / 8;
  auto* rows = static_cast<uint4*>(d.rows);
  volatile int32_t* claimed = claimed_chunk;
  for (int m = 0; m < d.num_minibatches; ++m) {
    const int begin = m * d.minibatch_rows;
    const int end = min(begin + d.minibatch_rows, rows_end);
    const int chunks = minibatch_chunks(d, m, rows_end);
    if (m >= d.ring_minibatches && chunks > 0) {
      const int old = m - d.ring_minibatches;
      if (g == 0) {
        const int old_begin = old * d.minibatch_rows;
        const int old_rows = segment_rows_in(problem, old_begin, min(old_begin + d.minibatch_rows, rows_end));
        sm90::wait_counter_at_least(consumed_rows(d) + old, n_tiles * old_rows, kWaitRingSlot, watch);
      }
      sm90::named_barrier_sync(kSideThreadsBarrier, kDispatchThreads);
      // The tiles' TMA reads of the slot are done; every writing thread orders them before its
      // ordinary writes.
      sm90::fence_proxy_async_global();
    }
    while (true) {
      if (g == 0) *claimed = atomicAdd(claimed_chunks(d) + m, 1);
      sm90::named_barrier_sync(kSideThreadsBarrier, kDispatchThreads);
      const int chunk = *claimed;
      sm90::named_barrier_sync(kSideThreadsBarrier, kDispatchThreads);  // read before the next claim
      if (chunk >= chunks) break;
      const int first = begin + chunk * kDispatchChunkRows;
      const int last = min(first + kDispatchChunkRows, end);
      // Every source row of the chunk in flight to L2 at once; the copy below then reads from L2
      // (64 threads with a few loads each in flight could not keep DRAM busy on their own).
      if (g < last - first) {
        const int64_t token = dispatched_token(d, first + g);
        if (token >= 0) sm90::prefetch_l2_bulk(dispatched_row(d, token, units), uint32_t(units) * 16);
      }
      for (int row = first; row < last; ++row) {
        const int64_t token = dispatched_token(d, row);
        copy_row(token >= 0 ? dispatched_row(d, token, units) : nullptr, rows + int64_t(ring_position(d, row)) * units,
                 units, g);
      }
      // The ring's first m-tile again past its end (a separate pass: the copy loop above has no
      // registers to spare for a second destination; these are 128 rows per turn of the ring).
      for (int row = first; row < last && d.ring_mirrored; ++row) {
        const int position = ring_position(d, row);
        if (position >= ExpertGemmTile::kM) continue;
        const int64_t token = dispatched_token(d, row);
        copy_row(token >= 0 ? dispatched_row(d, token, units) : nullptr, rows + int64_t(d.ring_rows + position) * units,
                 units, g);
      }
      // Other SMs read these rows with TMA (async proxy) once the chunk is counted.
      sm90::fence_proxy_async_global();
      sm90::named_barrier_sync(kSideThreadsBarrier, kDispatchThreads);
      if (g == 0) {
        __threadfence();
        sm90::red_release_gpu_add(done_chunks(d) + m, 1);
      }
    }
  }
  // The watchdog stays up until the dispatchers are done too (their ring waits are bounded waits).
  if (g == 0) sm90::mark_finished(watch);
}

// The producer's wait before loading a tile's rows: every minibatch up to the one holding the tile's
// last stored row is done (rows past the segment are loaded but never stored, so need not be).
// `ready` counts the minibatches already seen done; they complete in order of minibatch almost
// always, and waiting in order costs nothing otherwise.
__device__ __forceinline__ void wait_for_dispatched_rows(const ExpertGemmProblem& problem, const DispatchRingParams& d,
                                                         const TileCoord& c, int& ready, sm90::WaitWatch* watch) {
  if (c.rows <= 0) return;
  // (Clamped: offsets past the rows are a caller's bug the op does not check on the device; they
  // must not send this wait past the counters.)
  const int last = min((c.row0 + c.rows - 1) / d.minibatch_rows, d.num_minibatches - 1);
  if (last < ready) return;
  const int rows_end = dispatched_rows_end(problem);
  for (; ready <= last; ++ready) {
    sm90::wait_counter_at_least(done_chunks(d) + ready, minibatch_chunks(d, ready, rows_end),
                                kWaitDispatchedRows, watch);
  }
  sm90::fence_proxy_async_global();
}

// The A source of the dispatching GEMM (gemm/mainloop_sm90_tma_wgmma_ws.cuh): A's rows are
// p.a_source's ring, written by the side threads while the GEMM runs. RingParams: where the rows
// come from (DispatchRingA: one tensor; PeerDispatchRingA: the ranks' regions, below).
template <class RingParams>
struct DispatchRingSource {
  using Params = RingParams;
  static constexpr int kSideThreads = kDispatchThreads;
  static constexpr int kSideRoles = 1;  // the watchdog stays up until the dispatchers are done too
  struct ProducerState {
    int ready_minibatches = 0;  // minibatches already seen done
  };

  template <class KernelParams>
  static __device__ __forceinline__ void run_side_threads(const KernelParams& p, int32_t* claim, int n_tiles, int thread,
                                                          sm90::WaitWatch* watch) {
    dispatch_rows_ahead(p.problem, p.a_source, claim, n_tiles, thread, watch);
  }
  template <class KernelParams>
  static __device__ __forceinline__ void wait_for_rows(const KernelParams& p, const TileCoord& c, ProducerState& state,
                                                       sm90::WaitWatch* watch) {
    wait_for_dispatched_rows(p.problem, p.a_source, c, state.ready_minibatches, watch);
  }
  template <class KernelParams>
  static __device__ __forceinline__ int a_row(const KernelParams& p, const TileCoord& c) {
    return ring_position(p.a_source, c.row0);
  }
  // Every stage of the tile was full: all its rows were loaded, and their ring slot may be refilled.
  template <class KernelParams>
  static __device__ __forceinline__ void tile_loaded(const KernelParams& p, const TileCoord& c, int consumer, int thread) {
    if (consumer == 0 && thread == 0) count_consumed_rows(p.problem, p.a_source, c);
  }
};

// (Named classes, not aliases: the kernels' mangled names, and so ptxas's report, name the form.)
struct DispatchRingA : DispatchRingSource<DispatchRingParams> {};
struct PeerDispatchRingA : DispatchRingSource<PeerDispatchRingParams> {};

}  // namespace mok
