// The SwiGLU formulas in fp32, one place for the standalone SwiGLU kernels (moe/swiglu_sm90.cuh)
// and the GEMM epilogues that fuse them (gemm/epilogue_sm90_swiglu*.cuh), so both round alike.
#pragma once

namespace mok {

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// silu(gate) * up in fp32, the one formula of every SwiGLU forward (the fused GEMM epilogue too).
__device__ __forceinline__ float swiglu_value(float gate, float up) {
  return __fmul_rn(gate / (1.f + expf(-gate)), up);
}

// d gate and d up of one element in fp32, the one formula of every SwiGLU backward (the fused
// dgrad epilogue too). Same association as the reference: (da * up) * (s + silu * (1 - s)).
__device__ __forceinline__ void swiglu_backward_value(float gate, float up, float grad_act, float& grad_gate,
                                                      float& grad_up) {
  const float s = sigmoid(gate);
  const float silu = __fmul_rn(gate, s);
  grad_gate = __fmul_rn(__fmul_rn(grad_act, up), __fadd_rn(s, __fmul_rn(silu, __fsub_rn(1.f, s))));
  grad_up = __fmul_rn(grad_act, silu);
}

}  // namespace mok
