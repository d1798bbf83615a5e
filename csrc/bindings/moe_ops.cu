// Torch bindings of the memory-bound MoK stages (moe/): schedule, row dispatch (from one tensor or
// from the ranks' symmetric regions), combine and their backward counterparts, SwiGLU. Schemas and
// CUDA implementations here (fake implementations for torch.compile in megatron_mok/ops/); the
// argument checks guard the kernels' assumptions.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "bindings/op_utils.h"
#include "common/device_info.h"
#include "common/failure_record.h"
#include "common/limits.h"
#include "mok_params.h"
#include "moe/combine_sm90.cuh"
#include "moe/dispatch_sm90.cuh"
#include "moe/schedule_sm90.cuh"
#include "moe/swiglu_sm90.cuh"

namespace mok {
namespace {

using bindings::dispatch_dtype;
using bindings::grid_for;
using bindings::row_packs_ok;

constexpr int kThreads = 128;

// The per-token tables of scatter_rows_kernel (topk int64) and combine_kernel (topk int64 + float)
// fit the dynamic shared memory a launch gets without opting in.
static_assert(kMaxTopk * (sizeof(int64_t) + sizeof(float)) <= 48 * 1024, "MOK_MAX_TOPK is too large");

// The row gather (moe/dispatch_sm90.cuh) of slot_to_route's rows into a new (slots, hidden) tensor of
// `like`'s dtype and hidden size, from the source `p` already names (GatherRowsParams: one tensor;
// PeerGatherRowsParams: the ranks' regions), num_src_rows rows of the group in all; this fills in
// the rest of `p` and launches. src_packs_ok: the source rows allow 16-byte packs.
// expert_offsets (optional, (E + 1,) int32): rows at or past its last entry are left unwritten.
template <class Params>
at::Tensor launch_gather_rows(Params p, const at::Tensor& like, int64_t num_src_rows, const at::Tensor& slot_to_route,
                              int64_t topk, bool src_packs_ok, const std::optional<at::Tensor>& expert_offsets) {
  auto rows = at::empty({slot_to_route.numel(), like.size(1)}, like.options());
  if (rows.numel() == 0) return rows;
  p.row_end = nullptr;
  if (expert_offsets.has_value()) {
    const at::Tensor& offsets = *expert_offsets;
    TORCH_CHECK(offsets.is_cuda() && offsets.device() == like.device() && offsets.scalar_type() == at::kInt &&
                    offsets.dim() == 1 && offsets.numel() >= 1 && offsets.is_contiguous(),
                "gather rows: expert_offsets must be a contiguous 1-D int32 tensor on ", like.device().str());
    p.row_end = offsets.data_ptr<int32_t>() + (offsets.numel() - 1);
  }
  const int64_t num_routes = num_src_rows * topk;
  auto route_slot = at::full({std::max<int64_t>(num_routes, 1)}, -1, slot_to_route.options());
  p.slot_to_route = slot_to_route.data_ptr<int64_t>();
  p.route_slot = route_slot.data_ptr<int64_t>();
  p.rows = rows.data_ptr();
  p.num_slots = slot_to_route.numel();
  p.num_routes = num_routes;
  p.hidden = like.size(1);
  p.topk = topk;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // (The inversion reads no source rows: the one-tensor params serve both forms.)
  invert_slots_kernel<<<grid_for((p.num_slots + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const GatherRowsParams&>(p));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool packs_ok = src_packs_ok && row_packs_ok(p.hidden, like.scalar_type(), {rows});
  dispatch_dtype(like.scalar_type(), packs_ok, [&](auto tag) {
    using Cfg = decltype(tag);
    fill_unscattered_rows_kernel<typename Cfg::type, Cfg::kVec, Params>
        <<<grid_for((p.num_slots + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (num_src_rows > 0) {
      scatter_rows_kernel<typename Cfg::type, Cfg::kVec, Params>
          <<<grid_for(num_src_rows), kThreads, topk * sizeof(int64_t), stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return rows;
}

void check_gather_topk(const char* op, int64_t topk) {
  TORCH_CHECK(topk > 0 && topk <= kMaxTopk, op, ": topk must be in [1, ", std::to_string(kMaxTopk), "], got ",
              std::to_string(topk));
}

at::Tensor gather_rows(const at::Tensor& src, const std::optional<at::Tensor>& weights,
                       const at::Tensor& slot_to_route, int64_t topk, const std::optional<at::Tensor>& expert_offsets) {
  check_cuda(src, "src");
  check_index(slot_to_route, "slot_to_route");
  TORCH_CHECK(src.dim() == 2 && topk > 0, "gather rows: src must be 2-D and topk > 0");
  TORCH_CHECK(topk <= kMaxTopk, "gather rows: topk must be at most ", std::to_string(kMaxTopk), ", got ",
              std::to_string(topk));
  if (weights.has_value()) {
    check_cuda(*weights, "weights");
    TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == src.size(0) * topk,
                "gather rows: weights must be float32 with one entry per route");
  }
  const c10::cuda::CUDAGuard guard(src.device());
  GatherRowsParams p{};
  p.src = src.data_ptr();
  p.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  return launch_gather_rows(p, src, src.size(0), slot_to_route, topk, row_packs_ok(src.size(1), src.scalar_type(), {src}),
                            expert_offsets);
}

at::Tensor dispatch_rows(const at::Tensor& x_all, const at::Tensor& slot_to_route, int64_t topk,
                         const std::optional<at::Tensor>& expert_offsets) {
  return gather_rows(x_all, std::nullopt, slot_to_route, topk, expert_offsets);
}

// The gathers straight from the ranks' symmetric regions (comm/symmetric.py): own is this rank's
// (T, H) copy (its dtype, shape and device stand for every rank's; it is not read), row_ptrs every
// rank's address of it in rank order; weight_ptrs (the reverse-combine pull) every rank's (T * topk,) fp32 routing
// weights. Route r reads row r / topk of the group's rows: rank (r / topk) / T's token (r / topk) % T.
at::Tensor gather_rows_from_peers(const char* op, const at::Tensor& own, c10::IntArrayRef row_ptrs,
                                  const c10::IntArrayRef* weight_ptrs, const at::Tensor& slot_to_route, int64_t topk,
                                  const std::optional<at::Tensor>& expert_offsets) {
  const std::string prefix = std::string(op) + ": ";
  TORCH_CHECK(own.is_cuda() && own.is_contiguous() && own.dim() == 2, prefix,
              "the own region must be a contiguous 2-D CUDA tensor (num_tokens, hidden)");
  TORCH_CHECK(own.scalar_type() == at::kBFloat16 || own.scalar_type() == at::kFloat, prefix,
              "the own region must be bfloat16 or float32, got ", c10::toString(own.scalar_type()));
  check_index(slot_to_route, "slot_to_route");
  TORCH_CHECK(slot_to_route.device() == own.device(), prefix, "slot_to_route is on ", slot_to_route.device().str(),
              ", the own region on ", own.device().str());
  check_gather_topk(op, topk);
  const c10::cuda::CUDAGuard guard(own.device());
  PeerGatherRowsParams p{};  // (the inherited src and weights stay null: the rows come from p.source)
  const int num_ranks =
      bindings::fill_peer_table(p.source.bases, row_ptrs, op, "the row region table", 0, own.element_size());
  if (weight_ptrs != nullptr) {
    bindings::fill_peer_table(p.source.weight_bases, *weight_ptrs, op, "peer_weight_ptrs", num_ranks, sizeof(float));
  }
  p.source.rows_per_base = own.size(0);
  p.source.num_bases = num_ranks;
  TORCH_CHECK(int64_t(num_ranks) * own.size(0) * topk < (int64_t(1) << 62), prefix, "too many routes");
  const bool packs_ok = (own.size(1) * own.element_size()) % 16 == 0 && bindings::table_aligned16(p.source.bases, num_ranks);
  return launch_gather_rows(p, own, int64_t(num_ranks) * own.size(0), slot_to_route, topk, packs_ok, expert_offsets);
}

at::Tensor dispatch_rows_from_peers(const at::Tensor& own_tokens, c10::IntArrayRef peer_token_ptrs,
                                    const at::Tensor& slot_to_route, int64_t topk,
                                    const std::optional<at::Tensor>& expert_offsets) {
  return gather_rows_from_peers("dispatch_rows_from_peers", own_tokens, peer_token_ptrs, nullptr, slot_to_route, topk,
                                expert_offsets);
}

at::Tensor pull_grad_rows_from_peers(const at::Tensor& own_grad_tokens, c10::IntArrayRef peer_grad_ptrs,
                                     c10::IntArrayRef peer_weight_ptrs, const at::Tensor& slot_to_route, int64_t topk,
                                     const std::optional<at::Tensor>& expert_offsets) {
  return gather_rows_from_peers("pull_grad_rows_from_peers", own_grad_tokens, peer_grad_ptrs, &peer_weight_ptrs,
                                slot_to_route, topk, expert_offsets);
}

// keep: null, or the (num_table_rows or more, hidden) tensor of table's dtype the rows read are copied to.
at::Tensor combine_into(const at::Tensor& table, const at::Tensor& index, const std::optional<at::Tensor>& weights,
                        int64_t topk, const at::Tensor* keep) {
  check_cuda(table, "table");
  check_index(index, "index");
  TORCH_CHECK(table.dim() == 2 && topk > 0 && index.numel() % topk == 0, "combine: bad shapes");
  TORCH_CHECK(topk <= kMaxTopk, "combine: topk must be at most ", std::to_string(kMaxTopk), ", got ", std::to_string(topk));
  const int64_t num_tokens = index.numel() / topk;
  if (weights.has_value()) {
    check_cuda(*weights, "weights");
    TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->numel() == index.numel(),
                "combine: weights must be float32 with one entry per route");
  }
  if (keep != nullptr) {
    check_cuda(*keep, "keep");
    TORCH_CHECK(keep->scalar_type() == table.scalar_type() && keep->dim() == 2 && keep->size(1) == table.size(1) &&
                    keep->size(0) >= table.size(0) && keep->is_contiguous() && keep->device() == table.device(),
                "combine_keeping: keep must be a contiguous (table rows or more, hidden) tensor of table's dtype and "
                "device");
  }
  const c10::cuda::CUDAGuard guard(table.device());
  auto out = at::empty({num_tokens, table.size(1)}, table.options());
  if (out.numel() == 0) return out;
  CombineParams p{table.data_ptr(), index.data_ptr<int64_t>(),
                  weights.has_value() ? weights->data_ptr<float>() : nullptr, out.data_ptr(),
                  keep != nullptr ? keep->data_ptr() : nullptr, num_tokens, table.size(0), table.size(1), topk};
  const bool packs_ok =
      row_packs_ok(p.hidden, table.scalar_type(), {table, out}) && (keep == nullptr || bindings::aligned16(*keep));
  dispatch_dtype(table.scalar_type(), packs_ok, [&](auto tag) {
    using Cfg = decltype(tag);
    combine_kernel<typename Cfg::type, Cfg::kVec>
        <<<grid_for(num_tokens), kThreads, topk * (sizeof(int64_t) + sizeof(float)), c10::cuda::getCurrentCUDAStream()>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor combine(const at::Tensor& table, const at::Tensor& index, const std::optional<at::Tensor>& weights,
                   int64_t topk) {
  return combine_into(table, index, weights, topk, nullptr);
}

at::Tensor combine_keeping(const at::Tensor& table, const at::Tensor& index, const std::optional<at::Tensor>& weights,
                           int64_t topk, at::Tensor& keep) {
  return combine_into(table, index, weights, topk, &keep);
}

at::Tensor pull_grad_rows(const at::Tensor& grad_y_all, const at::Tensor& weights_all,
                          const at::Tensor& slot_to_route, int64_t topk, const std::optional<at::Tensor>& expert_offsets) {
  return gather_rows(grad_y_all, weights_all, slot_to_route, topk, expert_offsets);
}

at::Tensor route_weight_grads(const at::Tensor& grad_y, const at::Tensor& table, const at::Tensor& index,
                              int64_t topk) {
  check_cuda(grad_y, "grad_y");
  check_cuda(table, "table");
  check_index(index, "index");
  TORCH_CHECK(grad_y.scalar_type() == table.scalar_type() && grad_y.size(1) == table.size(1),
              "route_weight_grads: grad_y and table must share dtype and hidden size");
  TORCH_CHECK(index.numel() == grad_y.size(0) * topk, "route_weight_grads: one index per route");
  const c10::cuda::CUDAGuard guard(grad_y.device());
  auto d_weights = at::empty({grad_y.size(0), topk}, grad_y.options().dtype(at::kFloat));
  if (d_weights.numel() == 0) return d_weights;
  RouteWeightGradParams p{grad_y.data_ptr(), table.data_ptr(), index.data_ptr<int64_t>(),
                          d_weights.data_ptr<float>(), grad_y.size(0), table.size(0), grad_y.size(1), topk};
  dispatch_dtype(grad_y.scalar_type(), row_packs_ok(p.hidden, grad_y.scalar_type(), {grad_y, table}), [&](auto tag) {
    using Cfg = decltype(tag);
    route_weight_grads_kernel<typename Cfg::type, Cfg::kVec>
        <<<grid_for(p.num_tokens), kReduceThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return d_weights;
}

void check_swiglu(const at::Tensor& gate_up, const at::Tensor& offsets) {
  check_cuda(gate_up, "gate_up");
  check_cuda(offsets, "offsets");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.dim() == 1 && offsets.numel() >= 2,
              "offsets must be int32 (num_experts + 1,)");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (rows, 2 * ffn)");
}

at::Tensor swiglu_forward(const at::Tensor& gate_up, const at::Tensor& offsets) {
  check_swiglu(gate_up, offsets);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t ffn = gate_up.size(1) / 2;
  auto act = at::empty({gate_up.size(0), ffn}, gate_up.options());
  if (act.numel() == 0) return act;
  SwigluParams p{gate_up.data_ptr(), nullptr, act.data_ptr(), offsets.data_ptr<int32_t>(), offsets.numel() - 1,
                 gate_up.size(0), ffn};
  dispatch_dtype(gate_up.scalar_type(), row_packs_ok(ffn, gate_up.scalar_type(), {gate_up, act}), [&](auto tag) {
    using Cfg = decltype(tag);
    swiglu_forward_kernel<typename Cfg::type, Cfg::kVec>
        <<<grid_for(p.num_rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return act;
}

at::Tensor swiglu_backward(const at::Tensor& gate_up, const at::Tensor& grad_act, const at::Tensor& offsets) {
  check_swiglu(gate_up, offsets);
  check_cuda(grad_act, "grad_act");
  const int64_t ffn = gate_up.size(1) / 2;
  TORCH_CHECK(grad_act.size(0) == gate_up.size(0) && grad_act.size(1) == ffn &&
                  grad_act.scalar_type() == gate_up.scalar_type(),
              "grad_act must be (rows, ffn) in gate_up's dtype");
  const c10::cuda::CUDAGuard guard(gate_up.device());
  auto grad_gate_up = at::empty_like(gate_up);
  if (grad_gate_up.numel() == 0) return grad_gate_up;
  SwigluParams p{gate_up.data_ptr(), grad_act.data_ptr(), grad_gate_up.data_ptr(), offsets.data_ptr<int32_t>(),
                 offsets.numel() - 1, gate_up.size(0), ffn};
  dispatch_dtype(gate_up.scalar_type(), row_packs_ok(ffn, gate_up.scalar_type(), {gate_up, grad_act, grad_gate_up}),
                 [&](auto tag) {
                   using Cfg = decltype(tag);
                   swiglu_backward_kernel<typename Cfg::type, Cfg::kVec>
                       <<<grid_for(p.num_rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
                 });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_gate_up;
}

// num_experts_checked > 0: the count kernel checks every id against [-1, num_experts_checked) and
// traps on a bad one, naming it through the failure record (no extra launches or host work).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_schedule(const at::Tensor& topk_ids_all, int64_t rank,
                                                                       int64_t num_local_experts, int64_t alignment,
                                                                       int64_t num_experts_checked) {
  check_cuda(topk_ids_all, "topk_ids_all");
  TORCH_CHECK(topk_ids_all.scalar_type() == at::kLong || topk_ids_all.scalar_type() == at::kInt,
              "topk_ids_all must be int32 or int64");
  TORCH_CHECK(num_local_experts > 0 && alignment > 0 && rank >= 0 && num_experts_checked >= 0,
              "build_schedule: bad arguments");
  const c10::cuda::CUDAGuard guard(topk_ids_all.device());
  const int64_t num_routes = topk_ids_all.numel();
  const int64_t capacity = num_routes + num_local_experts * (alignment - 1);
  TORCH_CHECK(capacity < (int64_t(1) << 31), "build_schedule: more than 2^31 rows");
  auto long_options = topk_ids_all.options().dtype(at::kLong);
  auto int_options = topk_ids_all.options().dtype(at::kInt);
  auto slot_to_route = at::empty({capacity}, long_options);
  auto route_to_slot = at::empty({num_routes}, long_options);
  auto counts = at::empty({num_local_experts}, int_options);
  auto offsets = at::empty({num_local_experts + 1}, int_options);
  const int blocks = schedule_blocks(num_routes);
  auto block_counts = at::empty({blocks, num_local_experts}, int_options);
  ScheduleParams p{topk_ids_all.data_ptr(), slot_to_route.data_ptr<int64_t>(), route_to_slot.data_ptr<int64_t>(),
                   counts.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), block_counts.data_ptr<int32_t>(),
                   num_routes, capacity, num_local_experts, alignment, static_cast<int>(rank), num_experts_checked,
                   num_experts_checked > 0 ? failure_record(c10::cuda::getCurrentCUDAStream()) : nullptr};
  const size_t count_smem = size_t(num_local_experts) * sizeof(int);
  const size_t place_smem = (size_t(kScheduleWarps) * num_local_experts + 2 * num_local_experts + 1) * sizeof(int);
  TORCH_CHECK(place_smem <= size_t(max_shared_memory_per_block_optin()),
              "build_schedule: num_local_experts=", std::to_string(num_local_experts),
              " needs more shared memory per block than the device has (at most ~1700 local experts)");
  auto launch = [&](auto kernel, size_t smem) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    kernel<<<blocks, kScheduleWarps * 32, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (topk_ids_all.scalar_type() == at::kLong) {
    launch(count_routes_kernel<int64_t>, count_smem);
    launch(place_routes_kernel<int64_t>, place_smem);
  } else {
    launch(count_routes_kernel<int32_t>, count_smem);
    launch(place_routes_kernel<int32_t>, place_smem);
  }
  return {slot_to_route, route_to_slot, counts, offsets};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def("build_schedule(Tensor topk_ids_all, int rank, int num_local_experts, int alignment, int num_experts_checked) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dispatch_rows(Tensor x_all, Tensor slot_to_route, int topk, Tensor? expert_offsets=None) -> Tensor");
  m.def("combine(Tensor table, Tensor index, Tensor? weights, int topk) -> Tensor");
  m.def("combine_keeping(Tensor table, Tensor index, Tensor? weights, int topk, Tensor(a!) keep) -> Tensor");
  m.def("pull_grad_rows(Tensor grad_y_all, Tensor weights_all, Tensor slot_to_route, int topk, Tensor? expert_offsets=None) -> Tensor");
  m.def("dispatch_rows_from_peers(Tensor own_tokens, int[] peer_token_ptrs, Tensor slot_to_route, int topk, "
        "Tensor? expert_offsets=None) -> Tensor");
  m.def(
      "pull_grad_rows_from_peers(Tensor own_grad_tokens, int[] peer_grad_ptrs, int[] peer_weight_ptrs, "
      "Tensor slot_to_route, int topk, Tensor? expert_offsets=None) -> Tensor");
  m.def("route_weight_grads(Tensor grad_y, Tensor table, Tensor index, int topk) -> Tensor");
  m.def("swiglu_forward(Tensor gate_up, Tensor offsets) -> Tensor");
  m.def("swiglu_backward(Tensor gate_up, Tensor grad_act, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("build_schedule", &build_schedule);
  m.impl("dispatch_rows", &dispatch_rows);
  m.impl("combine", &combine);
  m.impl("combine_keeping", &combine_keeping);
  m.impl("pull_grad_rows", &pull_grad_rows);
  m.impl("dispatch_rows_from_peers", &dispatch_rows_from_peers);
  m.impl("pull_grad_rows_from_peers", &pull_grad_rows_from_peers);
  m.impl("route_weight_grads", &route_weight_grads);
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
}

}  // namespace mok
