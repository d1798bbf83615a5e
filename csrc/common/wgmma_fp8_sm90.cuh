// Hopper (sm_90a) warpgroup MMA on E4M3 operands: wgmma m64n128k32 and m64n192k32, e4m3 x e4m3 -> fp32. FP8 wgmma
// reads both operands from shared memory K-major only (no transpose flags), so the descriptors of
// common/wgmma_sm90.cuh serve unchanged: a 128-byte swizzled row holds 128 E4M3 values, and one
// instruction's 32 of K are 32 bytes of it (+2 in the descriptor's 16-byte units).
#pragma once

#include <cstdint>

#include "common/wgmma_sm90.cuh"

namespace mok::sm90 {

// d: this thread's 64 fp32 accumulators of the warpgroup's 64 x 128 outputs (fragment layout of
// gemm/tile_sm90.cuh: acc[4 * j + 2 * h + c] is row 16 * warp + lane / 4 + 8 * h, column
// 8 * j + 2 * (lane % 4) + c). scale_d = 0 overwrites them with the product (a fresh partial sum).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One 128-deep K block (an FP8 scale block: 128 bytes of each swizzled K row) of a warpgroup's 64 x
// 128 product into d: four wgmma m64n128k32, each 32 bytes further along the rows (+2 in the
// descriptors' 16-byte units), the first overwriting d (scale_d = 0: a partial never spans two
// blocks), committed as one group for the caller to wait on.
__device__ __forceinline__ void wgmma_block_m64n128k128_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  wgmma_fence();
  fence_accumulators(d);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(d, desc_a + 2 * kk, desc_b + 2 * kk, kk != 0);
  wgmma_commit_group();
}

// wgmma_m64n128k32_e4m3 with scale_d = 0 stated to the compiler: the empty asm statements define d
// (emitting nothing), so the values it held before are dead and a partial sum that restarts every K
// block holds no registers between blocks.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_fresh(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "=f"(d[i]));
  wgmma_m64n128k32_e4m3(d, desc_a, desc_b, 0);
}

// wgmma_m64n128k32_e4m3 widened to 192 columns: d holds this thread's 96 fp32 accumulators of the
// warpgroup's 64 x 192 outputs (the same fragment layout, column groups j = 0 .. 23). One
// instruction reads the A rows once per 192 columns (gemm/fp8_gemm_wide_sm90.cuh).
__device__ __forceinline__ void wgmma_m64n192k32_e4m3(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "%96, %97, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// wgmma_m64n192k32_e4m3 with scale_d = 0 stated to the compiler (as wgmma_m64n128k32_e4m3_fresh).
__device__ __forceinline__ void wgmma_m64n192k32_e4m3_fresh(float (&d)[96], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int i = 0; i < 96; ++i) asm volatile("" : "=f"(d[i]));
  wgmma_m64n192k32_e4m3(d, desc_a, desc_b, 0);
}

// One 128-deep K block of a warpgroup's 64 x 192 product into a fresh partial: four wgmma
// m64n192k32, each 32 bytes further along the rows, the first overwriting the partial (stated to the
// compiler), committed as one group for the caller to wait on. The fence first: the caller's reads
// of the partial (the previous block's promotion) come before the wgmmas' writes.
__device__ __forceinline__ void wgmma_block_m64n192k128_e4m3_fresh(float (&partial)[96], uint64_t desc_a,
                                                                   uint64_t desc_b) {
  wgmma_fence();
  wgmma_m64n192k32_e4m3_fresh(partial, desc_a, desc_b);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) {
    wgmma_m64n192k32_e4m3(partial, descriptor_plus(desc_a, 2 * kk), descriptor_plus(desc_b, 2 * kk), 1);
  }
  wgmma_commit_group();
}

}  // namespace mok::sm90
