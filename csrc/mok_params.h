// Parameter structs shared by the torch bindings (bindings/) and the kernels: one source of
// truth per kernel signature.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace mok {

// What a kernel leaves in host-mapped memory just before it traps: which bounded wait timed out
// (the watchdog of a persistent kernel, common/watchdog_sm90.cuh) or which in-kernel check failed
// (the schedule kernel's expert ids). It outlives the trap; the last_failure op names it
// (common/failure_codes.h holds the names, common/failure_record.h the host side).
struct FailureRecord {
  int recorded;  // 1 once the fields below hold a failure
  int kernel;    // FailingKernel (common/failure_codes.h)
  int check;     // the kernel's wait or check that failed (common/failure_codes.h)
  int block;     // blockIdx.x of the CTA that saw it
  int peer;      // the peer rank the wait or check was about (the exchange's waits), -1 for none
  int call;      // the layer call id the kernel ran for, -1 for none (not passed to kernels yet)
};

// Row gather in schedule order: rows[s] = w[route] * src[route / topk] for route =
// slot_to_route[s] (w = 1 when weights is null), zero where the route is -1. Pull dispatch of the
// activations (no weights) and the reverse-combine pull of dY (routing weights) both use it.
struct GatherRowsParams {
  const void* src;               // (num_src_rows, hidden) bf16/fp32
  const float* weights;          // (num_routes,) or null
  const int64_t* slot_to_route;  // (num_slots,) route index, -1 for padding
  int64_t* route_slot;           // (num_routes,) scratch: the row of each route, -1 if none
  void* rows;                    // (num_slots, hidden), same dtype
  // Null, or the schedule's end row (expert_offsets[num_experts], on the device): rows at or past
  // it are not written (no stage reads them), so a receive window's unused tail costs nothing.
  const int32_t* row_end;
  int64_t num_slots;
  int64_t num_routes;            // num_src_rows * topk
  int64_t hidden;
  int64_t topk;
};

// Fixed-order combine: out[t] = sum over k ascending of w[t,k] * table[index[t*topk+k]] in fp32
// (w = 1 when weights is null), rounded once; index -1 skips the route.
struct CombineParams {
  const void* table;      // (num_table_rows, hidden)
  const int64_t* index;   // (num_tokens * topk,)
  const float* weights;   // (num_tokens, topk) or null
  void* out;              // (num_tokens, hidden), same dtype as table
  void* keep;             // (num_table_rows, hidden) or null: each row read is copied to its row here
  int64_t num_tokens;
  int64_t num_table_rows;
  int64_t hidden;
  int64_t topk;
};

// d_weights[t,k] = <grad_y[t], table[index[t*topk+k]]> in fp32, zero where index is -1.
struct RouteWeightGradParams {
  const void* grad_y;     // (num_tokens, hidden)
  const void* table;      // (num_table_rows, hidden)
  const int64_t* index;   // (num_tokens * topk,)
  float* d_weights;       // (num_tokens, topk)
  int64_t num_tokens;
  int64_t num_table_rows;
  int64_t hidden;
  int64_t topk;
};

// SwiGLU over the schedule's rows: act[r] = silu(gate[r]) * up[r] for r < offsets[num_experts],
// zero for the rows past the last segment (the grouped GEMM leaves them unwritten).
struct SwigluParams {
  const void* gate_up;       // (num_rows, 2 * ffn) gate columns first
  const void* grad_act;      // backward only: (num_rows, ffn)
  void* out;                 // forward: act (num_rows, ffn); backward: grad_gate_up (num_rows, 2 * ffn)
  const int32_t* offsets;    // (num_experts + 1,) segment boundaries on the device
  int64_t num_experts;
  int64_t num_rows;
  int64_t ffn;
};

// The schedule of one rank from the group's routing (see moe/schedule_sm90.cuh).
struct ScheduleParams {
  const void* topk_ids;     // (num_routes,) int32 or int64 global expert ids, -1 = dropped
  int64_t* slot_to_route;   // (capacity,) route per row, -1 for padding
  int64_t* route_to_slot;   // (num_routes,) row per route owned here, `capacity` otherwise
  int32_t* expert_counts;   // (num_local_experts,)
  int32_t* expert_offsets;  // (num_local_experts + 1,)
  int32_t* block_counts;    // (schedule blocks, num_local_experts) scratch: routes per block and expert
  int64_t num_routes;
  int64_t capacity;
  int64_t num_local_experts;
  int64_t alignment;
  int rank;
  // > 0: every id must lie in [-1, num_experts_checked) (the group's experts); the count kernel
  // records a violation in failure_record and traps. 0: no check.
  int64_t num_experts_checked;
  FailureRecord* failure_record;  // host-mapped, or null
};

