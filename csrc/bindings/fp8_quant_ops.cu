// Torch bindings of the FP8 blockwise quantization kernels (quant/): ops fp8_quantize_rows,
// fp8_quantize_swiglu, fp8_quantize_columns (and its form over the ranks' regions,
// fp8_quantize_columns_from_peers), fp8_quantize_swiglu_columns,
// fp8_quantize_swiglu_backward (and its form writing both FP8 copies, fp8_quantize_swiglu_backward_copies),
// fp8_quantize_weight and fp8_transpose_weight of the `megatron_mok`
// library (validated wrappers, fake implementations and references in megatron_mok/ops/fp8_quant.py,
// which raise ValueError before these run; the checks here are the same, for callers of torch.ops
// directly). Each fills its params struct (mok_params.h) once and launches one kernel. An output a
// caller did not ask for is returned as an empty (0,) tensor (a schema cannot return None).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "bindings/checks.h"
#include "bindings/op_utils.h"
#include "common/device_info.h"
#include "common/failure_record.h"
#include "common/limits.h"
#include "mok_params.h"
#include "quant/quantize_columns_sm90.cuh"
#include "quant/quantize_rows_sm90.cuh"
#include "quant/quantize_swiglu_backward_sm90.cuh"
#include "quant/quantize_swiglu_backward_tiles_sm90.cuh"
#include "quant/quantize_swiglu_sm90.cuh"
#include "quant/quantize_weight_sm90.cuh"
#include "quant/transpose_weight_sm90.cuh"

namespace mok {
namespace {

// CTAs of `kernel` (kQuantizeThreads threads, no dynamic shared memory) resident on the device at
// once, found once per kernel and device: the grid-stride row kernel launches no more.
template <typename Kernel>
int resident_blocks(Kernel kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> found;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = found.find(key); it != found.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kQuantizeThreads, 0));
  const int blocks = std::max(1, per_sm) * multiprocessor_count();
  found.emplace(key, blocks);
  return blocks;
}

void check_bf16_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), op, "x must be a contiguous CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, "x must be bfloat16, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) % kFp8Block == 0, op,
              "x must be (rows, C) with C a positive multiple of ", std::to_string(kFp8Block), ", got ", sizes_str(x));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, "x must start 16-byte aligned");
}

uint8_t* e4m3_ptr(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// The weight copies' optional expert_offsets (num_experts + 1,) int32 on `like`'s device -> its
// pointer, or null.
const int32_t* weight_copy_offsets(const char* op, const std::optional<at::Tensor>& expert_offsets, int64_t experts,
                                   const at::Tensor& like) {
  if (!expert_offsets.has_value()) return nullptr;
  const at::Tensor& offsets = *expert_offsets;
  TORCH_CHECK(offsets.is_cuda() && offsets.device() == like.device() && offsets.is_contiguous() &&
                  offsets.scalar_type() == at::kInt && offsets.dim() == 1 && offsets.numel() == experts + 1,
              op, "expert_offsets must be a contiguous int32 (E + 1,) = (", std::to_string(experts + 1),
              ",) tensor on the weight's device, got ", sizes_str(offsets));
  return offsets.data_ptr<int32_t>();
}

at::Tensor nothing(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kFloat)); }

