// Torch bindings of the FP8 blockwise grouped GEMM (gemm/fp8_gemm_sm90.cuh): ops fp8_expert_gemm
// (bf16 out; fp8_expert_gemm_into writes the caller's; fp8_expert_gemm_push writes its rows into the
// sources' combine regions of the in-kernel exchange), fp8_expert_gemm_swiglu (gate_up bf16, act
// E4M3 with its 1x128 scales) and fp8_expert_gemm_swiglu_backward_into (d gate_up bf16 and E4M3
// with its scales, from the down projection's dgrad) of the
// `megatron_mok` library (validated wrappers, fake implementations and references in
// megatron_mok/ops/fp8_gemm.py, which raise ValueError before these run; the checks here are the
// same, for callers of torch.ops directly). Each fills Fp8ExpertGemmParams (mok_params.h) once and
// launches.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "bindings/checks.h"
#include "bindings/op_utils.h"
#include "common/device_info.h"
#include "common/failure_record.h"
#include "common/limits.h"
#include "common/tensor_map.h"
#include "gemm/epilogue_fp8_swiglu_bwd_sm90.cuh"
#include "gemm/fp8_gemm_sm90.cuh"
#include "gemm/fp8_gemm_wide_sm90.cuh"
#include "mok_params.h"

namespace mok {
namespace {

using Tile = Fp8GemmTile;
constexpr size_t kSmemBytes = Fp8GemmSharedStorage::kSmemBytes;

// A row-major E4M3 matrix (rows, k) read in boxes of box_rows rows x one 128-byte K block
// (common/tensor_map.h); k is a multiple of 128, so every row is whole 16 bytes.
CUtensorMap e4m3_rows_map(const at::Tensor& t, int64_t rows, int64_t k, uint32_t box_rows, const char* name) {
  static_assert(Tile::kK == 128, "one box is one 128-byte K block");
  return e4m3_tensor_map_sw128(t.data_ptr(), rows, k, box_rows, name);
}

// How many clusters of the kernel fit on the device at once, found once per kernel, device and
// cluster size; on first sight the kernel's registers are checked against its setmaxnreg budgets
// (fewer registers than they move would hang the consumers' increase until the watchdog traps).
template <typename Kernel>
int fp8_resident_clusters(Kernel kernel, cudaLaunchConfig_t config, int cluster_m) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int>, int> found;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = found.find(key); it != found.end()) return it->second;
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int needed = kNumThreadsPerWarpGroup * Tile::kProducerRegisters + Tile::kConsumerThreads * Tile::kConsumerRegisters;
  TORCH_CHECK(attributes.numRegs * Tile::kThreads >= needed, "fp8_expert_gemm: the kernel was compiled with ",
              std::to_string(attributes.numRegs), " registers per thread, fewer than its setmaxnreg budgets need (",
              std::to_string(needed), " per CTA); rebuild without a register limit (-maxrregcount)");
  config.gridDim = dim3(cluster_m * 1024);
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  TORCH_CHECK(clusters > 0, "fp8_expert_gemm: no cluster of ", std::to_string(cluster_m), " CTAs with ",
              std::to_string(config.dynamicSmemBytes), " bytes of shared memory fits on this GPU");
  found.emplace(key, clusters);
  return clusters;
}

// Launches Kernel (Fp8ExpertGemmKernel or Fp8ExpertGemmWideKernel, kClusterM CTAs per cluster) with
// as many clusters as fit at once and its tiles need. maps: A, B, then the epilogue's
// (Fp8ExpertGemmMaps<Epilogue::Maps> in order).
template <class Kernel, int kClusterM, class... EpilogueMaps>
void launch_fp8_gemm_kernel(typename Kernel::Params params, const EpilogueMaps&... maps) {
  constexpr size_t kSmemBytes = Kernel::SharedStorage::kSmemBytes;
  static_assert(Kernel::Tile::kThreads == Tile::kThreads && Kernel::Tile::kM == Tile::kM,
                "fp8_resident_clusters counts Fp8GemmTile's threads and registers");
  const ExpertGemmProblem& g = params.problem;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  params.failure_record = failure_record(stream);
  auto kernel = gemm_kernel_sm90<Kernel, typename Kernel::Maps, typename Kernel::Params, EpilogueMaps...>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(Tile::kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // The most cluster tiles any routing makes (each expert adds at most one partial m-tile), at most
  // as many clusters as fit at once (persistent: a waiting cluster would run its share late).
  constexpr int64_t kClusterRows = int64_t(Tile::kM) * kClusterM;
  const int64_t max_tiles = ((int64_t(g.num_rows) + kClusterRows - 1) / kClusterRows + g.num_experts) *
                            ((g.n_out + Kernel::Tile::kN - 1) / Kernel::Tile::kN);
  const int clusters = int(std::max<int64_t>(1, std::min<int64_t>(max_tiles, fp8_resident_clusters(kernel, config, kClusterM))));
  config.gridDim = dim3(clusters * kClusterM);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, maps..., params));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Epilogue, int kClusterM, Fp8Mainloop kMainloop, class... EpilogueMaps>
