"""The FP8 blockwise layer's memory bound (MoKConfig.precision="fp8_blockwise" with FP8 weight
gradients, the kernel backend): what memory.layer_memory_bound returns for it, from the shapes and
the config only, never from the routing.

Notation as memory.py's (T, H, F, E, K, R, W window rows, M windows, C the schedule's rows, s = 2
bytes of bf16), plus one byte per E4M3 value and 4 per fp32 scale of a 1x128 block:

    Q(n, c)   n rows of c values quantized along c, source scales (n, c/128): n*c + 4*n*c/128
    A(n, c)   the same with GEMM-A scales (c/128, pad4(n)): n*c + 4*(c/128)*pad4(n)
    V(n, c)   column-wise, 1x128 along the n rows (a weight gradient's operand, n padded to 128):
              c*pad128(n) + 4*(pad128(n)/128)*c
    Wq(N, K)  a weight's 128x128 copy (E, N, K): E*N*K + 4*E*(N/128)*(K/128)

Terms, per rank and per layer call:

    held       y s*T*H, the route table (the down outputs s*C*H at R = 1 and M = 1, else s*T*K*H),
               the first window's gate/up s*W*2F, the index tables 8*(C + R*T*K + T*K), and with the
               weight cache (MoKConfig.fp8_cache_weights) the forward copies Wq(2F, H) + Wq(H, F)
               (twice that with MoKConfig.fp8_cache_transposed_weights, their transposed copies kept):
               the cache holds them from the first microbatch of a weight version to the optimizer
               step, and a later call allocates nothing for them (in a CUDA-graph capture nothing
               is cached: the forward makes the same bytes and holds them for its windows instead)
    forward    held + x published Q(T, H) + without the cache both forward copies + the largest of
               a window's stages: the dispatched rows Q(W, H) and their GEMM-A scales with gate/up;
               gate/up, act A(W, F) and the down outputs s*W*H
    backward   the larger of: held + dY s*T*H + d topk_weights 4*T*K while d topk_weights reads
               the route table (its one reader in backward; then it is freed: functional.backward's
               release_saved, as mok_moe runs it), and
               held without the route table (the first window's gate/up, freed after the fc2 weight
               gradient, still counted)
               + dY published Q(T, H) (+ at M > 1 x again, for the recomputed gate/up) + dY and
               d x 2*s*T*H + d topk_weights 4*T*K + the weight gradients s*E*3F*H + at M > 1 two fp32
               carries per weight 8*(2F*H + H*F) + the largest of a window's stages
               (functional._backward_window's order; no weight copy is held across the windows):
                 down dgrad          dY rows Q(W, H) + their GEMM-A scales + d act s*W*F
                                     + one expert range's share of fc2's transposed copy: Wq over
                                     ceil(E / tuning.FP8_DGRAD_EXPERT_RANGES) experts, made (of the
                                     experts with rows in the window), multiplied and freed range by
                                     range
                 SwiGLU backward     dY rows + d act + d gate_up s*W*2F + its rows A(W, 2F);
                                     then dY rows + d gate_up + its rows + its columns V(W, 2F)
                 fc2 weight gradient d gate_up's two copies + the w * dY rows + V(W, H) + act's V(W, F)
                 gate/up dgrad       d gate_up's two copies + a range's share of fc1's transposed
                                     copy + d rows s*W*H
                 fc1 weight gradient V(W, 2F) + the rows + V(W, H)
               where the w * dY rows and the x rows are s*W*H pulled from the peers' regions over
               the in-kernel exchange (windowed), and otherwise gathered by the column kernel
               straight from one tensor: 32*W bytes of row indices and weights (RowsToGather), or
               with tuning.FP8_WGRAD_COLUMNS_FROM_PEERS straight from the peers' regions: 32*W and
               the routes' weights 4*R*T*K
               (+ at M > 1 the recomputed gate/up s*W*2F in the stages up to act's column-wise
               quantization, made right after the SwiGLU backward, and a stage of its own that makes
               it from the dispatched rows, without the cache through fc1's forward copy Wq(2F, H)
               made for that GEMM range of experts by range, one range's share at a time; where act
               comes from that GEMM's epilogue (tuning.FP8_ACT_QUANTIZE) the whole copy and its act
               A(W, F), dropped after it)
    every term + 1 MB per buffer (memory.ALLOCATOR_BLOCK_SLACK)
    symmetric  the bf16 regions and the FP8 ones (comm/symmetric.py FP8_REGIONS)

The stages are bounded one at a time because a window frees each buffer after its last reader
(tests/comm/test_gpu_fp8_memory.py measures every routing against this bound on a GPU; the
measured figures at the DeepSeek-V3 shape are in docs/performance.md).
"""