// ---- The sm90 GEMM kernels (gemm/kernel_sm90_tma_wgmma_ws.cuh) ---------------------------------
// Each kernel takes its TMA tensor maps, each a __grid_constant__ argument of its own (TMA reads a
// map where it lies), in the order of the pointers of its *Maps struct below (the mainloop's, then
// the epilogue's), and then its params by value (copied into registers on entry), the parts'
// structs side by side. The bindings fill them once; the kernel points a *Maps struct at its maps.
// No size is given twice: the epilogues get their output's extent from the problem, through the
// tile scheduler (OutputExtent in gemm/tile_scheduler_sm90.cuh).

// Grouped GEMM over the schedule's expert segments (gemm/expert_gemm_sm90.cuh): for each row r of
// expert e's segment [expert_offsets[e], expert_offsets[e + 1]), out[r] = A[r] . B_e^T with fp32
// accumulation, rounded once to bf16 by the epilogue. Rows outside every segment are not written.
struct ExpertGemmProblem {
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device, non-decreasing from >= 0
  int32_t num_experts;
  int32_t num_rows;       // rows of the schedule (of A, and of every output)
  int32_t n_out;          // output columns per expert (SwiGLU: of act; B_e then has 2 n_out rows)
  int32_t n_weight_rows;  // rows of B per expert
  int32_t k;              // reduction size
  int32_t group_m;        // raster: m-tiles per group, m fastest inside (a multiple of the cluster size)
};

// A's rows are in memory already (the a map covers them): nothing more to know.
struct RowsInMemoryParams {};

// The dispatching GEMM (the gate/up projection) pulls A's rows itself (moe/dispatch_ring_sm90_ws.cuh):
// warps 2-3 of every CTA copy rows[r] = x[slot_to_route[r] / topk] (zeros where slot_to_route[r] is
// -1), minibatch after minibatch in chunks claimed from a counter; each minibatch's `done` counter
// says how many of its chunks are written. The GEMM loads a tile's rows (TMA, from `rows`) once every
// minibatch they touch is done, so the dispatch overlaps the GEMM. `rows` is a ring of
// ring_minibatches minibatches: row r sits at position r % ring_rows, and a slot is refilled only
// after every tile has loaded the rows it held (consumed counter). With ring_mirrored, positions
// [0, kExpertGemmTileM) are also written at [ring_rows, ring_rows + kExpertGemmTileM), so a tile's
// box never runs off the ring's end.
struct DispatchRingParams {
  const void* x;                 // (x_rows, k) bf16: every token the schedule's routes name
  const int64_t* slot_to_route;  // (num_rows,) route per row, -1 for padding
  void* rows;                    // (ring_rows (+ kExpertGemmTileM when ring_mirrored), k) bf16: the ring, A of the GEMM
  int32_t* counters;             // (3 * num_minibatches,) zeroed: chunks claimed, chunks done, rows consumed
  int64_t x_rows;
  int32_t topk;
  int32_t minibatch_rows;    // kDispatchMinibatchRows (common/limits.h)
  int32_t num_minibatches;
  int32_t ring_minibatches;  // <= num_minibatches; equal: no slot is reused (rows holds every row)
  int32_t ring_rows;         // ring_minibatches * minibatch_rows
  int32_t ring_mirrored;     // 1 when ring_minibatches < num_minibatches
};

// Store epilogue (gemm/epilogue_sm90_store.cuh): out = the product, rounded to bf16.
struct StoreEpilogueMaps {
  const CUtensorMap* out;  // out in boxes of 64 rows x 64 columns
};
struct StoreEpilogueParams {
  void* out;  // (rows, n_out) bf16, the extent the tile scheduler gives (OutputExtent)
};

// SwiGLU epilogue (gemm/epilogue_sm90_swiglu.cuh), the gate/up projection: B_e holds n_out gate rows
// then n_out up rows; writes gate_up (the pre-activation, kept for backward) and act =
// silu(gate) * up from the bf16-rounded gate and up, the arithmetic of swiglu_forward_kernel.
struct SwigluEpilogueMaps {
  const CUtensorMap* act;   // act in boxes of 64 x 64
  const CUtensorMap* gate;  // the gate half of gate_up: (num_rows, n_out) with row stride 2 n_out
  const CUtensorMap* up;    // the up half
};
struct SwigluEpilogueParams {
  void* act;      // (num_rows, n_out) bf16
  void* gate_up;  // (num_rows, 2 n_out) bf16
};

// SwiGLU-backward epilogue (gemm/epilogue_sm90_swiglu_bwd.cuh), the dgrad of down: the product is
// grad_act; writes grad_gate_up = swiglu_backward(gate_up, grad_act), the arithmetic of
// swiglu_backward_kernel (grad_act itself is never written).
struct SwigluBackwardEpilogueMaps {};  // plain 16-byte stores: no tensor map
struct SwigluBackwardEpilogueParams {
  const void* gate_up;  // (num_rows, 2 n_out) bf16, read
  void* grad_gate_up;   // (num_rows, 2 n_out) bf16
};