// (q (R, C) e4m3, scales (R, C/128) fp32 or (0,), gemm_a_scales (C/128, fp8_scale_rows(R)) fp32 or
// (0,)): x (num_src_rows, C) bf16 quantized 1x128 along C, row r from x[row_index[r]] (zeros for -1)
// when row_index (R,) int64 is given, else R = num_src_rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_quantize_rows(const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& row_index,
                                                                 bool source_scales, bool gemm_a_scales, bool pow2) {
  constexpr const char* kOp = "fp8_quantize_rows: ";
  check_bf16_rows(kOp, x);
  if (row_index.has_value()) {
    const at::Tensor& index = *row_index;
    TORCH_CHECK(index.is_cuda() && index.is_contiguous() && index.device() == x.device() &&
                    index.scalar_type() == at::kLong && index.dim() == 1,
                kOp, "row_index must be a contiguous 1-D int64 CUDA tensor on x's device");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = row_index.has_value() ? row_index->numel() : x.size(0), cols = x.size(1);
  const int64_t blocks = cols / kFp8Block;
  const int64_t gemm_a_rows = (rows + kFp8ScaleRowPad - 1) / kFp8ScaleRowPad * kFp8ScaleRowPad;
  auto q = at::empty({rows, cols}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scales = source_scales ? at::empty({rows, blocks}, x.options().dtype(at::kFloat)) : nothing(x);
  auto a_scales = gemm_a_scales ? at::empty({blocks, gemm_a_rows}, x.options().dtype(at::kFloat)) : nothing(x);
  if (rows == 0) return {q, scales, a_scales};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Fp8QuantizeRowsParams p{};
  p.src = x.data_ptr();
  p.row_index = row_index.has_value() ? row_index->data_ptr<int64_t>() : nullptr;
  p.q = e4m3_ptr(q);
  p.scales = source_scales ? scales.data_ptr<float>() : nullptr;
  p.gemm_a_scales = gemm_a_scales ? a_scales.data_ptr<float>() : nullptr;
  p.num_src_rows = x.size(0);
  p.num_rows = rows;
  p.cols = cols;
  p.gemm_a_rows = gemm_a_rows;
  p.pow2 = pow2 ? 1 : 0;
  p.failure_record = row_index.has_value() ? failure_record(stream) : nullptr;
  auto launch = [&](auto kernel) {
    const int64_t wanted = (rows + kQuantizeThreads / 32 - 1) / (kQuantizeThreads / 32);  // a warp per row
    const int grid = int(std::max<int64_t>(1, std::min<int64_t>(wanted, resident_blocks(kernel))));
    kernel<<<grid, kQuantizeThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (row_index.has_value()) {
    launch(quantize_rows_kernel<true>);
  } else {
    launch(quantize_rows_kernel<false>);
  }
  return {q, scales, a_scales};
}

// expert_offsets (E + 1,) int32, the schedule's segments, beside x on its device.
void check_expert_offsets(const char* op, const at::Tensor& offsets, const at::Tensor& x, const char* x_name) {
  TORCH_CHECK(offsets.is_cuda() && offsets.is_contiguous() && offsets.device() == x.device() &&
                  offsets.scalar_type() == at::kInt && offsets.dim() == 1 && offsets.numel() >= 1,
              op, "expert_offsets must be a contiguous 1-D int32 CUDA tensor on ", x_name, "'s device");
}

// The SwiGLU quantizations' inputs: gate_up (R, 2F) bf16 rows with F a multiple of 128, and the
// schedule's offsets beside it.
void check_swiglu_inputs(const char* op, const at::Tensor& gate_up, const at::Tensor& expert_offsets) {
  check_bf16_rows(op, gate_up);
  TORCH_CHECK(gate_up.size(1) % (2 * kFp8Block) == 0, op, "gate_up must be (rows, 2F) with F a multiple of ",
              std::to_string(kFp8Block), ", got ", sizes_str(gate_up));
  check_expert_offsets(op, expert_offsets, gate_up, "gate_up");
}

// The grid of a SwiGLU kernel over units of a row and 128 of F's columns (quantize_swiglu_kernel,
// quantize_swiglu_backward_kernel): a warp per 2 * kRowsUnroll units, no more CTAs than are resident.
template <typename Kernel>
int swiglu_units_grid(Kernel kernel, int64_t rows, int64_t ffn) {
  const int64_t warps = (rows * (ffn / kFp8Block) + 2 * kRowsUnroll - 1) / (2 * kRowsUnroll);
  const int64_t wanted = (warps + kQuantizeThreads / 32 - 1) / (kQuantizeThreads / 32);
  return int(std::max<int64_t>(1, std::min<int64_t>(wanted, resident_blocks(kernel))));
}

// (act (R, F) e4m3, act_scales (F/128, fp8_scale_rows(R)) fp32, the GEMM-A layout, padding columns 1):
// silu(gate) * up of gate_up (R, 2F) bf16 rounded to bf16, quantized 1x128 along F; rows at or past
// expert_offsets[-1] are not read and quantize as zeros.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_swiglu(const at::Tensor& gate_up, const at::Tensor& expert_offsets,
                                                       bool pow2) {
  constexpr const char* kOp = "fp8_quantize_swiglu: ";
  check_swiglu_inputs(kOp, gate_up, expert_offsets);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
  const int64_t gemm_a_rows = (rows + kFp8ScaleRowPad - 1) / kFp8ScaleRowPad * kFp8ScaleRowPad;
  auto q = at::empty({rows, ffn}, gate_up.options().dtype(at::kFloat8_e4m3fn));
  auto a_scales = at::empty({ffn / kFp8Block, gemm_a_rows}, gate_up.options().dtype(at::kFloat));
  if (rows == 0) {
    a_scales.fill_(1.f);
    return {q, a_scales};
  }
  Fp8QuantizeSwigluParams p{};
  p.gate_up = gate_up.data_ptr();
  p.expert_offsets = expert_offsets.data_ptr<int32_t>();
  p.num_experts = int32_t(expert_offsets.numel() - 1);
  p.q = e4m3_ptr(q);
  p.gemm_a_scales = a_scales.data_ptr<float>();
  p.num_rows = rows;
  p.ffn = ffn;
  p.gemm_a_rows = gemm_a_rows;
  p.pow2 = pow2 ? 1 : 0;
  quantize_swiglu_kernel<<<swiglu_units_grid(quantize_swiglu_kernel, rows, ffn), kQuantizeThreads, 0,
                           c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, a_scales};
}

// fp8_quantize_columns' checks of x (the rows, or the own region of the ranks'), its row index and
// weights and the offsets.
void check_columns_gather(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& expert_offsets,
                          const std::optional<at::Tensor>& row_index, const std::optional<at::Tensor>& row_weights) {
  check_bf16_rows(op, x);
  if (row_index.has_value()) {
    const at::Tensor& index = *row_index;
    TORCH_CHECK(index.is_cuda() && index.is_contiguous() && index.device() == x.device() &&
                    index.scalar_type() == at::kLong && index.dim() == 1,
                op, "row_index must be a contiguous 1-D int64 CUDA tensor on x's device");
  }
  if (row_weights.has_value()) {
    const at::Tensor& weights = *row_weights;
    TORCH_CHECK(row_index.has_value(), op, "row_weights needs row_index");
    TORCH_CHECK(weights.is_cuda() && weights.is_contiguous() && weights.device() == x.device() &&
                    weights.scalar_type() == at::kFloat && weights.dim() == 1 &&
                    weights.numel() == row_index->numel(),
                op, "row_weights must be a contiguous 1-D float32 CUDA tensor on x's device, one per row_index entry");
  }
  if (expert_offsets.has_value()) check_expert_offsets(op, *expert_offsets, x, "x");
}

// (q (cols, R_pad) e4m3, scales (R_pad/128, cols) fp32), R_pad = `rows` rounded up to 128, from
// quantize_columns_kernel<kGather, kSwiglu> over p's source (p's outputs and sizes are filled here).
template <bool kGather, bool kSwiglu, bool kWeighted = false, typename Params = Fp8QuantizeColumnsParams>
std::tuple<at::Tensor, at::Tensor> launch_quantize_columns(Params p, const at::TensorOptions& options, int64_t rows,
                                                           int64_t cols, const char* op) {
  const int64_t padded_rows = (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  auto q = at::empty({cols, padded_rows}, options.dtype(at::kFloat8_e4m3fn));
  auto scales = at::empty({padded_rows / kFp8Block, cols}, options.dtype(at::kFloat));
  if (rows == 0) return {q, scales};
  const int64_t tiles = (padded_rows / kColumnsTileRows) * (cols / kColumnsTileCols);
  TORCH_CHECK(tiles < (int64_t(1) << 31), op, "more than 2^31 tiles of 128 x 128");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  p.q = e4m3_ptr(q);
  p.scales = scales.data_ptr<float>();
  p.num_rows = rows;
  p.cols = cols;
  p.padded_rows = padded_rows;
  p.failure_record = kGather ? failure_record(stream) : nullptr;
  quantize_columns_kernel<kGather, kSwiglu, kWeighted, Params><<<int(tiles), kColumnsThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scales};
}

// (q (C, R_pad) e4m3, scales (R_pad/128, C) fp32), R_pad = R rounded up to 128: x (R, C) bf16
// quantized 1x128 along R; rows at or past expert_offsets[-1] (when given) and past R as zeros.
// With row_index (R,) int64, x is (num_src_rows, C) and row r is x[row_index[r]] (zeros for -1);
// with row_weights (R,) fp32 too, x[row_index[r]] * row_weights[r], each value rounded to bf16.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_columns(const at::Tensor& x,
                                                        const std::optional<at::Tensor>& expert_offsets, bool pow2,
                                                        const std::optional<at::Tensor>& row_index,
                                                        const std::optional<at::Tensor>& row_weights) {
  constexpr const char* kOp = "fp8_quantize_columns: ";
  check_columns_gather(kOp, x, expert_offsets, row_index, row_weights);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = row_index.has_value() ? row_index->numel() : x.size(0);
  Fp8QuantizeColumnsParams p{};
  p.src = x.data_ptr();
  p.row_index = row_index.has_value() ? row_index->data_ptr<int64_t>() : nullptr;
  p.row_weights = row_weights.has_value() ? row_weights->data_ptr<float>() : nullptr;
  p.row_end = expert_offsets.has_value() ? expert_offsets->data_ptr<int32_t>() + (expert_offsets->numel() - 1) : nullptr;
  p.num_src_rows = x.size(0);
  p.pow2 = pow2 ? 1 : 0;
  if (row_weights.has_value()) return launch_quantize_columns<true, false, true>(p, x.options(), rows, x.size(1), kOp);
  if (row_index.has_value()) return launch_quantize_columns<true, false>(p, x.options(), rows, x.size(1), kOp);
  return launch_quantize_columns<false, false>(p, x.options(), rows, x.size(1), kOp);
}

