"""The sm90 expert GEMMs (csrc/gemm/): persistent warp-specialized TMA + wgmma grouped GEMMs over the
schedule's expert segments, forward (gate/up with SwiGLU and optionally the pull dispatch inside,
down) and backward (dgrads reading the weights as stored, weight gradients, whole or one window of
rows at a time with the accumulators carried). References: the functions of the same stage in
backends/reference.py. The launch shape (cluster_m: CTAs per cluster; group_m: m-tiles per raster
group) is the caller's argument: the kernel backend passes its tuning table's (backends/tuning.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import limits
from megatron_mok.limits import wgrad_carry_numel
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


@register_fake("dispatch_expert_gemm_swiglu_from_peers")
def _dispatch_expert_gemm_swiglu_from_peers_fake(
    own_tokens, peer_token_ptrs, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches
):
    return _dispatch_expert_gemm_swiglu_fake(
        own_tokens, slot_to_route, topk, weight, expert_offsets, cluster_m, group_m, ring_minibatches
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


@register_fake("expert_gemm_wgrad_window")
def _expert_gemm_wgrad_window_fake(grad, inputs, expert_offsets, window_begin, last_window, out, carry_in, carry_out):
    return None  # writes out and carry_out in place


def expert_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
) -> torch.Tensor:
    """(rows, N): a[r] @ weight[e].T for the rows r of segment e; rows past the last segment are not
    written. bf16, K and N multiples of 8. expert_offsets must be non-decreasing within [0, rows]
    (as the schedule makes them); that is not checked on the device. Ref: reference.segment_matmul."""
    return torch.ops.megatron_mok.expert_gemm(a, weight, expert_offsets, cluster_m, group_m)


def expert_gemm_swiglu(
    a: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
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
    cluster_m: int,
    group_m: int,
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
    cluster_m: int,
    group_m: int,
    ring_minibatches: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dispatch_expert_gemm_swiglu with the rows pulled straight from the ranks' `tokens` regions, in
    the same one kernel: its dispatch warps read row g = slot_to_route[r] // topk from rank g // T's
    region (T = own_tokens.shape[0]) over the peer mappings, minibatch by minibatch, while the GEMM
    consumes the minibatches already written.

    own_tokens: (T, K) bf16, this rank's copy of the region (its shape, dtype and device stand for
    every rank's; it is not read). peer_token_ptrs: every rank's address of it, in rank order
    (comm/symmetric.py peer_ptrs), at most limits.MAX_EP_RANKS. The other arguments and the results
    are dispatch_expert_gemm_swiglu's, and so is the ring: ring_minibatches > 0 bounds the rows buffer
    whatever the routing, and when the ring is shorter than the rows
    (not limits.dispatch_ring_holds_every_row) the first result is the ring
    (limits.dispatch_ring_buffer_rows rows), not the rows. The results are bitwise those of
    dispatch_expert_gemm_swiglu(torch.cat(regions), ...): the same bf16 rows reach the same GEMM
    tiles (tests/ops/test_gpu_exchange.py test_dispatching_gemm_from_peers_equals_the_one_tensor_kernel_bitwise)."""
    row_bytes = own_tokens.shape[-1] * own_tokens.element_size()
    if row_bytes % 16 != 0 or any(ptr % 16 != 0 for ptr in peer_token_ptrs):
        # The kernel's dispatch warps copy 16-byte units (and bulk-prefetch whole rows), which a base
        # or row off 16 bytes cannot give; the row gather has a one-element path. So: the two-kernel
        # pull, bitwise the same results, without the overlap or the ring bound (the first result is
        # every row, a superset of what a caller of the ring may read). Checked first as the kernel
        # checks it, so that a bad ring is an error on either path.
        if ring_minibatches != 0 and not (
            limits.raster_group_minibatches(group_m) < ring_minibatches <= limits.MAX_DISPATCH_RING_MINIBATCHES
        ):
            raise RuntimeError(
                "dispatch_expert_gemm_swiglu_from_peers: ring_minibatches must be 0 (no bound) or more than the "
                f"{limits.raster_group_minibatches(group_m)} minibatches a raster group of group_m = {group_m} m-tiles "
                f"spans, got {ring_minibatches}"
            )
        rows = dispatch_rows_from_peers(own_tokens, peer_token_ptrs, slot_to_route, topk, expert_offsets)
        gate_up, act = expert_gemm_swiglu(rows, weight, expert_offsets, cluster_m, group_m)
        return rows, gate_up, act
    return torch.ops.megatron_mok.dispatch_expert_gemm_swiglu_from_peers(
        own_tokens, list(peer_token_ptrs), slot_to_route, topk, weight, expert_offsets, cluster_m, group_m,
        ring_minibatches,
    )