// The expert GEMM kernel's arguments. A (num_rows, k) bf16 and B reach it as TMA tensor maps: B
// K-major (num_experts * n_weight_rows, k), or MN-major (num_experts, k, n_out) for the dgrad GEMMs.
template <class EpilogueMaps>
struct ExpertGemmMaps {
  const CUtensorMap* a;  // A in boxes of kExpertGemmTileM rows x 64 (the dispatching GEMM: its ring)
  const CUtensorMap* b;  // B in boxes of 128 rows x 64 (K-major) or 64 x 64 x 1 (MN-major)
  EpilogueMaps epilogue;
};

template <class EpilogueParams, class ASourceParams = RowsInMemoryParams>
struct ExpertGemmParams {
  ExpertGemmProblem problem;
  ASourceParams a_source;
  EpilogueParams epilogue;
  FailureRecord* failure_record;  // host-mapped; null: trap without a record
};

// The FP8 blockwise grouped GEMM over the schedule's expert segments (gemm/fp8_gemm_sm90.cuh,
// docs/design.md §12.3): for each row r of expert e's segment, with b the K blocks of 128 ascending,
//   out[r, n] = sum_b a_scales[b, r] * b_scales[e, n / 128, b] * P_b[r, n],
//   P_b[r, n] = sum over the 128 k of block b of A[r, k] * B_e[n, k]   (E4M3 operands, fp32 partial)
// (B_e[n] the weight row of output column n; the SwiGLU epilogue's gate and up partners) and handed
// to the epilogue: the store epilogue rounds it once to bf16 (StoreEpilogueParams, out (num_rows,
// n_out)). A (num_rows, k) and B (num_experts * n_weight_rows, k) are E4M3, K-major (the dgrad GEMMs
// pass the transposed weight copy as B). Rows outside every segment are not written.
struct Fp8BlockScales {
  const float* a;  // (k / 128, a_rows) fp32: the GEMM-A layout, one K block's scales contiguous over rows
  const float* b;  // (num_experts, n_weight_rows / 128, k / 128) fp32: the weight's 128 x 128 blocks
  int32_t a_rows;  // row stride of `a`: num_rows rounded up to kFp8ScaleRowPad
};

template <class EpilogueMaps>
struct Fp8ExpertGemmMaps {
  const CUtensorMap* a;    // A in boxes of 128 rows x 128 bytes (one K block of a tile's rows)
  const CUtensorMap* b;    // B in boxes of 64 rows x 128 bytes (a tile's B slice is two of them)
  EpilogueMaps epilogue;
};

template <class EpilogueParams>
struct Fp8ExpertGemmParams {
  ExpertGemmProblem problem;
  Fp8BlockScales scales;
  EpilogueParams epilogue;
  FailureRecord* failure_record;  // host-mapped; null: trap without a record
};

// The FP8 SwiGLU epilogue (gemm/fp8_gemm_sm90.cuh Fp8SwigluEpilogue), the gate/up projection: B_e
// holds n_out gate rows then n_out up rows; writes gate_up (bf16, kept for backward), act =
// silu(gate) * up from the bf16-rounded gate and up, rounded to bf16 (swiglu_forward_kernel's
// arithmetic), then quantized 1x128 along n_out exactly as docs/design.md §12.1 states: E4M3 act
// and its scales in the GEMM-A layout, the down projection's A operand. Plain stores: no tensor map.
struct Fp8SwigluEpilogueMaps {};
struct Fp8SwigluEpilogueParams {
  void* gate_up;       // (num_rows, 2 n_out) bf16
  void* act;           // (num_rows, n_out) e4m3
  float* act_scales;   // (n_out / 128, act_scale_rows) fp32: column r of block b is row r's scale
  int32_t act_scale_rows;  // num_rows rounded up to kFp8ScaleRowPad
};

// The FP8 SwiGLU-backward epilogue (gemm/epilogue_fp8_swiglu_bwd_sm90.cuh), the down projection's
// dgrad: the product is d act (num_rows, n_out), rounded once to bf16 and never written; per row of a
// segment the epilogue writes d gate_up = the SwiGLU backward of gate_up with it (fp32, rounded once
// to bf16) and its 1x128 quantization along 2 n_out (E4M3 + scales in the GEMM-A layout): bit for bit
// fp8_expert_gemm then fp8_quantize_swiglu_backward on the rows of the segments. Plain stores; the
// one tensor map is the L2 prefetch's.
struct Fp8SwigluBackwardEpilogueMaps {
  const CUtensorMap* gate_up;  // gate_up in boxes of 128 rows x 64 columns: the L2 prefetch of a tile's spans
};
struct Fp8SwigluBackwardEpilogueParams {
  const void* gate_up;   // (num_rows, 2 n_out) bf16, read
  void* grad_gate_up;    // (num_rows, 2 n_out) bf16
  uint8_t* rows_q;       // (num_rows, 2 n_out) e4m3
  float* rows_scales;    // (2 n_out / 128, gemm_a_rows) fp32: column r of block b is row r's scale
  int32_t gemm_a_rows;   // num_rows rounded up to kFp8ScaleRowPad
  int32_t pow2;          // the scales rounded up to powers of two
};

