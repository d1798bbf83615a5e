"""The `megatron_mok` custom ops over the CUDA extension, with fake implementations.

Each op's PyTorch reference is the function of the same stage in `reference.py`. The CUDA
implementations are registered by `megatron_mok._C` (csrc/mok_ops.cu); the fake ones here give
output shapes to torch.compile and meta tensors without running anything.
"""

from __future__ import annotations

import atexit
import sys
from typing import Optional

import torch

_LOAD_ERROR: Optional[str] = None
try:
    from megatron_mok import _C  # noqa: F401  (registers torch.ops.megatron_mok.*)
except ImportError as error:  # no CUDA toolchain at install time, or a CPU-only build
    _LOAD_ERROR = f"{type(error).__name__}: {error}"


def extension_error() -> Optional[str]:
    """None when the CUDA extension is loaded, else why it is not."""
    return _LOAD_ERROR


# Names of the bounded waits of each kernel, by (kernel, wait) as csrc/mok_params.h numbers them.
WAIT_NAMES = {
    (0, 0): "expert GEMM producer waiting for a free pipeline stage (empty barrier)",
    (0, 1): "expert GEMM consumer waiting for a loaded pipeline stage (full barrier)",
    (0, 2): "expert GEMM producer waiting for a minibatch of dispatched rows (ready counter)",
    (0, 3): "ping-pong expert GEMM consumer waiting for its turn at the tensor cores (turn barrier)",
    (0, 4): "expert GEMM dispatcher waiting for a ring slot's rows to be loaded by every tile (consumed counter)",
    (1, 0): "expert weight-gradient producer waiting for a free pipeline stage (empty barrier)",
    (1, 1): "expert weight-gradient consumer waiting for a loaded pipeline stage (full barrier)",
    # Not a wait: the schedule kernel's check of the ids (MoKConfig.check_expert_ids) failed.
    (2, 0): "schedule kernel: topk_ids holds an expert id outside [-1, num_experts)",
}


def last_wait_timeout() -> Optional[str]:
    """Which bounded wait of a kernel timed out in this process (the kernel then trapped), or which
    in-kernel check failed (the schedule's expert ids), or None."""
    if _LOAD_ERROR is not None:
        return None
    record = torch.ops.megatron_mok.last_wait_timeout()
    if not record:
        return None
    kernel, wait, block = record
    return f"{WAIT_NAMES.get((kernel, wait), f'wait {wait} of kernel {kernel}')} (block {block})"


def _report_wait_timeout_at_exit() -> None:
    message = last_wait_timeout()
    if message is not None:
        print(f"megatron_mok: a kernel trapped: {message}", file=sys.stderr)


