// The FP8 blockwise quantization of one block, in one place for the quantization kernels
// (quant/) and the GEMM epilogues that quantize (gemm/fp8_gemm_sm90.cuh), so all of them give
// megatron_mok/quantization.py's q and scale bit for bit (docs/design.md §12.1):
//   amax  = max |v| over the block (a NaN anywhere makes it NaN)
//   scale = amax / 448, IEEE division; 1 for amax == 0; pow2: the smallest power of two >= it;
//           2^-149 (fp32's least subnormal) where amax / 448 underflows to 0 (fp32 values only)
//   q     = e4m3(v / scale): IEEE division, round to nearest even, saturating to +-448
// Compiled without flush-to-zero (setup.py passes no --ftz): subnormal values and scales are exact.
#pragma once

#include <cstdint>

#include "common/limits.h"

namespace mok {

// max that returns NaN if either operand is NaN (fmaxf drops it): a block holding a NaN gets a NaN
// amax and scale, as torch.amax gives the reference.
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Two fp32 values -> two E4M3 bytes (lo at the lower address), round to nearest even, saturating to
// +-448: what torch's (v).clamp(-448, 448).to(float8_e4m3fn) gives for every value but NaN
// (Fp8BlockQuantizer handles NaN itself).
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// The smallest power of two >= s, for s > 0 and finite, from the bits as quantization._pow2_at_least
// builds it: a nonzero mantissa moves the exponent up one; a subnormal s is lifted by 2^64 into the
// normal range and brought back (both products exact).
__device__ __forceinline__ float pow2_at_least(float s) {
  const bool tiny = s < 0x1p-126f;
  uint32_t bits = __float_as_uint(tiny ? __fmul_rn(s, 0x1p64f) : s);
  if ((bits & 0x7FFFFFu) != 0) bits = (bits & 0x7F800000u) + 0x800000u;
  const float rounded = __uint_as_float(bits);
  return tiny ? __fmul_rn(rounded, 0x1p-64f) : rounded;
}

// A block's scale from its amax (quantization.block_scale): NaN and inf amax give NaN and inf.
__device__ __forceinline__ float fp8_block_scale(float amax, bool pow2) {
  if (amax == 0.f) return 1.f;
  float scale = __fdiv_rn(amax, kFp8E4m3Max);
  if (pow2 && isfinite(scale) && scale > 0.f) scale = pow2_at_least(scale);
  // amax below ~3.1e-43 (an fp32 block; every bf16 value is larger): a zero scale would make 0 / 0 =
  // NaN of the block's zeros. v / 2^-149 is then v's multiple of 2^-149, at most 224.
  if (scale == 0.f) scale = 0x1p-149f;
  return scale;
}

// The scales that Fp8BlockQuantizer's kReciprocal mode takes: every block of bf16 values whose amax
// is at least about 3.5e-28 has its scale here (bf16's largest amax / 448 is below 2^120); smaller
// ones divide.
constexpr float kReciprocalMinScale = 0x1p-100f;
constexpr float kReciprocalMaxScale = 0x1p120f;

// Quantizes the values of one block with its scale. Four ways to the same bytes, chosen once per
// block:
//   kMultiply    the scale is a power of two in [2^-126, 2^126] (every pow2 scale of a normal block):
//                v * (1 / scale) is the exact quotient, so its rounding is the division's;
//   kReciprocal  bf16 values (the caller says so) and a scale in [kReciprocalMinScale,
//                kReciprocalMaxScale]: y = RN(1 / scale) once per block, then per value
//                q0 = RN(v * y), r = fma(-q0, scale, v), RN(q0 + r * y) with v's sign (a zero keeps
//                its sign): Markstein's correction step, four instructions for the division's ~10
//                (reciprocal, check, branch). It gives the IEEE quotient's E4M3 byte for every bf16
//                value and every scale a block of bf16 values can have (scale = RN(amax / 448), amax
//                a bf16 value): tests/ops/test_gpu_fp8_quant.py checks all of them, exhaustively. The
//                fp32 quotient itself can be one ulp off where v is so small that r falls below fp32's
//                subnormal step, but only for quotients below 2^-13 (the scale's floor keeps them
//                there), which E4M3 rounds to a zero of v's sign either way. fp32 values (an fp32
//                weight) are not covered and divide;
//   kDivide      any other positive finite scale: IEEE division per value;
//   kSpecial     a NaN or inf scale (a block holding NaN or inf; fp8_block_scale gives no zero scale):
//                IEEE division, and a NaN quotient becomes 0x7F with the quotient's sign
//                bit, as torch's float -> float8_e4m3fn conversion makes it (cvt's NaN is not relied on).
struct Fp8BlockQuantizer {
  enum Mode : int { kMultiply = 0, kReciprocal = 1, kDivide = 2, kSpecial = 3 };
  float scale;
  float inverse;  // 1 / scale: exact (kMultiply), rounded to nearest (kReciprocal)
  int mode;