void launch_fp8_expert_gemm(const Fp8ExpertGemmParams<typename Epilogue::Params>& params,
                            const EpilogueMaps&... maps) {
  launch_fp8_gemm_kernel<Fp8ExpertGemmKernel<kClusterM, Epilogue, kMainloop>, kClusterM>(params, maps...);
}

template <class Epilogue, Fp8Mainloop kMainloop = Fp8Mainloop::kDefault, class... Maps>
void launch_with_cluster(int64_t cluster_m, const Fp8ExpertGemmParams<typename Epilogue::Params>& params,
                         const Maps&... maps) {
  if (cluster_m == 1) {
    launch_fp8_expert_gemm<Epilogue, 1, kMainloop>(params, maps...);
  } else {
    launch_fp8_expert_gemm<Epilogue, 2, kMainloop>(params, maps...);
  }
}

// The wide kernel's variants (Fp8ExpertGemmWideKernel: 128 x 192 tiles): the next tile's block 0
// issued after or before a tile's epilogue, each with or without the consumers' blocks issued in
// turn; and in turn with the A scales through the stages.
bool is_wide_variant(int64_t variant) {
  return variant == int64_t(Fp8Mainloop::kWide) || variant == int64_t(Fp8Mainloop::kWideAcrossTiles) ||
         variant == int64_t(Fp8Mainloop::kWideOrdered) || variant == int64_t(Fp8Mainloop::kWideOrderedAcrossTiles) ||
         variant == int64_t(Fp8Mainloop::kWideOrderedStagedScales);
}

template <class Epilogue, bool kAcrossTiles, bool kIssueOrder, bool kStagedScales = false, class... Maps>
void launch_wide_with_cluster(int64_t cluster_m, const Fp8ExpertGemmParams<typename Epilogue::Params>& params,
                              const Maps&... maps) {
  if (cluster_m == 1) {
    launch_fp8_gemm_kernel<Fp8ExpertGemmWideKernel<1, Epilogue, kAcrossTiles, kIssueOrder, kStagedScales>, 1>(params,
                                                                                                            maps...);
  } else {
    launch_fp8_gemm_kernel<Fp8ExpertGemmWideKernel<2, Epilogue, kAcrossTiles, kIssueOrder, kStagedScales>, 2>(params,
                                                                                                            maps...);
  }
}

// The wide kernel (B in boxes of 96 rows of weight (b_rows, k) e4m3) with Epilogue's store or push,
// variant kWide, kWideAcrossTiles, kWideOrdered, kWideOrderedAcrossTiles or kWideOrderedStagedScales;
// maps: A, then the epilogue's.
template <class Epilogue, class... Maps>
void launch_wide(const char* op, int64_t variant, int64_t cluster_m,
                 const Fp8ExpertGemmParams<typename Epilogue::Params>& params, const at::Tensor& weight,
                 int64_t b_rows, int64_t k, const CUtensorMap& a_map, const Maps&... maps) {
  TORCH_CHECK(Fp8WideGemmSharedStorage::kSmemBytes <= size_t(max_shared_memory_per_block_optin()), op,
              "this GPU has less shared memory per block than the wide kernel's ",
              std::to_string(Fp8WideGemmSharedStorage::kSmemBytes), " bytes");
  const CUtensorMap b_map = e4m3_rows_map(weight, b_rows, k, Fp8WideGemmTile::kBPartRows, "weight");
  if (Fp8Mainloop(variant) == Fp8Mainloop::kWideAcrossTiles) {
    launch_wide_with_cluster<Epilogue, true, false>(cluster_m, params, a_map, b_map, maps...);
  } else if (Fp8Mainloop(variant) == Fp8Mainloop::kWideOrdered) {
    launch_wide_with_cluster<Epilogue, false, true>(cluster_m, params, a_map, b_map, maps...);
  } else if (Fp8Mainloop(variant) == Fp8Mainloop::kWideOrderedAcrossTiles) {
    launch_wide_with_cluster<Epilogue, true, true>(cluster_m, params, a_map, b_map, maps...);
  } else if (Fp8Mainloop(variant) == Fp8Mainloop::kWideOrderedStagedScales) {
    // The stages' scale rows are bulk copies from a 16-byte aligned row of each K block's scales.
    TORCH_CHECK(reinterpret_cast<uintptr_t>(params.scales.a) % 16 == 0, op,
                "a_scales must start on a 16-byte boundary for variant ",
                std::to_string(int(Fp8Mainloop::kWideOrderedStagedScales)), " (wide_ordered_staged_scales)");
    launch_wide_with_cluster<Epilogue, false, true, true>(cluster_m, params, a_map, b_map, maps...);
  } else {
    launch_wide_with_cluster<Epilogue, false, false>(cluster_m, params, a_map, b_map, maps...);
  }
}

