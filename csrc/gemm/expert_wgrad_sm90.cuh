// Weight gradients of the expert projections (sm_90a), tokens as the reduction dimension:
//   out[e] (m, n) = grad[seg_e]^T (m x rows_e) . inputs[seg_e] (rows_e x n)
// The kernel skeleton (gemm/kernel_sm90_tma_wgmma_ws.cuh) composed of the weight-gradient mainloop
// (both operands MN-major, the segment's rows as K), the store epilogue into out viewed as
// (num_experts * m, n), and the static weight-gradient tile scheduler. Reference:
// segment_weight_grad_reference in megatron_mok/reference.py.
#pragma once

#include "common/failure_codes.h"
#include "gemm/epilogue_sm90_store.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/mainloop_wgrad_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"

namespace mok {

using ExpertWgradKernel = GemmKernelSm90<WgradMainloop, StoreEpilogue, WgradTileScheduler, kExpertWgradKernel>;

}  // namespace mok
