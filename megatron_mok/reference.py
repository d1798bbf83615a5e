"""Exact PyTorch reference of every MoK stage.

These functions are the reference backend and the oracle every fused kernel is tested against.
Each takes and returns fixed-shape tensors (shapes depend only on the schedule's capacity, never
on the routing), so the whole layer runs without a host synchronization and is deterministic:
every reduction here is either a GEMM with a fixed reduction order or an explicit loop over k.

Precision: GEMMs run in the activation dtype with fp32 accumulation (as cuBLAS/CUTLASS do),
SwiGLU runs in fp32 and is rounded once to the activation dtype, the weighted sum over k runs in
fp32 in ascending k order and is rounded once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_mok.schedule import Schedule
from megatron_mok.workspace import Workspace

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def _pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = t.shape[dim]
    padded = -(-size // multiple) * multiple
    if padded == size:
        return t
    pad = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, padded - size]
    return F.pad(t, pad)


def _alignment(dtype: torch.dtype) -> int:
    # torch's grouped GEMM needs every stride to be a multiple of 16 bytes.
    return 16 // torch.empty((), dtype=dtype).element_size()


def segment_matmul_reference(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """out[i] = rows[i] @ weight[e].T for every row i of segment e.

    Args:
        rows: (capacity, K) activations in schedule order.
        weight: (num_local_experts, N, K), any strides.
        offsets: (num_local_experts + 1,) int32 segment boundaries.
    Returns:
        (capacity, N) in rows.dtype. Rows at or past offsets[-1] are zero.
    """
    n = weight.shape[1]
    align = _alignment(rows.dtype)
    # Zero padding of the reduction dim adds exact zeros; padding of N is cut off again.
    rows_p = _pad_dim(rows, 1, align)
    weight_p = _pad_dim(_pad_dim(weight, 2, align), 1, align)
    out = _grouped_mm(rows_p, weight_p.transpose(-2, -1), offs=offsets[1:])
    out = out[:, :n] if out.shape[1] != n else out
    # The grouped GEMM leaves rows past the last segment unwritten; give them a defined value.
    in_segment = torch.arange(out.shape[0], device=out.device) < offsets[-1]
    return torch.where(in_segment.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def segment_weight_grad_reference(
    grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """dW[e] = grad_out[seg e].T @ inputs[seg e], the reduction over a segment's rows.

    Args:
        grad_out: (capacity, N); inputs: (capacity, K); offsets as in segment_matmul_reference.
    Returns:
        (num_local_experts, N, K) in grad_out.dtype; an expert with no rows gets zeros.
    """
    n, k = grad_out.shape[1], inputs.shape[1]
    align = _alignment(grad_out.dtype)
    grad_p = _pad_dim(grad_out, 1, align)
    inputs_p = _pad_dim(inputs, 1, align)
    out = _grouped_mm(grad_p.t(), inputs_p, offs=offsets[1:])
    if out.shape[1] != n or out.shape[2] != k:
        out = out[:, :n, :k].contiguous()
    return out


def dispatch_rows_reference(x_all: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """Pull dispatch: gathers the rows of the group's tokens into this rank's schedule order.

    Args:
        x_all: (num_ranks * num_tokens, hidden), the group's activations in rank order.
    Returns:
        (capacity, hidden); padding rows are zero.
    """
    route = schedule.slot_to_route
    token_row = torch.where(route >= 0, route // schedule.topk, 0)
    rows = x_all.index_select(0, token_row)
    return torch.where((route >= 0).unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once. gate_up: (rows, 2F), gate columns first."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu_backward_reference(gate_up: torch.Tensor, grad_act: torch.Tensor) -> torch.Tensor:
    """d(gate_up) from d(act) for act = silu(gate) * up, in fp32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad_act = grad_act.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_gate = grad_act * up * (sig + silu * (1.0 - sig))
    grad_up = grad_act * silu
    return torch.cat((grad_gate, grad_up), dim=-1).to(gate_up.dtype)