// The ops whose epilogues are built in the kDefault and kOverlap mainloops only (and, with_wide, in
// the wide kernel's four variants) refuse every other variant here, before anything is launched.
void check_built_variant(const char* op, int64_t variant, bool with_wide = false) {
  const bool built = variant == int64_t(Fp8Mainloop::kDefault) || variant == int64_t(Fp8Mainloop::kOverlap) ||
                     (with_wide && is_wide_variant(variant));
  TORCH_CHECK(built, op, "variant must be ", std::to_string(int(Fp8Mainloop::kDefault)), " (default)",
              with_wide ? ", " : " or ", std::to_string(int(Fp8Mainloop::kOverlap)), " (overlap)",
              with_wide ? ", " + std::to_string(int(Fp8Mainloop::kWide)) + " (wide), " +
                              std::to_string(int(Fp8Mainloop::kWideAcrossTiles)) + " (wide_across_tiles), " +
                              std::to_string(int(Fp8Mainloop::kWideOrdered)) + " (wide_ordered), " +
                              std::to_string(int(Fp8Mainloop::kWideOrderedAcrossTiles)) +
                              " (wide_ordered_across_tiles) or " +
                              std::to_string(int(Fp8Mainloop::kWideOrderedStagedScales)) +
                              " (wide_ordered_staged_scales)"
                        : std::string(),
              ", got ", std::to_string(variant));
}

// variant: an Fp8Mainloop (gemm/fp8_gemm_sm90.cuh), checked by the caller. kWithPingpong false: the
// epilogue has no kPingpong, kOverlapLateScales or kOverlapEagerRetire instance (the caller refuses
// those variants).
template <class Epilogue, bool kWithPingpong = true, class... Maps>
void launch_with_variant(int64_t variant, int64_t cluster_m,
                         const Fp8ExpertGemmParams<typename Epilogue::Params>& params, const Maps&... maps) {
  switch (Fp8Mainloop(variant)) {
    case Fp8Mainloop::kPingpong:
      if constexpr (kWithPingpong) launch_with_cluster<Epilogue, Fp8Mainloop::kPingpong>(cluster_m, params, maps...);
      break;
    case Fp8Mainloop::kOverlap:
      launch_with_cluster<Epilogue, Fp8Mainloop::kOverlap>(cluster_m, params, maps...);
      break;
    case Fp8Mainloop::kOverlapLateScales:
      if constexpr (kWithPingpong) launch_with_cluster<Epilogue, Fp8Mainloop::kOverlapLateScales>(cluster_m, params, maps...);
      break;
    case Fp8Mainloop::kOverlapEagerRetire:
      if constexpr (kWithPingpong) launch_with_cluster<Epilogue, Fp8Mainloop::kOverlapEagerRetire>(cluster_m, params, maps...);
      break;
    default:
      launch_with_cluster<Epilogue>(cluster_m, params, maps...);
  }
}

