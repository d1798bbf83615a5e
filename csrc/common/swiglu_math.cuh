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

// The batched forms below give swiglu_value's and swiglu_backward_value's bits without a branch per
// value. The compiler guards every IEEE division with a range check (FCHK) and a call to its slow
// path, each in its own branch region, so the values of a thread cannot overlap their latencies (the
// SwiGLU kernels were issue-bound). Here every quotient q = x / d, d = 1 + expf(-gate) >= 1, takes
// the fast path: y = d's reciprocal (rcp.approx refined by one Newton step), q0 = RN(x * y),
// r = fma(-q0, d, x), RN(q0 + r * y) with x's sign (Markstein's correction), and one range check for
// all N values sends them all to the IEEE division where any lies outside the range in which that
// equals it: d above 2^120 (gate below about -83) or not finite, x not finite, or x nonzero with
// |x| below 2^-100 (where r can fall below fp32's subnormal step). Bit for bit the IEEE quotient
// for every fp32 gate: tests/ops/test_gpu_swiglu_math.py checks all 2^32.
constexpr float kSwigluFastMaxDivisor = 0x1p120f;
constexpr float kSwigluFastMinQuotient = 0x1p-100f;

__device__ __forceinline__ float swiglu_fast_reciprocal(float d) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return __fmaf_rn(__fmaf_rn(-d, y, 1.f), y, y);
}

__device__ __forceinline__ float swiglu_fast_quotient(float x, float d, float y) {
  const float q0 = __fmul_rn(x, y);
  const float residual = __fmaf_rn(-q0, d, x);
  return copysignf(__fmaf_rn(residual, y, q0), x);
}

__device__ __forceinline__ bool swiglu_fast_path_holds(float x, float d) {
  const float magnitude = fabsf(x);
  return d <= kSwigluFastMaxDivisor && magnitude <= kSwigluFastMaxDivisor &&
         (magnitude >= kSwigluFastMinQuotient || magnitude == 0.f);  // (false for NaN: every compare is)
}

// act[i] = swiglu_value(gate[i], up[i]) for N values.
template <int N>
__device__ __forceinline__ void swiglu_values(const float (&gate)[N], const float (&up)[N], float (&act)[N]) {
  float d[N], silu[N];
  bool fast = true;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    d[i] = 1.f + expf(-gate[i]);
    silu[i] = swiglu_fast_quotient(gate[i], d[i], swiglu_fast_reciprocal(d[i]));
    fast = fast && swiglu_fast_path_holds(gate[i], d[i]);
  }
  if (!fast) {
#pragma unroll
    for (int i = 0; i < N; ++i) silu[i] = gate[i] / d[i];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) act[i] = __fmul_rn(silu[i], up[i]);
}

// swiglu_backward_value of N values.
template <int N>
__device__ __forceinline__ void swiglu_backward_values(const float (&gate)[N], const float (&up)[N],
                                                       const float (&grad_act)[N], float (&grad_gate)[N],
                                                       float (&grad_up)[N]) {
  float d[N], s[N];
  bool fast = true;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    d[i] = 1.f + expf(-gate[i]);
    s[i] = swiglu_fast_quotient(1.f, d[i], swiglu_fast_reciprocal(d[i]));
    fast = fast && swiglu_fast_path_holds(1.f, d[i]);
  }
  if (!fast) {
#pragma unroll
    for (int i = 0; i < N; ++i) s[i] = 1.f / d[i];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float silu = __fmul_rn(gate[i], s[i]);
    grad_gate[i] = __fmul_rn(__fmul_rn(grad_act[i], up[i]), __fadd_rn(s[i], __fmul_rn(silu, __fsub_rn(1.f, s[i]))));
    grad_up[i] = __fmul_rn(grad_act[i], silu);
  }
}

}  // namespace mok