// fp8_quantize_columns gathered from the group's rows where they lie, in the ranks' symmetric
// regions: own (T, C) bf16 is this rank's copy, peer_ptrs every rank's address of it in rank order;
// row_index[r] = g reads rank g / T's row g % T (-1: zeros; outside [-1, R * T): trapped with a
// failure record). Bitwise fp8_quantize_columns(cat of the regions, ...).
std::tuple<at::Tensor, at::Tensor> fp8_quantize_columns_from_peers(const at::Tensor& own, c10::IntArrayRef peer_ptrs,
                                                                   const std::optional<at::Tensor>& expert_offsets,
                                                                   bool pow2, const at::Tensor& row_index,
                                                                   const std::optional<at::Tensor>& row_weights) {
  constexpr const char* kOp = "fp8_quantize_columns_from_peers: ";
  check_columns_gather(kOp, own, expert_offsets, row_index, row_weights);
  const c10::cuda::CUDAGuard guard(own.device());
  PeerFp8QuantizeColumnsParams p{};  // (the inherited src stays null: the rows come from p.source)
  // 16-byte aligned bases: the tile loads read 16-byte pieces of each row (C, a multiple of 128).
  const int num_ranks = bindings::fill_peer_table(p.source.bases, peer_ptrs, "fp8_quantize_columns_from_peers",
                                                  "peer_ptrs", 0, 16);
  p.source.rows_per_base = own.size(0);
  p.source.num_bases = num_ranks;
  p.row_index = row_index.data_ptr<int64_t>();
  p.row_weights = row_weights.has_value() ? row_weights->data_ptr<float>() : nullptr;
  p.row_end = expert_offsets.has_value() ? expert_offsets->data_ptr<int32_t>() + (expert_offsets->numel() - 1) : nullptr;
  p.num_src_rows = int64_t(num_ranks) * own.size(0);
  p.pow2 = pow2 ? 1 : 0;
  const int64_t rows = row_index.numel();
  if (row_weights.has_value()) {
    return launch_quantize_columns<true, false, true>(p, own.options(), rows, own.size(1), kOp);
  }
  return launch_quantize_columns<true, false>(p, own.options(), rows, own.size(1), kOp);
}

