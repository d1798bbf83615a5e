// Device attributes the host code asks for on every launch, read once per device and cached
// (cudaDeviceGetAttribute costs microseconds; the answers never change for a device).
// Call after the op's CUDAGuard: the current device is the one the kernel runs on.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

namespace mok {

template <cudaDeviceAttr kAttribute>
int current_device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> values[kMaxDevices] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "megatron_mok: CUDA device index ", std::to_string(device),
              " is past the ", std::to_string(kMaxDevices), " devices the attribute cache holds");
  int value = values[device].load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
    values[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int multiprocessor_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }

inline int max_shared_memory_per_block_optin() {
  return current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
}

}  // namespace mok