// The FP8 push epilogue (gemm/fp8_gemm_sm90.cuh Fp8PushEpilogue), the down projection and the
// gate/up dgrad over the in-kernel exchange: the product's row r, rounded once to bf16, goes where
// push_rows_kernel (PushRowsParams) would move it, slot t * topk + k of its route's source rank's
// combine region; a row of route -1 (padding) is not written. No output tensor, no tensor map.
struct Fp8PushEpilogueMaps {};
struct Fp8PushEpilogueParams {
  const int64_t* slot_to_route;    // (num_rows,) the group route of each row of the product, -1 for padding
  void* peer_tables[kMaxEpRanks];  // [num_ranks] every rank's combine region, (routes_per_rank, n_out) bf16
  int32_t routes_per_rank;         // num_tokens * topk; num_ranks * routes_per_rank < 2^31
  int32_t num_ranks;
};

// The FP8 blockwise weight gradient per expert (gemm/fp8_wgrad_sm90.cuh, docs/design.md §12.3) over
// one window of the schedule's rows, [window_begin, window_begin + num_rows) (the whole schedule:
// window_begin 0 and all its rows). With o_e = expert_offsets[e], expert e's rows in the window are
// [max(o_e, b), min(o_e+1, b + num_rows)) (b = window_begin), and with blocks b of 128 of them,
// ascending:
//   out[e] (m, n) = (accumulate ? out[e] : 0) + sum_b grad_scales[b, i] * inputs_scales[b, j] * P_b[i, j]
//   P_b[i, j] = sum over block b's 128 rows r of grad[i, r] * inputs[j, r]   (E4M3, fp32 partial)
// accumulated in fp32 as acc = fma(grad_scale * inputs_scale, P_b, acc) from acc = out[e] (accumulate)
// or 0: windows called in order, the first with accumulate = 0, give out bitwise equal to one call
// over all their rows. An expert with no row in the window: zeros, or (accumulate) out[e] unchanged.
// NOTES: every expert with rows in the window starts on a 128-row block of it (o_e % 128 == 0
// where o_e >= b; checked in the kernel, kCheckFp8WgradSegmentAlignment); the rows of a segment's
// last block past o_e+1 are padding, zero in both operands (not checked; the recipe pads so);
// offsets non-decreasing (not checked).
struct Fp8ExpertWgradProblem {
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device: the whole schedule's segments
  int32_t num_experts;
  int32_t num_rows;      // rows of the window (of both operands), a positive multiple of 128
  int32_t m;             // grad's columns (out's rows), a multiple of 128
  int32_t n;             // inputs' columns (out's columns), a multiple of 128
  int32_t window_begin;  // schedule row of the window's first row, a multiple of 128
  int32_t accumulate;    // 1: every expert's chain starts from chain_in (a later window), 0: from zero
  int32_t rounded;       // 1: every tile's sums rounded into rounded_out (rounded_out given)
  // 1: the windowed form (accumulate 0, rounded 1, chain_in / chain_out the carries): expert e's chain
  // starts from chain_in when its segment [o_e, o_e+1) begins before the window, is rounded into
  // rounded_out when it ends inside the window (o_e+1 <= window_begin + num_rows), else stored into
  // chain_out; an expert without rows in the window is skipped, but for an empty one (o_e = o_e+1),
  // rounded (as zeros) by the window that begins at row 0. Windows run in order and tile the rows.
  int32_t windowed;
};

struct Fp8ExpertWgradMaps {
  const CUtensorMap* grad;    // grad (m, num_rows) e4m3 column-wise, boxes of 128 rows x 128 tokens
  const CUtensorMap* inputs;  // inputs (n, num_rows) e4m3 column-wise, the same boxes
  // rounded_out seen as (num_experts * m, n) bf16, TMA store boxes of 64 rows x 64 columns; without
  // rounded_out a map of grad, never used
  const CUtensorMap* rounded_out;
};

