// The host side of the FailureRecord (mok_params.h) a kernel leaves before it traps: which bounded
// wait timed out (a persistent GEMM's watchdog) or which check failed (the schedule kernel's expert
// ids). It lives in host-mapped memory and outlives the trap, so the last_failure op can name the
// failure afterwards. One record per process, shared by the extension's translation units (inline
// variable).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <string>

#include "common/failure_codes.h"
#include "mok_params.h"

namespace mok {

inline std::atomic<FailureRecord*> g_failure_record{nullptr};

// The record, allocated on first use outside graph capture (an allocation is not allowed while
// capturing; a kernel launched before it exists traps without one).
inline FailureRecord* failure_record(cudaStream_t stream) {
  if (FailureRecord* record = g_failure_record.load()) return record;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  void* host = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(FailureRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, sizeof(FailureRecord));
  FailureRecord* expected = nullptr;
  if (!g_failure_record.compare_exchange_strong(expected, static_cast<FailureRecord*>(host))) {
    C10_CUDA_CHECK(cudaFreeHost(host));
  }
  return g_failure_record.load();  // with unified addressing the host pointer is the device pointer
}

// An exchange wait (common/failure_codes.h numbers them by phase and signal kind), in words: the
// phase, the kind, the peer rank whose signal never came and the phase's call count.
inline std::string exchange_failure_message(int check, int peer, int call, int block) {
  const int phase = check / kNumSignalKinds, kind = check % kNumSignalKinds;
  const std::string phase_name =
      check >= 0 && phase < kNumExchangePhases ? kExchangePhaseNames[phase] : "unknown (" + std::to_string(check) + ")";
  return "exchange kernel: waiting for the " + phase_name + " phase's " +
         (check >= 0 ? kExchangeSignalKindNames[kind] : "unknown") + " signal of peer " + std::to_string(peer) +
         " (call " + std::to_string(call) + ") timed out (block " + std::to_string(block) + ")";
}

// "" when no kernel of this process recorded a failure, else what failed (the wait's or check's
// description), in which kernel and block, and the peer rank and layer call it concerned (-1: none).
inline std::string last_failure_message() {
  const volatile FailureRecord* r = g_failure_record.load();
  if (r == nullptr || r->recorded == 0) return "";
  const int kernel = r->kernel, check = r->check;
  if (kernel == kExchangeKernel) return exchange_failure_message(check, r->peer, r->call, r->block);
  std::string description = "check " + std::to_string(check) + " of kernel " + std::to_string(kernel);
  for (const FailureName& name : kFailureNames) {
    if (name.kernel == kernel && name.check == check) description = name.description;
  }
  constexpr int kKernels = sizeof(kFailingKernelNames) / sizeof(kFailingKernelNames[0]);
  const std::string kernel_name = kernel >= 0 && kernel < kKernels ? kFailingKernelNames[kernel] : std::to_string(kernel);
  return description + " (kernel " + kernel_name + ", block " + std::to_string(r->block) + ", peer " +
         std::to_string(r->peer) + ", call " + std::to_string(r->call) + ")";
}

}  // namespace mok
