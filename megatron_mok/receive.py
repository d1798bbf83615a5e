"""The receive capacity: a pass over a rank's schedule in windows of bounded rows (macrobatches).

A rank's schedule holds every route of the group its experts could receive: R*T*K rows at EP = R
(plus padding), though a balanced routing fills about T*K of them. The expert stages' buffers
(rows, gate_up, act, the down outputs and their gradients) would be sized by that worst case and
grow with EP. So a pass runs over the schedule in `num_windows` windows of `window_rows` rows:
window w is rows [w*W, (w+1)*W) of the schedule, each window one macrobatch through the same
stages (dispatch, gate/up, down, push), with its buffers reused by the next. W comes from
`MoKConfig.receive_capacity_factor`: W >= factor*T*K + the segments' padding, so a routing that
sends no rank more than factor*T*K routes needs one window, and any routing (all of the group's
routes to one expert included) completes in at most num_windows, with memory set by W alone. The
count is fixed by the shapes (no host synchronization): windows past the received rows are empty,
and their kernels find no work.

What forward keeps for backward is window 0's gate/up output; backward recomputes the others'
(pulling their rows again, as it does anyway for the fc1 weight gradient). Per-row stages give the
same bits in any window (a row's GEMM does not depend on the rows beside it), and the weight
gradients carry their fp32 accumulators from window to window (ops.expert_gemm_wgrad_window), so a
windowed pass is bitwise the one-window pass. That carry needs every window boundary on a K block of
every segment: with more than one window the segments are aligned to EXPERT_WGRAD_K_ROWS.

Only the in-kernel exchange returns rows window by window (Exchange.windowed); over the collective
exchange a pass is one window of the whole schedule.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from megatron_mok.limits import EXPERT_GEMM_TILE_M, EXPERT_WGRAD_K_ROWS, schedule_capacity
from megatron_mok.schedule import Schedule


# A pass's windows are a host loop of launches: past this many, a too small factor is an error.
MAX_RECEIVE_WINDOWS = 1024


@dataclasses.dataclass(frozen=True)
class ReceivePlan:
    """How a pass covers a schedule; a function of the shapes and the config only, so every rank of
    a group computes the same plan."""

    segment_alignment: int  # the schedule's (config.segment_alignment, or a multiple of it)
    capacity: int  # the schedule's rows
    window_rows: int  # W: rows of each window
    num_windows: int  # M: ceil(capacity / W)


def receive_window_rows(num_tokens: int, topk: int, num_local_experts: int, segment_alignment: int, factor: float) -> int:
    """W for a factor: room for factor*T*K routes and every segment's worst padding, in whole m-tiles."""
    routes = math.ceil(factor * num_tokens * topk)
    rows = routes + num_local_experts * (segment_alignment - 1)
    return max(EXPERT_GEMM_TILE_M, -(-rows // EXPERT_GEMM_TILE_M) * EXPERT_GEMM_TILE_M)


def receive_plan(
    *, num_ranks: int, num_tokens: int, topk: int, num_local_experts: int, segment_alignment: int, factor: float, windowed: bool
) -> ReceivePlan:
    """The plan of a layer call. windowed: whether the exchange returns rows window by window."""
    num_routes = num_ranks * num_tokens * topk
    capacity = schedule_capacity(num_routes, num_local_experts, segment_alignment)
    if not windowed:
        return ReceivePlan(segment_alignment, capacity, capacity, 1)
    if receive_window_rows(num_tokens, topk, num_local_experts, segment_alignment, factor) >= capacity:
        return ReceivePlan(segment_alignment, capacity, capacity, 1)  # one window: the schedule as is
    alignment = math.lcm(segment_alignment, EXPERT_WGRAD_K_ROWS)
    capacity = schedule_capacity(num_routes, num_local_experts, alignment)
    window_rows = receive_window_rows(num_tokens, topk, num_local_experts, alignment, factor)
    if window_rows >= capacity:  # (the coarser alignment's padding filled the gap)
        return ReceivePlan(alignment, capacity, capacity, 1)
    num_windows = -(-capacity // window_rows)
    if num_windows > MAX_RECEIVE_WINDOWS:
        raise ValueError(
            f"MoKConfig.receive_capacity_factor={factor} gives {num_windows} receive windows per pass (each a "
            f"sequence of launches), more than {MAX_RECEIVE_WINDOWS}: use a larger factor"
        )
    return ReceivePlan(alignment, capacity, window_rows, num_windows)


@dataclasses.dataclass(frozen=True)
class Window:
    """Rows [begin, begin + rows) of a pass's schedule, as a schedule of its own for the stages."""

    index: int
    num_windows: int
    begin: int
    # slot_to_route: rows [begin, begin + W) (-1 past the schedule's end); expert_offsets: the
    # segments clamped to [0, W), window-relative; route_to_slot: empty (a window has no route table).
    schedule: Schedule
    full_offsets: torch.Tensor  # (E + 1,) int32: the whole schedule's segment offsets

    @property
    def rows(self) -> int:
        return self.schedule.capacity

    @property
    def last(self) -> bool:
        return self.index == self.num_windows - 1


def windows(schedule: Schedule, plan: ReceivePlan) -> list[Window]:
    """The plan's windows over `schedule` (views and tiny device ops: no host synchronization)."""
    if schedule.capacity != plan.capacity or schedule.segment_alignment != plan.segment_alignment:
        raise ValueError(
            f"the schedule has {schedule.capacity} rows at alignment {schedule.segment_alignment}, the plan "
            f"{plan.capacity} at {plan.segment_alignment}"
        )
    if plan.num_windows == 1:
        return [Window(0, 1, 0, schedule, schedule.expert_offsets)]
    rows = plan.window_rows
    padded = F.pad(schedule.slot_to_route, (0, plan.num_windows * rows - plan.capacity), value=-1)
    no_routes = schedule.route_to_slot.new_empty((0,))
    out = []
    for index in range(plan.num_windows):
        begin = index * rows
        offsets = (schedule.expert_offsets - begin).clamp(0, rows).to(torch.int32)
        window_schedule = dataclasses.replace(
            schedule, slot_to_route=padded[begin:begin + rows], route_to_slot=no_routes, expert_offsets=offsets
        )
        out.append(Window(index, plan.num_windows, begin, window_schedule, schedule.expert_offsets))
    return out
