// The kernels that leave a FailureRecord (mok_params.h) and the waits and checks they name in it:
// the one table of their names (the last_failure op's messages, common/failure_record.h).
#pragma once

#include "common/limits.h"

namespace mok {

enum FailingKernel : int {
  kExpertGemmKernel = 0,
  kExpertWgradKernel = 1,
  kScheduleKernel = 2,
  kExchangeKernel = 3,
  kFp8ExpertGemmKernel = 4,
  kFp8ExpertWgradKernel = 5,
  kFp8QuantizeKernel = 6,
};

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

// The windowed weight gradient's checks of a carried expert (gemm/mainloop_wgrad_window_sm90_*,
// reported through the watchdog like its waits); not waits. Numbered after every GEMM wait.
enum WgradWindowCheck : int {
  kCheckCarryKBlockAlignment = 4,  // a window boundary inside a 64-row K block of the expert it splits
  kCheckCarryInBuffer = 5,         // an expert continues into the window, but carry_in is null
  kCheckCarryOutBuffer = 6,        // an expert continues past the window, but carry_out is null
};

// The FP8 weight gradient's check of a tile's segment (gemm/fp8_wgrad_sm90.cuh, reported through
// the watchdog like its waits); not a wait. Numbered after every GEMM wait and check.
enum Fp8WgradCheck : int {
  kCheckFp8WgradSegmentAlignment = 7,  // an expert's rows start inside a 128-row block of the window
};

// The FP8 expert GEMM's own bounded wait beside the pipeline's (gemm/fp8_gemm_sm90.cuh, the pingpong
// mainloop's turns). Numbered after every GEMM wait and check.
enum Fp8GemmWait : int {
  kWaitPingpongTurn = 8,  // a consumer warpgroup: the other one handed it the turn (turn barrier)
};

// The schedule kernel's check (moe/schedule_sm90.cuh); not a wait.
enum ScheduleCheck : int { kCheckExpertIds = 0 };

// The row-wise FP8 quantization's check of its row gather (quant/quantize_rows_sm90.cuh).
enum Fp8QuantizeCheck : int { kCheckRowIndex = 0 };

struct FailureName {
  int kernel;
  int check;
  const char* description;
};

// The in-kernel exchange's signal protocol (comm/symmetric.py, moe/exchange_sm90.cuh): its phases,
// in the order of the signal pad's first dimension (megatron_mok.ops.exchange_phase_names() reads
// them from here, so Python derives the phase ids from this one table; their count, the pad's size,
// is megatron_mok/limits.py NUM_EXCHANGE_PHASES, kNumExchangePhases of common/limits.h), and the
// two signal kinds of a phase. Its waits are numbered exchange_wait(phase, kind); a timed-out one
// records the peer rank it waited for and the phase's call count.
enum ExchangePhase : int {
  kPhaseRouting = 0,     // every rank's top-k ids (region `routing`)
  kPhaseTokens = 1,      // the rows the pull dispatch reads (region `tokens`)
  kPhaseGradTokens = 2,  // dY and the routing weights the reverse-combine pull reads
  kPhaseCombine = 3,     // the rows pushed back into the sources' `combine` regions
  // FP8 blockwise: the FP8 rows and their scales, beside the activation-dtype ones (a backward pulls
  // both: its dgrads read FP8 rows, its weight gradients the high-precision ones), so each source
  // published in a call has a phase of its own to be freed in.
  kPhaseFp8Tokens = 4,      // x's E4M3 rows and scales (regions `fp8_tokens`, `fp8_token_scales`)
  kPhaseFp8GradTokens = 5,  // dY's E4M3 rows and scales and the routing weights (`fp8_grad_*`)
};
inline constexpr const char* kExchangePhaseNames[] = {"routing", "tokens", "grad_tokens", "combine",
                                                      "fp8_tokens", "fp8_grad_tokens"};
static_assert(kPhaseFp8GradTokens + 1 == kNumExchangePhases, "limits.py NUM_EXCHANGE_PHASES counts these phases");
static_assert(sizeof(kExchangePhaseNames) / sizeof(kExchangePhaseNames[0]) == kNumExchangePhases,
              "one name per exchange phase");

// kReady: the source wrote what the phase's call publishes; kFree: the reader finished reading it.
enum ExchangeSignalKind : int { kSignalReady = 0, kSignalFree = 1, kNumSignalKinds = 2 };
inline constexpr const char* kExchangeSignalKindNames[] = {"ready", "free"};

// The `check` field of an exchange wait's failure record.
constexpr int exchange_wait(int phase, int kind) { return phase * kNumSignalKinds + kind; }

inline constexpr const char* kFailingKernelNames[] = {"expert_gemm", "expert_wgrad", "schedule", "exchange",
                                                       "fp8_expert_gemm", "fp8_expert_wgrad",
                                                       "fp8_quantize_rows/fp8_quantize_columns"};

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
    {kExpertWgradKernel, kCheckCarryKBlockAlignment,
     "expert weight-gradient window: a window boundary splits a carried expert's segment inside a 64-row K block "
     "((window_begin - offsets[e]) % 64 != 0 or (window end - offsets[e]) % 64 != 0)"},
    {kExpertWgradKernel, kCheckCarryInBuffer,
     "expert weight-gradient window: an expert continues into the window but carry_in is None"},
    {kExpertWgradKernel, kCheckCarryOutBuffer,
     "expert weight-gradient window: an expert continues past the window but carry_out is None"},
    {kScheduleKernel, kCheckExpertIds, "schedule kernel: topk_ids holds an expert id outside [-1, num_experts)"},
    {kFp8ExpertGemmKernel, kWaitFreeStage, "FP8 expert GEMM producer waiting for a free pipeline stage (empty barrier)"},
    {kFp8ExpertGemmKernel, kWaitLoadedStage,
     "FP8 expert GEMM consumer waiting for a loaded pipeline stage (full barrier)"},
    {kFp8ExpertGemmKernel, kWaitPingpongTurn,
     "FP8 expert GEMM consumer waiting for its pingpong turn (the other consumer warpgroup's hand-over, turn "
     "barrier)"},
    {kFp8ExpertWgradKernel, kWaitFreeStage,
     "FP8 expert weight-gradient producer waiting for a free pipeline stage (empty barrier)"},
    {kFp8ExpertWgradKernel, kWaitLoadedStage,
     "FP8 expert weight-gradient consumer waiting for a loaded pipeline stage (full barrier)"},
    {kFp8ExpertWgradKernel, kCheckFp8WgradSegmentAlignment,
     "FP8 expert weight gradient: an expert's rows start inside a 128-row block of the window "
     "(offsets[e] % 128 != 0 for a segment with rows at or past window_begin)"},
    {kFp8QuantizeKernel, kCheckRowIndex,
     "FP8 quantization (row-wise or column-wise): row_index holds a row outside [-1, the number of source rows)"},
};

}  // namespace mok
