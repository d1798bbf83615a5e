// Torch bindings of the sm90 expert GEMMs (gemm/expert_gemm_sm90.cuh, gemm/expert_wgrad_sm90.cuh,
// the dispatching one with moe/dispatch_ring_sm90_ws.cuh): ops expert_gemm, expert_gemm_swiglu,
// dispatch_expert_gemm_swiglu (from one tensor) and dispatch_expert_gemm_swiglu_from_peers (from the
// ranks' symmetric regions), expert_gemm_dgrad, expert_gemm_dgrad_swiglu, expert_gemm_wgrad and
// expert_gemm_wgrad_window of the `megatron_mok` library (fake implementations beside the wrappers in
// megatron_mok/ops/expert_gemm.py). Each op checks its arguments, fills its kernel's params
// (mok_params.h) once and launches.
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
#include "common/tensor_map.h"
#include "gemm/expert_gemm_sm90.cuh"
#include "gemm/expert_wgrad_sm90.cuh"
#include "mok_params.h"
#include "moe/dispatch_ring_sm90_ws.cuh"

namespace mok {
namespace {

using Tile = ExpertGemmTile;
constexpr size_t kSmemBytes = ExpertGemmSharedStorage::kSmemBytes;

// setmaxnreg moves registers inside the CTA's launch allocation, numRegs per thread as ptxas
// compiled the kernel: if it gave fewer than the budgets assume (ExpertGemmTile's static_assert
// takes 168), the consumers' increase would wait forever (until the watchdog traps). Checked once
// per kernel, before its first launch, as a named error instead.
template <typename Kernel>
void check_register_budget(Kernel kernel, const char* op) {
  static std::mutex mutex;
  static std::map<const void*, bool> checked;
  const std::lock_guard<std::mutex> lock(mutex);
  const void* key = reinterpret_cast<const void*>(kernel);
  if (checked.count(key)) return;
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int needed =
      kNumThreadsPerWarpGroup * Tile::kProducerRegisters + Tile::kConsumerThreads * Tile::kConsumerRegisters;
  TORCH_CHECK(attributes.numRegs * Tile::kThreads >= needed, op, ": the kernel was compiled with ",
              std::to_string(attributes.numRegs), " registers per thread, fewer than its setmaxnreg budgets need (",
              std::to_string(needed), " per CTA); rebuild without a register limit (-maxrregcount)");
  checked.emplace(key, true);
}

// How many clusters of `config`'s shape fit on the device at once, cached per kernel, device and
// shared-memory size (the query costs microseconds; the answer only changes with those).
template <typename Kernel>
int resident_clusters(Kernel kernel, cudaLaunchConfig_t config, int cluster_m) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, int> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, config.dynamicSmemBytes);
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  config.gridDim = dim3(cluster_m * 1024);
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  TORCH_CHECK(clusters > 0, "expert_gemm: no cluster of ", std::to_string(cluster_m), " CTAs with ",
              std::to_string(config.dynamicSmemBytes), " bytes of shared memory fits on this GPU");
  cache.emplace(key, clusters);
  return clusters;
}

// Checks shared by the ops (`op` names the op in messages, `a_name` its A operand); returns (num_experts, weight rows per
// expert). Runs under the op's CUDAGuard (the shared-memory limit is the device's of `a`).
// weight_mn_major: weight is (experts, K, N) (the dgrad GEMMs) instead of (experts, N, K).
std::pair<int64_t, int64_t> check_expert_gemm(const char* op, const char* a_name, const at::Tensor& a, const at::Tensor& weight,
                                              const at::Tensor& expert_offsets, int64_t cluster_m, int64_t group_m,
                                              bool weight_mn_major = false) {
  const int k_dim = weight_mn_major ? 1 : 2, n_dim = weight_mn_major ? 2 : 1;
  const std::string prefix = std::string(op) + ": ";
  TORCH_CHECK(cluster_m == 1 || cluster_m == 2, prefix, "cluster_m must be 1 or 2, got ", std::to_string(cluster_m));
  TORCH_CHECK(group_m >= cluster_m && group_m % cluster_m == 0 && group_m <= 1024, prefix,
              "group_m must be a multiple of cluster_m in [cluster_m, 1024], got ", std::to_string(group_m));
  for (auto [t, name] : {std::pair{&a, a_name}, std::pair{&weight, "weight"}, std::pair{&expert_offsets, "expert_offsets"}}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), prefix, name, " must be a contiguous CUDA tensor");
    TORCH_CHECK(t->device() == a.device(), prefix, name, " is on ", t->device().str(), ", ", a_name, " on ", a.device().str());
  }
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, prefix, a_name,
              " and weight must be bfloat16, got ", c10::toString(a.scalar_type()), " and ",
              c10::toString(weight.scalar_type()));
  TORCH_CHECK(a.dim() == 2 && weight.dim() == 3 && weight.size(k_dim) == a.size(1), prefix, a_name,
              " must be (rows, K) and weight ", weight_mn_major ? "(experts, K, N)" : "(experts, N, K)",
              " with the same K; got ", sizes_str(a), " and ", sizes_str(weight));
  TORCH_CHECK(weight.size(0) > 0, prefix, "weight must hold at least one expert, got ", sizes_str(weight));
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 &&
                  expert_offsets.numel() == weight.size(0) + 1,
              prefix, "expert_offsets must be int32 (experts + 1,), got ", sizes_str(expert_offsets), " ",
              c10::toString(expert_offsets.scalar_type()));
  TORCH_CHECK(a.size(1) > 0 && a.size(1) % 8 == 0, prefix, "K must be a positive multiple of 8, got ",
              std::to_string(a.size(1)));
  TORCH_CHECK(weight.size(n_dim) % 8 == 0 && weight.size(n_dim) > 0, prefix, "N must be a positive multiple of 8, got ",
              std::to_string(weight.size(n_dim)));
  TORCH_CHECK(a.size(0) < (int64_t(1) << 31) && weight.size(0) * weight.size(1) < (int64_t(1) << 31), prefix,
              "more than 2^31 rows");
  TORCH_CHECK(kSmemBytes <= size_t(max_shared_memory_per_block_optin()), prefix,
              "this GPU has less shared memory per block than the kernel's ", std::to_string(kSmemBytes), " bytes");
  return {weight.size(0), weight.size(n_dim)};
}

