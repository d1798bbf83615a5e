// Where a dispatched row comes from, for every dispatch: the row-gather kernels (dispatch_rows,
// pull_grad_rows: moe/dispatch_sm90.cuh) and the dispatching GEMM's ring
// (moe/dispatch_ring_sm90_ws.cuh). Row s of the schedule holds route slot_to_route[s] =
// (src_rank * num_tokens + token) * topk + k (-1: padding, a zero row), so its source is row
// route / topk of the gathered tokens (every rank's, rank-major, in this rank's memory).
#pragma once

#include <cstdint>

namespace mok {

__device__ __forceinline__ int64_t route_source_row(int64_t route, int64_t topk) { return route / topk; }

}  // namespace mok
