// Torch bindings of the in-kernel exchange through symmetric memory (comm/symmetric.py: the regions
// and the signal protocol; comm/symmetric_exchange.py calls these ops): the signal steps
// (moe/exchange_sm90.cuh), the push combine and the region pull (moe/push_combine_sm90.cuh). The
// row pulls (dispatch_rows_from_peers, pull_grad_rows_from_peers) live beside the one-tensor
// gathers in bindings/moe_ops.cu. Fake implementations: megatron_mok/ops/exchange.py.
//
// Every op takes this rank's own copy of what it writes or waits on as a tensor argument (marked
// mutable where the op or a peer writes it), so torch.compile keeps the ops and their order; the
// peers' copies arrive as device addresses in rank order (SymmetricRegion.peer_ptrs).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "bindings/op_utils.h"
#include "common/failure_codes.h"
#include "common/failure_record.h"
#include "common/limits.h"
#include "mok_params.h"
#include "moe/exchange_sm90.cuh"
#include "moe/push_combine_sm90.cuh"

namespace mok {
namespace {

using bindings::fill_peer_table;
using bindings::grid_for;

// The phases in the order of the signal pad's first dimension (common/failure_codes.h): Python
// derives the phase ids and the pad's size from this list.
std::vector<std::string> exchange_phase_names() {
  return std::vector<std::string>(std::begin(kExchangePhaseNames), std::end(kExchangePhaseNames));
}

// The signal kernels' params from this rank's calls and pad; peer_signal_ptrs (exchange_signal
// only) every rank's pad, this rank's at index `rank` (the kernel adds to it there, not to
// `signals`, which anchors the op's order).
ExchangeSignalParams signal_params(const char* op, const at::Tensor& calls, const at::Tensor& signals, int64_t rank,
                                   int64_t phase, const c10::IntArrayRef* peer_signal_ptrs) {
  const std::string prefix = std::string(op) + ": ";
  check_cuda(calls, "calls");
  check_cuda(signals, "signals");
  TORCH_CHECK(calls.scalar_type() == at::kLong && calls.dim() == 1 && calls.size(0) == kNumExchangePhases, prefix,
              "calls must be int64 (", std::to_string(kNumExchangePhases), ",), one count per phase");
  TORCH_CHECK(signals.scalar_type() == at::kLong && signals.dim() == 3 && signals.size(0) == kNumExchangePhases &&
                  signals.size(1) == kNumSignalKinds && signals.size(2) >= 1 && signals.size(2) <= kMaxEpRanks,
              prefix, "signals must be this rank's int64 pad (", std::to_string(kNumExchangePhases), ", ",
              std::to_string(kNumSignalKinds), ", num_ranks) with num_ranks in [1, ", std::to_string(kMaxEpRanks), "]");
  TORCH_CHECK(calls.device() == signals.device(), prefix, "calls is on ", calls.device().str(), ", signals on ",
              signals.device().str());
  const int64_t num_ranks = signals.size(2);
  TORCH_CHECK(rank >= 0 && rank < num_ranks, prefix, "rank must be in [0, ", std::to_string(num_ranks), "), got ",
              std::to_string(rank));
  TORCH_CHECK(phase >= 0 && phase < kNumExchangePhases, prefix, "phase must be in [0, ",
              std::to_string(kNumExchangePhases), ") (exchange_phase_names()), got ", std::to_string(phase));
  ExchangeSignalParams p{};
  p.calls = calls.data_ptr<int64_t>();
  p.signals = signals.data_ptr<int64_t>();
  if (peer_signal_ptrs != nullptr) {
    fill_peer_table(p.peer_signals, *peer_signal_ptrs, op, "peer_signal_ptrs", num_ranks, sizeof(int64_t));
  }
  p.rank = int32_t(rank);
  p.num_ranks = int32_t(num_ranks);
  p.phase = int32_t(phase);
  p.kind = 0;
  return p;
}

template <typename Kernel>
void launch_signal_kernel(Kernel kernel, ExchangeSignalParams p, const at::Tensor& signals) {
  const c10::cuda::CUDAGuard guard(signals.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  p.failure_record = failure_record(stream);
  kernel<<<1, kExchangeThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Call c = ++calls[phase] of the phase; waits until every peer signalled `free` c - 1 times.
void exchange_begin(const at::Tensor& calls, const at::Tensor& signals, int64_t rank, int64_t phase) {
  launch_signal_kernel(exchange_begin_kernel, signal_params("exchange_begin", calls, signals, rank, phase, nullptr),
                       signals);
}

// Adds one `kind` signal of this rank into every rank's pad (after everything earlier on the stream).
// calls is only read (by nothing but the op's order: it follows exchange_begin's update).
void exchange_signal(const at::Tensor& calls, const at::Tensor& signals, c10::IntArrayRef peer_signal_ptrs,
                     int64_t rank, int64_t phase, int64_t kind) {
  ExchangeSignalParams p = signal_params("exchange_signal", calls, signals, rank, phase, &peer_signal_ptrs);
  TORCH_CHECK(kind == kSignalReady || kind == kSignalFree, "exchange_signal: kind must be 0 (ready) or 1 (free), got ",
              std::to_string(kind));
  p.kind = int32_t(kind);
  launch_signal_kernel(exchange_signal_kernel, p, signals);
}

// Waits until every rank signalled `ready` for this rank's current call of the phase.
void exchange_wait_ready(const at::Tensor& calls, const at::Tensor& signals, int64_t rank, int64_t phase) {
  launch_signal_kernel(exchange_wait_ready_kernel,
                       signal_params("exchange_wait_ready", calls, signals, rank, phase, nullptr), signals);
}

// The copy unit of rows of row_bytes bytes whose bases are all `aligned` (a power of two): 16
// bytes where possible, else the element's size (`element_size`, which divides both).
template <typename Fn>
void dispatch_copy_unit(int64_t row_bytes, uintptr_t aligned, int64_t element_size, Fn&& fn) {
  if (row_bytes % 16 == 0 && aligned % 16 == 0) return fn(uint4{});
  switch (element_size) {
    case 8: return fn(uint2{});
    case 4: return fn(uint32_t{});
    case 2: return fn(uint16_t{});
    default: return fn(uint8_t{});
  }
}

// The lowest set bit of every address: the largest power-of-two alignment they all share.
template <typename Ptr>
uintptr_t common_alignment(const Ptr (&table)[kMaxEpRanks], int n, std::initializer_list<const void*> more) {
  uintptr_t bits = 0;
  for (int r = 0; r < n; ++r) bits |= reinterpret_cast<uintptr_t>(table[r]);
  for (const void* ptr : more) bits |= reinterpret_cast<uintptr_t>(ptr);
  return bits & (~bits + 1);
}

// The push combine: for every row s of this rank's schedule with route r = slot_to_route[s] >= 0,
// slot_rows[s] goes to row r % (num_tokens * topk) of rank r / (num_tokens * topk)'s combine region
// (peer_combine_ptrs in rank order; own_combine is this rank's, (num_tokens * topk, hidden)).
void push_rows(const at::Tensor& slot_rows, const at::Tensor& slot_to_route, int64_t topk, int64_t num_tokens,
               const at::Tensor& own_combine, c10::IntArrayRef peer_combine_ptrs) {
  constexpr const char* kOp = "push_rows";
  check_cuda(slot_rows, "slot_rows");
  check_index(slot_to_route, "slot_to_route");
  check_cuda(own_combine, "own_combine");
  TORCH_CHECK(slot_rows.dim() == 2 && own_combine.dim() == 2 && slot_rows.size(1) == own_combine.size(1) &&
                  slot_rows.scalar_type() == own_combine.scalar_type(),
              kOp, ": slot_rows (rows, hidden) and own_combine (num_tokens * topk, hidden) must share hidden and dtype");
  TORCH_CHECK(slot_to_route.dim() == 1 && slot_to_route.size(0) == slot_rows.size(0), kOp,
              ": slot_to_route must hold one route per row of slot_rows");
  TORCH_CHECK(topk > 0 && num_tokens >= 0 && own_combine.size(0) == num_tokens * topk, kOp,
              ": own_combine must be (num_tokens * topk, hidden) = (", std::to_string(num_tokens * topk), ", ...)");
  TORCH_CHECK(slot_rows.device() == own_combine.device() && slot_to_route.device() == own_combine.device(), kOp,
              ": slot_rows, slot_to_route and own_combine must be on one device");
  const c10::cuda::CUDAGuard guard(own_combine.device());
  PushRowsParams p{};
  const int num_ranks =
      fill_peer_table(p.peer_tables, peer_combine_ptrs, kOp, "peer_combine_ptrs", 0, own_combine.element_size());
  if (slot_rows.size(0) == 0 || slot_rows.size(1) == 0) return;
  p.slot_rows = slot_rows.data_ptr();
  p.slot_to_route = slot_to_route.data_ptr<int64_t>();
  p.num_slots = slot_rows.size(0);
  p.routes_per_rank = num_tokens * topk;
  p.num_ranks = num_ranks;
  const int64_t row_bytes = slot_rows.size(1) * slot_rows.element_size();
  const uintptr_t aligned = common_alignment(p.peer_tables, num_ranks, {slot_rows.data_ptr()});
  dispatch_copy_unit(row_bytes, aligned, slot_rows.element_size(), [&](auto unit) {
    using U = decltype(unit);
    p.row_units = row_bytes / int64_t(sizeof(U));
    push_rows_kernel<U><<<grid_for(p.num_slots), kPushThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// out[r] = rank r's copy of `own`'s region (peer_ptrs in rank order, own's shape and dtype).
at::Tensor gather_peer_regions(const at::Tensor& own, c10::IntArrayRef peer_ptrs) {
  constexpr const char* kOp = "gather_peer_regions";
  check_cuda(own, "own");
  const c10::cuda::CUDAGuard guard(own.device());
  GatherRegionsParams p{};
  const int num_ranks = fill_peer_table(p.peer_regions, peer_ptrs, kOp, "peer_ptrs", 0, own.element_size());
  std::vector<int64_t> shape{num_ranks};
  for (int64_t size : own.sizes()) shape.push_back(size);
  auto out = at::empty(shape, own.options());
  const int64_t bytes = own.numel() * own.element_size();
  if (bytes == 0) return out;
  p.out = out.data_ptr();
  p.num_ranks = num_ranks;
  const uintptr_t aligned = common_alignment(p.peer_regions, num_ranks, {out.data_ptr()});
  dispatch_copy_unit(bytes, aligned, own.element_size(), [&](auto unit) {
    using U = decltype(unit);
    p.units = bytes / int64_t(sizeof(U));
    constexpr int kThreads = 256;
    const dim3 grid(unsigned(std::max<int64_t>(1, std::min<int64_t>((p.units + kThreads - 1) / kThreads, 1024))),
                    unsigned(num_ranks));
    gather_regions_kernel<U><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def("exchange_phase_names() -> str[]", &exchange_phase_names);
  m.def("exchange_begin(Tensor(a!) calls, Tensor(b!) signals, int rank, int phase) -> ()");
  m.def(
      "exchange_signal(Tensor calls, Tensor(a!) signals, int[] peer_signal_ptrs, int rank, int phase, int kind) -> "
      "()");
  m.def("exchange_wait_ready(Tensor calls, Tensor(a!) signals, int rank, int phase) -> ()");
  m.def(
      "push_rows(Tensor slot_rows, Tensor slot_to_route, int topk, int num_tokens, Tensor(a!) own_combine, "
      "int[] peer_combine_ptrs) -> ()");
  m.def("gather_peer_regions(Tensor own, int[] peer_ptrs) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("exchange_begin", &exchange_begin);
  m.impl("exchange_signal", &exchange_signal);
  m.impl("exchange_wait_ready", &exchange_wait_ready);
  m.impl("push_rows", &push_rows);
  m.impl("gather_peer_regions", &gather_peer_regions);
}

}  // namespace mok
