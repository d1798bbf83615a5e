// The kernels that leave a FailureRecord (mok_params.h) and the waits and checks they name in it:
// the one table of their names (the last_failure op's messages, common/failure_record.h).
#pragma once

namespace mok {

enum FailingKernel : int { kExpertGemmKernel = 0, kExpertWgradKernel = 1, kScheduleKernel = 2 };

// The bounded waits of the sm90 GEMM pipeline (gemm/kernel_sm90_tma_wgmma_ws.cuh), in every GEMM kernel.
enum PipelineWait : int {
  kWaitFreeStage = 0,    // the producer: a stage every consumer of the cluster released (empty barrier)
  kWaitLoadedStage = 1,  // a consumer: a stage whose loads landed (full barrier)
};

// The bounded waits of the dispatching expert GEMM's ring (moe/dispatch_ring_sm90_ws.cuh).
enum DispatchRingWait : int {
  kWaitDispatchedRows = 2,  // the producer: the minibatches of a tile's rows are written (done counters)
  kWaitRingSlot = 3,        // a dispatcher: every tile loaded a ring slot's previous rows (consumed counter)
};

// The schedule kernel's check (moe/schedule_sm90.cuh); not a wait.
enum ScheduleCheck : int { kCheckExpertIds = 0 };

struct FailureName {
  int kernel;
  int check;
  const char* description;
};

inline constexpr const char* kFailingKernelNames[] = {"expert_gemm", "expert_wgrad", "schedule"};

inline constexpr FailureName kFailureNames[] = {
    {kExpertGemmKernel, kWaitFreeStage, "expert GEMM producer waiting for a free pipeline stage (empty barrier)"},
    {kExpertGemmKernel, kWaitLoadedStage, "expert GEMM consumer waiting for a loaded pipeline stage (full barrier)"},
    {kExpertGemmKernel, kWaitDispatchedRows,
     "expert GEMM producer waiting for a minibatch of dispatched rows (ready counter)"},
    {kExpertGemmKernel, kWaitRingSlot,
     "expert GEMM dispatcher waiting for a ring slot's rows to be loaded by every tile (consumed counter)"},
    {kExpertWgradKernel, kWaitFreeStage,
     "expert weight-gradient producer waiting for a free pipeline stage (empty barrier)"},
    {kExpertWgradKernel, kWaitLoadedStage,
     "expert weight-gradient consumer waiting for a loaded pipeline stage (full barrier)"},
    {kScheduleKernel, kCheckExpertIds, "schedule kernel: topk_ids holds an expert id outside [-1, num_experts)"},
};

}  // namespace mok
