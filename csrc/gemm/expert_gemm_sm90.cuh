// The persistent, warp-specialized expert GEMM of the MoK layer (sm_90a): the kernel skeleton
// (gemm/kernel_sm90_tma_wgmma_ws.cuh) composed of the expert GEMM mainloop (TMA loads into a
// 4-stage, or 3-stage with MOK_EXPERT_GEMM_STAGES, mbarrier pipeline; wgmma m64n256k16 from shared
// memory), one epilogue, and the expert tile scheduler. The instances:
//   StoreEpilogue, K-major B           expert_gemm (e.g. down):           out = a . w_e^T
//   SwigluEpilogue, gated K-major B    expert_gemm_swiglu (gate/up):      gate_up, act
//   SwigluEpilogue, DispatchRingA      dispatch_expert_gemm_swiglu:       the rows dispatched in-kernel
//   StoreEpilogue, MN-major B          expert_gemm_dgrad:                 out = a . w_e (w as stored)
//   SwigluBackwardEpilogue, MN-major B expert_gemm_dgrad_swiglu:          grad_gate_up
// References: segment_matmul (store), swiglu over it (SwiGLU), dispatch_gate_up (dispatching),
// dgrad_swiglu (SwiGLU backward) in megatron_mok/backends/reference.py.
//
// Before exiting, each producer waits until every CTA of the cluster released every stage, so no
// CTA leaves while a peer may still arrive on its barriers.
#pragma once

#include "common/failure_codes.h"
#include "gemm/epilogue_sm90_store.cuh"
#include "gemm/epilogue_sm90_swiglu.cuh"
#include "gemm/epilogue_sm90_swiglu_bwd.cuh"
#include "gemm/kernel_sm90_tma_wgmma_ws.cuh"
#include "gemm/mainloop_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "mok_params.h"

namespace mok {

// kClusterM: 1, or 2 CTAs sharing each B slice through TMA multicast. ASource: where A's rows come
// from (RowsInMemoryA, or moe/dispatch_ring_sm90_ws.cuh's DispatchRingA). kTransB: B is MN-major,
// (experts, K, N) with N contiguous, through a 3-D tensor map (the dgrad GEMMs: d act = d out .
// fc2[e], d rows = d gate_up . fc1[e]); clusters of 1 only.
template <class Epilogue, int kClusterM, class ASource = RowsInMemoryA, bool kTransB = false>
using ExpertGemmKernel =
    GemmKernelSm90<ExpertGemmMainloop<kClusterM, kTransB, Epilogue::kGatedB, ASource>, Epilogue,
                   ExpertTileScheduler<kClusterM, Epilogue::kTileCols>, kExpertGemmKernel>;

template <class Epilogue>
using ExpertGemmKernelMaps = ExpertGemmMaps<typename Epilogue::Maps>;  // kernel arguments: mok_params.h
template <class Epilogue, class ASource = RowsInMemoryA>
using ExpertGemmKernelParams = ExpertGemmParams<typename Epilogue::Params, typename ASource::Params>;

}  // namespace mok