ExpertGemmProblem make_problem(const at::Tensor& expert_offsets, int64_t num_experts, int64_t rows, int64_t n_out,
                               int64_t n_weight_rows, int64_t k, int64_t group_m) {
  return ExpertGemmProblem{expert_offsets.data_ptr<int32_t>(), int32_t(num_experts), int32_t(rows),   int32_t(n_out),
                           int32_t(n_weight_rows),             int32_t(k),           int32_t(group_m)};
}

// A of the GEMM in boxes of kM rows. (a.size(0): the dispatching kernel's A is its ring, which may
// be shorter than the rows.)
CUtensorMap rows_map(const at::Tensor& a, const ExpertGemmProblem& g) {
  return bf16_tensor_map_sw128(a.data_ptr(), a.size(0), g.k, g.k, Tile::kM, "a");
}

// B as (experts, N, K): boxes of half a tile's 256 rows (each CTA of a 2-CTA cluster loads one).
CUtensorMap weight_map(const at::Tensor& weight, const ExpertGemmProblem& g) {
  return bf16_tensor_map_sw128(weight.data_ptr(), int64_t(g.num_experts) * g.n_weight_rows, g.k, g.k, Tile::kN / 2,
                               "weight");
}

// B as stored by the dgrad GEMMs, (experts, K, N): boxes of 64 N x 64 K x 1 expert.
CUtensorMap weight_map_mn_major(const at::Tensor& weight, const ExpertGemmProblem& g) {
  return bf16_tensor_map_3d_sw128(weight.data_ptr(), g.num_experts, g.k, g.n_out, Tile::kK, "weight");
}

// The store epilogue's view of `out`: (rows, n_out), row-major (its map: store_map).
CUtensorMap store_map(const at::Tensor& out, int64_t rows, int64_t n_out) {
  return bf16_tensor_map_sw128(out.data_ptr(), rows, n_out, n_out, Tile::kStoreBox, "out");
}
StoreEpilogueParams store_epilogue(const at::Tensor& out) { return StoreEpilogueParams{out.data_ptr()}; }

// act (rows, n_out) and gate_up (rows, 2 n_out): the two halves of each gate_up row as matrices of
// their own (gate_half_map, up: half 1), so a box never spills over from the gate half into the up half.
CUtensorMap gate_up_half_map(const at::Tensor& gate_up, int64_t rows, int64_t n_out, int half) {
  const auto* base = static_cast<const __nv_bfloat16*>(gate_up.data_ptr());
  return bf16_tensor_map_sw128(base + half * n_out, rows, n_out, 2 * n_out, Tile::kStoreBox, "gate_up");
}
SwigluEpilogueParams swiglu_epilogue(const at::Tensor& act, const at::Tensor& gate_up) {
  return SwigluEpilogueParams{act.data_ptr(), gate_up.data_ptr()};
}

