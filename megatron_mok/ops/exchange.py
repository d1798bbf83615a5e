"""The in-kernel exchange's ops (csrc/moe/exchange_sm90.cuh, csrc/moe/push_combine_sm90.cuh): the
signal protocol of comm/symmetric.py, the push combine and the region pull. comm/symmetric_exchange.py
is their caller. The row pulls from the peers' regions are in dispatch_combine.py.

Every op takes this rank's own copy of what it writes or waits on as a tensor (mutable where the op
or a peer writes it), so torch.compile keeps the ops and their order; every other rank's copy comes
as a device address, in rank order (SymmetricRegion.peer_ptrs), at most limits.MAX_EP_RANKS of them.
Reference: the collective exchange (comm/exchange.py CollectiveExchange) moves the same bytes.
"""

from __future__ import annotations

import functools

import torch

from megatron_mok.ops.extension import extension_error, register_fake


@functools.cache
def exchange_phase_names() -> tuple[str, ...]:
    """The exchange's phases in the order of the signal pad's first dimension (the index is the
    phase id the ops take), from the extension (csrc/common/failure_codes.h, the one table)."""
    if extension_error() is not None:
        raise RuntimeError(f"the in-kernel exchange needs the CUDA extension: {extension_error()}")
    return tuple(torch.ops.megatron_mok.exchange_phase_names())


@register_fake("exchange_begin")
def _exchange_begin_fake(calls, signals, rank, phase):
    return None


@register_fake("exchange_signal")
def _exchange_signal_fake(calls, signals, peer_signal_ptrs, rank, phase, kind):
    return None


@register_fake("exchange_wait_ready")
def _exchange_wait_ready_fake(calls, signals, rank, phase):
    return None


@register_fake("push_rows")
def _push_rows_fake(slot_rows, slot_to_route, topk, num_tokens, own_combine, peer_combine_ptrs):
    return None


@register_fake("gather_peer_regions")
def _gather_peer_regions_fake(own, peer_ptrs):
    return own.new_empty((len(peer_ptrs), *own.shape))


def exchange_begin(calls: torch.Tensor, signals: torch.Tensor, rank: int, phase: int) -> None:
    """Starts call c = ++calls[phase] of a phase on this rank: waits on the device until every rank
    has signalled `free` c - 1 times for it (nobody still reads what call c - 1 left). calls:
    (num_phases,) int64, this rank's; signals: (num_phases, 2, num_ranks) int64, this rank's pad.
    Bounded: past limits.WAIT_TIMEOUT_NS the kernel records the phase, the peer and the call
    (last_failure()) and traps."""
    torch.ops.megatron_mok.exchange_begin(calls, signals, rank, phase)


def exchange_signal(
    calls: torch.Tensor, signals: torch.Tensor, peer_signal_ptrs: list[int], rank: int, phase: int, kind: int
) -> None:
    """Adds one signal of `kind` (0 ready: this rank wrote the call's data; 1 free: it finished
    reading) from this rank into every rank's pad (peer_signal_ptrs, rank order, this rank's own
    pad `signals` at index rank), ordered after everything earlier on the stream (a system-scope
    fence and release)."""
    torch.ops.megatron_mok.exchange_signal(calls, signals, peer_signal_ptrs, rank, phase, kind)


def exchange_wait_ready(calls: torch.Tensor, signals: torch.Tensor, rank: int, phase: int) -> None:
    """Waits on the device until every rank has signalled `ready` for this rank's current call
    (calls[phase]) of the phase. Bounded like exchange_begin."""
    torch.ops.megatron_mok.exchange_wait_ready(calls, signals, rank, phase)


def push_rows(
    slot_rows: torch.Tensor,
    slot_to_route: torch.Tensor,
    topk: int,
    num_tokens: int,
    own_combine: torch.Tensor,
    peer_combine_ptrs: list[int],
) -> None:
    """The push combine: slot_rows[s] (capacity, H) goes to row r % (num_tokens * topk) (= t * topk + k)
    of rank r // (num_tokens * topk)'s combine region, for r = slot_to_route[s] (int64, -1: skipped).
    own_combine: this rank's region, (num_tokens * topk, H), slot_rows' dtype; peer_combine_ptrs:
    every rank's, rank order. Each slot of the group is written by one row of one rank."""
    torch.ops.megatron_mok.push_rows(slot_rows, slot_to_route, topk, num_tokens, own_combine, peer_combine_ptrs)


def gather_peer_regions(own: torch.Tensor, peer_ptrs: list[int]) -> torch.Tensor:
    """(R, *own.shape) in own's dtype: out[r] = the bytes of rank r's copy of own's region
    (peer_ptrs, rank order, own's address among them). For small regions: the routing ids."""
    return torch.ops.megatron_mok.gather_peer_regions(own, peer_ptrs)
