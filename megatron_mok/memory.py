"""The memory a MoK layer call may use per rank, stated up front: `layer_memory_bound`.

The bound depends on the shapes, the EP size and the config only, never on the routing: every
buffer of a pass is sized by the receive window (receive.py) or by this rank's own tokens. It counts,
per rank and per layer call, in bytes (s = the activation dtype's size; T tokens, H hidden, F ffn
hidden, E local experts, K topk, R ranks; W the window rows, M the windows, C the schedule's rows):

    held (forward -> backward)   y s*T*H, the route table s*T*K*H (at R = 1 and M = 1 the down
                                 outputs s*C*H instead), the first window's gate/up s*W*2F, and
                                 at R = 1 and M = 1 also act s*C*F and the rows s*C*H (kept unless
                                 the sm90 gate/up ran them through a bounded ring); index tables
                                 8*(C + R*T*K + T*K)
    forward peak                 held + one window's rows (or the ring), second gate/up, act and
                                 down outputs s*W*(2H + 3F) + the gathered routing, the gathers'
                                 route scratch and the windows' route view 8*(2*R*T*K + M*W)
    backward peak                the larger of: held + dY s*T*H + d topk_weights 4*T*K, while
                                 d topk_weights reads the route table, its one reader in backward;
                                 then, the table freed (functional.backward's release_saved,
                                 as mok_moe runs it), held without the route table
                                 (it frees the first window's gate/up and act after the fc2 weight
                                 gradient too; the bound counts them held)
                                 + dY and d x 2*s*T*H + the weight gradients s*E*3F*H (and,
                                 over several windows, their carries 8*(pad(2F)*pad(H) +
                                 pad(H)*pad(F)) with sm90 weight gradients, or fp32 sums
                                 4*E*3F*H with the other families) + d topk_weights 4*T*K + one
                                 window's live buffers s*W*(H + 6F) (the order of
                                 functional._backward_window) + 8*(2*R*T*K + M*W)
    every term                   + 1 MB per buffer: the caching allocator does not split a free
                                 block when less than 1 MB would remain
    symmetric (per process)      comm/symmetric.py: 2*s*T*H + s*T*K*H + 12*T*K + 16*P*R bytes per
                                 layer shape, shared by every layer of that shape; allocated before
                                 the first call, so not part of a call's peak

FP8 blockwise (MoKConfig.precision="fp8_blockwise", FP8 weight gradients) has terms of its own:
memory_fp8.py.

The backward terms are mok_moe's backward, which frees the route table once read
(functional.backward(release_saved=True)). Where it is not freed (functional.backward without
release_saved; a saved-tensor hook that hands back a tensor of its own; torch.compile, whose graph
frees saved tensors itself; a backward with create_graph) it stays to backward's end: add it (s*C*H
at R = 1 and M = 1, else s*T*K*H) to the backward peak.

Tables of 8 bytes per group route (R*T*K) are the only terms that grow with EP: 4 MB each at the
DeepSeek-V3 shape at EP = 8, against about 2 GB of activations. Over the collective exchange a pass
is one window of C = R*T*K rows, plus gathered copies of x and dY (R*T rows) and all-to-all buffers
(R*T*K rows): all grow with EP, and this module does not bound them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_mok.backends.tuning import EXPERT_GEMM_CHOICES
from megatron_mok.config import MoKConfig
from megatron_mok.limits import NUM_EXCHANGE_PHASES, dispatch_ring_buffer_rows, dispatch_ring_holds_every_row, wgrad_carry_numel
from megatron_mok.receive import receive_plan


# PyTorch's caching allocator does not split a free block whose remainder would be under 1 MB, so
# every buffer may count up to that much more than its size; the bound allows it per buffer.
ALLOCATOR_BLOCK_SLACK = 1 << 20
HELD_BUFFERS, FORWARD_BUFFERS, BACKWARD_BUFFERS = 10, 8, 16
# What backward allocates while the route table is still held: dY in the activation dtype and
# d topk_weights.
ROUTE_READER_BUFFERS = 4


@dataclasses.dataclass(frozen=True)
class LayerMemoryBound:
    """Bytes per rank and per layer call (the module docstring's terms)."""

    held: int
    forward_peak: int
    backward_peak: int
    symmetric: int  # per process and layer shape, shared by the layers of that shape
    window_rows: int
    num_windows: int

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def layer_memory_bound(
    *,
    num_tokens: int,
    hidden: int,
    ffn_hidden: int,
    num_local_experts: int,
    topk: int,
    num_ranks: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    config: MoKConfig = MoKConfig(),
    windowed: Optional[bool] = None,
) -> LayerMemoryBound:
    """The bound of one layer call of the kernel backend (bf16 activations; FP8 blockwise experts with
    FP8 weight gradients by memory_fp8.py's terms). windowed: whether the exchange
    returns rows window by window, the in-kernel exchange (None: at EP > 1, and not at EP = 1 without
    a group). The collective exchange at EP > 1 is not bounded here: its gathered x and dY and its
    all-to-all buffers grow with EP (the module docstring), so asking for it is a ValueError."""
    from megatron_mok.comm.symmetric import symmetric_bytes_per_rank

    t, h, f, e, k, r = num_tokens, hidden, ffn_hidden, num_local_experts, topk, num_ranks
    windowed = r > 1 if windowed is None else windowed
    if r > 1 and not windowed:
        raise ValueError(
            "layer_memory_bound bounds the in-kernel exchange at EP > 1; the collective exchange's buffers "
            "grow with EP (EP*T rows of x and dY, EP*T*K rows in flight) and are not bounded here"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"layer_memory_bound models the kernel backend, which runs bf16; got dtype {dtype}")
    if config.precision == "fp8_blockwise":
        if not config.fp8_weight_grad:
            raise ValueError(
                "layer_memory_bound models the FP8 layer with FP8 weight gradients (MoKConfig.fp8_weight_grad=True, "
                "the default); its BF16 weight gradients' gathered bf16 rows and act are not modelled"
            )
        from megatron_mok.memory_fp8 import fp8_layer_memory_bound

        return fp8_layer_memory_bound(
            num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k, num_ranks=r, config=config,
            windowed=windowed,
        )
    s = torch.empty((), dtype=dtype).element_size()
    weight_grad_family = EXPERT_GEMM_CHOICES[config.expert_gemm].weight_grads
    plan = receive_plan(
        num_ranks=r, num_tokens=t, topk=k, num_local_experts=e, segment_alignment=config.segment_alignment,
        factor=config.receive_capacity_factor, windowed=windowed,
    )
    w, m, c = plan.window_rows, plan.num_windows, plan.capacity
    one_window_one_rank = r == 1 and m == 1
    routes = r * t * k
    ring = config.dispatch_ring_minibatches

    rows_kept = EXPERT_GEMM_CHOICES[config.expert_gemm].gate_up == "grouped_mm" or dispatch_ring_holds_every_row(c, ring)
    # The route table: the down outputs on one rank in one window, else every route's returned row.
    route_table = s * c * h if one_window_one_rank else s * t * k * h
    held = s * t * h + route_table + s * w * 2 * f + 8 * (c + routes + t * k) + HELD_BUFFERS * ALLOCATOR_BLOCK_SLACK
    if one_window_one_rank:
        held += s * c * f + (s * c * h if rows_kept else 0)
    # Over the in-kernel exchange the sm90 gate/up pulls a window's rows whole before its GEMM (no ring).
    rows_buffer = w if rows_kept or r > 1 else dispatch_ring_buffer_rows(w, ring)
    forward_peak = (
        held + s * (rows_buffer * h + w * (2 * f + f + h)) + 8 * (2 * routes + m * w) + FORWARD_BUFFERS * ALLOCATOR_BLOCK_SLACK
    )

    weight_grads = s * e * 3 * f * h
    if m > 1:
        if weight_grad_family == "sm90":
            weight_grads += 2 * 4 * (wgrad_carry_numel(2 * f, h) + wgrad_carry_numel(h, f))
        else:
            weight_grads += 4 * e * 3 * f * h
    # One window's buffers alive at once, at most (functional._backward_window's order): the
    # recomputed rows, gate/up and act (H + 3F); then dY rows, gate/up, d act, d gate/up and act
    # (H + 6F, d act inside grouped_mm's SwiGLU-backward dgrad); later only d gate/up with the dX
    # rows or with the rows pulled again (H + 2F).
    window_live = s * w * (h + 6 * f)
    route_reader = held + s * t * h + 4 * t * k + ROUTE_READER_BUFFERS * ALLOCATOR_BLOCK_SLACK
    backward_peak = max(
        route_reader,
        held - route_table + 2 * s * t * h + weight_grads + 4 * t * k + window_live + 8 * (2 * routes + m * w)
        + BACKWARD_BUFFERS * ALLOCATOR_BLOCK_SLACK,
    )
    symmetric = symmetric_bytes_per_rank(t, h, k, dtype, r, NUM_EXCHANGE_PHASES) if r > 1 and windowed else 0
    return LayerMemoryBound(held, forward_peak, backward_peak, symmetric, w, m)