// fp8_quantize_columns of act = SwiGLU(gate_up) (swiglu_forward_kernel's bf16 values): gate_up (R, 2F)
// bf16 -> (q (F, R_pad) e4m3, scales (R_pad/128, F) fp32); rows at or past expert_offsets[-1] as zeros.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_swiglu_columns(const at::Tensor& gate_up,
                                                               const at::Tensor& expert_offsets, bool pow2) {
  constexpr const char* kOp = "fp8_quantize_swiglu_columns: ";
  check_swiglu_inputs(kOp, gate_up, expert_offsets);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  Fp8QuantizeColumnsParams p{};
  p.src = gate_up.data_ptr();
  p.row_end = expert_offsets.data_ptr<int32_t>() + (expert_offsets.numel() - 1);
  p.num_src_rows = gate_up.size(0);
  p.pow2 = pow2 ? 1 : 0;
  return launch_quantize_columns<false, true>(p, gate_up.options(), gate_up.size(0), gate_up.size(1) / 2, kOp);
}

// The SwiGLU backward quantizations' inputs: check_swiglu_inputs', and grad_act (R, F) bf16 beside gate_up.
void check_swiglu_backward_inputs(const char* op, const at::Tensor& gate_up, const at::Tensor& grad_act,
                                  const at::Tensor& expert_offsets) {
  check_swiglu_inputs(op, gate_up, expert_offsets);
  const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
  TORCH_CHECK(grad_act.is_cuda() && grad_act.is_contiguous() && grad_act.device() == gate_up.device(), op,
              "grad_act must be a contiguous CUDA tensor on gate_up's device");
  TORCH_CHECK(grad_act.scalar_type() == at::kBFloat16, op, "grad_act must be bfloat16, got ",
              c10::toString(grad_act.scalar_type()));
  TORCH_CHECK(grad_act.dim() == 2 && grad_act.size(0) == rows && grad_act.size(1) == ffn, op,
              "grad_act must be (rows, F) = (", std::to_string(rows), ", ", std::to_string(ffn), ") for gate_up ",
              sizes_str(gate_up), ", got ", sizes_str(grad_act));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(grad_act.data_ptr()) % 16 == 0, op, "grad_act must start 16-byte aligned");
}

