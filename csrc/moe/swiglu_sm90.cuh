// SwiGLU over the schedule's rows, forward and backward, fp32 math rounded once.
// Reference: swiglu / swiglu_backward in megatron_mok/backends/reference.py.
#pragma once

#include "common/swiglu_math.cuh"
#include "common/vec_utils.cuh"
#include "mok_params.h"

namespace mok {

template <typename T, int kVec>
__global__ void swiglu_forward_kernel(const SwigluParams p) {
  using P = Pack<T, kVec>;
  const int64_t end = p.offsets[p.num_experts];  // rows past it were never written by the GEMM
  const int64_t num_packs = p.ffn / kVec;
  for (int64_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
    P* out = reinterpret_cast<P*>(static_cast<T*>(p.out) + row * p.ffn);
    if (row >= end) {
      const P zero = zero_pack<T, kVec>();
      for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) out[i] = zero;
      continue;
    }
    const T* base = static_cast<const T*>(p.gate_up) + row * 2 * p.ffn;
    const P* gate = reinterpret_cast<const P*>(base);
    const P* up = reinterpret_cast<const P*>(base + p.ffn);
    for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
      const P g = gate[i], u = up[i];
      float gate_values[kVec], up_values[kVec], act[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) gate_values[j] = to_float(g.v[j]), up_values[j] = to_float(u.v[j]);
      swiglu_values(gate_values, up_values, act);
      P a;
#pragma unroll
      for (int j = 0; j < kVec; ++j) a.v[j] = from_float<T>(act[j]);
      out[i] = a;
    }
  }
}

template <typename T, int kVec>
__global__ void swiglu_backward_kernel(const SwigluParams p) {
  using P = Pack<T, kVec>;
  const int64_t end = p.offsets[p.num_experts];
  const int64_t num_packs = p.ffn / kVec;
  for (int64_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
    T* out_base = static_cast<T*>(p.out) + row * 2 * p.ffn;
    P* grad_gate = reinterpret_cast<P*>(out_base);
    P* grad_up = reinterpret_cast<P*>(out_base + p.ffn);
    if (row >= end) {
      const P zero = zero_pack<T, kVec>();
      for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) grad_gate[i] = grad_up[i] = zero;
      continue;
    }
    const T* base = static_cast<const T*>(p.gate_up) + row * 2 * p.ffn;
    const P* gate = reinterpret_cast<const P*>(base);
    const P* up = reinterpret_cast<const P*>(base + p.ffn);
    const P* grad_act = reinterpret_cast<const P*>(static_cast<const T*>(p.grad_act) + row * p.ffn);
    for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
      const P g = gate[i], u = up[i], d = grad_act[i];
      float gate_values[kVec], up_values[kVec], grad_values[kVec], grad_gate_values[kVec], grad_up_values[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        gate_values[j] = to_float(g.v[j]), up_values[j] = to_float(u.v[j]), grad_values[j] = to_float(d.v[j]);
      }
      swiglu_backward_values(gate_values, up_values, grad_values, grad_gate_values, grad_up_values);
      P dg, du;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        dg.v[j] = from_float<T>(grad_gate_values[j]);
        du.v[j] = from_float<T>(grad_up_values[j]);
      }
      grad_gate[i] = dg;
      grad_up[i] = du;
    }
  }
}

}  // namespace mok
