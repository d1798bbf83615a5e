"""The kernel backend's stages (megatron_mok.ops over csrc/), one table per `MoKConfig.expert_gemm`
family, composed from the tuning table (backends/tuning.py) projection by projection:

- "sm90": megatron_mok's persistent warp-specialized TMA + wgmma expert GEMMs (csrc/gemm/):
  gate/up with the pull dispatch inside the same kernel (dispatch warps hand minibatches of rows to
  the GEMM through ready counters, in a ring buffer of MoKConfig.dispatch_ring_minibatches
  minibatches) and SwiGLU in its epilogue; down; in backward the two dgrad GEMMs reading fc1 and
  fc2 as stored (MN-major B), the down one with the SwiGLU backward in its epilogue; the weight
  gradients with tokens as the reduction dimension;
- "grouped_mm": torch's grouped GEMM (CUTLASS on sm90) and the SwiGLU kernels;
- "auto" (the default): per projection the faster of the two (tuning.EXPERT_GEMM_CHOICES).

Every table shares the schedule kernel, the fixed-order fp32 combine and the data-movement kernels
of the backward. Every reduction has a fixed order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok import ops
from megatron_mok.backends.stages import Stages
from megatron_mok.backends.tuning import (
    DISPATCH_GEMM_CLUSTER_M,
    EXPERT_GEMM_CHOICES,
    EXPERT_GEMM_CLUSTER_M,
    EXPERT_GEMM_GROUP_M,
    ExpertGemmChoice,
)
from megatron_mok.comm.exchange import GradSource, RowSource
from megatron_mok.limits import dispatch_ring_holds_every_row
from megatron_mok.schedule import Schedule

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


# ---- torch's grouped GEMM (CUTLASS) ---------------------------------------------------------


def segment_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # Rows past offsets[-1] are left unwritten; no later stage reads them.
    return _grouped_mm(rows, weight.transpose(-2, -1), offs=offsets[1:])


def grouped_mm_gate_up(rows: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = segment_matmul(rows, fc1, offsets)
    return gate_up, ops.swiglu_forward(gate_up, offsets)


def grouped_mm_dispatch_gate_up(
    source: RowSource, schedule: Schedule, fc1: torch.Tensor, ring_minibatches: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch's grouped GEMM takes its A operand whole: every row is gathered (no ring), and kept.
    rows = dispatch_rows(source, schedule)
    return (rows, *grouped_mm_gate_up(rows, fc1, schedule.expert_offsets))


def grouped_mm_recompute_gate_up(source: RowSource, schedule: Schedule, fc1: torch.Tensor) -> torch.Tensor:
    """grouped_mm_dispatch_gate_up's gate_up without its SwiGLU launch (backward's recomputed windows)."""
    return segment_matmul(dispatch_rows(source, schedule), fc1, schedule.expert_offsets)


def grouped_mm_dgrad_swiglu(
    grad_out: torch.Tensor, fc2: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return ops.swiglu_backward(gate_up, segment_matmul(grad_out, fc2.transpose(1, 2), offsets), offsets)


def grouped_mm_dgrad_rows(grad_gate_up: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return segment_matmul(grad_gate_up, fc1.transpose(1, 2), offsets)


def segment_weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(grad_out.t(), inputs, offs=offsets[1:])


# ---- megatron_mok's sm90 expert GEMMs --------------------------------------------------------


def dispatch_gate_up(
    source: RowSource, schedule: Schedule, fc1: torch.Tensor, ring_minibatches: int
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    # One kernel: the dispatch runs ahead of the GEMM minibatch by minibatch, into a ring buffer of
    # ring_minibatches minibatches (0: every row). Rows at or past offsets[-1] stay unwritten; every
    # later stage reads only rows below offsets[-1] (grouped_mm's offs, the schedule's route index).
    launch = dict(cluster_m=DISPATCH_GEMM_CLUSTER_M, group_m=EXPERT_GEMM_GROUP_M, ring_minibatches=ring_minibatches)
    if source.peer_ptrs is None:
        rows, gate_up, act = ops.dispatch_expert_gemm_swiglu(
            source.tensor, schedule.slot_to_route, schedule.topk, fc1.contiguous(), schedule.expert_offsets, **launch
        )
    else:
        # The rows straight from the sources' regions: the same kernel, its dispatch warps reading the
        # peers' regions (bitwise the one-tensor kernel's results, the same ring bound).
        rows, gate_up, act = ops.dispatch_expert_gemm_swiglu_from_peers(
            source.tensor, list(source.peer_ptrs), schedule.slot_to_route, schedule.topk, fc1.contiguous(),
            schedule.expert_offsets, **launch,
        )
    # A ring shorter than the rows holds only the last minibatches: backward gathers them again.
    return (rows if dispatch_ring_holds_every_row(schedule.capacity, ring_minibatches) else None), gate_up, act


def expert_down(act: torch.Tensor, fc2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ops.expert_gemm(act, fc2.contiguous(), offsets, EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M)


def dgrad_swiglu(grad_out: torch.Tensor, fc2: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # The sm90 GEMM reads fc2 as stored (MN-major B) and applies the SwiGLU backward in its
    # epilogue; grad_act never reaches global memory. Rows at or past offsets[-1] stay unwritten.
    return ops.expert_gemm_dgrad_swiglu(grad_out, fc2.contiguous(), offsets, gate_up, EXPERT_GEMM_GROUP_M)


def dgrad_rows(grad_gate_up: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ops.expert_gemm_dgrad(grad_gate_up, fc1.contiguous(), offsets, EXPERT_GEMM_GROUP_M)


def expert_weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # Both operands as stored (MN-major), the segment's rows in order; zeros for an empty expert.
    return ops.expert_gemm_wgrad(grad_out, inputs, offsets)


# ---- data movement, shared by every family ---------------------------------------------------


def dispatch_rows(source: RowSource, schedule: Schedule) -> torch.Tensor:
    # Rows past the schedule's end (a receive window's unused tail) are left unwritten, as the GEMMs
    # leave theirs: no stage reads them.
    if source.peer_ptrs is None:
        return ops.dispatch_rows(source.tensor, schedule.slot_to_route, schedule.topk, schedule.expert_offsets)
    return ops.dispatch_rows_from_peers(
        source.tensor, list(source.peer_ptrs), schedule.slot_to_route, schedule.topk, schedule.expert_offsets
    )


def combine(
    table: torch.Tensor, index: torch.Tensor, topk_weights: Optional[torch.Tensor], topk: int, dtype: torch.dtype,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    if table.dtype != dtype:
        raise ValueError(f"combine: table is {table.dtype}, expected {dtype}")
    weights = topk_weights.contiguous() if topk_weights is not None else None
    if keep is not None:
        return ops.combine_keeping(table, index, weights, topk, keep)
    return ops.combine(table, index, weights, topk)


def pull_route_grads(source: GradSource, schedule: Schedule) -> torch.Tensor:
    grad_y, weights = source.grad_y, source.weights
    if grad_y.peer_ptrs is None:  # (then weights' too: a GradSource holds both in one form)
        return ops.pull_grad_rows(grad_y.tensor, weights.tensor, schedule.slot_to_route, schedule.topk, schedule.expert_offsets)
    return ops.pull_grad_rows_from_peers(
        grad_y.tensor, list(grad_y.peer_ptrs), list(weights.peer_ptrs), schedule.slot_to_route, schedule.topk,
        schedule.expert_offsets,
    )


def route_weight_grads(grad_y: torch.Tensor, table: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    return ops.route_weight_grads(grad_y.contiguous(), table, index, topk)


# Each projection's stage field and its implementation per family.
_PROJECTION_STAGES = {
    "gate_up": ("dispatch_gate_up", {"sm90": dispatch_gate_up, "grouped_mm": grouped_mm_dispatch_gate_up}),
    "down": ("expert_down", {"sm90": expert_down, "grouped_mm": segment_matmul}),
    "dgrad_down": ("dgrad_swiglu", {"sm90": dgrad_swiglu, "grouped_mm": grouped_mm_dgrad_swiglu}),
    "dgrad_gate_up": ("dgrad_rows", {"sm90": dgrad_rows, "grouped_mm": grouped_mm_dgrad_rows}),
    "weight_grads": ("segment_weight_grad", {"sm90": expert_weight_grad, "grouped_mm": segment_weight_grad}),
}


def kernel_stages_for(choice: ExpertGemmChoice) -> Stages:
    """The kernel backend's stage table for one choice of GEMM family per projection."""
    chosen = {field: implementations[getattr(choice, projection)] for projection, (field, implementations) in _PROJECTION_STAGES.items()}
    # The sm90 gate/up makes act in its epilogue at no launch of its own: backward recomputes through it.
    recompute = grouped_mm_recompute_gate_up if choice.gate_up == "grouped_mm" else None
    return Stages(
        recompute_gate_up=recompute,
        dispatch_rows=dispatch_rows,
        segment_matmul=segment_matmul,
        swiglu=ops.swiglu_forward,
        swiglu_backward=ops.swiglu_backward,
        combine=combine,
        pull_route_grads=pull_route_grads,
        route_weight_grads=route_weight_grads,
        weight_grad_family=choice.weight_grads,
        **chosen,
    )


KERNEL_STAGES = {name: kernel_stages_for(choice) for name, choice in EXPERT_GEMM_CHOICES.items()}