// (grad_gate_up (R, 2F) bf16, rows_q (R, 2F) e4m3, rows_scales (2F/128, fp8_scale_rows(R)) fp32 in the
// GEMM-A layout, padding columns 1): d gate_up, the SwiGLU backward of gate_up (R, 2F) bf16 with
// grad_act (R, F) bf16 (swiglu_backward's values), and its quantization 1x128 along 2F; rows at or
// past expert_offsets[-1] are not read: zero rows of d gate_up, quantized as zeros.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_quantize_swiglu_backward(const at::Tensor& gate_up,
                                                                            const at::Tensor& grad_act,
                                                                            const at::Tensor& expert_offsets,
                                                                            bool pow2) {
  constexpr const char* kOp = "fp8_quantize_swiglu_backward: ";
  check_swiglu_backward_inputs(kOp, gate_up, grad_act, expert_offsets);
  const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t gemm_a_rows = (rows + kFp8ScaleRowPad - 1) / kFp8ScaleRowPad * kFp8ScaleRowPad;
  auto grad_gate_up = at::empty({rows, 2 * ffn}, gate_up.options());
  auto rows_q = at::empty({rows, 2 * ffn}, gate_up.options().dtype(at::kFloat8_e4m3fn));
  auto rows_scales = at::empty({2 * ffn / kFp8Block, gemm_a_rows}, gate_up.options().dtype(at::kFloat));
  if (rows == 0) {
    rows_scales.fill_(1.f);
    return {grad_gate_up, rows_q, rows_scales};
  }
  Fp8QuantizeSwigluBackwardParams p{};
  p.gate_up = gate_up.data_ptr();
  p.grad_act = grad_act.data_ptr();
  p.expert_offsets = expert_offsets.data_ptr<int32_t>();
  p.num_experts = int32_t(expert_offsets.numel() - 1);
  p.grad_gate_up = grad_gate_up.data_ptr();
  p.rows_q = e4m3_ptr(rows_q);
  p.rows_scales = rows_scales.data_ptr<float>();
  p.num_rows = rows;
  p.ffn = ffn;
  p.gemm_a_rows = gemm_a_rows;
  p.pow2 = pow2 ? 1 : 0;
  quantize_swiglu_backward_kernel<<<swiglu_units_grid(quantize_swiglu_backward_kernel, rows, ffn), kQuantizeThreads,
                                    0, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_gate_up, rows_q, rows_scales};
}