// The checks both ops share (the FP8 operands, the offsets and the launch shape); returns (experts,
// weight rows per expert N, K, fp8_scale_rows(rows)).
std::tuple<int64_t, int64_t, int64_t, int64_t> check_fp8_operands(const char* kOp, const at::Tensor& a,
                                                                  const at::Tensor& a_scales, const at::Tensor& weight,
                                                                  const at::Tensor& weight_scales,
                                                                  const at::Tensor& expert_offsets, int64_t cluster_m,
                                                                  int64_t group_m) {
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&a, "a"}, {&a_scales, "a_scales"}, {&weight, "weight"}, {&weight_scales, "weight_scales"},
      {&expert_offsets, "expert_offsets"}};
  for (auto [t, name] : tensors) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->device() == a.device(), kOp, name,
                " must be a contiguous CUDA tensor on a's device");
  }
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn && weight.scalar_type() == at::kFloat8_e4m3fn, kOp,
              "a and weight must be float8_e4m3fn, got ", c10::toString(a.scalar_type()), " and ",
              c10::toString(weight.scalar_type()));
  TORCH_CHECK(a_scales.scalar_type() == at::kFloat && weight_scales.scalar_type() == at::kFloat, kOp,
              "a_scales and weight_scales must be float32");
  TORCH_CHECK(a.dim() == 2 && weight.dim() == 3 && weight.size(2) == a.size(1), kOp,
              "a must be (rows, K) and weight (experts, N, K) with the same K; got ", sizes_str(a), " and ",
              sizes_str(weight));
  const int64_t rows = a.size(0), k = a.size(1), experts = weight.size(0), n = weight.size(1);
  TORCH_CHECK(experts > 0, kOp, "weight must hold at least one expert");
  TORCH_CHECK(k > 0 && k % kFp8Block == 0 && n > 0 && n % kFp8Block == 0, kOp, "K and N must be positive multiples of ",
              std::to_string(kFp8Block), ", got ", std::to_string(k), " and ", std::to_string(n));
  const int64_t scale_rows = (rows + kFp8ScaleRowPad - 1) / kFp8ScaleRowPad * kFp8ScaleRowPad;
  TORCH_CHECK(a_scales.dim() == 2 && a_scales.size(0) == k / kFp8Block && a_scales.size(1) == scale_rows, kOp,
              "a_scales must be (K/128, fp8_scale_rows(rows)) = (", std::to_string(k / kFp8Block), ", ",
              std::to_string(scale_rows), "), got ", sizes_str(a_scales));
  TORCH_CHECK(weight_scales.dim() == 3 && weight_scales.size(0) == experts && weight_scales.size(1) == n / kFp8Block &&
                  weight_scales.size(2) == k / kFp8Block,
              kOp, "weight_scales must be (experts, N/128, K/128), got ", sizes_str(weight_scales));
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 &&
                  expert_offsets.numel() == experts + 1,
              kOp, "expert_offsets must be int32 (experts + 1,), got ", sizes_str(expert_offsets));
  TORCH_CHECK(cluster_m == 1 || cluster_m == 2, kOp, "cluster_m must be 1 or 2, got ", std::to_string(cluster_m));
  TORCH_CHECK(group_m >= cluster_m && group_m % cluster_m == 0 && group_m <= 1024, kOp,
              "group_m must be a multiple of cluster_m in [cluster_m, 1024], got ", std::to_string(group_m));
  TORCH_CHECK(scale_rows < (int64_t(1) << 31) && experts * n < (int64_t(1) << 31), kOp, "more than 2^31 rows");
  TORCH_CHECK(kSmemBytes <= size_t(max_shared_memory_per_block_optin()), kOp,
              "this GPU has less shared memory per block than the kernel's ", std::to_string(kSmemBytes), " bytes");
  return {experts, n, k, scale_rows};
}

template <class EpilogueParams>
Fp8ExpertGemmParams<EpilogueParams> fp8_params(const at::Tensor& a, const at::Tensor& a_scales,
                                               const at::Tensor& weight_scales, const at::Tensor& expert_offsets,
                                               int64_t experts, int64_t n_out, int64_t n_weight_rows, int64_t k,
                                               int64_t scale_rows, int64_t group_m) {
  Fp8ExpertGemmParams<EpilogueParams> p{};
  p.problem = ExpertGemmProblem{expert_offsets.data_ptr<int32_t>(), int32_t(experts),       int32_t(a.size(0)),
                                int32_t(n_out),                     int32_t(n_weight_rows), int32_t(k),
                                int32_t(group_m)};
  p.scales = Fp8BlockScales{a_scales.data_ptr<float>(), weight_scales.data_ptr<float>(), int32_t(scale_rows)};
  return p;
}

