"""The kernel backend's stages (megatron_mok.ops over csrc/), in three tables that differ in the
expert GEMMs (MoKConfig.expert_gemm):

- SM90_KERNEL_STAGES: megatron_mok's persistent warp-specialized TMA + wgmma expert GEMM
  (csrc/expert_gemm_sm90.cuh): gate/up with the pull dispatch inside the same kernel (dispatch
  warps hand minibatches of rows to the GEMM through ready counters, in a ring buffer of
  MoKConfig.dispatch_ring_minibatches minibatches) and SwiGLU in its epilogue;
  down; and in backward the two dgrad GEMMs reading fc1 and fc2 as stored (MN-major B), the
  down one with the SwiGLU backward in its epilogue;
  The weight gradients too (csrc/expert_wgrad_sm90.cuh: tokens as the reduction dimension, both
  operands MN-major);
- GROUPED_MM_KERNEL_STAGES: torch's grouped GEMM (CUTLASS on sm90) and the SwiGLU kernels;
- AUTO_KERNEL_STAGES (the default): per projection the faster of the two on the H200, measured
  on the same inputs in one run by scripts/bench_expert_gemm.py (docs/performance.md).

All three share the schedule kernel, the fixed-order fp32 combine and the data-movement kernels of the
backward. Every reduction has a fixed order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok import ops
from megatron_mok.schedule import Schedule
from megatron_mok.stages import Stages
from megatron_mok.workspace import Workspace

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def segment_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # Rows past offsets[-1] are left unwritten; no later stage reads them.
    return _grouped_mm(rows, weight.transpose(-2, -1), offs=offsets[1:])


def dispatch_gate_up(
    x_all: torch.Tensor, schedule: Schedule, fc1: torch.Tensor, ring_minibatches: int
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    # One kernel: the dispatch runs ahead of the GEMM minibatch by minibatch, into a ring buffer of
    # ring_minibatches minibatches (0: every row). Rows at or past offsets[-1] stay unwritten; every
    # later stage reads only rows below offsets[-1] (grouped_mm's offs, the schedule's route index).
    # Clusters of 2 (B multicast to both CTAs): 0.96-0.98x CUTLASS on DeepSeek-V3 against 0.86-0.95x
    # with 1, equal on the other shapes (bench_expert_gemm, docs/performance.md).
    rows, gate_up, act = ops.dispatch_expert_gemm_swiglu(
        x_all, schedule.slot_to_route, schedule.topk, fc1.contiguous(), schedule.expert_offsets,
        cluster_m=2, ring_minibatches=ring_minibatches,
    )
    # A ring shorter than the rows holds only the last minibatches: backward gathers them again.
    return (rows if ops.dispatch_ring_holds_every_row(schedule.capacity, ring_minibatches) else None), gate_up, act


def expert_down(act: torch.Tensor, fc2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ops.expert_gemm(act, fc2.contiguous(), offsets)


def grouped_mm_gate_up(rows: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = segment_matmul(rows, fc1, offsets)
    return gate_up, ops.swiglu_forward(gate_up, offsets)


def grouped_mm_dispatch_gate_up(
    x_all: torch.Tensor, schedule: Schedule, fc1: torch.Tensor, ring_minibatches: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch's grouped GEMM takes its A operand whole: every row is gathered (no ring), and kept.
    rows = dispatch_rows(x_all, schedule)
    return (rows, *grouped_mm_gate_up(rows, fc1, schedule.expert_offsets))


def grouped_mm_dgrad_swiglu(
    grad_out: torch.Tensor, fc2: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return ops.swiglu_backward(gate_up, segment_matmul(grad_out, fc2.transpose(1, 2), offsets), offsets)


def grouped_mm_dgrad_rows(grad_gate_up: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return segment_matmul(grad_gate_up, fc1.transpose(1, 2), offsets)


def dgrad_swiglu(grad_out: torch.Tensor, fc2: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # The sm90 GEMM reads fc2 as stored (MN-major B) and applies the SwiGLU backward in its
    # epilogue; grad_act never reaches global memory. Rows at or past offsets[-1] stay unwritten.
    return ops.expert_gemm_dgrad_swiglu(grad_out, fc2.contiguous(), offsets, gate_up)


def dgrad_rows(grad_gate_up: torch.Tensor, fc1: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ops.expert_gemm_dgrad(grad_gate_up, fc1.contiguous(), offsets)


def segment_weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(grad_out.t(), inputs, offs=offsets[1:])


def expert_weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # Both operands as stored (MN-major), the segment's rows in order; zeros for an empty expert.
    return ops.expert_gemm_wgrad(grad_out, inputs, offsets)


def dispatch_rows(x_all: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    return ops.dispatch_rows(x_all, schedule.slot_to_route, schedule.topk)


def combine(
    table: torch.Tensor, index: torch.Tensor, topk_weights: Optional[torch.Tensor], topk: int, dtype: torch.dtype
) -> torch.Tensor:
    if table.dtype != dtype:
        raise ValueError(f"combine: table is {table.dtype}, expected {dtype}")
    weights = topk_weights.contiguous() if topk_weights is not None else None
    return ops.combine(table, index, weights, topk)


def pull_route_grads(
    grad_y: torch.Tensor, topk_weights: torch.Tensor, schedule: Schedule, workspace: Workspace
) -> torch.Tensor:
    grad_y_all = workspace.all_gather(grad_y).reshape(-1, grad_y.shape[1])
    weights_all = workspace.all_gather(topk_weights).reshape(-1)
    return ops.pull_grad_rows(grad_y_all, weights_all, schedule.slot_to_route, schedule.topk)


def route_weight_grads(grad_y: torch.Tensor, table: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    return ops.route_weight_grads(grad_y.contiguous(), table, index, topk)


SM90_KERNEL_STAGES = Stages(
    dispatch_rows=dispatch_rows,
    dispatch_gate_up=dispatch_gate_up,
    expert_down=expert_down,
    segment_matmul=segment_matmul,
    swiglu=ops.swiglu_forward,
    swiglu_backward=ops.swiglu_backward,
    segment_weight_grad=expert_weight_grad,
    dgrad_swiglu=dgrad_swiglu,
    dgrad_rows=dgrad_rows,
    combine=combine,
    pull_route_grads=pull_route_grads,
    route_weight_grads=route_weight_grads,
)

GROUPED_MM_KERNEL_STAGES = dataclasses.replace(
    SM90_KERNEL_STAGES,
    dispatch_gate_up=grouped_mm_dispatch_gate_up,
    expert_down=segment_matmul,
    segment_weight_grad=segment_weight_grad,
    dgrad_swiglu=grouped_mm_dgrad_swiglu,
    dgrad_rows=grouped_mm_dgrad_rows,
)

# bench_expert_gemm on 1xH200 (docs/performance.md, 2026-11-29, mok / torch on the DeepSeek-V3,
# (8192, 4096, 1536) and Qwen3-30B shapes): down 1.05-1.08x, dgrad of gate/up 1.03-1.07x, weight
# gradients 1.03-1.10x; torch's CUTLASS is ahead on gate/up (with the dispatch: 0.84-0.99x, from
# dispatched rows 0.88-1.00x) and on the down dgrad with the SwiGLU backward (0.84-0.95x).
AUTO_KERNEL_STAGES = dataclasses.replace(
    GROUPED_MM_KERNEL_STAGES,
    expert_down=expert_down,
    dgrad_rows=dgrad_rows,
    segment_weight_grad=expert_weight_grad,
)

KERNEL_STAGES = {"auto": AUTO_KERNEL_STAGES, "grouped_mm": GROUPED_MM_KERNEL_STAGES, "sm90": SM90_KERNEL_STAGES}
