"""The reference backend: every MoK stage in exact PyTorch.

These functions are the backend that runs anywhere (CPU, any GPU, any dtype) and the oracle every
fused kernel is tested against.
Each takes and returns fixed-shape tensors (shapes depend only on the schedule's capacity, never
on the routing), so the whole layer runs without a host synchronization and is deterministic:
every reduction here is either a GEMM with a fixed reduction order or an explicit loop over k.

Precision: GEMMs run in the activation dtype with fp32 accumulation (as cuBLAS/CUTLASS do),
SwiGLU runs in fp32 and is rounded once to the activation dtype, the weighted sum over k runs in
fp32 in ascending k order and is rounded once at the end.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok.backends.stages import Stages
from megatron_mok.schedule import Schedule, take_rows

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


def segment_matmul(
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


def segment_weight_grad(
    grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """dW[e] = grad_out[seg e].T @ inputs[seg e], the reduction over a segment's rows.

    Args:
        grad_out: (capacity, N); inputs: (capacity, K); offsets as in segment_matmul.
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


def dispatch_rows(source, schedule: Schedule) -> torch.Tensor:
    """Pull dispatch: gathers the rows of the group's tokens into this rank's schedule order.

    Args:
        source: Exchange.dispatch_source's; materialized as (num_ranks * num_tokens, hidden), the
            group's activations in rank order.
    Returns:
        (capacity, hidden); padding rows are zero.
    """
    x_all = source.materialize()
    route = schedule.slot_to_route
    token_row = torch.where(route >= 0, route // schedule.topk, 0)
    rows = take_rows(x_all, token_row)
    return torch.where((route >= 0).unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def swiglu(gate_up: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once. gate_up: (rows, 2F), gate columns first.

    `offsets` is unused: rows past the last segment are already zero (segment_matmul).
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def expert_gate_up(
    rows: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up projection and SwiGLU of every segment: (gate_up (capacity, 2F), act (capacity, F)).

    act is computed from the rounded gate_up, so backward's SwiGLU derivative sees the same values.
    """
    gate_up = segment_matmul(rows, fc1, offsets)
    return gate_up, swiglu(gate_up, offsets)


def dispatch_gate_up(
    source, schedule: Schedule, fc1: torch.Tensor, ring_minibatches: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pull dispatch, then the gate/up projection and SwiGLU: (rows (capacity, H), gate_up, act).
    The reference gathers every row (ring_minibatches, the kernel's buffer bound, does not apply)."""
    rows = dispatch_rows(source, schedule)
    return (rows, *expert_gate_up(rows, fc1, schedule.expert_offsets))


def swiglu_backward(
    gate_up: torch.Tensor, grad_act: torch.Tensor, offsets: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """d(gate_up) from d(act) for act = silu(gate) * up, in fp32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad_act = grad_act.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_gate = grad_act * up * (sig + silu * (1.0 - sig))
    grad_up = grad_act * silu
    return torch.cat((grad_gate, grad_up), dim=-1).to(gate_up.dtype)


def gather_route_rows(table: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    """(num_tokens, topk, hidden): table[index], zero where index is -1."""
    padded = torch.cat((table, table.new_zeros(1, table.shape[1])), dim=0)
    safe = torch.where(index >= 0, index, table.shape[0])
    return padded.index_select(0, safe).view(-1, topk, table.shape[1])


def combine(
    table: torch.Tensor,
    index: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    topk: int,
    dtype: torch.dtype,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y[t] = sum over k (ascending) of w[t, k] * table[index[t, k]] in fp32, rounded once to dtype.

    Routes with index -1 are skipped whatever their weight; topk_weights None means all ones.
    keep: (table rows or more, hidden), table's dtype: the whole table is copied into its first rows
    (the kernel copies only the rows routes read; the others are not read after).
    Returns: (num_tokens, hidden) in dtype.
    """
    if keep is not None:
        keep[: table.shape[0]].copy_(table)
    route_rows = gather_route_rows(table, index, topk)
    acc = torch.zeros(route_rows.shape[0], route_rows.shape[2], dtype=torch.float32, device=table.device)
    for k in range(topk):
        rows_k = route_rows[:, k].float()
        if topk_weights is not None:
            weight = torch.where(index.view(-1, topk)[:, k] >= 0, topk_weights[:, k], 0.0)
            rows_k = weight.unsqueeze(1) * rows_k
        acc = acc + rows_k
    return acc.to(dtype)


def pull_route_grads(source, schedule: Schedule) -> torch.Tensor:
    """Pull reverse-combine: each row's output gradient, weight * dY of its token, in dY's dtype.

    Args:
        source: Exchange.grad_source's; materialized as the group's output gradients
            (num_ranks * num_tokens, hidden) and routing weights (num_ranks * num_tokens * topk,) fp32.
    Returns:
        (capacity, hidden); padding rows are zero.
    """
    grad_y_all, weights_all = source.materialize()
    route = schedule.slot_to_route
    valid = route >= 0
    safe_route = torch.where(valid, route, 0)
    rows = take_rows(grad_y_all, safe_route // schedule.topk).float()
    weight = torch.where(valid, take_rows(weights_all, safe_route), 0.0)
    # Padding rows read route 0's dY through safe_route: zeroed by where, never by the weight 0,
    # so a non-finite dY of token 0 stays out of other experts' segments (NaN * 0 is NaN).
    return torch.where(valid.unsqueeze(1), rows * weight.unsqueeze(1), 0.0).to(grad_y_all.dtype)


def route_weight_grads(
    grad_y: torch.Tensor, table: torch.Tensor, index: torch.Tensor, topk: int
) -> torch.Tensor:
    """d topk_weights[t, k] = <dY[t], table[index[t, k]]> in fp32; zero for dropped routes."""
    route_rows = gather_route_rows(table, index, topk)
    grads = torch.einsum("th,tkh->tk", grad_y.float(), route_rows.float())
    return torch.where(index.view(-1, topk) >= 0, grads, 0.0)


def dgrad_swiglu(
    grad_out: torch.Tensor, fc2: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """d gate_up (capacity, 2F) from d out (capacity, H): the down projection's dgrad, grad_act =
    grad_out @ fc2[e] per segment (rounded like every matmul stage), then the SwiGLU backward."""
    grad_act = segment_matmul(grad_out, fc2.transpose(1, 2), offsets)
    return swiglu_backward(gate_up, grad_act, offsets)


def dgrad_rows(grad_gate_up: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """d rows (capacity, H) = d gate_up @ fc1[e] per segment: the gate/up projection's dgrad."""
    return segment_matmul(grad_gate_up, fc1.transpose(1, 2), offsets)


REFERENCE_STAGES = Stages(
    dispatch_rows=dispatch_rows,
    dispatch_gate_up=dispatch_gate_up,
    expert_down=segment_matmul,
    segment_matmul=segment_matmul,
    swiglu=swiglu,
    swiglu_backward=swiglu_backward,
    segment_weight_grad=segment_weight_grad,
    dgrad_swiglu=dgrad_swiglu,
    dgrad_rows=dgrad_rows,
    combine=combine,
    pull_route_grads=pull_route_grads,
    route_weight_grads=route_weight_grads,
    weight_grad_family="reference",
)