// Writes out (rows, N) bf16 = per expert segment e, a[r] (E4M3, K) times weight[e]^T (E4M3 (N, K))
// with blockwise scales (mok_params.h Fp8ExpertGemmParams); rows outside the segments not written.
// The segments are [expert_offsets[e], expert_offsets[e + 1]) of a's rows: a slice of a schedule's
// offsets with the matching experts' weights multiplies those experts' rows alone.
// variant: the consumers' mainloop (Fp8Mainloop), every one bitwise the same output.
void fp8_expert_gemm_launch(const char* op, const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& weight,
                            const at::Tensor& weight_scales, const at::Tensor& expert_offsets, int64_t cluster_m,
                            int64_t group_m, int64_t variant, const at::Tensor& out) {
  TORCH_CHECK(a.is_cuda(), op, "a must be a CUDA tensor");
  TORCH_CHECK(variant >= 0 && variant < kFp8MainloopCount, op, "variant must be in [0, ",
              std::to_string(kFp8MainloopCount), "), got ", std::to_string(variant));
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [experts, n, k, scale_rows] =
      check_fp8_operands(op, a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m);
  const int64_t rows = a.size(0);
  TORCH_CHECK(out.is_cuda() && out.device() == a.device() && out.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == rows && out.size(1) == n,
              op, "out must be a contiguous bfloat16 (rows, N) = (", std::to_string(rows), ", ", std::to_string(n),
              ") tensor on a's device, got ", sizes_str(out));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0, op, "out must start 16-byte aligned");
  TORCH_CHECK(!contiguous_overlap(out, a) && !contiguous_overlap(out, a_scales) && !contiguous_overlap(out, weight) &&
                  !contiguous_overlap(out, weight_scales) && !contiguous_overlap(out, expert_offsets),
              op, "out must not overlap an input in memory (the kernel reads them while it writes out)");
  if (rows == 0) return;
  auto p = fp8_params<StoreEpilogueParams>(a, a_scales, weight_scales, expert_offsets, experts, n, n, k, scale_rows,
                                           group_m);
  p.epilogue = StoreEpilogueParams{out.data_ptr()};
  const CUtensorMap a_map = e4m3_rows_map(a, rows, k, Tile::kM, "a");
  const CUtensorMap out_map = bf16_tensor_map_sw128(out.data_ptr(), rows, n, n, ExpertGemmTile::kStoreBox, "out");
  if (is_wide_variant(variant)) {
    launch_wide<Fp8StoreEpilogue>(op, variant, cluster_m, p, weight, experts * n, k, a_map, out_map);
    return;
  }
  const CUtensorMap b_map = e4m3_rows_map(weight, experts * n, k, Tile::kN / 2, "weight");
  launch_with_variant<Fp8StoreEpilogue>(variant, cluster_m, p, a_map, b_map, out_map);
}

// out (rows, N) bf16, fp8_expert_gemm_launch's product; rows outside the segments not written.
at::Tensor fp8_expert_gemm(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& weight,
                           const at::Tensor& weight_scales, const at::Tensor& expert_offsets, int64_t cluster_m,
                           int64_t group_m, int64_t variant) {
  TORCH_CHECK(a.dim() == 2 && weight.dim() == 3,
              "fp8_expert_gemm: a must be (rows, K) and weight (experts, N, K), got ", sizes_str(a), " and ",
              sizes_str(weight));
  auto out = at::empty({a.size(0), weight.size(1)}, a.options().dtype(at::kBFloat16));
  fp8_expert_gemm_launch("fp8_expert_gemm: ", a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m,
                         variant, out);
  return out;
}

// The same product written into the caller's out (the rows of the segments only), so that launches
// over disjoint expert ranges fill one output.
void fp8_expert_gemm_into(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& weight,
                          const at::Tensor& weight_scales, const at::Tensor& expert_offsets, int64_t cluster_m,
                          int64_t group_m, int64_t variant, const at::Tensor& out) {
  fp8_expert_gemm_launch("fp8_expert_gemm_into: ", a, a_scales, weight, weight_scales, expert_offsets, cluster_m,
                         group_m, variant, out);
}