// (rows_q (R, 2F) e4m3, rows_scales (2F/128, fp8_scale_rows(R)) fp32 in the GEMM-A layout, padding
// columns 1, columns_q (2F, R_pad) e4m3, columns_scales (R_pad/128, 2F) fp32, and with act_columns
// act_q (F, R_pad) e4m3, act_scales (R_pad/128, F) fp32, else (0, 0) each), R_pad = R rounded up to 128:
// both FP8 copies of d gate_up, the SwiGLU backward of gate_up (R, 2F) bf16 with grad_act (R, F) bf16,
// from one pass and with no bf16 d gate_up: fp8_quantize_swiglu_backward's row copy and
// fp8_quantize_columns' copy of its d gate_up, bit for bit; act's column copy is
// fp8_quantize_swiglu_columns' of gate_up. Rows at or past expert_offsets[-1] are not read and quantize
// as zeros in every copy.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_swiglu_backward_copies(
    const at::Tensor& gate_up, const at::Tensor& grad_act, const at::Tensor& expert_offsets, bool pow2,
    bool act_columns) {
  constexpr const char* kOp = "fp8_quantize_swiglu_backward_copies: ";
  check_swiglu_backward_inputs(kOp, gate_up, grad_act, expert_offsets);
  const int64_t rows = gate_up.size(0), ffn = gate_up.size(1) / 2;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t gemm_a_rows = (rows + kFp8ScaleRowPad - 1) / kFp8ScaleRowPad * kFp8ScaleRowPad;
  const int64_t padded_rows = (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
  const auto options = gate_up.options();
  auto rows_q = at::empty({rows, 2 * ffn}, options.dtype(at::kFloat8_e4m3fn));
  auto rows_scales = at::empty({2 * ffn / kFp8Block, gemm_a_rows}, options.dtype(at::kFloat));
  auto columns_q = at::empty({2 * ffn, padded_rows}, options.dtype(at::kFloat8_e4m3fn));
  auto columns_scales = at::empty({padded_rows / kFp8Block, 2 * ffn}, options.dtype(at::kFloat));
  auto act_q = at::empty({act_columns ? ffn : 0, act_columns ? padded_rows : 0}, options.dtype(at::kFloat8_e4m3fn));
  auto act_scales = at::empty({act_columns ? padded_rows / kFp8Block : 0, act_columns ? ffn : 0},
                              options.dtype(at::kFloat));
  if (rows == 0) {
    rows_scales.fill_(1.f);
    return {rows_q, rows_scales, columns_q, columns_scales, act_q, act_scales};
  }
  const int64_t tiles = (padded_rows / kFp8Block) * (ffn / kFp8Block);
  TORCH_CHECK(tiles < (int64_t(1) << 31), kOp, "more than 2^31 tiles of 128 x 128");
  Fp8QuantizeSwigluBackwardCopiesParams p{};
  p.gate_up = gate_up.data_ptr();
  p.grad_act = grad_act.data_ptr();
  p.expert_offsets = expert_offsets.data_ptr<int32_t>();
  p.num_experts = int32_t(expert_offsets.numel() - 1);
  p.rows_q = e4m3_ptr(rows_q);
  p.rows_scales = rows_scales.data_ptr<float>();
  p.columns_q = e4m3_ptr(columns_q);
  p.columns_scales = columns_scales.data_ptr<float>();
  p.act_columns_q = act_columns ? e4m3_ptr(act_q) : nullptr;
  p.act_columns_scales = act_columns ? act_scales.data_ptr<float>() : nullptr;
  p.num_rows = rows;
  p.ffn = ffn;
  p.gemm_a_rows = gemm_a_rows;
  p.padded_rows = padded_rows;
  p.pow2 = pow2 ? 1 : 0;
  const auto launch = [&](auto kernel, int smem) {
    // (every launch: the attribute is the function's, per device, and costs no stream work)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<int(tiles), kTilesThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (act_columns) {
    launch(quantize_swiglu_backward_tiles_kernel<true>, tiles_shared_bytes(true));
  } else {
    launch(quantize_swiglu_backward_tiles_kernel<false>, tiles_shared_bytes(false));
  }
  return {rows_q, rows_scales, columns_q, columns_scales, act_q, act_scales};
}

// (q (E, N, K) e4m3 and scales (E, N/128, K/128) fp32, or (0,) each without forward_copy; q_t
// (E, K, N) e4m3 and scales_t (E, K/128, N/128) fp32, or (0,) each without transposed): weight
// (E, N, K) bf16 or fp32 quantized 128 x 128, and its transposed copy (at least one of the two).
// With expert_offsets (E + 1,) int32, only the experts with rows there (offsets[e] < offsets[e + 1]):
// the other experts' parts of the copies are left unwritten (a GEMM over those segments reads none).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_weight(
    const at::Tensor& weight, bool transposed, bool pow2, bool forward_copy,
    const std::optional<at::Tensor>& expert_offsets) {
  constexpr const char* kOp = "fp8_quantize_weight: ";
  TORCH_CHECK(transposed || forward_copy, kOp, "forward_copy or transposed must be set (at least one copy)");
  TORCH_CHECK(weight.is_cuda() && weight.is_contiguous(), kOp, "weight must be a contiguous CUDA tensor");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat, kOp,
              "weight must be bfloat16 or float32, got ", c10::toString(weight.scalar_type()));
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) > 0 && weight.size(1) % kFp8Block == 0 && weight.size(2) > 0 &&
                  weight.size(2) % kFp8Block == 0,
              kOp, "weight must be (E, N, K) with N and K positive multiples of ", std::to_string(kFp8Block), ", got ",
              sizes_str(weight));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0, kOp, "weight must start 16-byte aligned");
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t experts = weight.size(0), n = weight.size(1), k = weight.size(2);
  const auto e4m3 = weight.options().dtype(at::kFloat8_e4m3fn);
  const auto fp32 = weight.options().dtype(at::kFloat);
  auto q = forward_copy ? at::empty({experts, n, k}, e4m3) : nothing(weight);
  auto scales = forward_copy ? at::empty({experts, n / kFp8Block, k / kFp8Block}, fp32) : nothing(weight);
  auto q_t = transposed ? at::empty({experts, k, n}, e4m3) : nothing(weight);
  auto scales_t = transposed ? at::empty({experts, k / kFp8Block, n / kFp8Block}, fp32) : nothing(weight);
  const int64_t tiles = experts * (n / kFp8Block) * (k / kFp8Block);
  if (tiles == 0) return {q, scales, q_t, scales_t};
  TORCH_CHECK(tiles < (int64_t(1) << 31), kOp, "more than 2^31 blocks of 128 x 128");
  Fp8QuantizeWeightParams p{};
  p.src = weight.data_ptr();
  p.q = forward_copy ? e4m3_ptr(q) : nullptr;
  p.scales = forward_copy ? scales.data_ptr<float>() : nullptr;
  p.q_t = transposed ? e4m3_ptr(q_t) : nullptr;
  p.scales_t = transposed ? scales_t.data_ptr<float>() : nullptr;
  p.num_experts = experts;
  p.n = n;
  p.k = k;
  p.pow2 = pow2 ? 1 : 0;
  p.expert_offsets = weight_copy_offsets(kOp, expert_offsets, experts, weight);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (weight.scalar_type() == at::kBFloat16) {
    quantize_weight_kernel<__nv_bfloat16><<<int(tiles), kWeightThreads, 0, stream>>>(p);
  } else {
    quantize_weight_kernel<float><<<int(tiles), kWeightThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scales, q_t, scales_t};
}

