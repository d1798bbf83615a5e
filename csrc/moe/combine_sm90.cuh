// Fixed-order combine and its backward counterpart, the routing-weight gradients, for one rank's
// schedule. Reference: combine / route_weight_grads in megatron_mok/backends/reference.py.
// Every output element is written by exactly one thread and every sum
// runs in a fixed order in fp32, so results are bitwise reproducible; there are no atomics.
#pragma once

#include "common/vec_utils.cuh"
#include "mok_params.h"

namespace mok {

// One block per token: out[t] = sum_k w[t,k] * table[index[t,k]], k ascending, fp32. The
// separately rounded multiply and add (no FMA contraction) match the reference bit for bit.
// With p.keep, every row a route reads is also written to the same row of keep, as it is read: the
// copy of a table that outlives its buffer costs the writes only (rows no route reads are not
// written). Each route owns its row, so each kept element has one writer; were a row read by two
// routes, both would write the same bits.
// Routes of a token whose table loads a thread has in flight together in the combine.
constexpr int kCombineBatch = 4;

template <typename T, int kVec>
__global__ void combine_kernel(const CombineParams p) {
  using P = Pack<T, kVec>;
  extern __shared__ int64_t route_rows[];  // [topk] this token's table rows (-1: dropped), then
  float* route_weights = reinterpret_cast<float*>(route_rows + p.topk);  // [topk] weights
  const int64_t num_packs = p.hidden / kVec;
  for (int64_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    __syncthreads();  // every thread is done reading the previous token's routes
    for (int64_t k = threadIdx.x; k < p.topk; k += blockDim.x) {
      const int64_t row = p.index[token * p.topk + k];
      if (row >= p.num_table_rows) __trap();  // an index past the table is a schedule bug
      route_rows[k] = row;
      route_weights[k] = p.weights != nullptr ? p.weights[token * p.topk + k] : 1.f;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
      for (int64_t k0 = 0; k0 < p.topk; k0 += kCombineBatch) {
        // The batch's loads first (in flight together), then the sums in ascending k.
        P values[kCombineBatch];
#pragma unroll
        for (int b = 0; b < kCombineBatch; ++b) {
          const int64_t row = k0 + b < p.topk ? route_rows[k0 + b] : -1;
          values[b] = row >= 0 ? reinterpret_cast<const P*>(static_cast<const T*>(p.table) + row * p.hidden)[i]
                               : zero_pack<T, kVec>();
        }
#pragma unroll
        for (int b = 0; b < kCombineBatch; ++b) {
          const int64_t k = k0 + b;
          if (k >= p.topk || route_rows[k] < 0) continue;  // past topk, or a dropped route
          if (p.keep != nullptr) reinterpret_cast<P*>(static_cast<T*>(p.keep) + route_rows[k] * p.hidden)[i] = values[b];
          if (p.weights != nullptr) {
            const float w = route_weights[k];
#pragma unroll
            for (int j = 0; j < kVec; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, to_float(values[b].v[j])));
          } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j) acc[j] = __fadd_rn(acc[j], to_float(values[b].v[j]));
          }
        }
      }
      P out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = from_float<T>(acc[j]);
      reinterpret_cast<P*>(static_cast<T*>(p.out) + token * p.hidden)[i] = out;
    }
  }
}

constexpr int kReduceThreads = 256;

// Deterministic block sum: each thread's partial in a fixed order, then a fixed shuffle tree
// and a fixed pass over the warps' results.
__device__ __forceinline__ float block_sum(float value, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();  // warp_sums complete before thread 0 reads them
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kReduceThreads / 32; ++w) total += warp_sums[w];
  }
  __syncthreads();  // warp_sums may be overwritten by the next call only after thread 0 read them
  return total;
}

// One block per token: d_weights[t,k] = <dY[t], table[index[t,k]]>.
template <typename T, int kVec>
__global__ void __launch_bounds__(kReduceThreads) route_weight_grads_kernel(const RouteWeightGradParams p) {
  using P = Pack<T, kVec>;
  __shared__ float warp_sums[kReduceThreads / 32];
  const int64_t num_packs = p.hidden / kVec;
  for (int64_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    const P* dy = reinterpret_cast<const P*>(static_cast<const T*>(p.grad_y) + token * p.hidden);
    for (int64_t k = 0; k < p.topk; ++k) {
      const int64_t row = p.index[token * p.topk + k];
      if (row >= p.num_table_rows) __trap();
      float partial = 0.f;
      if (row >= 0) {
        const P* values = reinterpret_cast<const P*>(static_cast<const T*>(p.table) + row * p.hidden);
        for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
          const P a = dy[i], b = values[i];
#pragma unroll
          for (int j = 0; j < kVec; ++j) partial = fmaf(to_float(a.v[j]), to_float(b.v[j]), partial);
        }
      }
      const float total = block_sum(partial, warp_sums);
      if (threadIdx.x == 0) p.d_weights[token * p.topk + k] = total;
    }
  }
}

}  // namespace mok