def expert_ffn_forward_reference(
    rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate/up GEMM, SwiGLU, down GEMM per expert segment.

    Returns:
        gate_up (capacity, 2F) and out (capacity, hidden), both in rows.dtype.
    """
    gate_up = segment_matmul_reference(rows, fc1, offsets)
    out = segment_matmul_reference(swiglu_reference(gate_up), fc2, offsets)
    return gate_up, out


def return_rows_reference(
    slot_rows: torch.Tensor, schedule: Schedule, topk_ids: torch.Tensor, workspace: Workspace
) -> torch.Tensor:
    """Push combine: sends every computed row back to its route's source rank.

    Each route is computed by exactly one rank (the owner of its expert); the source picks the
    owner's copy, so no value is ever summed across ranks and the result is deterministic.

    Args:
        slot_rows: (capacity, hidden) per-row results in this rank's schedule order.
        topk_ids: (num_tokens, topk) this rank's routing.
    Returns:
        (num_tokens, topk, hidden): the result of each of this rank's routes, zero where dropped.
    """
    num_tokens, topk, hidden = schedule.num_tokens, schedule.topk, slot_rows.shape[1]
    zero_row = slot_rows.new_zeros(1, hidden)
    # Row `capacity` is the zero row that routes owned by other ranks read.
    padded = torch.cat((slot_rows, zero_row), dim=0)
    send = padded.index_select(0, schedule.route_to_slot)
    recv = workspace.all_to_all(send.view(schedule.num_ranks, num_tokens * topk, hidden))
    ids = topk_ids.to(torch.int64).reshape(-1)
    owner = torch.where(ids >= 0, ids // schedule.num_local_experts, 0)
    local_route = torch.arange(num_tokens * topk, device=ids.device, dtype=torch.int64)
    picked = recv.reshape(-1, hidden).index_select(0, owner * (num_tokens * topk) + local_route)
    dropped = (ids < 0).unsqueeze(1)
    picked = torch.where(dropped, torch.zeros((), dtype=picked.dtype, device=picked.device), picked)
    return picked.view(num_tokens, topk, hidden)


def weighted_sum_reference(
    route_out: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """y[t] = sum over k (ascending) of topk_weights[t, k] * route_out[t, k], in fp32.

    Dropped routes (id -1) are skipped whatever their weight.
    Returns: (num_tokens, hidden) float32.
    """
    weights = torch.where(topk_ids >= 0, topk_weights, 0.0)
    acc = torch.zeros(route_out.shape[0], route_out.shape[2], dtype=torch.float32, device=route_out.device)
    for k in range(route_out.shape[1]):
        acc = acc + weights[:, k : k + 1] * route_out[:, k].float()
    return acc


def pull_route_grads_reference(
    grad_y: torch.Tensor, topk_weights: torch.Tensor, schedule: Schedule, workspace: Workspace
) -> torch.Tensor:
    """Pull reverse-combine: each row's output gradient, weight * dY of its token, in dY's dtype.

    Args:
        grad_y: (num_tokens, hidden) gradient of this rank's output.
        topk_weights: (num_tokens, topk) float32.
    Returns:
        (capacity, hidden); padding rows are zero.
    """
    grad_y_all = workspace.all_gather(grad_y).reshape(-1, grad_y.shape[1])
    weights_all = workspace.all_gather(topk_weights).reshape(-1)
    route = schedule.slot_to_route
    valid = route >= 0
    safe_route = torch.where(valid, route, 0)
    rows = grad_y_all.index_select(0, safe_route // schedule.topk).float()
    weight = torch.where(valid, weights_all.index_select(0, safe_route), 0.0)
    return (rows * weight.unsqueeze(1)).to(grad_y.dtype)


def route_weight_grads_reference(
    grad_y: torch.Tensor, route_out: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """d topk_weights[t, k] = <dY[t], route_out[t, k]> in fp32; zero for dropped routes."""
    grads = torch.einsum("th,tkh->tk", grad_y.float(), route_out.float())
    return torch.where(topk_ids >= 0, grads, 0.0)