struct Fp8ExpertWgradParams {
  Fp8ExpertWgradProblem problem;
  const float* grad_scales;    // (num_rows / 128, m) fp32: block b's scales contiguous over columns
  const float* inputs_scales;  // (num_rows / 128, n) fp32
  // The fp32 chains: read from chain_in where a chain continues, written to chain_out where a tile
  // is not rounded, expert e's tile at e * chain_expert_stride: out (num_experts, m, n) for both
  // (stride m * n), or the windowed form's two carries of (m, n) (stride 0: a window continues at
  // most the one expert that crosses its first row and carries on the one that crosses its end).
  const float* chain_in;
  float* chain_out;
  int64_t chain_expert_stride;
  uint16_t* rounded_out;       // (num_experts, m, n) bf16 bits or null: the sums rounded (to nearest even)
                               // here instead of written to chain_out
  FailureRecord* failure_record;  // host-mapped; null: trap without a record
};

// FP8 blockwise quantization (quant/, docs/design.md §12.1-12.2), each kernel bit for bit the
// function of megatron_mok/quantization.py named beside it; pow2: power-of-two scales.
//
// 1x128 along the columns (quantization.quantize_rowwise, gemm_a_scales): row r of the output is
// source row row_index[r] (row r when row_index is null; a zero row for -1), quantized per 128
// columns. Either scale layout may be null. Every output element is written, the GEMM-A layout's
// padding columns [num_rows, gemm_a_rows) with 1.
struct Fp8QuantizeRowsParams {
  const void* src;            // (num_src_rows, cols) bf16
  const int64_t* row_index;   // (num_rows,) or null: the source row of each output row, -1 for a zero row
  uint8_t* q;                 // (num_rows, cols) e4m3
  float* scales;              // (num_rows, cols / 128) fp32 or null: the source layout, a row's scales contiguous
  float* gemm_a_scales;       // (cols / 128, gemm_a_rows) fp32 or null: the GEMM-A layout
  int64_t num_src_rows;
  int64_t num_rows;
  int64_t cols;               // a multiple of 128
  int64_t gemm_a_rows;        // num_rows rounded up to kFp8ScaleRowPad
  int32_t pow2;
  FailureRecord* failure_record;  // host-mapped; null: trap without a record (an index out of range)
};

// SwiGLU of gate/up rows quantized 1x128 along F (quant/quantize_swiglu_sm90.cuh): q (num_rows, ffn)
// and its GEMM-A scales from gate_up (num_rows, 2 ffn), gate columns then up columns; rows at or past
// expert_offsets[num_experts] are not read and quantize as zeros.
struct Fp8QuantizeSwigluParams {
  const void* gate_up;            // (num_rows, 2 ffn) bf16
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device: the schedule's end row
  int32_t num_experts;
  uint8_t* q;                     // (num_rows, ffn) e4m3
  float* gemm_a_scales;           // (ffn / 128, gemm_a_rows) fp32: the GEMM-A layout
  int64_t num_rows;
  int64_t ffn;                    // a multiple of 128
  int64_t gemm_a_rows;            // num_rows rounded up to kFp8ScaleRowPad
  int32_t pow2;
};

// 1x128 along the rows (tokens) for the weight gradients (quantization.quantize_columnwise): q is
// the matrix transposed, q[c][r] of source row r, over padded_rows = num_rows rounded up to 128; rows
// at or past min(num_rows, *row_end) quantize as zeros (their memory is never read), so a schedule's
// unused tail and the last block's padding need not be zero in memory. Every output element is
// written.
struct Fp8QuantizeColumnsParams {
  const void* src;            // (num_src_rows, cols) bf16, or the SwiGLU kernel's gate/up (num_rows, 2 cols)
  const int64_t* row_index;   // (num_rows,) or null: the source row of each row, -1 for a zero row
  const float* row_weights;   // (num_rows,) or null (with row_index): row r scaled by row_weights[r]
  const int32_t* row_end;     // null, or the schedule's end row on the device (expert_offsets[E])
  uint8_t* q;                 // (cols, padded_rows) e4m3
  float* scales;              // (padded_rows / 128, cols) fp32
  int64_t num_src_rows;
  int64_t num_rows;
  int64_t cols;               // a multiple of 128
  int64_t padded_rows;        // num_rows rounded up to 128
  int32_t pow2;
  FailureRecord* failure_record;  // host-mapped; null: trap without a record (an index out of range)
};

