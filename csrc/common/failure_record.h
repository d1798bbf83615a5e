// The host-mapped record a kernel leaves before it traps: which bounded wait timed out (the
// persistent GEMMs' watchdog), or which check failed (the schedule kernel's expert ids). It
// outlives the trap, so megatron_mok.ops.last_wait_timeout() can name the failure afterwards.
// One record per process, shared by the extension's translation units (inline variable).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "mok_params.h"

namespace mok {

inline std::atomic<WaitTimeoutRecord*> g_failure_record{nullptr};

// The record, allocated on first use outside graph capture (an allocation is not allowed while
// capturing; a kernel launched before it exists traps without one).
inline WaitTimeoutRecord* failure_record(cudaStream_t stream) {
  if (WaitTimeoutRecord* record = g_failure_record.load()) return record;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  void* host = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(WaitTimeoutRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, sizeof(WaitTimeoutRecord));
  WaitTimeoutRecord* expected = nullptr;
  if (!g_failure_record.compare_exchange_strong(expected, static_cast<WaitTimeoutRecord*>(host))) {
    C10_CUDA_CHECK(cudaFreeHost(host));
  }
  return g_failure_record.load();  // with unified addressing the host pointer is the device pointer
}

// [kernel, wait, block] of the recorded failure, or [] when none was.
inline std::vector<int64_t> last_recorded_failure() {
  const volatile WaitTimeoutRecord* r = g_failure_record.load();
  if (r == nullptr || r->recorded == 0) return {};
  return {r->kernel, r->wait, r->block};
}

}  // namespace mok