// fp8_expert_gemm_launch's product, row r rounded once to bf16 and written to the combine region of
// its route's source rank, at the route's slot t * topk + k (push_rows' destination: exchange_ops.cu),
// nothing for a row of route -1; rows outside the segments not written. slot_to_route (rows,) int64;
// own_combine (num_tokens * topk, N) bf16, this rank's region, stands for every rank's (peer ptrs in
// rank order, each 16-byte aligned). variant: kDefault, kOverlap or a wide kernel's (is_wide_variant):
// the instances built for it.
void fp8_expert_gemm_push(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& weight,
                          const at::Tensor& weight_scales, const at::Tensor& expert_offsets, int64_t cluster_m,
                          int64_t group_m, int64_t variant, const at::Tensor& slot_to_route, int64_t topk,
                          int64_t num_tokens, const at::Tensor& own_combine, c10::IntArrayRef peer_combine_ptrs) {
  constexpr const char* kOp = "fp8_expert_gemm_push: ";
  TORCH_CHECK(a.is_cuda(), kOp, "a must be a CUDA tensor");
  check_built_variant(kOp, variant, /*with_wide=*/true);
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [experts, n, k, scale_rows] =
      check_fp8_operands(kOp, a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m);
  const int64_t rows = a.size(0);
  check_index(slot_to_route, "fp8_expert_gemm_push: slot_to_route");
  check_cuda(own_combine, "fp8_expert_gemm_push: own_combine");
  TORCH_CHECK(slot_to_route.dim() == 1 && slot_to_route.size(0) == rows && slot_to_route.device() == a.device(), kOp,
              "slot_to_route must hold one route per row of a (", std::to_string(rows), ") on a's device, got ",
              sizes_str(slot_to_route));
  TORCH_CHECK(topk > 0 && num_tokens >= 0, kOp, "topk must be positive and num_tokens non-negative");
  // (The epilogue's route arithmetic is 32-bit.)
  TORCH_CHECK(int64_t(peer_combine_ptrs.size()) * num_tokens * topk < (int64_t(1) << 31), kOp,
              "the group's routes (ranks * num_tokens * topk) must number fewer than 2^31");
  TORCH_CHECK(own_combine.scalar_type() == at::kBFloat16 && own_combine.dim() == 2 &&
                  own_combine.size(0) == num_tokens * topk && own_combine.size(1) == n &&
                  own_combine.device() == a.device(),
              kOp, "own_combine must be bfloat16 (num_tokens * topk, N) = (", std::to_string(num_tokens * topk), ", ",
              std::to_string(n), ") on a's device, got ", sizes_str(own_combine));
  Fp8PushEpilogueParams epilogue{};
  epilogue.num_ranks = bindings::fill_peer_table(epilogue.peer_tables, peer_combine_ptrs, "fp8_expert_gemm_push",
                                                 "peer_combine_ptrs", 0, 16);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(own_combine.data_ptr()) % 16 == 0, kOp, "own_combine must start 16-byte aligned");
  if (rows == 0) return;
  epilogue.slot_to_route = slot_to_route.data_ptr<int64_t>();
  epilogue.routes_per_rank = int32_t(num_tokens * topk);
  auto p = fp8_params<Fp8PushEpilogueParams>(a, a_scales, weight_scales, expert_offsets, experts, n, n, k, scale_rows,
                                             group_m);
  p.epilogue = epilogue;
  const CUtensorMap a_map = e4m3_rows_map(a, rows, k, Tile::kM, "a");
  if (is_wide_variant(variant)) {
    launch_wide<Fp8PushEpilogue>(kOp, variant, cluster_m, p, weight, experts * n, k, a_map);
    return;
  }
  const CUtensorMap b_map = e4m3_rows_map(weight, experts * n, k, Tile::kN / 2, "weight");
  launch_with_variant<Fp8PushEpilogue, false>(variant, cluster_m, p, a_map, b_map);
}