  // bf16_values: every value this quantizer is given is a bf16 value (converted to fp32 exactly).
  __device__ __forceinline__ Fp8BlockQuantizer(float s, bool bf16_values) : scale(s), inverse(1.f), mode(kDivide) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = (bits >> 23) & 0xFFu;
    if (!(s > 0.f) || !isfinite(s)) {
      mode = kSpecial;
    } else if ((bits & 0x7FFFFFu) == 0 && exponent >= 1 && exponent <= 253) {
      mode = kMultiply;
      inverse = __uint_as_float((254u - exponent) << 23);  // 2^(127 - exponent) = 1 / scale
    } else if (bf16_values && s >= kReciprocalMinScale && s <= kReciprocalMaxScale) {
      mode = kReciprocal;
      inverse = __frcp_rn(s);
    }
  }

  // kReciprocal's quotient (the mode is the caller's to check).
  __device__ __forceinline__ float reciprocal_quotient(float v) const {
    const float q0 = __fmul_rn(v, inverse);
    const float residual = __fmaf_rn(-q0, scale, v);
    return copysignf(__fmaf_rn(residual, inverse, q0), v);
  }

  __device__ __forceinline__ float quotient(float v) const {
    if (mode == kMultiply) return __fmul_rn(v, inverse);
    if (mode == kReciprocal) return reciprocal_quotient(v);
    return __fdiv_rn(v, scale);
  }

  // Whether a value's quotient needs the IEEE division (kDivide, kSpecial): the other two modes take
  // every block of bf16 values whose amax lies in [~3.5e-28, bf16's max] (kReciprocal), and every pow2
  // scale of a normal block (kMultiply).
  __device__ __forceinline__ bool divides() const { return mode >= kDivide; }

  // quad() of a quantizer that does not divide (its caller checks divides() once for all its values,
  // so the division's code sits on a path of its own): the same bytes, one select a value instead of
  // quad()'s branches.
  __device__ __forceinline__ uint32_t quad_without_division(float v0, float v1, float v2, float v3) const {
    const auto q = [&](float v) { return mode == kMultiply ? __fmul_rn(v, inverse) : reciprocal_quotient(v); };
    return e4m3x2(q(v0), q(v1)) | (uint32_t(e4m3x2(q(v2), q(v3))) << 16);
  }

  // v[0], v[1] -> two E4M3 bytes, v[0] at the lower address.
  __device__ __forceinline__ uint32_t pair(float lo, float hi) const {
    if (mode == kReciprocal) return e4m3x2(reciprocal_quotient(lo), reciprocal_quotient(hi));  // (one branch a pair)
    const float q_lo = quotient(lo), q_hi = quotient(hi);
    uint32_t out = e4m3x2(q_lo, q_hi);
    if (mode == kSpecial) {
      if (isnan(q_lo)) out = (out & 0xFF00u) | 0x7Fu | ((__float_as_uint(q_lo) >> 24) & 0x80u);
      if (isnan(q_hi)) out = (out & 0x00FFu) | 0x7F00u | ((__float_as_uint(q_hi) >> 16) & 0x8000u);
    }
    return out;
  }

  // Four values -> four E4M3 bytes in one word, v[0] in the lowest byte.
  __device__ __forceinline__ uint32_t quad(float v0, float v1, float v2, float v3) const {
    if (mode == kReciprocal) {  // (one branch for the four)
      return e4m3x2(reciprocal_quotient(v0), reciprocal_quotient(v1)) |
             (uint32_t(e4m3x2(reciprocal_quotient(v2), reciprocal_quotient(v3))) << 16);
    }
    return pair(v0, v1) | (pair(v2, v3) << 16);
  }
};

}  // namespace mok
