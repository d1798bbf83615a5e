// Weight gradients of the expert projections (sm_90a), tokens as the reduction dimension:
//   out[e] (m, n) = grad[seg_e]^T (m x rows_e) . inputs[seg_e] (rows_e x n)
// The kernel skeleton (gemm/kernel_sm90_tma_wgmma_ws.cuh) composed of the weight-gradient mainloop
// (both operands MN-major, the segment's rows as K), the store epilogue into out viewed as
// (num_experts * m, n), and the static weight-gradient tile scheduler. The instances:
//   ExpertWgradKernel         expert_gemm_wgrad: every row of the schedule at once
//   ExpertWgradWindowKernel   expert_gemm_wgrad_window: one window of the schedule's rows, the K
//                             chains that cross its boundaries carried in fp32 (the windowed
//                             mainloop and scheduler), so that a sequence of windows gives out
//                             bitwise equal to ExpertWgradKernel's
// Reference: segment_weight_grad in megatron_mok/backends/reference.py.
#pragma once

#include "common/failure_codes.h"
#include "gemm/epilogue_sm90_store.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/mainloop_wgrad_sm90_tma_wgmma_ws.cuh"
#include "gemm/mainloop_wgrad_window_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"

namespace mok {

using ExpertWgradKernel = GemmKernelSm90<WgradMainloop, StoreEpilogue, WgradTileScheduler, kExpertWgradKernel>;
using ExpertWgradWindowKernel =
    GemmKernelSm90<WgradWindowMainloop, StoreEpilogue, WgradWindowTileScheduler, kExpertWgradKernel>;

}  // namespace mok
