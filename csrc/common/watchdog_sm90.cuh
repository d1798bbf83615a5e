// The watchdog of the persistent sm90 kernels' bounded waits. Every wait of common/sync_sm90.cuh
// ends: past kWaitTimeoutNs the waiting thread tells the CTA's watchdog thread which wait failed,
// the watchdog records it in the host-mapped failure record and traps, so a broken pipeline
// surfaces as a CUDA error naming the wait instead of a hang.
#pragma once

#include <cstdint>

#include "common/failure_codes.h"
#include "common/limits.h"
#include "mok_params.h"

namespace mok {

// Fills the host-mapped record (null: nothing to fill) before the caller traps: the fields first,
// then `recorded`, each write made visible to the host in that order.
__device__ __forceinline__ void record_failure(FailureRecord* record, int kernel, int check, int peer, int call) {
  volatile FailureRecord* r = record;
  if (r != nullptr) {
    r->kernel = kernel;
    r->check = check;
    r->block = int(blockIdx.x);
    r->peer = peer;
    r->call = call;
    __threadfence_system();
    r->recorded = 1;
    __threadfence_system();
  }
}

}  // namespace mok

namespace mok::sm90 {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A wait that can time out reports through a watchdog thread of the same CTA. No printf: a
// function call anywhere in a kernel with wgmma makes ptxas serialize every wgmma (C7510). The
// waiting thread records which wait failed in shared memory; the watchdog copies it, with the
// kernel and block, into the host-mapped FailureRecord (which outlives the trap) and traps.
// The host reads it back: torch.ops.megatron_mok.last_failure().
struct WaitWatch {
  int failed;    // 0, or 1 + the index of the wait that timed out
  int finished;  // roles that have finished their work
};

// A trap reached through a call. A trap instruction inside a warpgroup's code after
// setmaxnreg.inc holds ptxas to the launch's register count there (nvcc 13.0: the FP8 GEMM's
// overlap consumer, 192 live accumulators, spills at 168 registers with the trap inline and fits in
// its 232 with it out of line). The call sits on the timed-out path only; unlike printf's (C7510
// above), a call to this function that never returns serializes no wgmma (nvcc 13.0, checked in
// the FP8 GEMM's SASS).
inline __device__ __noinline__ void trap_out_of_line() { asm volatile("trap;"); }

// A wait past its timeout tells the watchdog which wait failed, then traps (kTrapOutOfLine: through
// trap_out_of_line, for code that needs its setmaxnreg budget).
template <bool kTrapOutOfLine = false>
__device__ __forceinline__ void fail_if_timed_out(int wait_id, WaitWatch* watch, uint64_t start) {
  if (global_timer_ns() - start > kWaitTimeoutNs) {
    *reinterpret_cast<volatile int*>(&watch->failed) = 1 + wait_id;
    // The watchdog traps within a microsecond or so; should it not, trap here.
    while (global_timer_ns() - start < 2 * kWaitTimeoutNs) __nanosleep(1000000);
    if constexpr (kTrapOutOfLine) {
      trap_out_of_line();
    } else {
      asm volatile("trap;");
    }
  }
}

// A failed in-kernel check of a role (not a wait): named to the watchdog like a timed-out wait, so
// the record says which check failed; the role does nothing more. Should the watchdog not trap
// within kWaitTimeoutNs, trap here.
__device__ __forceinline__ void fail_check(int check_id, WaitWatch* watch) {
  *reinterpret_cast<volatile int*>(&watch->failed) = 1 + check_id;
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < kWaitTimeoutNs) __nanosleep(1000000);
  asm volatile("trap;");
}

__device__ __forceinline__ void mark_finished(WaitWatch* watch) { atomicAdd(&watch->finished, 1); }

// Run by one thread until `roles` roles have called mark_finished.
// (No wait is about a peer yet, nor does a kernel know its layer call: both are recorded as -1.)
__device__ __forceinline__ void watch_waits(WaitWatch* watch, int roles, FailureRecord* record, int kernel_id) {
  volatile WaitWatch* w = watch;
  while (w->finished < roles) {
    const int failed = w->failed;
    if (failed > 0) {
      record_failure(record, kernel_id, failed - 1, -1, -1);
      asm volatile("trap;");
    }
    // Every CTA is resident for the whole launch and the kernel ends when the last one exits, so
    // this poll interval is added to the kernel's time: keep it short (the sleeping warp costs
    // no issue slots).
    __nanosleep(1000);
  }
}

}  // namespace mok::sm90