// The SwiGLU backward of gate/up rows with d act, and its 1x128 quantization along 2 ffn (quant/
// quantize_swiglu_backward_sm90.cuh): d gate_up (num_rows, 2 ffn) bf16, gate columns then up
// columns, and its E4M3 copy with the GEMM-A scales (the gate/up dgrad's operand). Rows at or past
// expert_offsets[num_experts] are not read: d gate_up zero there, quantized as zero rows.
struct Fp8QuantizeSwigluBackwardParams {
  const void* gate_up;            // (num_rows, 2 ffn) bf16
  const void* grad_act;           // (num_rows, ffn) bf16
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device: the schedule's end row
  int32_t num_experts;
  void* grad_gate_up;             // (num_rows, 2 ffn) bf16
  uint8_t* rows_q;                // (num_rows, 2 ffn) e4m3
  float* rows_scales;             // (2 ffn / 128, gemm_a_rows) fp32: the GEMM-A layout
  int64_t num_rows;
  int64_t ffn;                    // a multiple of 128
  int64_t gemm_a_rows;            // num_rows rounded up to kFp8ScaleRowPad
  int32_t pow2;
};

// The SwiGLU backward of gate/up rows with d act and both of d gate_up's FP8 copies from one pass
// (quant/quantize_swiglu_backward_tiles_sm90.cuh): the row copy 1x128 along 2 ffn with GEMM-A scales
// (the gate/up dgrad's operand) and the column copy 1x128 along the rows, transposed (the fc1 weight
// gradient's), with no bf16 d gate_up; optionally act's column copy (the fc2 weight gradient's) from
// the same gate_up. Rows at or past expert_offsets[num_experts] are not read: zero rows of every copy;
// the column copies' rows past num_rows (to padded_rows) are zeros.
struct Fp8QuantizeSwigluBackwardCopiesParams {
  const void* gate_up;            // (num_rows, 2 ffn) bf16
  const void* grad_act;           // (num_rows, ffn) bf16
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device: the schedule's end row
  int32_t num_experts;
  uint8_t* rows_q;                // (num_rows, 2 ffn) e4m3
  float* rows_scales;             // (2 ffn / 128, gemm_a_rows) fp32: the GEMM-A layout
  uint8_t* columns_q;             // (2 ffn, padded_rows) e4m3
  float* columns_scales;          // (padded_rows / 128, 2 ffn) fp32
  uint8_t* act_columns_q;         // (ffn, padded_rows) e4m3, or null: act = SwiGLU of gate_up, its column
  float* act_columns_scales;      // copy too, scales (padded_rows / 128, ffn) fp32 (the fc2 weight gradient's)
  int64_t num_rows;
  int64_t ffn;                    // a multiple of 128
  int64_t gemm_a_rows;            // num_rows rounded up to kFp8ScaleRowPad
  int64_t padded_rows;            // num_rows rounded up to 128
  int32_t pow2;
};

// 128x128 blocks of a weight (quantization.quantize_weight), and with q_t its transposed copy
// (quantization.transpose_weight of it): one pass over the weight.
struct Fp8QuantizeWeightParams {
  const void* src;            // (num_experts, n, k) bf16 or fp32
  uint8_t* q;                 // (num_experts, n, k) e4m3, or null (then scales is null too)
  float* scales;              // (num_experts, n / 128, k / 128) fp32
  uint8_t* q_t;               // (num_experts, k, n) e4m3, or null (then scales_t is null too); q or q_t
  float* scales_t;            // (num_experts, k / 128, n / 128) fp32
  int64_t num_experts;
  int64_t n;                  // a multiple of 128
  int64_t k;                  // a multiple of 128
  int32_t pow2;
  // (num_experts + 1) on the device, or null. Where set, only the experts with rows
  // (expert_offsets[e] < expert_offsets[e + 1]) are quantized: the copies of a GEMM over those
  // segments, which reads no block of an expert without rows; the other experts' blocks are left
  // unwritten (their CTAs return at once: quant/quantize_weight_sm90.cuh).
  const int32_t* expert_offsets;
};

// The transposed copy of a weight's 128x128 quantization, from that quantization
// (quant/transpose_weight_sm90.cuh).
struct Fp8TransposeWeightParams {
  const uint8_t* q;           // (num_experts, n, k) e4m3
  const float* scales;        // (num_experts, n / 128, k / 128) fp32
  uint8_t* q_t;               // (num_experts, k, n) e4m3
  float* scales_t;            // (num_experts, k / 128, n / 128) fp32
  int64_t num_experts;
  int64_t n;                  // a multiple of 128
  int64_t k;                  // a multiple of 128
  const int32_t* expert_offsets;  // as Fp8QuantizeWeightParams'
};

// Weight gradients per expert, tokens as the reduction dimension (gemm/expert_wgrad_sm90.cuh):
// out[e] (m, n) = grad[rows of e]^T . inputs[rows of e]; every element of out is written (zeros
// for an expert with no rows).
struct ExpertWgradProblem {
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device
  int32_t num_experts;
  int32_t num_rows;
  int32_t m;
  int32_t n;
};

struct ExpertWgradMaps {
  const CUtensorMap* grad;      // grad (num_rows, m) bf16 in boxes of 64 columns x 64 rows
  const CUtensorMap* inputs;    // inputs (num_rows, n) bf16, the same boxes
  StoreEpilogueMaps epilogue;  // out (num_experts, m, n) as (num_experts * m, n)
};