// maps: the kernel's tensor maps in the order of ExpertGemmKernelMaps<Epilogue> (A, B, the epilogue's).
template <class Epilogue, int kClusterM, class ASource = RowsInMemoryA, bool kTransB = false, class... Maps>
void launch_expert_gemm(ExpertGemmKernelParams<Epilogue, ASource> params, const Maps&... maps) {
  using Kernel = ExpertGemmKernel<Epilogue, kClusterM, ASource, kTransB>;
  const ExpertGemmProblem& g = params.problem;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  params.failure_record = failure_record(stream);
  auto kernel = gemm_kernel_sm90<Kernel, ExpertGemmKernelMaps<Epilogue>, decltype(params), Maps...>;
  check_register_budget(kernel, "expert_gemm");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 0));
  // Enough clusters for the most cluster tiles any routing can make, at most as many as fit on the
  // GPU at once (persistent: a cluster that had to wait for a free pair of SMs would run its whole
  // static share of tiles after the others).
  constexpr int kTileCols = Epilogue::kTileCols;
  constexpr int kClusterRows = Tile::kM * kClusterM;
  const int64_t max_tiles = ((int64_t(g.num_rows) + kClusterRows - 1) / kClusterRows + g.num_experts) *
                            ((int64_t(g.n_out) + kTileCols - 1) / kTileCols);
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(Tile::kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const int clusters = int(std::max<int64_t>(1, std::min<int64_t>(max_tiles, resident_clusters(kernel, config, kClusterM))));
  config.gridDim = dim3(clusters * kClusterM);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, maps..., params));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Epilogue, class ASource = RowsInMemoryA, class... Maps>
void launch_with_cluster(int64_t cluster_m, const ExpertGemmKernelParams<Epilogue, ASource>& params,
                         const Maps&... maps) {
  if (cluster_m == 1) {
    launch_expert_gemm<Epilogue, 1, ASource>(params, maps...);
  } else {
    launch_expert_gemm<Epilogue, 2, ASource>(params, maps...);
  }
}

