// The signal protocol of the in-kernel exchange (comm/symmetric.py describes it, and the regions it
// guards): per (phase, kind, source) a counter in every rank's signal pad that only grows. Call c of
// a phase on a rank:
//   exchange_begin_kernel       c = ++calls[phase]; wait until every peer's `free` count >= c - 1
//                               (nobody still reads what call c - 1 left in the buffers this rank
//                               is about to overwrite: its own regions, or a source's combine);
//   (the caller writes)
//   exchange_signal_kernel      `ready` (or `free`): +1 at [phase][kind][this rank] of every pad;
//   exchange_wait_ready_kernel  wait until every source's `ready` count >= c;
//   (the caller reads)          then signals `free`.
// Counters never reset, so a CUDA-graph replay simply continues them, and a count left from an
// earlier call can never pass for this one (it is below c). Unicast loads, stores and reductions
// only: NVLink multicast (multimem, NVLS) is never used. Every wait is bounded: past kWaitTimeoutNs
// the failure record names the phase, the kind, the peer rank whose signal never came and the call
// (last_failure()), and the kernel traps. Each kernel is one warp, lane p for rank p.
#pragma once

#include <cstdint>

#include "common/failure_codes.h"
#include "common/limits.h"
#include "common/sync_sm90.cuh"
#include "common/watchdog_sm90.cuh"
#include "mok_params.h"
#include "moe/row_source_sm90.cuh"

namespace mok {

constexpr int kExchangeThreads = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// The counters of (phase, kind) in a pad, one per source rank.
__device__ __forceinline__ int64_t* signal_counters(int64_t* pad, int num_ranks, int phase, int kind) {
  return pad + (int64_t(phase) * kNumSignalKinds + kind) * num_ranks;
}

// The warp waits until this rank's (phase, kind) counter of every source is >= target. Past the
// timeout lane 0 records the lowest source still short (one record, written before any lane
// traps), then the warp traps.
__device__ __forceinline__ void wait_for_signals(const ExchangeSignalParams& p, int kind, int64_t target, int64_t call) {
  const int lane = int(threadIdx.x);
  const int64_t* counter = signal_counters(p.signals, p.num_ranks, p.phase, kind) + lane;
  bool done = lane >= p.num_ranks || sm90::ld_acquire_sys(counter) >= target;
  if (__all_sync(kFullWarp, done)) return;
  const uint64_t start = sm90::global_timer_ns();
  while (true) {
    // Short: the whole exchange round is a few microseconds, and one warp polling costs little.
    __nanosleep(32);
    if (!done) done = sm90::ld_acquire_sys(counter) >= target;
    if (__all_sync(kFullWarp, done)) return;
    const bool timed_out = __shfl_sync(kFullWarp, sm90::global_timer_ns() - start > kWaitTimeoutNs, 0);
    if (timed_out) {
      const unsigned short_of = __ballot_sync(kFullWarp, !done);
      if (lane == 0) {
        record_failure(p.failure_record, kExchangeKernel, exchange_wait(p.phase, kind), __ffs(short_of) - 1, int(call));
      }
      __syncwarp();  // the record is complete (record_failure fences it) before anyone traps
      asm volatile("trap;");
    }
  }
}

__global__ void __launch_bounds__(kExchangeThreads) exchange_begin_kernel(const ExchangeSignalParams p) {
  int64_t call = 0;
  if (threadIdx.x == 0) {
    // This rank's calls of a phase run in stream order, so one thread owns the count.
    call = p.calls[p.phase] + 1;
    p.calls[p.phase] = call;
  }
  call = __shfl_sync(kFullWarp, call, 0);
  wait_for_signals(p, kSignalFree, call - 1, call);
}

__global__ void __launch_bounds__(kExchangeThreads) exchange_signal_kernel(const ExchangeSignalParams p) {
  const int lane = int(threadIdx.x);
  if (lane >= p.num_ranks) return;
  // The writes this signal announces were made by earlier kernels and copies of this stream (to
  // this rank's regions, or pushed into peers'); they precede this kernel, and the system-scope
  // fence and release order them before the count every peer acquires.
  __threadfence_system();
  sm90::red_release_sys_add(signal_counters(pick_rank(p.peer_signals, lane), p.num_ranks, p.phase, p.kind) + p.rank, 1);
}

__global__ void __launch_bounds__(kExchangeThreads) exchange_wait_ready_kernel(const ExchangeSignalParams p) {
  const int64_t call = p.calls[p.phase];  // set by this call's exchange_begin_kernel, earlier on the stream
  wait_for_signals(p, kSignalReady, call, call);
}

}  // namespace mok
