// Torch binding of the FP8 blockwise weight gradient (gemm/fp8_wgrad_sm90.cuh): op fp8_expert_wgrad of
// the `megatron_mok` library, in place into an fp32 out (validated wrapper, fake implementation and
// reference in megatron_mok/ops/fp8_wgrad.py, which raises ValueError before this runs; the checks
// here are the same, for callers of torch.ops directly). Fills Fp8ExpertWgradParams (mok_params.h)
// once and launches one CTA per SM, or fewer when there are fewer tiles.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <optional>
#include <utility>
#include <vector>

#include "bindings/checks.h"
#include "common/device_info.h"
#include "common/failure_record.h"
#include "common/limits.h"
#include "common/tensor_map.h"
#include "gemm/fp8_wgrad_sm90.cuh"
#include "gemm/fp8_wgrad_wide_sm90.cuh"
#include "mok_params.h"

namespace mok {
namespace {

constexpr const char* kOp = "fp8_expert_wgrad: ";

// The op's variants (megatron_mok/ops/fp8_wgrad.py FP8_WGRAD_VARIANTS, in this order): the 128-wide
// kernel's mainloops (Fp8WgradMainloop), then the 128 x 192 kernel (Fp8ExpertWgradWideKernel), without
// and with its consumers' blocks issued in turn.
constexpr int64_t kWideVariant = kFp8WgradMainloopCount;
constexpr int64_t kWideOrderedVariant = kFp8WgradMainloopCount + 1;
constexpr int64_t kVariantCount = kFp8WgradMainloopCount + 2;

// On first sight of a kernel on a device, its registers against its setmaxnreg budgets (fewer
// registers than they move would hang the consumers' increase until the watchdog traps).
template <typename Tile, typename Kernel>
void check_register_budget(Kernel kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> checked;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mutex);
  if (checked.count(key) != 0) return;
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int needed =
      kNumThreadsPerWarpGroup * Tile::kProducerRegisters + Tile::kConsumerThreads * Tile::kConsumerRegisters;
  TORCH_CHECK(attributes.numRegs * Tile::kThreads >= needed, kOp, "the kernel was compiled with ",
              std::to_string(attributes.numRegs), " registers per thread, fewer than its setmaxnreg budgets need (",
              std::to_string(needed), " per CTA); rebuild without a register limit (-maxrregcount)");
  checked.emplace(key, true);
}

// Kernel: Fp8ExpertWgradKernel<mainloop> or Fp8ExpertWgradWideKernel (its tile's width sets the inputs
// map's box rows and the n-tiles, the last of which may reach past n).
template <class Kernel>
void launch_fp8_expert_wgrad(Fp8ExpertWgradParams params, const at::Tensor& grad, const at::Tensor& inputs) {
  using Tile = typename Kernel::Tile;
  constexpr size_t kSmemBytes = Kernel::SharedStorage::kSmemBytes;
  TORCH_CHECK(kSmemBytes <= size_t(max_shared_memory_per_block_optin()), kOp,
              "this GPU has less shared memory per block than the kernel's ", std::to_string(kSmemBytes), " bytes");
  const Fp8ExpertWgradProblem& g = params.problem;
  const CUtensorMap grad_map = e4m3_tensor_map_sw128(grad.data_ptr(), g.m, g.num_rows, Tile::kM, "grad");
  const CUtensorMap inputs_map = e4m3_tensor_map_sw128(inputs.data_ptr(), g.n, g.num_rows, Tile::kN, "inputs");
  // The kernel's maps are one per operand whatever the launch: without rounded_out it never reads
  // the third, so grad's stands in.
  const CUtensorMap rounded_out_map =
      params.rounded_out != nullptr
          ? bf16_tensor_map_sw128(params.rounded_out, int64_t(g.num_experts) * g.m, g.n, g.n,
                                  ExpertGemmTile::kStoreBox, "rounded_out")
          : grad_map;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  params.failure_record = failure_record(stream);
  auto kernel =
      gemm_kernel_sm90<Kernel, typename Kernel::Maps, typename Kernel::Params, CUtensorMap, CUtensorMap, CUtensorMap>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  check_register_budget<Tile>(kernel);
  // Persistent: at most one CTA per SM (the shared memory allows no second), at most one per tile.
  const int64_t tiles = int64_t(g.num_experts) * (g.m / Tile::kM) * ((g.n + Tile::kN - 1) / Tile::kN);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(tiles, multiprocessor_count())));
  kernel<<<grid, Tile::kThreads, kSmemBytes, stream>>>(grad_map, inputs_map, rounded_out_map, params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Expert e's weight gradient from the window's rows (mok_params.h Fp8ExpertWgradProblem) into out
// (E, m, n) fp32, in place (read first with accumulate), or, with rounded_out (E, m, n) bf16, rounded
// into it (out then read with accumulate only, and may be absent without it). The windowed form
// (carry_in and carry_out, (m, n) fp32 each, with rounded_out, without out and accumulate): each
// expert's chain continues from carry_in, ends in rounded_out or goes on in carry_out, by where its
// segment lies against the window (Fp8ExpertWgradProblem::windowed). variant: the mainloop
// (Fp8WgradMainloop) or the wide kernel (kWideVariant, kWideOrderedVariant), the same bits for every
// one. grad (m, R) and inputs (n, R) E4M3 column-wise, grad_scales (R/128, m) and inputs_scales (R/128, n) fp32, R the
// window's rows (a multiple of 128); m and n multiples of 128.
void fp8_expert_wgrad(const at::Tensor& grad, const at::Tensor& grad_scales, const at::Tensor& inputs,
                      const at::Tensor& inputs_scales, const at::Tensor& expert_offsets, int64_t window_begin,
                      bool accumulate, const std::optional<at::Tensor>& out_opt,
                      const std::optional<at::Tensor>& rounded_out, const std::optional<at::Tensor>& carry_in,
                      const std::optional<at::Tensor>& carry_out, int64_t variant) {
  TORCH_CHECK(grad.is_cuda(), kOp, "grad must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(grad.device());
  TORCH_CHECK(variant >= 0 && variant < kVariantCount, kOp, "variant must be in [0, ", std::to_string(kVariantCount),
              "), got ", std::to_string(variant));
  TORCH_CHECK(out_opt.has_value() || rounded_out.has_value(), kOp, "out or rounded_out must be given");
  TORCH_CHECK(out_opt.has_value() || !accumulate, kOp, "accumulate=True reads out: out must be given");
  const bool windowed = carry_in.has_value() || carry_out.has_value();
  TORCH_CHECK(!windowed || (carry_in.has_value() && carry_out.has_value() && rounded_out.has_value() &&
                            !out_opt.has_value() && !accumulate),
              kOp, "the windowed form takes carry_in, carry_out and rounded_out, without out and accumulate");
  std::vector<std::pair<const at::Tensor*, const char*>> tensors = {
      {&grad, "grad"}, {&grad_scales, "grad_scales"}, {&inputs, "inputs"}, {&inputs_scales, "inputs_scales"},
      {&expert_offsets, "expert_offsets"}};
  if (out_opt.has_value()) tensors.emplace_back(&*out_opt, "out");
  if (rounded_out.has_value()) tensors.emplace_back(&*rounded_out, "rounded_out");
  if (carry_in.has_value()) tensors.emplace_back(&*carry_in, "carry_in");
  if (carry_out.has_value()) tensors.emplace_back(&*carry_out, "carry_out");
  for (auto [t, name] : tensors) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->device() == grad.device(), kOp, name,
                " must be a contiguous CUDA tensor on grad's device");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, kOp, name, " must start 16-byte aligned");
  }
  TORCH_CHECK(grad.scalar_type() == at::kFloat8_e4m3fn && inputs.scalar_type() == at::kFloat8_e4m3fn, kOp,
              "grad and inputs must be float8_e4m3fn, got ", c10::toString(grad.scalar_type()), " and ",
              c10::toString(inputs.scalar_type()));
  TORCH_CHECK(grad_scales.scalar_type() == at::kFloat && inputs_scales.scalar_type() == at::kFloat &&
                  (!out_opt.has_value() || out_opt->scalar_type() == at::kFloat),
              kOp, "grad_scales, inputs_scales and out must be float32");
  TORCH_CHECK(!rounded_out.has_value() || rounded_out->scalar_type() == at::kBFloat16, kOp,
              "rounded_out must be bfloat16, got ", c10::toString(rounded_out->scalar_type()));
  TORCH_CHECK(grad.dim() == 2 && inputs.dim() == 2 && inputs.size(1) == grad.size(1), kOp,
              "grad must be (m, R) and inputs (n, R) with the same R; got ", sizes_str(grad), " and ",
              sizes_str(inputs));
  const int64_t m = grad.size(0), n = inputs.size(0), rows = grad.size(1);
  TORCH_CHECK(rows % kFp8Block == 0, kOp, "R (the window's rows) must be a multiple of ", std::to_string(kFp8Block),
              ", got ", std::to_string(rows));
  TORCH_CHECK(m > 0 && m % kFp8Block == 0 && n > 0 && n % kFp8Block == 0, kOp, "m and n must be positive multiples of ",
              std::to_string(kFp8Block), ", got ", std::to_string(m), " and ", std::to_string(n));
  TORCH_CHECK(grad_scales.dim() == 2 && grad_scales.size(0) == rows / kFp8Block && grad_scales.size(1) == m, kOp,
              "grad_scales must be (R/128, m) = (", std::to_string(rows / kFp8Block), ", ", std::to_string(m),
              "), got ", sizes_str(grad_scales));
  TORCH_CHECK(inputs_scales.dim() == 2 && inputs_scales.size(0) == rows / kFp8Block && inputs_scales.size(1) == n,
              kOp, "inputs_scales must be (R/128, n) = (", std::to_string(rows / kFp8Block), ", ", std::to_string(n),
              "), got ", sizes_str(inputs_scales));
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 && expert_offsets.numel() >= 2,
              kOp, "expert_offsets must be int32 (E + 1,) with E >= 1, got ", sizes_str(expert_offsets));
  const int64_t experts = expert_offsets.numel() - 1;
  const auto check_result_shape = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == experts && t.size(1) == m && t.size(2) == n, kOp, name,
                " must be (E, m, n) = (", std::to_string(experts), ", ", std::to_string(m), ", ", std::to_string(n),
                "), got ", sizes_str(t));
  };
  if (out_opt.has_value()) check_result_shape(*out_opt, "out");
  if (rounded_out.has_value()) check_result_shape(*rounded_out, "rounded_out");
  for (const auto& [t, name] : {std::make_pair(&carry_in, "carry_in"), std::make_pair(&carry_out, "carry_out")}) {
    if (!t->has_value()) continue;
    const at::Tensor& carry = **t;
    TORCH_CHECK(carry.scalar_type() == at::kFloat && carry.dim() == 2 && carry.size(0) == m && carry.size(1) == n, kOp,
                name, " must be float32 (m, n) = (", std::to_string(m), ", ", std::to_string(n), "), got ",
                c10::toString(carry.scalar_type()), " ", sizes_str(carry));
  }
  if (windowed) {
    // (all contiguous)
    TORCH_CHECK(!contiguous_overlap(*carry_in, *carry_out) && !contiguous_overlap(*carry_in, *rounded_out) &&
                    !contiguous_overlap(*carry_out, *rounded_out),
                kOp, "carry_in, carry_out and rounded_out must not overlap in memory (a window reads one carry while "
                "it writes the other and the result)");
  }
  TORCH_CHECK(window_begin >= 0 && window_begin % kFp8Block == 0, kOp,
              "window_begin must be a non-negative multiple of ", std::to_string(kFp8Block), ", got ",
              std::to_string(window_begin));
  TORCH_CHECK(window_begin + rows < (int64_t(1) << 31) && m < (int64_t(1) << 31) && n < (int64_t(1) << 31) &&
                  experts * m < (int64_t(1) << 31),
              kOp, "sizes past 2^31 (window_begin + R, m, n, E * m)");
  if (rows == 0 && windowed) {
    // No row: a window at row 0 rounds the empty experts (zeros; the mask is formed on the device, so
    // no host synchronization); an expert crossing a later empty window's position goes on unchanged
    // into carry_out.
    if (window_begin == 0) {
      const at::Tensor empty = expert_offsets.slice(0, 1).eq(expert_offsets.slice(0, 0, experts)).view({experts, 1, 1});
      rounded_out->masked_fill_(empty, 0);
    } else {
      carry_out->copy_(*carry_in);
    }
    return;
  }
  if (rows == 0) {  // no block: nothing to add
    if (rounded_out.has_value()) {
      if (accumulate) rounded_out->copy_(*out_opt); else rounded_out->zero_();
    } else if (!accumulate) {
      out_opt->zero_();
    }
    return;
  }
  Fp8ExpertWgradParams p{};
  p.problem = Fp8ExpertWgradProblem{expert_offsets.data_ptr<int32_t>(), int32_t(experts), int32_t(rows), int32_t(m),
                                    int32_t(n), int32_t(window_begin), int32_t(accumulate ? 1 : 0),
                                    int32_t(rounded_out.has_value() ? 1 : 0), int32_t(windowed ? 1 : 0)};
  p.grad_scales = grad_scales.data_ptr<float>();
  p.inputs_scales = inputs_scales.data_ptr<float>();
  if (windowed) {
    p.chain_in = carry_in->data_ptr<float>();
    p.chain_out = carry_out->data_ptr<float>();
    p.chain_expert_stride = 0;
  } else {
    p.chain_out = out_opt.has_value() ? out_opt->data_ptr<float>() : nullptr;
    p.chain_in = p.chain_out;
    p.chain_expert_stride = m * n;
  }
  p.rounded_out = rounded_out.has_value() ? static_cast<uint16_t*>(rounded_out->data_ptr()) : nullptr;
  if (variant == kWideVariant) {
    launch_fp8_expert_wgrad<Fp8ExpertWgradWideKernel<false>>(p, grad, inputs);
  } else if (variant == kWideOrderedVariant) {
    launch_fp8_expert_wgrad<Fp8ExpertWgradWideKernel<true>>(p, grad, inputs);
  } else if (variant == int64_t(Fp8WgradMainloop::kOverlapAcrossTiles)) {
    launch_fp8_expert_wgrad<Fp8ExpertWgradKernel<Fp8WgradMainloop::kOverlapAcrossTiles>>(p, grad, inputs);
  } else if (variant == int64_t(Fp8WgradMainloop::kOverlap)) {
    launch_fp8_expert_wgrad<Fp8ExpertWgradKernel<Fp8WgradMainloop::kOverlap>>(p, grad, inputs);
  } else {
    launch_fp8_expert_wgrad<Fp8ExpertWgradKernel<Fp8WgradMainloop::kDefault>>(p, grad, inputs);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "fp8_expert_wgrad(Tensor grad, Tensor grad_scales, Tensor inputs, Tensor inputs_scales, Tensor expert_offsets, "
      "int window_begin, bool accumulate, Tensor(a!)? out, Tensor(b!)? rounded_out, Tensor? carry_in, "
      "Tensor(c!)? carry_out, int variant) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) { m.impl("fp8_expert_wgrad", &fp8_expert_wgrad); }

}  // namespace mok