at::Tensor expert_gemm(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& expert_offsets,
                       int64_t cluster_m, int64_t group_m) {
  TORCH_CHECK(a.is_cuda(), "expert_gemm: a must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [num_experts, n] = check_expert_gemm("expert_gemm", "a", a, weight, expert_offsets, cluster_m, group_m);
  auto out = at::empty({a.size(0), n}, a.options());
  if (a.size(0) == 0) return out;
  ExpertGemmKernelParams<StoreEpilogue> p{};
  p.problem = make_problem(expert_offsets, num_experts, a.size(0), n, n, a.size(1), group_m);
  p.epilogue = store_epilogue(out);
  const CUtensorMap b_map = weight_map(weight, p.problem);  // (maps in this order: the checks' order)
  const CUtensorMap a_map = rows_map(a, p.problem);
  launch_with_cluster<StoreEpilogue>(cluster_m, p, a_map, b_map, store_map(out, a.size(0), n));
  return out;
}

int64_t check_swiglu_weight(const char* op, int64_t two_ffn) {
  TORCH_CHECK(two_ffn % 16 == 0, op, ": weight must hold gate and up rows of a multiple of 8 each, got ",
              std::to_string(two_ffn), " rows");
  return two_ffn / 2;
}

std::tuple<at::Tensor, at::Tensor> expert_gemm_swiglu(const at::Tensor& a, const at::Tensor& weight,
                                                      const at::Tensor& expert_offsets, int64_t cluster_m,
                                                      int64_t group_m) {
  constexpr const char* kOp = "expert_gemm_swiglu";
  TORCH_CHECK(a.is_cuda(), kOp, ": a must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [num_experts, two_ffn] = check_expert_gemm(kOp, "a", a, weight, expert_offsets, cluster_m, group_m);
  const int64_t ffn = check_swiglu_weight(kOp, two_ffn);
  auto gate_up = at::empty({a.size(0), two_ffn}, a.options());
  auto act = at::empty({a.size(0), ffn}, a.options());
  if (a.size(0) == 0) return {gate_up, act};
  ExpertGemmKernelParams<SwigluEpilogue> p{};
  p.problem = make_problem(expert_offsets, num_experts, a.size(0), ffn, two_ffn, a.size(1), group_m);
  p.epilogue = swiglu_epilogue(act, gate_up);
  const CUtensorMap b_map = weight_map(weight, p.problem);
  const CUtensorMap a_map = rows_map(a, p.problem);
  const CUtensorMap act_map = store_map(act, a.size(0), ffn);
  const CUtensorMap gate_map = gate_up_half_map(gate_up, a.size(0), ffn, 0);
  launch_with_cluster<SwigluEpilogue>(cluster_m, p, a_map, b_map, act_map, gate_map,
                                      gate_up_half_map(gate_up, a.size(0), ffn, 1));
  return {gate_up, act};
}

// Ring minibatches of the dispatching GEMM for `rows` rows: all of them when ring_minibatches is 0 or
// at least that many (nothing is reused), else ring_minibatches.
int64_t ring_minibatches_for(int64_t rows, int64_t ring_minibatches) {
  const int64_t minibatches = (rows + kDispatchMinibatchRows - 1) / kDispatchMinibatchRows;
  return ring_minibatches == 0 ? minibatches : std::min(ring_minibatches, minibatches);
}

// The dispatching GEMM's rows buffer: every row when its ring covers them all, else the ring and
// the mirror of its first m-tile.
int64_t dispatch_ring_buffer_rows(int64_t rows, int64_t ring_minibatches) {
  const int64_t ring = ring_minibatches_for(rows, ring_minibatches);
  const int64_t minibatches = (rows + kDispatchMinibatchRows - 1) / kDispatchMinibatchRows;
  return ring == minibatches ? rows : ring * kDispatchMinibatchRows + kExpertGemmTileM;
}

// The checks of both dispatching ops past check_expert_gemm (`x` names their row operand): the
// schedule, topk and the ring.
void check_dispatch(const char* op, const char* x_name, const at::Tensor& x, const at::Tensor& slot_to_route, int64_t topk,
                    int64_t group_m, int64_t ring_minibatches) {
  TORCH_CHECK(slot_to_route.is_cuda() && slot_to_route.is_contiguous() && slot_to_route.device() == x.device() &&
                  slot_to_route.scalar_type() == at::kLong && slot_to_route.dim() == 1,
              op, ": slot_to_route must be a contiguous int64 (rows,) tensor on ", x_name, "'s device, got ",
              sizes_str(slot_to_route), " ", c10::toString(slot_to_route.scalar_type()));
  // (Minibatch bounds are computed in 32 bits on the device.)
  TORCH_CHECK(slot_to_route.numel() < (int64_t(1) << 31) - kDispatchMinibatchRows, op, ": more than 2^31 rows");
  TORCH_CHECK(topk > 0 && topk < (int64_t(1) << 31), op, ": topk must be positive, got ", std::to_string(topk));
  // A dispatcher waits for the slot of minibatch m - ring only once every minibatch below m is
  // written; that cannot wait on itself when every tile a CTA runs before the last of minibatch
  // m - ring lies below m, i.e. when the ring outlasts the minibatches one raster group spans
  // (group_m m-tiles of 128 rows) by one (moe/dispatch_ring_sm90_ws.cuh, dispatch_rows_ahead).
  const int64_t group_minibatches = (group_m * kExpertGemmTileM + kDispatchMinibatchRows - 1) / kDispatchMinibatchRows;
  TORCH_CHECK(ring_minibatches == 0 ||
                  (ring_minibatches > group_minibatches && ring_minibatches <= kMaxDispatchRingMinibatches),
              op,
              ": ring_minibatches must be 0 (no bound) or more than the ", std::to_string(group_minibatches),
              " minibatches of ", std::to_string(kDispatchMinibatchRows), " rows that a raster group of group_m = ",
              std::to_string(group_m), " m-tiles spans, got ", std::to_string(ring_minibatches));
}

// The dispatching GEMM once checked: `source` names where the rows come from (x, or the peers'
// table), x_rows rows of the group in all; `like` gives the dtype, K and device. Fills in the rest
// of the ring's params and launches; returns (rows or the ring, gate_up, act).
template <class ASource>
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_dispatching_gemm(
    typename ASource::Params source, const at::Tensor& like, int64_t x_rows, const at::Tensor& slot_to_route,
    int64_t topk, const at::Tensor& weight, const at::Tensor& expert_offsets, int64_t num_experts, int64_t two_ffn,
    int64_t cluster_m, int64_t group_m, int64_t ring_minibatches) {
  const int64_t ffn = two_ffn / 2;
  const int64_t num_rows = slot_to_route.numel();
  const int64_t minibatches = (num_rows + kDispatchMinibatchRows - 1) / kDispatchMinibatchRows;
  const int64_t ring = ring_minibatches_for(num_rows, ring_minibatches);
  auto rows = at::empty({dispatch_ring_buffer_rows(num_rows, ring_minibatches), like.size(1)}, like.options());
  auto gate_up = at::empty({num_rows, two_ffn}, like.options());
  auto act = at::empty({num_rows, ffn}, like.options());
  if (num_rows == 0) return {rows, gate_up, act};
  auto counters = at::zeros({3 * minibatches}, like.options().dtype(at::kInt));
  ExpertGemmKernelParams<SwigluEpilogue, ASource> p{};
  p.problem = make_problem(expert_offsets, num_experts, num_rows, ffn, two_ffn, like.size(1), group_m);
  p.epilogue = swiglu_epilogue(act, gate_up);
  p.a_source = source;
  // Routes whose token is past the group's rows read zeros: a schedule never names one.
  DispatchRingParams& d = p.a_source;
  d.slot_to_route = slot_to_route.data_ptr<int64_t>();
  d.rows = rows.data_ptr();
  d.counters = counters.data_ptr<int32_t>();
  d.x_rows = x_rows;
  d.topk = int32_t(topk);
  d.minibatch_rows = kDispatchMinibatchRows;
  d.num_minibatches = int32_t(minibatches);
  d.ring_minibatches = int32_t(ring);
  d.ring_rows = int32_t(ring * kDispatchMinibatchRows);
  d.ring_mirrored = int32_t(ring < minibatches);
  const CUtensorMap b_map = weight_map(weight, p.problem);
  const CUtensorMap a_map = rows_map(rows, p.problem);
  const CUtensorMap act_map = store_map(act, num_rows, ffn);
  const CUtensorMap gate_map = gate_up_half_map(gate_up, num_rows, ffn, 0);
  launch_with_cluster<SwigluEpilogue, ASource>(cluster_m, p, a_map, b_map, act_map, gate_map,
                                               gate_up_half_map(gate_up, num_rows, ffn, 1));
  return {rows, gate_up, act};
}

// The pull dispatch and the gate/up projection in one kernel: (rows, gate_up, act) with rows[r] =
// x[slot_to_route[r] / topk] (zeros where slot_to_route[r] is -1) and gate_up, act those of
// expert_gemm_swiglu(rows, ...). The GEMM starts on each minibatch of rows once it is dispatched.
// ring_minibatches > 0 bounds the rows buffer to that many minibatches of kDispatchMinibatchRows
// rows (a ring reused once every tile has loaded a slot's rows); the first result is then the ring
// (dispatch_ring_buffer_rows rows), not the rows. 0: no bound, the first result is rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_expert_gemm_swiglu(
    const at::Tensor& x, const at::Tensor& slot_to_route, int64_t topk, const at::Tensor& weight,
    const at::Tensor& expert_offsets, int64_t cluster_m, int64_t group_m, int64_t ring_minibatches) {
  constexpr const char* kOp = "dispatch_expert_gemm_swiglu";
  TORCH_CHECK(x.is_cuda(), kOp, ": x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [num_experts, two_ffn] = check_expert_gemm(kOp, "x", x, weight, expert_offsets, cluster_m, group_m);
  check_swiglu_weight(kOp, two_ffn);
  check_dispatch(kOp, "x", x, slot_to_route, topk, group_m, ring_minibatches);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, kOp, ": x must be 16-byte aligned");
  DispatchRingParams source{};
  source.x = x.data_ptr();
  return launch_dispatching_gemm<DispatchRingA>(source, x, x.size(0), slot_to_route, topk, weight, expert_offsets,
                                                num_experts, two_ffn, cluster_m, group_m, ring_minibatches);
}

// The same kernel with the rows pulled straight from the ranks' `tokens` regions (comm/symmetric.py):
// own_tokens is this rank's (T, K) bf16 copy (its shape, dtype and device stand for every rank's; it
// is not read), peer_token_ptrs every rank's address of it in rank order. Row r reads row g =
// slot_to_route[r] / topk of the group's rows: rank g / T's token g % T. Results bitwise those of
// dispatch_expert_gemm_swiglu on the concatenated regions (the same bf16 rows reach the same tiles).
// Every address must be 16-byte aligned (the ring copies 16-byte units; ops/expert_gemm.py falls
// back to the two-kernel pull otherwise); K % 8 == 0 makes every row so too.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_expert_gemm_swiglu_from_peers(
    const at::Tensor& own_tokens, c10::IntArrayRef peer_token_ptrs, const at::Tensor& slot_to_route, int64_t topk,
    const at::Tensor& weight, const at::Tensor& expert_offsets, int64_t cluster_m, int64_t group_m,
    int64_t ring_minibatches) {
  constexpr const char* kOp = "dispatch_expert_gemm_swiglu_from_peers";
  TORCH_CHECK(own_tokens.is_cuda(), kOp, ": own_tokens must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(own_tokens.device());
  const auto [num_experts, two_ffn] =
      check_expert_gemm(kOp, "own_tokens", own_tokens, weight, expert_offsets, cluster_m, group_m);
  check_swiglu_weight(kOp, two_ffn);
  check_dispatch(kOp, "own_tokens", own_tokens, slot_to_route, topk, group_m, ring_minibatches);
  PeerDispatchRingParams source{};  // (the inherited x stays null: the rows come from source.source)
  const int num_ranks = bindings::fill_peer_table(source.source.bases, peer_token_ptrs, kOp, "peer_token_ptrs", 0, 16);
  source.source.rows_per_base = own_tokens.size(0);
  source.source.num_bases = num_ranks;
  const int64_t x_rows = int64_t(num_ranks) * own_tokens.size(0);
  // (The dispatch warps locate a row's rank in 32 bits, moe/dispatch_ring_sm90_ws.cuh.)
  TORCH_CHECK(x_rows < (int64_t(1) << 31), kOp, ": the group's rows (ranks * T = ", std::to_string(x_rows),
              ") must be below 2^31");
  return launch_dispatching_gemm<PeerDispatchRingA>(source, own_tokens, x_rows, slot_to_route, topk, weight,
                                                    expert_offsets, num_experts, two_ffn, cluster_m, group_m,
                                                    ring_minibatches);
}

// The dgrad GEMMs: out = a @ weight[e] for the rows of segment e, weight (experts, K, N) as stored
// (fc2 for d act, fc1 for d rows), no transposed copy.
at::Tensor expert_gemm_dgrad(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& expert_offsets,
                             int64_t group_m) {
  constexpr const char* kOp = "expert_gemm_dgrad";
  TORCH_CHECK(a.is_cuda(), kOp, ": a must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(a.device());
  const auto [num_experts, n] = check_expert_gemm(kOp, "a", a, weight, expert_offsets, 1, group_m, true);
  auto out = at::empty({a.size(0), n}, a.options());
  if (a.size(0) == 0) return out;
  ExpertGemmKernelParams<StoreEpilogue> p{};
  p.problem = make_problem(expert_offsets, num_experts, a.size(0), n, weight.size(1), a.size(1), group_m);
  p.epilogue = store_epilogue(out);
  const CUtensorMap b_map = weight_map_mn_major(weight, p.problem);
  const CUtensorMap a_map = rows_map(a, p.problem);
  launch_expert_gemm<StoreEpilogue, 1, RowsInMemoryA, true>(p, a_map, b_map, store_map(out, a.size(0), n));
  return out;
}

// The dgrad of the down projection with the SwiGLU backward in its epilogue: grad_gate_up =
// swiglu_backward(gate_up, grad_out @ fc2[e]) for the rows of segment e; grad_act itself is never
// written. fc2 (experts, H, F) as stored.
at::Tensor expert_gemm_dgrad_swiglu(const at::Tensor& grad_out, const at::Tensor& fc2, const at::Tensor& expert_offsets,
                                    const at::Tensor& gate_up, int64_t group_m) {
  constexpr const char* kOp = "expert_gemm_dgrad_swiglu";
  TORCH_CHECK(grad_out.is_cuda(), kOp, ": grad_out must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const auto [num_experts, ffn] = check_expert_gemm(kOp, "grad_out", grad_out, fc2, expert_offsets, 1, group_m, true);
  TORCH_CHECK(gate_up.is_cuda() && gate_up.is_contiguous() && gate_up.device() == grad_out.device() &&
                  gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.size(0) == grad_out.size(0) &&
                  gate_up.size(1) == 2 * ffn,
              kOp, ": gate_up must be a contiguous bfloat16 (rows, 2F) tensor beside grad_out, got ", sizes_str(gate_up));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(gate_up.data_ptr()) % 16 == 0, kOp,
              ": gate_up must be 16-byte aligned (the epilogue reads it in 16-byte chunks)");
  auto grad_gate_up = at::empty({grad_out.size(0), 2 * ffn}, grad_out.options());
  if (grad_out.size(0) == 0) return grad_gate_up;
  ExpertGemmKernelParams<SwigluBackwardEpilogue> p{};
  p.problem = make_problem(expert_offsets, num_experts, grad_out.size(0), ffn, fc2.size(1), grad_out.size(1), group_m);
  p.epilogue = SwigluBackwardEpilogueParams{gate_up.data_ptr(), grad_gate_up.data_ptr()};
  const CUtensorMap b_map = weight_map_mn_major(fc2, p.problem);
  launch_expert_gemm<SwigluBackwardEpilogue, 1, RowsInMemoryA, true>(p, rows_map(grad_out, p.problem), b_map);
  return grad_gate_up;
}

// The weight gradients' operands: grad (rows, m) and inputs (rows, n) bf16, expert_offsets
// (experts + 1,) int32, contiguous on grad's device. Returns (experts, m, n, rows).
std::tuple<int64_t, int64_t, int64_t, int64_t> check_wgrad_operands(const char* kOp, const at::Tensor& grad,
                                                                    const at::Tensor& inputs,
                                                                    const at::Tensor& expert_offsets) {
  for (auto [t, name] : {std::pair{&grad, "grad"}, std::pair{&inputs, "inputs"}, std::pair{&expert_offsets, "expert_offsets"}}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->device() == grad.device(), kOp, ": ", name,
                " must be a contiguous CUDA tensor on grad's device");
  }
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && inputs.scalar_type() == at::kBFloat16, kOp,
              ": grad and inputs must be bfloat16, got ", c10::toString(grad.scalar_type()), " and ",
              c10::toString(inputs.scalar_type()));
  TORCH_CHECK(grad.dim() == 2 && inputs.dim() == 2 && grad.size(0) == inputs.size(0), kOp,
              ": grad (rows, m) and inputs (rows, n) must have the same rows, got ", sizes_str(grad), " and ",
              sizes_str(inputs));
  TORCH_CHECK(grad.size(1) > 0 && grad.size(1) % 8 == 0 && inputs.size(1) > 0 && inputs.size(1) % 8 == 0, kOp,
              ": m and n must be positive multiples of 8, got ", std::to_string(grad.size(1)), " and ",
              std::to_string(inputs.size(1)));
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt && expert_offsets.dim() == 1 && expert_offsets.numel() >= 2, kOp,
              ": expert_offsets must be int32 (experts + 1,) with at least one expert, got ", sizes_str(expert_offsets));
  const int64_t experts = expert_offsets.numel() - 1, m = grad.size(1), n = inputs.size(1), rows = grad.size(0);
  TORCH_CHECK(rows < (int64_t(1) << 31) && experts * m < (int64_t(1) << 31), kOp, ": more than 2^31 rows");
  TORCH_CHECK(kSmemBytes <= size_t(max_shared_memory_per_block_optin()), kOp,
              ": this GPU has less shared memory per block than the kernel's ", std::to_string(kSmemBytes), " bytes");
  return {experts, m, n, rows};
}

