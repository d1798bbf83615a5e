"""The deterministic MoK schedule: which received (source rank, token, k) route sits in which
row of this rank's expert-ordered buffer.

Every rank all-gathers the top-k routing of the expert-parallel group, so each rank computes the
same function of the same data: rows for local expert e come before rows for e + 1; inside an
expert, rows are ordered by source rank, then token, then k. Each expert's segment is padded to a
multiple of `segment_alignment` rows; padding rows hold route -1. All counts and offsets stay on
the device and every shape depends only on (num_ranks, num_tokens, topk, num_local_experts,
alignment), so building a schedule never synchronizes with the host.

Route index: route = (src_rank * num_tokens + token) * topk + k, so route // topk is the row of
the token in the all-gathered activations (num_ranks * num_tokens, hidden).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_mok.limits import schedule_capacity


@dataclasses.dataclass(frozen=True)
class Schedule:
    num_ranks: int
    rank: int
    num_tokens: int  # per rank
    topk: int
    num_local_experts: int
    segment_alignment: int
    # (capacity,) int64: route held by each row, -1 for padding rows.
    slot_to_route: torch.Tensor
    # (num_ranks * num_tokens * topk,) int64: row of each route owned here, `capacity` otherwise.
    route_to_slot: torch.Tensor
    # (num_local_experts,) int32: rows routed to each local expert (without padding).
    expert_counts: torch.Tensor
    # (num_local_experts + 1,) int32: start row of each expert's segment; [-1] is the end of
    # the last one. Segment e is rows [expert_offsets[e], expert_offsets[e + 1]).
    expert_offsets: torch.Tensor
    # Whether building it checked every id against [-1, num_ranks * num_local_experts)
    # (functional.forward checks the ids itself when given a schedule that did not).
    expert_ids_checked: bool = False

    @property
    def capacity(self) -> int:
        return self.slot_to_route.shape[0]

    @property
    def num_routes(self) -> int:
        return self.route_to_slot.shape[0]


def take_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source (N, ...) -> source[index] (M, ...) along rows; M zero rows where the source has none (a
    group without tokens: its schedule's rows are all padding, whose index, 0 by convention, points
    at no row). The references' gathers take their rows so."""
    if source.shape[0] == 0:
        return source.new_zeros((index.shape[0], *source.shape[1:]))
    return source.index_select(0, index)