// The gate/up projection with SwiGLU, act quantized 1x128 along F: weight (E, 2F, K) gate rows then
// up rows, F a multiple of 128. Returns (gate_up (rows, 2F) bf16, act (rows, F) e4m3, act_scales
// (F/128, fp8_scale_rows(rows)) fp32, the GEMM-A layout; its padding columns hold 1 as
// quantization.gemm_a_scales makes them). Rows past the last segment are not written. variant: the
// consumers' mainloop (Fp8Mainloop), as fp8_expert_gemm's, kDefault or kOverlap: kPingpong with this
// epilogue spills (its turn barriers beside the act registers), so it is not built.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_expert_gemm_swiglu(const at::Tensor& a, const at::Tensor& a_scales,
                                                                      const at::Tensor& weight,
                                                                      const at::Tensor& weight_scales,
                                                                      const at::Tensor& expert_offsets,
                                                                      int64_t cluster_m, int64_t group_m,
                                                                      int64_t variant) {
  constexpr const char* kOp = "fp8_expert_gemm_swiglu: ";
  TORCH_CHECK(a.is_cuda(), kOp, "a must be a CUDA tensor");
  check_built_variant(kOp, variant);
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [experts, two_ffn, k, scale_rows] =
      check_fp8_operands(kOp, a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m);
  TORCH_CHECK(two_ffn % (2 * kFp8Block) == 0, kOp, "weight must hold gate and up rows of a multiple of ",
              std::to_string(kFp8Block), " each (F), got ", std::to_string(two_ffn), " rows");
  const int64_t rows = a.size(0), ffn = two_ffn / 2;
  auto gate_up = at::empty({rows, two_ffn}, a.options().dtype(at::kBFloat16));
  auto act = at::empty({rows, ffn}, a.options());
  auto act_scales = at::empty({ffn / kFp8Block, scale_rows}, a_scales.options());
  act_scales.narrow(1, rows, scale_rows - rows).fill_(1.f);
  if (rows == 0) return {gate_up, act, act_scales};
  auto p = fp8_params<Fp8SwigluEpilogueParams>(a, a_scales, weight_scales, expert_offsets, experts, ffn, two_ffn, k,
                                               scale_rows, group_m);
  p.epilogue = Fp8SwigluEpilogueParams{gate_up.data_ptr(), act.data_ptr(), act_scales.data_ptr<float>(),
                                       int32_t(scale_rows)};
  const CUtensorMap a_map = e4m3_rows_map(a, rows, k, Tile::kM, "a");
  const CUtensorMap b_map = e4m3_rows_map(weight, experts * two_ffn, k, Tile::kN / 2, "weight");
  launch_with_variant<Fp8SwigluEpilogue, false>(variant, cluster_m, p, a_map, b_map);
  return {gate_up, act, act_scales};
}