def expert_gemm_dgrad(
    a: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor, group_m: int
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
    group_m: int,
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


def expert_gemm_wgrad_window(
    grad: torch.Tensor,
    inputs: torch.Tensor,
    expert_offsets: torch.Tensor,
    window_begin: int,
    last_window: bool,
    out: torch.Tensor,
    carry_in: Optional[torch.Tensor] = None,
    carry_out: Optional[torch.Tensor] = None,
) -> None:
    """expert_gemm_wgrad over one window of the schedule's rows, in place: calling it for the windows
    [w * W, w * W + W) of the schedule in order, w = 0 .. M - 1 (the last one may be shorter), gives
    `out` bitwise equal to expert_gemm_wgrad(all grad rows, all inputs rows, expert_offsets), with
    only a window's rows in memory at once.

    grad (W, m) bf16 and inputs (W, n) bf16: schedule rows [window_begin, window_begin + W); m and n
    multiples of 8, W >= 1. expert_offsets (E + 1,) int32: the WHOLE schedule's segment offsets (not
    clamped to the window), non-decreasing from 0 (not checked). window_begin: a multiple of 64.
    last_window: the schedule ends with this window. out (E, m, n) bf16: written in place, expert e
    by the window where its segment [o_e, o_e+1) ends (b < o_e+1 <= b + W, b = window_begin), or an
    empty expert by the window with b <= o_e < b + W (the last window also stores those at or past
    its end, as expert_gemm_wgrad does past its rows).

    An expert whose segment crosses a window boundary has its fp32 accumulators carried: carry_in
    holds those of the expert continuing into this window (o_e < b < o_e+1), carry_out receives those
    of the expert continuing past it (o_e < b + W < o_e+1; nothing of it goes to out yet). Each is
    None or a float32 (wgrad_carry_numel(m, n),) tensor, and they must be different buffers: pass
    carry_in = bufs[w % 2], carry_out = bufs[(w + 1) % 2] (None for w = 0, and on the last window).
    Every window boundary must fall on a 64-row K block of the segment it splits
    ((boundary - o_e) % 64 == 0, e.g. segments aligned to 64 and W a multiple of 64); the kernel
    checks it and a missing carry buffer on the device (offsets are not read on the host), records
    the failure (last_failure()) and traps. Ref: reference.segment_weight_grad over all rows."""
    _check_wgrad_window_args(grad, inputs, expert_offsets, window_begin, last_window, out, carry_in, carry_out)
    torch.ops.megatron_mok.expert_gemm_wgrad_window(
        grad, inputs, expert_offsets, window_begin, last_window, out, carry_in, carry_out
    )


def _check_wgrad_window_args(grad, inputs, expert_offsets, window_begin, last_window, out, carry_in, carry_out):
    """ValueErrors naming the argument, shapes and dtypes before devices (so they are checkable on the CPU)."""

    def fail(message: str) -> None:
        raise ValueError(f"expert_gemm_wgrad_window: {message}")

    tensors = {"grad": grad, "inputs": inputs, "expert_offsets": expert_offsets, "out": out}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a tensor, got {type(t).__name__}")
    for name in ("grad", "inputs"):
        t = tensors[name]
        if t.dtype != torch.bfloat16 or t.dim() != 2:
            fail(f"{name} must be a 2-D bfloat16 tensor, got {tuple(t.shape)} {t.dtype}")
    if grad.shape[0] != inputs.shape[0]:
        fail(f"grad (W, m) and inputs (W, n) must have the same rows, got {tuple(grad.shape)} and {tuple(inputs.shape)}")
    rows, m, n = grad.shape[0], grad.shape[1], inputs.shape[1]
    if rows < 1:
        fail("the window must hold at least one row (grad (W, m)), got 0")
    if m <= 0 or m % 8 or n <= 0 or n % 8:
        fail(f"m (grad's columns) and n (inputs' columns) must be positive multiples of 8, got {m} and {n}")
    if expert_offsets.dtype != torch.int32 or expert_offsets.dim() != 1 or expert_offsets.shape[0] < 2:
        fail(f"expert_offsets must be int32 (E + 1,) with at least one expert, got {tuple(expert_offsets.shape)} "
             f"{expert_offsets.dtype}")
    if isinstance(window_begin, bool) or not isinstance(window_begin, int):
        fail(f"window_begin must be an int, got {type(window_begin).__name__}")
    # A window boundary falls on a K block of every segment it splits (csrc/gemm/tile_sm90.cuh kK).
    if window_begin < 0 or window_begin % limits.EXPERT_WGRAD_K_ROWS:
        fail(f"window_begin must be a non-negative multiple of {limits.EXPERT_WGRAD_K_ROWS} (the K blocks of a "
             f"carried segment), got {window_begin}")
    if window_begin + rows >= 1 << 31:
        fail(f"window_begin + W must be below 2^31, got {window_begin + rows}")
    if not isinstance(last_window, bool):
        fail(f"last_window must be a bool, got {type(last_window).__name__}")
    experts = expert_offsets.shape[0] - 1
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (experts, m, n):
        fail(f"out must be bfloat16 (E, m, n) = {(experts, m, n)}, got {tuple(out.shape)} {out.dtype}")
    numel = wgrad_carry_numel(m, n)
    for name, carry in (("carry_in", carry_in), ("carry_out", carry_out)):
        if carry is None:
            continue
        if not isinstance(carry, torch.Tensor) or carry.dtype != torch.float32 or tuple(carry.shape) != (numel,):
            got = f"{tuple(carry.shape)} {carry.dtype}" if isinstance(carry, torch.Tensor) else type(carry).__name__
            fail(f"{name} must be None or float32 (wgrad_carry_numel(m, n),) = ({numel},), got {got}")
        tensors[name] = carry
    if carry_in is not None and carry_out is not None and torch._C._is_alias_of(carry_in, carry_out):
        fail("carry_in and carry_out must not share storage (one expert's tiles read the one while another's write "
             "the other): alternate two buffers by window parity")
    for name, t in tensors.items():
        if not t.is_contiguous():
            fail(f"{name} must be contiguous")
    for name, t in tensors.items():
        if t.device.type != "cuda" or t.device != grad.device:
            fail(f"{name} must be a CUDA tensor on grad's device ({grad.device}), got {t.device}")