struct ExpertWgradParams {
  ExpertWgradProblem problem;
  StoreEpilogueParams epilogue;  // out (num_experts, m, n) as (num_experts * m, n)
  FailureRecord* failure_record;
};

// The weight gradient over one window of the schedule, schedule rows [window_begin, window_begin +
// num_rows) (gemm/expert_wgrad_sm90.cuh, ExpertWgradWindowKernel): a sequence of windows covering
// the schedule gives out bitwise equal to one ExpertWgradProblem over all its rows. Expert e's
// segment [o_e, o_e+1) of the whole schedule (offsets not clamped to the window) contributes its
// rows inside the window; with b = window_begin, w_end = b + num_rows (on the last window the
// segments end at w_end at the latest, as the whole-schedule kernel clamps them to its rows):
//   o_e < b < o_e+1       the K chain continues from the previous window (carry in)
//   o_e < w_end < o_e+1   it continues in the next window: the accumulators go to the carry out
//   otherwise, b < o_e+1 <= w_end, or o_e == o_e+1 with b <= o_e < w_end (or o_e == w_end on the
//   last window): out[e] is stored, as the whole-schedule kernel stores it.
// NOTES: a window boundary must fall on a 64-row K block of every expert it splits (checked in the
// kernel, kCheckCarryKBlockAlignment); offsets must be non-decreasing from >= 0 (not checked).
struct ExpertWgradWindowProblem {
  const int32_t* expert_offsets;  // (num_experts + 1,) on the device: the whole schedule's segments
  int32_t num_experts;
  int32_t num_rows;      // rows of the window (of grad and inputs), > 0
  int32_t m;
  int32_t n;
  int32_t window_begin;  // schedule row of the window's first row, a multiple of 64
  int32_t last_window;   // 1: no expert continues past the window
};

// The accumulators of the one expert whose K chain crosses a window boundary, in fragment order,
// each consumer thread's own (loaded and stored by the thread that owns them, so exact and
// private). For the expert's tile t = m_tile + m_tiles * n_tile (m_tiles = ceil(m / 128)),
// consumer thread c = 128 * consumer warpgroup + thread (0..255) and accumulator register
// acc[4 * i + j] (i = 0..31, j = 0..3), the float at
//   ((t * 32 + i) * 256 + c) * 4 + j
// (a warp's 16-byte chunk i lies in 512 contiguous bytes: coalesced). A buffer holds m_tiles *
// n_tiles * 32 * 256 * 4 floats = ceil(m / 128) * 128 * ceil(n / 256) * 256 (limits.py
// wgrad_carry_numel), 4 bytes each. carry_in and carry_out are different buffers (two different
// experts may carry in and out of one window); null where no expert carries (a tile that needs one
// records kCheckCarryInBuffer / kCheckCarryOutBuffer and traps).
struct WgradCarryParams {
  const float* in;  // read by the tiles of the expert carried into the window, or null
  float* out;       // written by the tiles of the expert carried past the window, or null
};

struct ExpertWgradWindowParams {
  ExpertWgradWindowProblem problem;
  StoreEpilogueParams epilogue;  // out (num_experts, m, n) as (num_experts * m, n)
  WgradCarryParams carry;
  FailureRecord* failure_record;
};

}  // namespace mok

// ==== The in-kernel expert-parallel exchange ====================================================
// The structs of the exchange through symmetric memory (comm/symmetric.py has the regions and the
// signal protocol): the row source of the peer gathers (moe/row_source_sm90.cuh,
// moe/dispatch_sm90.cuh) and of the dispatching GEMM's ring (moe/dispatch_ring_sm90_ws.cuh), the
// signal kernels (moe/exchange_sm90.cuh), the push combine and the region pull
// (moe/push_combine_sm90.cuh); bindings/exchange_ops.cu, bindings/moe_ops.cu and
// bindings/expert_gemm_ops.cu fill them. One section of its own at the end of this file: kMaxEpRanks comes from common/limits.h,
// included here so that the section stands alone.

#include "common/limits.h"

