"""The sm90 expert GEMMs (csrc/gemm/): persistent warp-specialized TMA + wgmma grouped GEMMs over the
schedule's expert segments, forward (gate/up with SwiGLU and optionally the pull dispatch inside,
down) and backward (dgrads reading the weights as stored, weight gradients). References: the
functions of the same stage in backends/reference.py. Launch-shape defaults: backends/tuning.py.
"""

from __future__ import annotations

import torch

from megatron_mok import limits
from megatron_mok.backends.tuning import EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M
from megatron_mok.ops.dispatch_combine import dispatch_rows_from_peers
from megatron_mok.ops.extension import register_fake


@register_fake("expert_gemm")
def _expert_gemm_fake(a, weight, expert_offsets, cluster_m, group_m):
    return a.new_empty((a.shape[0], weight.shape[1]))


@register_fake("expert_gemm_swiglu")
def _expert_gemm_swiglu_fake(a, weight, expert_offsets, cluster_m, group_m):
    return a.new_empty((a.shape[0], weight.shape[1])), a.new_empty((a.shape[0], weight.shape[1] // 2))


@register_fake("dispatch_expert_gemm_swiglu")
def _dispatch_expert_gemm_swiglu_fake(x, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches):
    rows = slot_to_route.shape[0]
    return (
        x.new_empty((limits.dispatch_ring_buffer_rows(rows, ring_minibatches), x.shape[1])),
        x.new_empty((rows, weight.shape[1])),
        x.new_empty((rows, weight.shape[1] // 2)),
    )


@register_fake("expert_gemm_dgrad")
def _expert_gemm_dgrad_fake(a, weight, expert_offsets, group_m):
    return a.new_empty((a.shape[0], weight.shape[2]))


@register_fake("expert_gemm_dgrad_swiglu")
def _expert_gemm_dgrad_swiglu_fake(grad_out, fc2, expert_offsets, gate_up, group_m):
    return grad_out.new_empty((grad_out.shape[0], 2 * fc2.shape[2]))


@register_fake("expert_gemm_wgrad")
def _expert_gemm_wgrad_fake(grad, inputs, expert_offsets):
    return grad.new_empty((expert_offsets.shape[0] - 1, grad.shape[1], inputs.shape[1]))


def expert_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
) -> torch.Tensor:
    """(rows, N): a[r] @ weight[e].T for the rows r of segment e; rows past the last segment are not
    written. bf16, K and N multiples of 8. expert_offsets must be non-decreasing within [0, rows]
    (as the schedule makes them); that is not checked on the device. Ref: reference.segment_matmul."""
    return torch.ops.megatron_mok.expert_gemm(a, weight, expert_offsets, cluster_m, group_m)


def expert_gemm_swiglu(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (rows, 2F), act (rows, F)) with weight (E, 2F, K) gate rows then up rows; rows past the
    last segment are not written. Ref: reference.expert_gate_up."""
    return torch.ops.megatron_mok.expert_gemm_swiglu(a, weight, expert_offsets, cluster_m, group_m)


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
    limits.DISPATCH_MINIBATCH_ROWS rows, whatever the routing: a slot is refilled once every tile has loaded
    its rows. It must exceed the minibatches one raster group of group_m m-tiles spans (an error
    names it otherwise). When the ring is shorter than the rows, the first result is the ring
    (limits.dispatch_ring_buffer_rows rows), not the rows. Ref: reference.dispatch_gate_up."""
    return torch.ops.megatron_mok.dispatch_expert_gemm_swiglu(
        x, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches
    )


def dispatch_expert_gemm_swiglu_from_peers(
    own_tokens: torch.Tensor,
    peer_token_ptrs: list[int],
    slot_to_route: torch.Tensor,
    topk: int,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int = EXPERT_GEMM_CLUSTER_M,
    group_m: int = EXPERT_GEMM_GROUP_M,
    ring_minibatches: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dispatch_expert_gemm_swiglu with the rows pulled straight from the ranks' `tokens` regions
    (own_tokens and peer_token_ptrs as for dispatch_rows_from_peers).

    For now two kernels, not one: dispatch_rows_from_peers, then expert_gemm_swiglu on its rows. The
    results are bitwise those of the dispatching kernel (the same GEMM tiles over the same bf16 rows:
    tests/test_gpu_expert_gemm.py test_dispatching_gemm_equals_dispatch_then_gemm), but the dispatch
    does not overlap the GEMM and the rows are not bounded by the ring: the first result is every
    row, (capacity, H), whatever ring_minibatches (checked as the dispatching op checks it, so
    callers need not change when the GEMM's dispatch warps read the peers themselves)."""
    if ring_minibatches != 0 and not (limits.raster_group_minibatches(group_m) < ring_minibatches < (1 << 20)):
        raise RuntimeError(
            "dispatch_expert_gemm_swiglu_from_peers: ring_minibatches must be 0 (no bound) or more than the "
            f"{limits.raster_group_minibatches(group_m)} minibatches a raster group of group_m = {group_m} m-tiles "
            f"spans, got {ring_minibatches}"
        )
    rows = dispatch_rows_from_peers(own_tokens, peer_token_ptrs, slot_to_route, topk, expert_offsets)
    gate_up, act = expert_gemm_swiglu(rows, weight, expert_offsets, cluster_m, group_m)
    return rows, gate_up, act


def expert_gemm_dgrad(
    a: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor, group_m: int = EXPERT_GEMM_GROUP_M
) -> torch.Tensor:
    """(rows, N): a[r] @ weight[e] for the rows r of segment e, weight (E, K, N) as stored (the dgrad
    GEMMs: d rows = d gate_up @ fc1[e]); rows past the last segment are not written.
    Ref: reference.segment_matmul(a, weight.transpose(1, 2), offsets)."""
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
    as stored. Rows past the last segment are not written. Ref: reference.dgrad_swiglu."""
    return torch.ops.megatron_mok.expert_gemm_dgrad_swiglu(grad_out, fc2, expert_offsets, gate_up, group_m)


def expert_gemm_wgrad(grad: torch.Tensor, inputs: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """(E, m, n): grad[rows of e].T @ inputs[rows of e] per expert, tokens as the reduction dimension
    in row order (bitwise reproducible), zeros for an expert with no rows; grad (rows, m) and inputs
    (rows, n) bf16. Ref: reference.segment_weight_grad."""
    return torch.ops.megatron_mok.expert_gemm_wgrad(grad, inputs, expert_offsets)