// Launches a weight-gradient kernel (ExpertWgradKernel or ExpertWgradWindowKernel) over rows > 0
// rows of grad and inputs into out (experts, m, n), its params filled but for the failure record.
// One CTA per SM at most, and no more than the tiles of every expert.
template <class Kernel, class Params>
void launch_wgrad(const char* kOp, Params p, const at::Tensor& grad, const at::Tensor& inputs, const at::Tensor& out) {
  const int64_t rows = grad.size(0), m = grad.size(1), n = inputs.size(1), experts = out.size(0);
  const CUtensorMap grad_map = bf16_tensor_map_sw128(grad.data_ptr(), rows, m, m, Tile::kK, "grad");
  const CUtensorMap inputs_map = bf16_tensor_map_sw128(inputs.data_ptr(), rows, n, n, Tile::kK, "inputs");
  const CUtensorMap out_map = store_map(out, experts * m, n);  // out as (experts * m, n)
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  p.failure_record = failure_record(stream);
  auto kernel = gemm_kernel_sm90<Kernel, ExpertWgradMaps, Params, CUtensorMap, CUtensorMap, CUtensorMap>;
  check_register_budget(kernel, kOp);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  const int64_t tiles = experts * ((m + Tile::kM - 1) / Tile::kM) * ((n + Tile::kN - 1) / Tile::kN);
  const int grid = int(std::min<int64_t>(tiles, multiprocessor_count()));  // one CTA per SM (shared memory)
  kernel<<<grid, Tile::kThreads, kSmemBytes, stream>>>(grad_map, inputs_map, out_map, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Weight gradients per expert: out[e] = grad[rows of e]^T @ inputs[rows of e], (experts, m, n),
// tokens as the reduction dimension in row order (bitwise reproducible); zeros for an expert with
// no rows. grad (rows, m) and inputs (rows, n) as stored.
at::Tensor expert_gemm_wgrad(const at::Tensor& grad, const at::Tensor& inputs, const at::Tensor& expert_offsets) {
  constexpr const char* kOp = "expert_gemm_wgrad";
  TORCH_CHECK(grad.is_cuda(), kOp, ": grad must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto [experts, m, n, rows] = check_wgrad_operands(kOp, grad, inputs, expert_offsets);
  if (rows == 0) return at::zeros({experts, m, n}, grad.options());
  auto out = at::empty({experts, m, n}, grad.options());
  ExpertWgradParams p{};
  p.problem = ExpertWgradProblem{expert_offsets.data_ptr<int32_t>(), int32_t(experts), int32_t(rows), int32_t(m),
                                 int32_t(n)};
  p.epilogue = store_epilogue(out);
  launch_wgrad<ExpertWgradKernel>(kOp, p, grad, inputs, out);
  return out;
}

// fp32 elements of a carry buffer of the windowed weight gradient for (m, n): one expert's tiles
// of 128 x 256 accumulators (mok_params.h WgradCarryParams; limits.py wgrad_carry_numel).
int64_t wgrad_carry_numel(int64_t m, int64_t n) {
  return (m + Tile::kM - 1) / Tile::kM * Tile::kM * ((n + Tile::kN - 1) / Tile::kN * Tile::kN);
}

// A carry buffer: None, or a contiguous fp32 (wgrad_carry_numel(m, n),) tensor on grad's device.
const float* check_carry(const char* kOp, const char* name, const std::optional<at::Tensor>& carry,
                         const at::Tensor& grad, int64_t numel) {
  if (!carry.has_value()) return nullptr;
  const at::Tensor& t = *carry;
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.device() == grad.device() && t.scalar_type() == at::kFloat &&
                  t.dim() == 1 && t.numel() == numel,
              kOp, ": ", name, " must be None or a contiguous float32 (", std::to_string(numel),
              ",) tensor (wgrad_carry_numel(m, n)) on grad's device, got ", sizes_str(t), " ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kOp, ": ", name,
              " must be 16-byte aligned (read and written in 16-byte chunks)");
  return t.data_ptr<float>();
}

// The weight gradient over one window of the schedule, rows [window_begin, window_begin + rows) of
// it in grad and inputs, expert_offsets the whole schedule's: writes out[e] for the experts whose
// segment ends in the window (and the empty ones it holds), continues the K chain of the expert
// carried in from carry_in and leaves that of the expert carried past the window in carry_out
// (mok_params.h ExpertWgradWindowProblem has the contract).
void expert_gemm_wgrad_window(const at::Tensor& grad, const at::Tensor& inputs, const at::Tensor& expert_offsets,
                              int64_t window_begin, bool last_window, const at::Tensor& out,
                              const std::optional<at::Tensor>& carry_in, const std::optional<at::Tensor>& carry_out) {
  constexpr const char* kOp = "expert_gemm_wgrad_window";
  TORCH_CHECK(grad.is_cuda(), kOp, ": grad must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto [experts, m, n, rows] = check_wgrad_operands(kOp, grad, inputs, expert_offsets);
  TORCH_CHECK(rows > 0, kOp, ": the window must hold at least one row (grad (rows, m)), got ", sizes_str(grad));
  TORCH_CHECK(window_begin >= 0 && window_begin % Tile::kK == 0, kOp, ": window_begin must be a non-negative multiple of ",
              std::to_string(Tile::kK), " (the K blocks of a carried segment), got ", std::to_string(window_begin));
  TORCH_CHECK(window_begin + rows < (int64_t(1) << 31), kOp, ": window_begin + rows must be below 2^31, got ",
              std::to_string(window_begin + rows));
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.device() == grad.device() &&
                  out.scalar_type() == at::kBFloat16 && out.dim() == 3 && out.size(0) == experts && out.size(1) == m &&
                  out.size(2) == n,
              kOp, ": out must be a contiguous bfloat16 (experts, m, n) = (", std::to_string(experts), ", ",
              std::to_string(m), ", ", std::to_string(n), ") tensor on grad's device, got ", sizes_str(out), " ",
              c10::toString(out.scalar_type()));
  const int64_t carry_numel = wgrad_carry_numel(m, n);
  ExpertWgradWindowParams p{};
  p.carry.in = check_carry(kOp, "carry_in", carry_in, grad, carry_numel);
  p.carry.out = const_cast<float*>(check_carry(kOp, "carry_out", carry_out, grad, carry_numel));
  // Two experts may carry, one in and one out, each tile reading one buffer while another tile
  // writes the other: one buffer for both would race.
  TORCH_CHECK(p.carry.in == nullptr || p.carry.in != p.carry.out, kOp,
              ": carry_in and carry_out must be different buffers (alternate two by window parity)");
  p.problem = ExpertWgradWindowProblem{expert_offsets.data_ptr<int32_t>(), int32_t(experts), int32_t(rows),
                                       int32_t(m), int32_t(n), int32_t(window_begin), int32_t(last_window)};
  p.epilogue = store_epilogue(out);
  launch_wgrad<ExpertWgradWindowKernel>(kOp, p, grad, inputs, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def("expert_gemm(Tensor a, Tensor weight, Tensor expert_offsets, int cluster_m, int group_m) -> Tensor");
  m.def(
      "expert_gemm_swiglu(Tensor a, Tensor weight, Tensor expert_offsets, int cluster_m, int group_m) -> (Tensor, "
      "Tensor)");
  m.def(
      "dispatch_expert_gemm_swiglu(Tensor x, Tensor slot_to_route, int topk, Tensor weight, Tensor expert_offsets, "
      "int cluster_m, int group_m, int ring_minibatches) -> (Tensor, Tensor, Tensor)");
  m.def(
      "dispatch_expert_gemm_swiglu_from_peers(Tensor own_tokens, int[] peer_token_ptrs, Tensor slot_to_route, int topk, "
      "Tensor weight, Tensor expert_offsets, int cluster_m, int group_m, int ring_minibatches) -> (Tensor, Tensor, "
      "Tensor)");
  m.def("expert_gemm_dgrad(Tensor a, Tensor weight, Tensor expert_offsets, int group_m) -> Tensor");
  m.def(
      "expert_gemm_dgrad_swiglu(Tensor grad_out, Tensor fc2, Tensor expert_offsets, Tensor gate_up, int group_m) -> "
      "Tensor");
  m.def("expert_gemm_wgrad(Tensor grad, Tensor inputs, Tensor expert_offsets) -> Tensor");
  m.def(
      "expert_gemm_wgrad_window(Tensor grad, Tensor inputs, Tensor expert_offsets, int window_begin, bool last_window, "
      "Tensor(a!) out, Tensor? carry_in, Tensor(b!)? carry_out) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("expert_gemm", &expert_gemm);
  m.impl("expert_gemm_swiglu", &expert_gemm_swiglu);
  m.impl("dispatch_expert_gemm_swiglu", &dispatch_expert_gemm_swiglu);
  m.impl("dispatch_expert_gemm_swiglu_from_peers", &dispatch_expert_gemm_swiglu_from_peers);
  m.impl("expert_gemm_dgrad", &expert_gemm_dgrad);
  m.impl("expert_gemm_dgrad_swiglu", &expert_gemm_dgrad_swiglu);
  m.impl("expert_gemm_wgrad", &expert_gemm_wgrad);
  m.impl("expert_gemm_wgrad_window", &expert_gemm_wgrad_window);
}

}  // namespace mok
