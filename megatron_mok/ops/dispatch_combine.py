"""Row movement ops (csrc/moe/): the pull dispatch, the fixed-order combine and their backward; the
pulls also straight from the ranks' symmetric regions (the in-kernel exchange, comm/symmetric.py).
References: the functions of the same stage in backends/reference.py."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok.ops.extension import register_fake
from megatron_mok.ops.tensor_checks import overlap


@register_fake("dispatch_rows")
def _dispatch_rows_fake(x_all, slot_to_route, topk, expert_offsets=None):
    return x_all.new_empty((slot_to_route.shape[0], x_all.shape[1]))


@register_fake("combine")
def _combine_fake(table, index, weights, topk):
    return table.new_empty((index.shape[0] // topk, table.shape[1]))


@register_fake("combine_keeping")
def _combine_keeping_fake(table, index, weights, topk, keep):
    return table.new_empty((index.shape[0] // topk, table.shape[1]))


@register_fake("pull_grad_rows")
def _pull_grad_rows_fake(grad_y_all, weights_all, slot_to_route, topk, expert_offsets=None):
    return grad_y_all.new_empty((slot_to_route.shape[0], grad_y_all.shape[1]))


@register_fake("dispatch_rows_from_peers")
def _dispatch_rows_from_peers_fake(own_tokens, peer_token_ptrs, slot_to_route, topk, expert_offsets=None):
    return own_tokens.new_empty((slot_to_route.shape[0], own_tokens.shape[1]))


@register_fake("pull_grad_rows_from_peers")
def _pull_grad_rows_from_peers_fake(own_grad_tokens, peer_grad_ptrs, peer_weight_ptrs, slot_to_route, topk, expert_offsets=None):
    return own_grad_tokens.new_empty((slot_to_route.shape[0], own_grad_tokens.shape[1]))


@register_fake("route_weight_grads")
def _route_weight_grads_fake(grad_y, table, index, topk):
    return grad_y.new_empty((grad_y.shape[0], topk), dtype=torch.float32)


def dispatch_rows(
    x_all: torch.Tensor, slot_to_route: torch.Tensor, topk: int, expert_offsets: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(capacity, H): x_all[slot_to_route // topk], zero for route -1. Ref: reference.dispatch_rows.
    expert_offsets ((E + 1,) int32, every gather here): when given, rows at or past its last entry
    (the schedule's end) are left unwritten, as the GEMMs leave them; no stage reads them."""
    return torch.ops.megatron_mok.dispatch_rows(x_all, slot_to_route, topk, expert_offsets)


def combine(table: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], topk: int) -> torch.Tensor:
    """(T, H) in table.dtype: fixed-order fp32 sum over k. Ref: reference.combine."""
    return torch.ops.megatron_mok.combine(table, index, weights, topk)


def combine_keeping(
    table: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], topk: int, keep: torch.Tensor
) -> torch.Tensor:
    """combine, and every row a route reads written to the same row of keep ((table rows or more, H),
    table's dtype) as it is read; rows no route reads are not written. Forward's copy of a table that
    lies in a buffer the exchange reuses, made by the reads the combine does anyway."""
    if overlap(keep, table):  # (rows written while other blocks read the table)
        raise ValueError("combine_keeping: keep must not overlap table in memory")
    return torch.ops.megatron_mok.combine_keeping(table, index, weights, topk, keep)


def pull_grad_rows(
    grad_y_all: torch.Tensor,
    weights_all: torch.Tensor,
    slot_to_route: torch.Tensor,
    topk: int,
    expert_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(capacity, H): w[route] * dY[route // topk]. Ref: reference.pull_route_grads."""
    return torch.ops.megatron_mok.pull_grad_rows(grad_y_all, weights_all, slot_to_route, topk, expert_offsets)


def dispatch_rows_from_peers(
    own_tokens: torch.Tensor,
    peer_token_ptrs: list[int],
    slot_to_route: torch.Tensor,
    topk: int,
    expert_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dispatch_rows over the group's rows where they lie, in the ranks' `tokens` regions: own_tokens
    is this rank's (T, H) copy (bf16/fp32; every rank's has its shape), peer_token_ptrs every rank's
    address of it in rank order (own's among them). Row g = route // topk of the group is rank
    g // T's token g % T. Returns (capacity, H), bitwise dispatch_rows(cat of the regions, ...)."""
    return torch.ops.megatron_mok.dispatch_rows_from_peers(own_tokens, peer_token_ptrs, slot_to_route, topk, expert_offsets)


def pull_grad_rows_from_peers(
    own_grad_tokens: torch.Tensor,
    peer_grad_ptrs: list[int],
    peer_weight_ptrs: list[int],
    slot_to_route: torch.Tensor,
    topk: int,
    expert_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """pull_grad_rows over the ranks' `grad_tokens` (dY, (T, H) each) and `grad_weights` ((T * topk,)
    float32 each, by local route t * topk + k) regions: (capacity, H), row s = w[route] * dY[route //
    topk] of the group, bitwise pull_grad_rows on the concatenated regions."""
    return torch.ops.megatron_mok.pull_grad_rows_from_peers(
        own_grad_tokens, peer_grad_ptrs, peer_weight_ptrs, slot_to_route, topk, expert_offsets
    )


def route_weight_grads(grad_y: torch.Tensor, table: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    """(T, K) float32: <dY[t], table[index]>. Ref: reference.route_weight_grads."""
    return torch.ops.megatron_mok.route_weight_grads(grad_y, table, index, topk)