// The down projection's dgrad with the SwiGLU backward in its epilogue: per segment e, d act = a
// times weight[e]^T (fp8_expert_gemm_launch's product, weight the transposed fc2 copy (E, F, H)),
// rounded once to bf16 and not written; into the caller's grad_gate_up (rows, 2F) bf16, rows_q (rows,
// 2F) e4m3 and rows_scales (2F/128, fp8_scale_rows(rows)) fp32 (the GEMM-A layout) go d gate_up =
// the SwiGLU backward of gate_up (rows, 2F) bf16 with d act and its 1x128 quantization along 2F:
// bit for bit fp8_expert_gemm then fp8_quantize_swiglu_backward on the segments' rows. Rows outside
// the segments are not written (so launches over disjoint expert ranges fill one output). variant:
// kDefault or kOverlap (the instances built for it).
void fp8_expert_gemm_swiglu_backward_into(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& weight,
                                          const at::Tensor& weight_scales, const at::Tensor& expert_offsets,
                                          int64_t cluster_m, int64_t group_m, int64_t variant,
                                          const at::Tensor& gate_up, const at::Tensor& grad_gate_up,
                                          const at::Tensor& rows_q, const at::Tensor& rows_scales, bool pow2) {
  constexpr const char* kOp = "fp8_expert_gemm_swiglu_backward_into: ";
  TORCH_CHECK(a.is_cuda(), kOp, "a must be a CUDA tensor");
  check_built_variant(kOp, variant);
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [experts, ffn, k, scale_rows] =
      check_fp8_operands(kOp, a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m);
  const int64_t rows = a.size(0);
  const std::tuple<const at::Tensor*, const char*, at::ScalarType> tensors[] = {
      {&gate_up, "gate_up", at::kBFloat16}, {&grad_gate_up, "grad_gate_up", at::kBFloat16},
      {&rows_q, "rows_q", at::kFloat8_e4m3fn}};
  for (auto [t, name, dtype] : tensors) {
    TORCH_CHECK(t->is_cuda() && t->device() == a.device() && t->is_contiguous() && t->scalar_type() == dtype &&
                    t->dim() == 2 && t->size(0) == rows && t->size(1) == 2 * ffn,
                kOp, name, " must be a contiguous ", c10::toString(dtype), " (rows, 2F) = (", std::to_string(rows),
                ", ", std::to_string(2 * ffn), ") tensor on a's device, got ", sizes_str(*t));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, kOp, name, " must start 16-byte aligned");
  }
  TORCH_CHECK(rows_scales.is_cuda() && rows_scales.device() == a.device() && rows_scales.is_contiguous() &&
                  rows_scales.scalar_type() == at::kFloat && rows_scales.dim() == 2 &&
                  rows_scales.size(0) == 2 * ffn / kFp8Block && rows_scales.size(1) == scale_rows,
              kOp, "rows_scales must be a contiguous float32 (2F/128, fp8_scale_rows(rows)) = (",
              std::to_string(2 * ffn / kFp8Block), ", ", std::to_string(scale_rows), ") tensor on a's device, got ",
              sizes_str(rows_scales));
  const at::Tensor* outputs[] = {&grad_gate_up, &rows_q, &rows_scales};
  const at::Tensor* inputs[] = {&a, &a_scales, &weight, &weight_scales, &expert_offsets, &gate_up};
  for (const at::Tensor* out : outputs) {
    for (const at::Tensor* in : inputs) {
      TORCH_CHECK(!contiguous_overlap(*out, *in), kOp,
                  "grad_gate_up, rows_q and rows_scales must not overlap an input in memory");
    }
  }
  TORCH_CHECK(!contiguous_overlap(grad_gate_up, rows_q) && !contiguous_overlap(grad_gate_up, rows_scales) &&
                  !contiguous_overlap(rows_q, rows_scales),
              kOp, "grad_gate_up, rows_q and rows_scales must not overlap each other");
  if (rows == 0) return;
  auto p = fp8_params<Fp8SwigluBackwardEpilogueParams>(a, a_scales, weight_scales, expert_offsets, experts, ffn, ffn, k,
                                                       scale_rows, group_m);
  p.epilogue = Fp8SwigluBackwardEpilogueParams{gate_up.data_ptr(), grad_gate_up.data_ptr(),
                                               static_cast<uint8_t*>(rows_q.data_ptr()),
                                               rows_scales.data_ptr<float>(), int32_t(scale_rows), int32_t(pow2)};
  const CUtensorMap a_map = e4m3_rows_map(a, rows, k, Tile::kM, "a");
  const CUtensorMap b_map = e4m3_rows_map(weight, experts * ffn, k, Tile::kN / 2, "weight");
  const CUtensorMap gate_up_map =
      bf16_tensor_map_sw128(gate_up.data_ptr(), rows, 2 * ffn, 2 * ffn, Tile::kM, "gate_up");
  launch_with_variant<Fp8SwigluBackwardEpilogue, false>(variant, cluster_m, p, a_map, b_map, gate_up_map);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def(
      "fp8_expert_gemm(Tensor a, Tensor a_scales, Tensor weight, Tensor weight_scales, Tensor expert_offsets, "
      "int cluster_m, int group_m, int variant=0) -> Tensor");
  m.def(
      "fp8_expert_gemm_into(Tensor a, Tensor a_scales, Tensor weight, Tensor weight_scales, Tensor expert_offsets, "
      "int cluster_m, int group_m, int variant, Tensor(a!) out) -> ()");
  m.def(
      "fp8_expert_gemm_push(Tensor a, Tensor a_scales, Tensor weight, Tensor weight_scales, Tensor expert_offsets, "
      "int cluster_m, int group_m, int variant, Tensor slot_to_route, int topk, int num_tokens, "
      "Tensor(a!) own_combine, int[] peer_combine_ptrs) -> ()");
  m.def(
      "fp8_expert_gemm_swiglu(Tensor a, Tensor a_scales, Tensor weight, Tensor weight_scales, Tensor expert_offsets, "
      "int cluster_m, int group_m, int variant=0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fp8_expert_gemm_swiglu_backward_into(Tensor a, Tensor a_scales, Tensor weight, Tensor weight_scales, "
      "Tensor expert_offsets, int cluster_m, int group_m, int variant, Tensor gate_up, Tensor(a!) grad_gate_up, "
      "Tensor(b!) rows_q, Tensor(c!) rows_scales, bool pow2) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("fp8_expert_gemm", &fp8_expert_gemm);
  m.impl("fp8_expert_gemm_into", &fp8_expert_gemm_into);
  m.impl("fp8_expert_gemm_push", &fp8_expert_gemm_push);
  m.impl("fp8_expert_gemm_swiglu", &fp8_expert_gemm_swiglu);
  m.impl("fp8_expert_gemm_swiglu_backward_into", &fp8_expert_gemm_swiglu_backward_into);
}

}  // namespace mok