from __future__ import annotations

import math

import torch

from megatron_mok.backends import tuning
from megatron_mok.config import MoKConfig
from megatron_mok.limits import FP8_BLOCK, NUM_EXCHANGE_PHASES, fp8_padded_rows, fp8_scale_rows
from megatron_mok.receive import receive_plan

BF16_BYTES = 2
FP32_BYTES = 4
# Buffers that may each take ALLOCATOR_BLOCK_SLACK more than their size (the docstring's terms,
# counted: a quantized tensor is two, values and scales).
FP8_HELD_BUFFERS, FP8_FORWARD_BUFFERS, FP8_BACKWARD_BUFFERS = 12, 16, 36


def quantized_rows_bytes(rows: int, columns: int) -> int:
    """Q(n, c): E4M3 rows and their source-layout scales."""
    return rows * columns + FP32_BYTES * rows * (columns // FP8_BLOCK)


def gemm_a_scale_bytes(rows: int, columns: int) -> int:
    """The GEMM-A scale layout (c/128, pad4(n)) fp32."""
    return FP32_BYTES * (columns // FP8_BLOCK) * fp8_scale_rows(rows)


def quantized_columns_bytes(rows: int, columns: int) -> int:
    """V(n, c): (c, pad128(n)) E4M3 and (pad128(n)/128, c) fp32."""
    padded = fp8_padded_rows(rows)
    return columns * padded + FP32_BYTES * (padded // FP8_BLOCK) * columns


def weight_copy_bytes(experts: int, n: int, k: int) -> int:
    """Wq(N, K): an (E, N, K) weight's E4M3 copy and its (E, N/128, K/128) fp32 scales."""
    return experts * n * k + FP32_BYTES * experts * (n // FP8_BLOCK) * (k // FP8_BLOCK)


def fp8_layer_memory_bound(
    *,
    num_tokens: int,
    hidden: int,
    ffn_hidden: int,
    num_local_experts: int,
    topk: int,
    num_ranks: int,
    config: MoKConfig,
    windowed: bool,
):
    """The bound of one FP8 layer call (the module docstring's terms) as a memory.LayerMemoryBound."""
    from megatron_mok.comm.symmetric import symmetric_bytes_per_rank
    from megatron_mok.memory import ALLOCATOR_BLOCK_SLACK, ROUTE_READER_BUFFERS, LayerMemoryBound

    t, h, f, e, k, r = num_tokens, hidden, ffn_hidden, num_local_experts, topk, num_ranks
    for name, value in (("hidden", h), ("ffn_hidden", f)):
        if value % FP8_BLOCK:
            raise ValueError(f"layer_memory_bound: {name}={value} must be a multiple of {FP8_BLOCK} with FP8")
    s = BF16_BYTES
    plan = receive_plan(
        num_ranks=r, num_tokens=t, topk=k, num_local_experts=e,
        segment_alignment=math.lcm(config.segment_alignment, FP8_BLOCK),
        factor=config.receive_capacity_factor, windowed=windowed,
    )
    w, m, c = plan.window_rows, plan.num_windows, plan.capacity
    routes = r * t * k
    one_window_one_rank = r == 1 and m == 1
    slack = ALLOCATOR_BLOCK_SLACK

    forward_copies = weight_copy_bytes(e, 2 * f, h) + weight_copy_bytes(e, h, f)
    cached = forward_copies if config.fp8_cache_weights else 0
    # The transposed copies kept beside them (fp8_cache_transposed_weights): the same bytes again. The
    # dgrads' range copies stay counted below: in a CUDA-graph capture nothing is cached and the
    # dgrads make them as without the option.
    if config.fp8_cache_weights and config.fp8_cache_transposed_weights:
        cached += forward_copies
    route_table = s * c * h if one_window_one_rank else s * t * k * h
    held = s * t * h + route_table + s * w * 2 * f + 8 * (c + routes + t * k) + cached + FP8_HELD_BUFFERS * slack

    rows_q = quantized_rows_bytes(w, h) + gemm_a_scale_bytes(w, h)
    act_q = w * f + gemm_a_scale_bytes(w, f)
    forward_window = max(rows_q + s * w * 2 * f, s * w * 2 * f + act_q + s * w * h)
    tables = 8 * (2 * routes + m * w)
    forward_peak = (
        held + quantized_rows_bytes(t, h) + (0 if config.fp8_cache_weights else forward_copies) + forward_window
        + tables + FP8_FORWARD_BUFFERS * slack
    )

    grad_gate_up_rows = w * 2 * f + gemm_a_scale_bytes(w, 2 * f)
    grad_gate_up_columns = quantized_columns_bytes(w, 2 * f)
    # The weight gradients' w * dY and x rows: pulled from peer memory (windowed), else gathered by the
    # column kernel from one tensor or, with tuning.FP8_WGRAD_COLUMNS_FROM_PEERS, from the ranks'
    # regions (int64 row index and its temporaries, fp32 weights; from the regions also the routes'
    # weights copied out of them, 4 * R * T * K).
    if windowed and not tuning.FP8_WGRAD_COLUMNS_FROM_PEERS:
        wgrad_rows = s * w * h
    else:
        wgrad_rows = 32 * w + (4 * routes if windowed else 0)
    # A dgrad makes its transposed copy one expert range at a time, each freed after its GEMM
    # (kernel_fp8._dgrad): at most `span` experts' copy exists at once, in every window.
    span = tuning.fp8_dgrad_expert_span(e)
    transposed_per_stage = (weight_copy_bytes(span, f, h), weight_copy_bytes(span, h, 2 * f))
    # At M > 1 a window after the first makes its gate/up again from the dispatched rows (no act:
    # kernel_fp8.recompute_gate_up) and holds it until the fc2 weight gradient has run; without the
    # cache through a copy of fc1 (its experts with rows; allocated whole) made for that GEMM alone.
    recomputed = s * w * 2 * f if m > 1 else 0
    # Where act comes from the gate/up GEMM's epilogue, that GEMM made again writes an act (dropped)
    # and takes the whole copy in one launch; otherwise the copy is made range of experts by range.
    act_in_epilogue = tuning.FP8_ACT_QUANTIZE == "gemm_epilogue" and not config.fp8_pow2_scales
    recompute_act = act_q if m > 1 and act_in_epilogue else 0
    recompute_copy = 0
    if m > 1 and not config.fp8_cache_weights:
        recompute_copy = weight_copy_bytes(e if act_in_epilogue else span, 2 * f, h)
    stages = (
        recomputed + rows_q + recompute_copy + recompute_act,  # the gate/up made again
        recomputed + rows_q + s * w * f + transposed_per_stage[0],  # the down dgrad
        recomputed + rows_q + s * w * f + s * w * 2 * f + grad_gate_up_rows,  # the SwiGLU backward's pass
        recomputed + rows_q + s * w * 2 * f + grad_gate_up_rows + grad_gate_up_columns,  # then d gate_up's columns
        grad_gate_up_rows + grad_gate_up_columns + wgrad_rows + quantized_columns_bytes(w, h)
        + quantized_columns_bytes(w, f),  # the fc2 weight gradient (gate/up freed once act's columns are made)
        grad_gate_up_rows + grad_gate_up_columns + transposed_per_stage[1] + s * w * h,  # the gate/up dgrad
        grad_gate_up_columns + wgrad_rows + quantized_columns_bytes(w, h),  # the fc1 weight gradient
    )
    pass_terms = 0
    if m > 1:
        pass_terms = 2 * FP32_BYTES * (2 * f * h + h * f)
        pass_terms += quantized_rows_bytes(t, h)  # x published again, for the recomputed gate/up
    route_reader = held + s * t * h + 4 * t * k + ROUTE_READER_BUFFERS * slack
    backward_peak = max(
        route_reader,
        held - route_table + quantized_rows_bytes(t, h) + 2 * s * t * h + 4 * t * k + s * e * 3 * f * h + pass_terms
        + max(stages) + tables + FP8_BACKWARD_BUFFERS * slack,
    )
    symmetric = symmetric_bytes_per_rank(t, h, k, torch.bfloat16, r, NUM_EXCHANGE_PHASES, fp8=True) if r > 1 and windowed else 0
    return LayerMemoryBound(held, forward_peak, backward_peak, symmetric, w, m)
