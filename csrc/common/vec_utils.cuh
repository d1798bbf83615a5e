// Element conversion and 16-byte packs for the memory-bound MoK stages.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok {

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

// Round to nearest even, as torch's .to(dtype) does.
template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// kVec elements moved as one access: 16 bytes when the row allows it, else one element.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> zero_pack() {
  Pack<T, kVec> pack;
#pragma unroll
  for (int i = 0; i < kVec; ++i) pack.v[i] = from_float<T>(0.f);
  return pack;
}

// Each element times w, an fp32 multiply rounded once to T (the reference's w * dY): the weighted
// pull's rows (moe/dispatch_sm90.cuh) and the weighted column quantization's (quant/) alike.
template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> scaled_pack(const Pack<T, kVec>& value, float w) {
  Pack<T, kVec> out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) out.v[j] = from_float<T>(__fmul_rn(to_float(value.v[j]), w));
  return out;
}

}  // namespace mok