def check_expert_id_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Checks -1 <= topk_ids < num_experts without synchronizing a CUDA device.

    On CPU the check raises ValueError. On CUDA (and under torch.compile) it is an assert inside
    the computation: reading the ids on the host would stall the stream and break CUDA-graph
    capture.
    """
    if topk_ids.numel() == 0:
        return
    in_range = (topk_ids >= -1) & (topk_ids < num_experts)
    # Under torch.compile the host check would be a data-dependent branch: assert in the graph.
    if topk_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(in_range.all()):
            where = (~in_range).nonzero()[0].tolist()
            bad = topk_ids[tuple(where)].item()
            # (The group's gathered ids are (num_ranks, num_tokens, topk): name the rank that passed it.)
            source = f" on rank {where[0]}" if topk_ids.dim() == 3 else ""
            raise ValueError(
                f"topk_ids holds expert id {bad}{source}, outside [-1, {num_experts}) "
                f"(num_experts = num_local_experts * expert-parallel size)"
            )
    else:
        torch._assert_async(in_range.all(), "topk_ids holds an expert id outside [-1, num_experts)")


def build_schedule_from_gathered(
    topk_ids_all: torch.Tensor,
    *,
    rank: int,
    num_local_experts: int,
    segment_alignment: int = 1,
    check_expert_ids: bool = False,
) -> Schedule:
    """Builds this rank's schedule from the group's routing: two CUDA kernels where the extension
    is loaded (csrc/moe/schedule_sm90.cuh), else `build_schedule_torch`; both give the same result.

    Args:
        topk_ids_all: (num_ranks, num_tokens, topk) int32/int64 global expert ids, -1 = dropped.
        rank: this rank's index in the expert-parallel group; it owns global experts
            [rank * num_local_experts, (rank + 1) * num_local_experts).
        check_expert_ids: check every id against [-1, num_ranks * num_local_experts) (every rank
            sees the whole group's ids, so all fail alike instead of one rank leaving the others
            in a collective). The kernel checks while it reads the ids and traps on a bad one
            (ops.last_failure() names it): no extra launches or host work before the layer's
            first large kernel. Elsewhere `check_expert_id_range` (a ValueError on CPU, a
            device-side assert on CUDA).
    """
    num_experts = topk_ids_all.shape[0] * num_local_experts
    if topk_ids_all.is_cuda:
        from megatron_mok import ops

        if ops.extension_error() is None:
            num_ranks, num_tokens, topk = topk_ids_all.shape
            slot_to_route, route_to_slot, counts, offsets = ops.build_schedule(
                topk_ids_all.contiguous(), rank, num_local_experts, segment_alignment,
                num_experts if check_expert_ids else 0,
            )
            return Schedule(
                num_ranks=num_ranks, rank=rank, num_tokens=num_tokens, topk=topk,
                num_local_experts=num_local_experts, segment_alignment=segment_alignment,
                slot_to_route=slot_to_route, route_to_slot=route_to_slot,
                expert_counts=counts, expert_offsets=offsets, expert_ids_checked=check_expert_ids,
            )
    if check_expert_ids:
        check_expert_id_range(topk_ids_all, num_experts)
    schedule = build_schedule_torch(
        topk_ids_all, rank=rank, num_local_experts=num_local_experts, segment_alignment=segment_alignment
    )
    return dataclasses.replace(schedule, expert_ids_checked=check_expert_ids)


def build_schedule_torch(
    topk_ids_all: torch.Tensor, *, rank: int, num_local_experts: int, segment_alignment: int = 1
) -> Schedule:
    """The schedule in PyTorch ops: the schedule off CUDA, and the reference of the schedule kernel;
    arguments as above."""
    num_ranks, num_tokens, topk = topk_ids_all.shape
    device = topk_ids_all.device
    num_routes = num_ranks * num_tokens * topk
    capacity = schedule_capacity(num_routes, num_local_experts, segment_alignment)

    ids = topk_ids_all.reshape(-1).to(torch.int64)  # (num_routes,)
    local_expert = ids - rank * num_local_experts
    owned = (ids >= 0) & (local_expert >= 0) & (local_expert < num_local_experts)
    # Routes not owned here sort after every local expert (key = num_local_experts).
    sort_key = torch.where(owned, local_expert, num_local_experts)
    # A stable sort of the route index (already in source-rank, token, k order) by local expert
    # gives the documented order, and is deterministic.
    sorted_key, sorted_route = torch.sort(sort_key, stable=True)

    # Unpadded segment starts from the sorted keys: searchsorted instead of bincount, which has
    # no deterministic CUDA implementation.
    expert_ids = torch.arange(num_local_experts + 1, device=device, dtype=torch.int64)
    unpadded_starts = torch.searchsorted(sorted_key, expert_ids)  # (E + 1,)
    counts = unpadded_starts[1:] - unpadded_starts[:-1]  # (E,)
    padded_counts = (counts + segment_alignment - 1) // segment_alignment * segment_alignment
    offsets = torch.zeros(num_local_experts + 1, device=device, dtype=torch.int64)
    offsets[1:] = torch.cumsum(padded_counts, 0)

    sorted_owned = sorted_key < num_local_experts
    clamped_key = sorted_key.clamp(max=num_local_experts - 1)
    position = torch.arange(num_routes, device=device, dtype=torch.int64)
    slot_of_sorted = offsets[clamped_key] + position - unpadded_starts[clamped_key]
    slot_of_sorted = torch.where(sorted_owned, slot_of_sorted, capacity)

    route_to_slot = torch.empty(num_routes, device=device, dtype=torch.int64)
    route_to_slot.scatter_(0, sorted_route, slot_of_sorted)  # a permutation: unique indices

    # One spare row at `capacity` absorbs the routes not owned here; it is cut off below. Owned
    # routes have distinct slots, so every kept row is written by exactly one route.
    slot_to_route = torch.full((capacity + 1,), -1, device=device, dtype=torch.int64)
    slot_to_route.scatter_(0, slot_of_sorted, torch.where(sorted_owned, sorted_route, -1))
    return Schedule(
        num_ranks=num_ranks,
        rank=rank,
        num_tokens=num_tokens,
        topk=topk,
        num_local_experts=num_local_experts,
        segment_alignment=segment_alignment,
        slot_to_route=slot_to_route[:capacity],
        route_to_slot=route_to_slot,
        expert_counts=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
    )