// (q_t (E, K, N) e4m3, scales_t (E, K/128, N/128) fp32): the transposed copy of a weight's 128 x 128
// quantization q (E, N, K) e4m3 with scales (E, N/128, K/128) fp32, from it; with expert_offsets, of
// the experts with rows there only, as fp8_quantize_weight's.
std::tuple<at::Tensor, at::Tensor> fp8_transpose_weight(const at::Tensor& q, const at::Tensor& scales,
                                                        const std::optional<at::Tensor>& expert_offsets) {
  constexpr const char* kOp = "fp8_transpose_weight: ";
  TORCH_CHECK(q.is_cuda() && q.is_contiguous() && q.scalar_type() == at::kFloat8_e4m3fn, kOp,
              "q must be a contiguous float8_e4m3fn CUDA tensor");
  TORCH_CHECK(q.dim() == 3 && q.size(1) > 0 && q.size(1) % kFp8Block == 0 && q.size(2) > 0 && q.size(2) % kFp8Block == 0,
              kOp, "q must be (E, N, K) with N and K positive multiples of ", std::to_string(kFp8Block), ", got ",
              sizes_str(q));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0, kOp, "q must start 16-byte aligned");
  const int64_t experts = q.size(0), n = q.size(1), k = q.size(2);
  TORCH_CHECK(scales.is_cuda() && scales.is_contiguous() && scales.device() == q.device() &&
                  scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == experts &&
                  scales.size(1) == n / kFp8Block && scales.size(2) == k / kFp8Block,
              kOp, "scales must be a contiguous float32 (E, N/128, K/128) tensor on q's device, got ", sizes_str(scales));
  const c10::cuda::CUDAGuard guard(q.device());
  auto q_t = at::empty({experts, k, n}, q.options());
  auto scales_t = at::empty({experts, k / kFp8Block, n / kFp8Block}, scales.options());
  const int64_t tiles = experts * (n / kFp8Block) * (k / kFp8Block);
  if (tiles == 0) return {q_t, scales_t};
  TORCH_CHECK(tiles < (int64_t(1) << 31), kOp, "more than 2^31 blocks of 128 x 128");
  Fp8TransposeWeightParams p{};
  p.q = e4m3_ptr(q);
  p.scales = scales.data_ptr<float>();
  p.q_t = e4m3_ptr(q_t);
  p.scales_t = scales_t.data_ptr<float>();
  p.num_experts = experts;
  p.n = n;
  p.k = k;
  p.expert_offsets = weight_copy_offsets(kOp, expert_offsets, experts, q);
  transpose_weight_kernel<<<int(tiles), kTransposeThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q_t, scales_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "fp8_quantize_rows(Tensor x, Tensor? row_index, bool source_scales, bool gemm_a_scales, bool pow2) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("fp8_quantize_columns(Tensor x, Tensor? expert_offsets, bool pow2, Tensor? row_index=None, Tensor? row_weights=None) -> (Tensor, Tensor)");
  m.def(
      "fp8_quantize_columns_from_peers(Tensor own, int[] peer_ptrs, Tensor? expert_offsets, bool pow2, "
      "Tensor row_index, Tensor? row_weights=None) -> (Tensor, Tensor)");
  m.def("fp8_quantize_swiglu_columns(Tensor gate_up, Tensor expert_offsets, bool pow2) -> (Tensor, Tensor)");
  m.def(
      "fp8_quantize_swiglu_backward(Tensor gate_up, Tensor grad_act, Tensor expert_offsets, bool pow2) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "fp8_quantize_swiglu_backward_copies(Tensor gate_up, Tensor grad_act, Tensor expert_offsets, bool pow2, "
      "bool act_columns=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fp8_quantize_weight(Tensor weight, bool transposed, bool pow2, bool forward_copy, Tensor? expert_offsets=None) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_transpose_weight(Tensor q, Tensor scales, Tensor? expert_offsets=None) -> (Tensor, Tensor)");
  m.def("fp8_quantize_swiglu(Tensor gate_up, Tensor expert_offsets, bool pow2) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("fp8_quantize_rows", &fp8_quantize_rows);
  m.impl("fp8_quantize_columns", &fp8_quantize_columns);
  m.impl("fp8_quantize_columns_from_peers", &fp8_quantize_columns_from_peers);
  m.impl("fp8_quantize_swiglu_columns", &fp8_quantize_swiglu_columns);
  m.impl("fp8_quantize_swiglu_backward", &fp8_quantize_swiglu_backward);
  m.impl("fp8_quantize_swiglu_backward_copies", &fp8_quantize_swiglu_backward_copies);
  m.impl("fp8_quantize_weight", &fp8_quantize_weight);
  m.impl("fp8_transpose_weight", &fp8_transpose_weight);
  m.impl("fp8_quantize_swiglu", &fp8_quantize_swiglu);
}

}  // namespace mok