if _LOAD_ERROR is None:
    atexit.register(_report_wait_timeout_at_exit)

    @torch.library.register_fake("megatron_mok::expert_gemm")
    def _expert_gemm_fake(a, weight, expert_offsets, cluster_m, group_m):
        return a.new_empty((a.shape[0], weight.shape[1]))

    @torch.library.register_fake("megatron_mok::expert_gemm_swiglu")
    def _expert_gemm_swiglu_fake(a, weight, expert_offsets, cluster_m, group_m):
        return a.new_empty((a.shape[0], weight.shape[1])), a.new_empty((a.shape[0], weight.shape[1] // 2))

    @torch.library.register_fake("megatron_mok::dispatch_expert_gemm_swiglu")
    def _dispatch_expert_gemm_swiglu_fake(x, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches):
        rows = slot_to_route.shape[0]
        return (
            x.new_empty((dispatch_ring_buffer_rows(rows, ring_minibatches), x.shape[1])),
            x.new_empty((rows, weight.shape[1])),
            x.new_empty((rows, weight.shape[1] // 2)),
        )

    @torch.library.register_fake("megatron_mok::expert_gemm_dgrad")
    def _expert_gemm_dgrad_fake(a, weight, expert_offsets, group_m):
        return a.new_empty((a.shape[0], weight.shape[2]))

    @torch.library.register_fake("megatron_mok::expert_gemm_dgrad_swiglu")
    def _expert_gemm_dgrad_swiglu_fake(grad_out, fc2, expert_offsets, gate_up, group_m):
        return grad_out.new_empty((grad_out.shape[0], 2 * fc2.shape[2]))

    @torch.library.register_fake("megatron_mok::expert_gemm_pingpong")
    def _expert_gemm_pingpong_fake(a, weight, expert_offsets, group_m):
        return a.new_empty((a.shape[0], weight.shape[1]))

    @torch.library.register_fake("megatron_mok::expert_gemm_wgrad")
    def _expert_gemm_wgrad_fake(grad, inputs, expert_offsets):
        return grad.new_empty((expert_offsets.shape[0] - 1, grad.shape[1], inputs.shape[1]))

    @torch.library.register_fake("megatron_mok::build_schedule")
    def _build_schedule_fake(topk_ids_all, rank, num_local_experts, alignment, num_experts_checked):
        num_routes = topk_ids_all.numel()
        capacity = num_routes + num_local_experts * (alignment - 1)
        new = topk_ids_all.new_empty
        return (
            new((capacity,), dtype=torch.int64),
            new((num_routes,), dtype=torch.int64),
            new((num_local_experts,), dtype=torch.int32),
            new((num_local_experts + 1,), dtype=torch.int32),
        )

    @torch.library.register_fake("megatron_mok::dispatch_rows")
    def _dispatch_rows_fake(x_all, slot_to_route, topk):
        return x_all.new_empty((slot_to_route.shape[0], x_all.shape[1]))

    @torch.library.register_fake("megatron_mok::combine")
    def _combine_fake(table, index, weights, topk):
        return table.new_empty((index.shape[0] // topk, table.shape[1]))

    @torch.library.register_fake("megatron_mok::pull_grad_rows")
    def _pull_grad_rows_fake(grad_y_all, weights_all, slot_to_route, topk):
        return grad_y_all.new_empty((slot_to_route.shape[0], grad_y_all.shape[1]))

    @torch.library.register_fake("megatron_mok::route_weight_grads")
    def _route_weight_grads_fake(grad_y, table, index, topk):
        return grad_y.new_empty((grad_y.shape[0], topk), dtype=torch.float32)

    @torch.library.register_fake("megatron_mok::swiglu_forward")
    def _swiglu_forward_fake(gate_up, offsets):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @torch.library.register_fake("megatron_mok::swiglu_backward")
    def _swiglu_backward_fake(gate_up, grad_act, offsets):
        return torch.empty_like(gate_up)


def build_schedule(
    topk_ids_all: torch.Tensor, rank: int, num_local_experts: int, alignment: int, num_experts_checked: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_to_route, route_to_slot, expert_counts, expert_offsets). num_experts_checked > 0: the
    kernel also checks every id against [-1, num_experts_checked) and traps on a bad one
    (last_wait_timeout() then names it). Ref: build_schedule_reference."""
    return torch.ops.megatron_mok.build_schedule(topk_ids_all, rank, num_local_experts, alignment, num_experts_checked)


def dispatch_rows(x_all: torch.Tensor, slot_to_route: torch.Tensor, topk: int) -> torch.Tensor:
    """(capacity, H): x_all[slot_to_route // topk], zero for route -1. Ref: dispatch_rows_reference."""
    return torch.ops.megatron_mok.dispatch_rows(x_all, slot_to_route, topk)


def combine(table: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], topk: int) -> torch.Tensor:
    """(T, H) in table.dtype: fixed-order fp32 sum over k. Ref: combine_reference."""
    return torch.ops.megatron_mok.combine(table, index, weights, topk)


def pull_grad_rows(grad_y_all: torch.Tensor, weights_all: torch.Tensor, slot_to_route: torch.Tensor, topk: int) -> torch.Tensor:
    """(capacity, H): w[route] * dY[route // topk]. Ref: pull_route_grads_reference."""
    return torch.ops.megatron_mok.pull_grad_rows(grad_y_all, weights_all, slot_to_route, topk)


def route_weight_grads(grad_y: torch.Tensor, table: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    """(T, K) float32: <dY[t], table[index]>. Ref: route_weight_grads_reference."""
    return torch.ops.megatron_mok.route_weight_grads(grad_y, table, index, topk)


def swiglu_forward(gate_up: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, F): silu(gate) * up, zero past offsets[-1]. Ref: swiglu_reference."""
    return torch.ops.megatron_mok.swiglu_forward(gate_up, offsets)


def swiglu_backward(gate_up: torch.Tensor, grad_act: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, 2F): d gate_up, zero past offsets[-1]. Ref: swiglu_backward_reference."""
    return torch.ops.megatron_mok.swiglu_backward(gate_up, grad_act, offsets)


# CTAs per cluster of the sm90 expert GEMM (2: pairs of CTAs share each weight slice through TMA
# multicast; 1: none). The default is the faster on the H200 (docs/performance.md).
EXPERT_GEMM_CLUSTER_M = 1
# The tile raster of the sm90 expert GEMM: within an expert, groups of this many 128-row m-tiles
# are walked m fastest, so the CTAs working at once share weight slices and rows in L2.
EXPERT_GEMM_GROUP_M = 16


def expert_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
) -> torch.Tensor:
    """(rows, N): a[r] @ weight[e].T for the rows r of segment e; rows past the last segment are not
    written. bf16, K and N multiples of 8. expert_offsets must be non-decreasing within [0, rows]
    (as the schedule makes them); that is not checked on the device. Ref: segment_matmul_reference."""
    return torch.ops.megatron_mok.expert_gemm(a, weight, expert_offsets, cluster_m, group_m)


def expert_gemm_swiglu(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (rows, 2F), act (rows, F)) with weight (E, 2F, K) gate rows then up rows; rows past the
    last segment are not written. Ref: expert_gate_up_reference."""
    return torch.ops.megatron_mok.expert_gemm_swiglu(a, weight, expert_offsets, cluster_m, group_m)


# Rows per minibatch of the dispatching GEMM (kDispatchMinibatchRows in csrc/expert_gemm_ops.cu): the
# unit in which the dispatch hands rows to the GEMM and in which its ring buffer is reused.
DISPATCH_MINIBATCH_ROWS = 1024


def dispatch_ring_buffer_rows(rows: int, ring_minibatches: int) -> int:
    """Rows of dispatch_expert_gemm_swiglu's first result for `rows` schedule rows: `rows` when the
    ring holds every minibatch (ring_minibatches 0 or at least that many), else the ring and a mirror
    of its first 128-row m-tile (csrc/expert_gemm_ops.cu dispatch_ring_buffer_rows)."""
    if dispatch_ring_holds_every_row(rows, ring_minibatches):
        return rows
    return ring_minibatches * DISPATCH_MINIBATCH_ROWS + 128


def dispatch_ring_holds_every_row(rows: int, ring_minibatches: int) -> bool:
    """Whether dispatch_expert_gemm_swiglu's first result is the rows themselves (no slot reused)."""
    return ring_minibatches == 0 or ring_minibatches * DISPATCH_MINIBATCH_ROWS >= rows


def dispatch_expert_gemm_swiglu(
    x: torch.Tensor,
    slot_to_route: torch.Tensor,
    topk: int,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
    ring_minibatches: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, gate_up, act) = (dispatch_rows(x, slot_to_route, topk), *expert_gemm_swiglu(rows, weight,
    expert_offsets)) in one kernel: warps of every CTA dispatch the rows minibatch by minibatch and the
    GEMM starts on each minibatch once it is written (per-minibatch ready counters), so the dispatch
    overlaps the GEMM. Rows at or past expert_offsets[-1] are not written.

    ring_minibatches > 0 bounds the rows buffer to a ring of that many minibatches of
    DISPATCH_MINIBATCH_ROWS rows, whatever the routing: a slot is refilled once every tile has loaded
    its rows. It must exceed the minibatches one raster group of group_m m-tiles spans (an error
    names it otherwise). When the ring is shorter than the rows, the first result is the ring
    (dispatch_ring_buffer_rows rows), not the rows. Ref: dispatch_gate_up_reference."""
    return torch.ops.megatron_mok.dispatch_expert_gemm_swiglu(
        x, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches
    )


def expert_gemm_dgrad(
    a: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor, group_m: int = EXPERT_GEMM_GROUP_M
) -> torch.Tensor:
    """(rows, N): a[r] @ weight[e] for the rows r of segment e, weight (E, K, N) as stored (the dgrad
    GEMMs: d rows = d gate_up @ fc1[e]); rows past the last segment are not written.
    Ref: segment_matmul_reference(a, weight.transpose(1, 2), offsets)."""
    return torch.ops.megatron_mok.expert_gemm_dgrad(a, weight, expert_offsets, group_m)


def expert_gemm_dgrad_swiglu(
    grad_out: torch.Tensor,
    fc2: torch.Tensor,
    expert_offsets: torch.Tensor,
    gate_up: torch.Tensor,
    group_m: int = EXPERT_GEMM_GROUP_M,
) -> torch.Tensor:
    """(rows, 2F) d gate_up = swiglu_backward(gate_up, grad_out[r] @ fc2[e]) for the rows r of segment
    e, grad_act rounded to bf16 first (as the unfused pipeline does) and never written; fc2 (E, H, F)
    as stored. Rows past the last segment are not written. Ref: swiglu_backward_reference over
    segment_matmul_reference(grad_out, fc2.transpose(1, 2), offsets)."""
    return torch.ops.megatron_mok.expert_gemm_dgrad_swiglu(grad_out, fc2, expert_offsets, gate_up, group_m)


def expert_gemm_pingpong(
    a: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor, group_m: int = EXPERT_GEMM_GROUP_M
) -> torch.Tensor:
    """expert_gemm with ping-pong consumers (csrc/expert_gemm_pingpong_sm90.cuh), each warpgroup its own
    128x128 tiles; not used by the layer yet (faster than expert_gemm only at short K, see that
    file). Ref: segment_matmul_reference."""
    return torch.ops.megatron_mok.expert_gemm_pingpong(a, weight, expert_offsets, group_m)


def expert_gemm_wgrad(grad: torch.Tensor, inputs: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """(E, m, n): grad[rows of e].T @ inputs[rows of e] per expert, tokens as the reduction dimension
    in row order (bitwise reproducible), zeros for an expert with no rows; grad (rows, m) and inputs
    (rows, n) bf16. Ref: segment_weight_grad_reference."""
    return torch.ops.megatron_mok.expert_gemm_wgrad(grad, inputs, expert_offsets)