namespace mok {

// Where a row gather finds row g of the group's rows, rank-major (g = route / topk, schedule.py:
// rank r's token t is row r * rows_per_base + t): base b = the b with b * rows_per_base <= g <
// (b + 1) * rows_per_base, row g - b * rows_per_base of it, `hidden` elements. The weight of route
// g * topk + k (the reverse-combine pull) is weight_bases[b][(g - b * rows_per_base) * topk + k].
// The ranks' symmetric regions: base r = rank r's `tokens` (or `grad_tokens`, with `grad_weights`
// as weight base r), rows_per_base = T. One base holding every row is one gathered tensor (x_all).
// The bases travel by value in the params (no table in memory to read first): 144 bytes at 8 ranks.
struct RowSource {
  const void* bases[kMaxEpRanks];          // [num_bases], each (rows_per_base, hidden), 16-byte aligned for packs
  const float* weight_bases[kMaxEpRanks];  // [num_bases], each (rows_per_base * topk,) fp32; all null: no weights
  int64_t rows_per_base;
  int32_t num_bases;  // in [1, kMaxEpRanks]
};

// The row gather of moe/dispatch_sm90.cuh reading the group's rows through a RowSource: the pull
// dispatch from the ranks' `tokens` regions and the reverse-combine pull from `grad_tokens` and
// `grad_weights`. The inherited src and weights are unused (null): rows and weights come from
// `source`; num_routes is the group's, num_bases * rows_per_base * topk. GatherRowsParams has no
// RowSource, so its instantiation never pays for the region lookup: the peer form is a second one.
struct PeerGatherRowsParams : GatherRowsParams {
  RowSource source;
};

// The gathered column quantization (quant/quantize_columns_sm90.cuh) reading the group's rows
// where they lie, in the ranks' symmetric regions: row_index[r] = g is row g of the group, rank
// g / T's row g % T (T = source.rows_per_base; num_src_rows = num_bases * T). The inherited src is
// unused (null); source.weight_bases stay null (row_weights carries each row's weight). Every base
// 16-byte aligned (the tile loads read 16-byte pieces). A second instantiation, as for the row
// gathers: the one-tensor form pays for no lookup.
struct PeerFp8QuantizeColumnsParams : Fp8QuantizeColumnsParams {
  RowSource source;
};

// The dispatching GEMM's ring (moe/dispatch_ring_sm90_ws.cuh) filled straight from the ranks'
// `tokens` regions: ring row r = row g = slot_to_route[r] / topk of the group, rank g / T's token
// g % T (T = source.rows_per_base). The inherited x is unused (null); x_rows is the group's rows,
// num_bases * rows_per_base, below 2^31 (the dispatch warps locate rows in 32 bits);
// source.weight_bases stay null. Every base and the row size (2K bytes) 16-byte aligned (the copy
// reads 16-byte units; the bulk prefetch needs it). As for the gathers, the one-tensor ring
// (DispatchRingParams) has no RowSource and no lookup: this is a second instantiation.
struct PeerDispatchRingParams : DispatchRingParams {
  RowSource source;
};

// One rank's step of the signal protocol (comm/symmetric.py). Signal pad of a rank, int64 counters
// that only grow: pad[(phase * 2 + kind) * num_ranks + source] = how many times rank `source` has
// signalled `kind` (0 ready, 1 free: common/failure_codes.h) for `phase` to this rank; 16 * P * R
// bytes for P phases. calls[phase] = this rank's calls of the phase so far (local memory).
struct ExchangeSignalParams {
  int64_t* calls;                      // (num_phases,) this rank's, local
  int64_t* signals;                    // this rank's pad, (num_phases, 2, num_ranks)
  int64_t* peer_signals[kMaxEpRanks];  // [num_ranks] every rank's pad, rank order (this rank's included)
  int32_t rank;
  int32_t num_ranks;
  int32_t phase;                   // ExchangePhase (common/failure_codes.h)
  int32_t kind;                    // the signal's kind (exchange_signal only)
  FailureRecord* failure_record;   // host-mapped; null: trap without a record
};

// The push combine (moe/push_combine_sm90.cuh): row s of this rank's schedule, route r =
// slot_to_route[s] >= 0, goes to row r % routes_per_rank of rank r / routes_per_rank's combine
// table (the source's slot t * topk + k); rows with route -1 are skipped. Each (rank, slot) of the
// group is written by exactly one row of one owner: no two writers, no atomics.
struct PushRowsParams {
  const void* slot_rows;            // (num_slots, row_bytes): this rank's per-row results
  const int64_t* slot_to_route;     // (num_slots,) the group route of each row, -1 for padding
  void* peer_tables[kMaxEpRanks];   // [num_ranks] every rank's combine region, (routes_per_rank, row_bytes)
  int64_t num_slots;
  int64_t routes_per_rank;          // num_tokens * topk
  int64_t row_units;                // a row in units of the kernel's copy type
  int32_t num_ranks;
};

// The region pull (moe/push_combine_sm90.cuh): out[r] = the `units` copy units of rank r's copy of
// one region (every rank's top-k ids, for the schedule).
struct GatherRegionsParams {
  const void* peer_regions[kMaxEpRanks];  // [num_ranks] rank order
  void* out;                              // (num_ranks, units)
  int64_t units;
  int32_t num_ranks;
};

}  // namespace mok
