"""The schedule op (csrc/moe/schedule_sm90.cuh). Reference: schedule.build_schedule_torch."""

from __future__ import annotations

import torch

from megatron_mok.limits import schedule_capacity
from megatron_mok.ops.extension import register_fake


@register_fake("build_schedule")
def _build_schedule_fake(topk_ids_all, rank, num_local_experts, alignment, num_experts_checked):
    num_routes = topk_ids_all.numel()
    new = topk_ids_all.new_empty
    return (
        new((schedule_capacity(num_routes, num_local_experts, alignment),), dtype=torch.int64),
        new((num_routes,), dtype=torch.int64),
        new((num_local_experts,), dtype=torch.int32),
        new((num_local_experts + 1,), dtype=torch.int32),
    )


def build_schedule(
    topk_ids_all: torch.Tensor, rank: int, num_local_experts: int, alignment: int, num_experts_checked: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_to_route, route_to_slot, expert_counts, expert_offsets) from topk_ids_all (R, T, K).
    num_experts_checked > 0: the kernel also checks every id against [-1, num_experts_checked) and
    traps on a bad one (ops.last_failure() then names it)."""
    return torch.ops.megatron_mok.build_schedule(topk_ids_all, rank, num_local_experts, alignment, num_experts_checked)
