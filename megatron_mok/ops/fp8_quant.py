"""FP8 blockwise quantization kernels (csrc/quant/; docs/design.md §12.1-12.2): one pass over the
high-precision values per layout, each bit for bit the function of megatron_mok/quantization.py it
names (the same q bytes and fp32 scales).

Notation: R rows (tokens, or the schedule's rows), C columns (H, F or 2F; a multiple of 128), E
experts, a weight (E, N, K). E4M3 is torch.float8_e4m3fn; pow2 rounds every scale up to a power of
two (quantization.block_scale).
    fp8_quantize_rows     x (R_src, C) bf16 -> q (R, C) e4m3, 1x128 along C, with its scales in the
                          source layout (R, C/128) and/or the GEMM-A layout (C/128, fp8_scale_rows(R));
                          optionally gathered: row r is x[row_index[r]], a zero row for -1
                          (quantization.quantize_rowwise, gemm_a_scales)
    fp8_quantize_swiglu   gate_up (R, 2F) bf16 -> act (R, F) e4m3, silu(gate) * up rounded to bf16 and
                          quantized 1x128 along F, scales in the GEMM-A layout; rows at or past
                          expert_offsets[-1] are not read (ops.swiglu_forward then quantize_rowwise)
    fp8_quantize_columns  x (R, C) bf16 -> q (C, R_pad) e4m3, 1x128 along R (tokens), scales
                          (R_pad/128, C), R_pad = R rounded up to 128; rows at or past
                          expert_offsets[-1] and the padding quantize as zeros; optionally
                          gathered as fp8_quantize_rows (quantization.quantize_columnwise);
                          fp8_quantize_columns_from_peers gathers from the ranks' symmetric regions
    fp8_quantize_swiglu_backward
                          gate_up (R, 2F) bf16, grad_act (R, F) bf16 -> d gate_up (R, 2F) bf16, the
                          SwiGLU backward (ops.swiglu_backward's values), and its E4M3 copy 1x128 along
                          2F with GEMM-A scales; rows at or past expert_offsets[-1] are not read
                          (ops.swiglu_backward then quantize_rowwise)
    fp8_quantize_swiglu_backward_copies
                          the same d gate_up's two FP8 copies from one pass, no bf16 d gate_up: the row
                          copy (as fp8_quantize_swiglu_backward's) and the column copy (as
                          fp8_quantize_columns of its d gate_up), 1x128 along 2F and along R; with
                          act_columns also act's column copy (as fp8_quantize_swiglu_columns')
    fp8_quantize_weight   weight (E, N, K) bf16 or fp32 -> q (E, N, K) e4m3, scales (E, N/128, K/128),
                          and its transposed copy q_t (E, K, N), scales_t (E, K/128, N/128)
                          (quantization.quantize_weight, transpose_weight)
    fp8_transpose_weight  q (E, N, K) e4m3 + scales (E, N/128, K/128), a weight's 128x128 quantization
                          -> its transposed copy q_t (E, K, N), scales_t (E, K/128, N/128): the same
                          bytes as fp8_quantize_weight's transposed copy, from one byte per element
                          instead of the weight's two or four (quantization.transpose_weight)
The references are the `*_reference` functions beside the ops.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import quantization
from megatron_mok.limits import FP8_BLOCK, MAX_EP_RANKS, fp8_padded_rows, fp8_scale_rows
from megatron_mok.ops.extension import register_fake

E4M3 = torch.float8_e4m3fn
Tensor = torch.Tensor


@register_fake("fp8_quantize_rows")
def _fp8_quantize_rows_fake(x, row_index, source_scales, gemm_a_scales, pow2):
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    blocks = x.shape[1] // FP8_BLOCK
    nothing = x.new_empty((0,), dtype=torch.float32)
    return (
        x.new_empty((rows, x.shape[1]), dtype=E4M3),
        x.new_empty((rows, blocks), dtype=torch.float32) if source_scales else nothing,
        x.new_empty((blocks, fp8_scale_rows(rows)), dtype=torch.float32) if gemm_a_scales else nothing.clone(),
    )


@register_fake("fp8_quantize_swiglu")
def _fp8_quantize_swiglu_fake(gate_up, expert_offsets, pow2):
    ffn = gate_up.shape[1] // 2
    return (gate_up.new_empty((gate_up.shape[0], ffn), dtype=E4M3),
            gate_up.new_empty((ffn // FP8_BLOCK, fp8_scale_rows(gate_up.shape[0])), dtype=torch.float32))


@register_fake("fp8_quantize_columns")
def _fp8_quantize_columns_fake(x, expert_offsets, pow2, row_index=None, row_weights=None):
    padded = fp8_padded_rows(x.shape[0] if row_index is None else row_index.shape[0])
    return x.new_empty((x.shape[1], padded), dtype=E4M3), x.new_empty((padded // FP8_BLOCK, x.shape[1]), dtype=torch.float32)


@register_fake("fp8_quantize_columns_from_peers")
def _fp8_quantize_columns_from_peers_fake(own, peer_ptrs, expert_offsets, pow2, row_index, row_weights=None):
    return _fp8_quantize_columns_fake(own, expert_offsets, pow2, row_index, row_weights)


@register_fake("fp8_quantize_swiglu_columns")
def _fp8_quantize_swiglu_columns_fake(gate_up, expert_offsets, pow2):
    padded, ffn = fp8_padded_rows(gate_up.shape[0]), gate_up.shape[1] // 2
    return gate_up.new_empty((ffn, padded), dtype=E4M3), gate_up.new_empty((padded // FP8_BLOCK, ffn), dtype=torch.float32)


@register_fake("fp8_quantize_swiglu_backward")
def _fp8_quantize_swiglu_backward_fake(gate_up, grad_act, expert_offsets, pow2):
    rows, cols = gate_up.shape
    return (gate_up.new_empty((rows, cols)), gate_up.new_empty((rows, cols), dtype=E4M3),
            gate_up.new_empty((cols // FP8_BLOCK, fp8_scale_rows(rows)), dtype=torch.float32))


@register_fake("fp8_quantize_swiglu_backward_copies")
def _fp8_quantize_swiglu_backward_copies_fake(gate_up, grad_act, expert_offsets, pow2, act_columns=False):
    rows, cols = gate_up.shape
    padded, ffn = fp8_padded_rows(rows), cols // 2
    return (gate_up.new_empty((rows, cols), dtype=E4M3),
            gate_up.new_empty((cols // FP8_BLOCK, fp8_scale_rows(rows)), dtype=torch.float32),
            gate_up.new_empty((cols, padded), dtype=E4M3),
            gate_up.new_empty((padded // FP8_BLOCK, cols), dtype=torch.float32),
            gate_up.new_empty((ffn, padded) if act_columns else (0, 0), dtype=E4M3),
            gate_up.new_empty((padded // FP8_BLOCK, ffn) if act_columns else (0, 0), dtype=torch.float32))


@register_fake("fp8_quantize_weight")
def _fp8_quantize_weight_fake(weight, transposed, pow2, forward_copy, expert_offsets=None):
    e, n, k = weight.shape
    nothing = weight.new_empty((0,), dtype=torch.float32)
    return (
        weight.new_empty((e, n, k), dtype=E4M3) if forward_copy else nothing.clone(),
        weight.new_empty((e, n // FP8_BLOCK, k // FP8_BLOCK), dtype=torch.float32) if forward_copy else nothing.clone(),
        weight.new_empty((e, k, n), dtype=E4M3) if transposed else nothing,
        weight.new_empty((e, k // FP8_BLOCK, n // FP8_BLOCK), dtype=torch.float32) if transposed else nothing.clone(),
    )


@register_fake("fp8_transpose_weight")
def _fp8_transpose_weight_fake(q, scales, expert_offsets=None):
    e, n, k = q.shape
    return q.new_empty((e, k, n)), scales.new_empty((e, k // FP8_BLOCK, n // FP8_BLOCK))


def kernel_ready(t: Tensor) -> Tensor:
    """t contiguous and starting 16-byte aligned, as the quantization kernels read their inputs (16-byte
    loads): t itself when it already is, else a copy (a misaligned view, e.g. one that starts at an odd
    element of its storage)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fp8_quantize_rows(
    x: Tensor,
    row_index: Optional[Tensor] = None,
    *,
    source_scales: bool = True,
    gemm_a_scales: bool = True,
    pow2: bool = False,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """x (R_src, C) bf16, 1x128 blocks along C -> (q (R, C) e4m3, scales (R, C/128) fp32 or None,
    gemm_a (C/128, fp8_scale_rows(R)) fp32 or None; its padding columns 1).

    row_index (R,) int64: row r of the output is x[row_index[r]], a zero row (q 0, scale 1) for -1;
    without it R = R_src and row r is x[r]. An index outside [-1, R_src) traps in the kernel, named
    by ops.last_failure() (it lives on the device: checking it here would synchronize). A route
    index maps to its token row by floor division by topk, which keeps -1. source_scales /
    gemm_a_scales: which scale layouts to write (at least one). Ref: fp8_quantize_rows_reference."""
    check_fp8_quantize_rows_args(x, row_index, source_scales, gemm_a_scales, pow2)
    q, scales, gemm_a = torch.ops.megatron_mok.fp8_quantize_rows(x, row_index, source_scales, gemm_a_scales, pow2)
    return q, scales if source_scales else None, gemm_a if gemm_a_scales else None


def fp8_quantize_rows_reference(
    x: Tensor, row_index: Optional[Tensor] = None, pow2: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """(q, scales, gemm_a) of fp8_quantize_rows through quantization.quantize_rowwise of the gathered
    rows (zero rows for -1) and quantization.gemm_a_scales."""
    rows = x
    if row_index is not None:
        rows = x.new_zeros((row_index.shape[0], x.shape[1]))
        taken = row_index >= 0
        rows[taken] = x[row_index[taken]]
    q, scales = quantization.quantize_rowwise(rows, pow2)
    return q, scales, quantization.gemm_a_scales(scales)


def fp8_quantize_swiglu(gate_up: Tensor, expert_offsets: Tensor, *, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """gate_up (R, 2F) bf16, gate columns then up columns (F a multiple of 128) -> (act (R, F) e4m3,
    act_scales (F/128, fp8_scale_rows(R)) fp32 in the GEMM-A layout, padding columns 1): act =
    silu(gate) * up in fp32 rounded to bf16 (ops.swiglu_forward's arithmetic), quantized 1x128 along F
    (quantization.quantize_rowwise), in one pass with no bf16 act in memory: the bytes of
    fp8_expert_gemm_swiglu's act for the same gate_up. Rows at or past expert_offsets[-1] ((E + 1,)
    int32, read on the device) are not read and quantize as zero rows (scale 1), as swiglu_forward's
    zero rows there would. Ref: fp8_quantize_swiglu_reference."""
    check_fp8_quantize_swiglu_args(gate_up, expert_offsets, pow2)
    return torch.ops.megatron_mok.fp8_quantize_swiglu(gate_up, expert_offsets, pow2)


def _swiglu_reference(gate_up: Tensor) -> Tensor:
    """gate_up (R, 2F) -> act (R, F) bf16: silu(gate) * up in fp32, rounded once (the SwiGLU kernels' bits)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).bfloat16()


def fp8_quantize_swiglu_reference(gate_up: Tensor, expert_offsets: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """fp8_quantize_swiglu through PyTorch: SwiGLU in fp32 rounded to bf16 (rows at or past
    expert_offsets[-1] zero), quantization.quantize_rowwise, quantization.gemm_a_scales. Reads the
    offsets on the host: tests and references only."""
    end = max(0, min(gate_up.shape[0], int(expert_offsets[-1])))
    act = _swiglu_reference(gate_up)
    act[end:] = 0
    q, scales = quantization.quantize_rowwise(act, pow2)
    return q, quantization.gemm_a_scales(scales)


def fp8_quantize_columns(
    x: Tensor,
    expert_offsets: Optional[Tensor] = None,
    *,
    pow2: bool = False,
    row_index: Optional[Tensor] = None,
    row_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16, 1x128 blocks along R (tokens) -> (q (C, R_pad) e4m3, the matrix transposed;
    scales (R_pad/128, C) fp32), R_pad = R rounded up to 128: the weight gradients' operands.

    Rows at or past expert_offsets[-1] ((E + 1,) int32, the schedule's end row, read on the device)
    and the padding rows [R, R_pad) quantize as zeros, whatever their memory holds. Each 128-row
    block is one expert's when segments start at multiples of 128 (the FP8 schedule's
    segment_alignment).

    row_index (R,) int64: x is (R_src, C) and row r is x[row_index[r]], a zero row for -1 (an index
    outside [-1, R_src) traps with a failure record), so the rows are never gathered into memory;
    entries at or past expert_offsets[-1] are not read. row_weights (R,) float32, with row_index: row r
    is x[row_index[r]] * row_weights[r], each value rounded once to bf16 as the weighted pull rounds
    w * dY (ops.pull_grad_rows), so the fc2 weight gradient's operand needs no pulled rows; entries at
    or past expert_offsets[-1] and of -1 rows are not read. Ref: fp8_quantize_columns_reference."""
    check_fp8_quantize_columns_args(x, expert_offsets, pow2, row_index, row_weights)
    return torch.ops.megatron_mok.fp8_quantize_columns(x, expert_offsets, pow2, row_index, row_weights)


def fp8_quantize_columns_from_peers(
    own: Tensor,
    peer_ptrs: list[int],
    expert_offsets: Optional[Tensor] = None,
    *,
    pow2: bool = False,
    row_index: Tensor,
    row_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """fp8_quantize_columns gathered from the group's rows where they lie, in the ranks' symmetric
    regions (comm/symmetric.py): own (T, C) bf16 is this rank's copy of the region, peer_ptrs every
    rank's device address of it in rank order (own's among them; at most limits.MAX_EP_RANKS, each
    16-byte aligned), row_index (R,) int64 rows of the group: row g is rank g // T's row g % T, -1 a
    zero row (outside [-1, len(peer_ptrs) * T): trapped with a failure record). row_weights and
    expert_offsets as fp8_quantize_columns'. Bitwise fp8_quantize_columns(torch.cat of the regions,
    ...): the weight gradients' x and w * dY operands over expert parallelism's in-kernel exchange,
    with no pulled (R, C) bf16 rows. The regions must hold their rows (the exchange's publish and
    signal) before the launch and until it ends."""
    check_fp8_quantize_columns_from_peers_args(own, peer_ptrs, expert_offsets, pow2, row_index, row_weights)
    return torch.ops.megatron_mok.fp8_quantize_columns_from_peers(
        own, list(peer_ptrs), expert_offsets, pow2, row_index, row_weights
    )


def fp8_quantize_columns_reference(
    x: Tensor,
    expert_offsets: Optional[Tensor] = None,
    pow2: bool = False,
    row_index: Optional[Tensor] = None,
    row_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """fp8_quantize_columns through quantization.quantize_columnwise of x (gathered by row_index,
    times row_weights in fp32 rounded to bf16) zero-padded to R_pad rows, rows at or past
    expert_offsets[-1] zeroed. Reads the offsets on the host: tests and references only."""
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    end = rows if expert_offsets is None else min(rows, int(expert_offsets[-1]))
    if row_index is not None:  # (as the op: the entries at or past the end are not read)
        gathered = x.new_zeros((rows, x.shape[1]))
        taken = torch.arange(rows, device=row_index.device) < end
        taken &= row_index >= 0
        gathered[taken] = x[row_index[taken]]
        if row_weights is not None:
            gathered[taken] = (gathered[taken].float() * row_weights[taken].unsqueeze(1)).to(x.dtype)
        x = gathered
    padded = x.new_zeros((fp8_padded_rows(x.shape[0]), x.shape[1]))
    padded[:end] = x[:end]
    return quantization.quantize_columnwise(padded, pow2)


def fp8_quantize_swiglu_columns(gate_up: Tensor, expert_offsets: Tensor, *, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """gate_up (R, 2F) bf16 -> act = SwiGLU(gate_up) quantized 1x128 along R (tokens): (q (F, R_pad) e4m3,
    scales (R_pad/128, F) fp32), bitwise fp8_quantize_columns(swiglu_forward(gate_up, expert_offsets),
    expert_offsets) (each act value SwiGLU in fp32 rounded once to bf16, as the SwiGLU kernel rounds it)
    with no bf16 act in memory: the fc2 weight gradient's act operand. Rows at or past expert_offsets[-1]
    ((E + 1,) int32, read on the device) and the padding rows quantize as zeros, and are not read.
    Ref: fp8_quantize_swiglu_columns_reference."""
    check_fp8_quantize_swiglu_args(gate_up, expert_offsets, pow2, op="fp8_quantize_swiglu_columns")
    return torch.ops.megatron_mok.fp8_quantize_swiglu_columns(gate_up, expert_offsets, pow2)


def fp8_quantize_swiglu_columns_reference(gate_up: Tensor, expert_offsets: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """fp8_quantize_swiglu_columns through PyTorch: SwiGLU in fp32 rounded to bf16, rows at or past
    expert_offsets[-1] zero, then fp8_quantize_columns_reference. Reads the offsets on the host: tests
    and references only."""
    return fp8_quantize_columns_reference(_swiglu_reference(gate_up), expert_offsets, pow2)


def fp8_quantize_swiglu_backward(
    gate_up: Tensor, grad_act: Tensor, expert_offsets: Tensor, *, pow2: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """gate_up (R, 2F) bf16 (gate columns then up columns, F a multiple of 128), grad_act (R, F) bf16 ->
    (grad_gate_up (R, 2F) bf16, q (R, 2F) e4m3, scales (2F/128, fp8_scale_rows(R)) fp32 in the GEMM-A
    layout, padding columns 1): d gate_up, the SwiGLU backward with ops.swiglu_backward's arithmetic
    (fp32, rounded once to bf16) and its bits, and its quantization 1x128 along 2F (the gate/up
    dgrad's left operand: fp8_quantize_rows' bytes), in one pass: d gate_up is not read back for it.
    Rows at or past expert_offsets[-1] ((E + 1,) int32, read on the device) are not read (of either
    input): zero rows of d gate_up, as swiglu_backward writes them, quantized as zero rows (scale 1).
    Ref: fp8_quantize_swiglu_backward_reference."""
    check_fp8_quantize_swiglu_backward_args(gate_up, grad_act, expert_offsets, pow2)
    return torch.ops.megatron_mok.fp8_quantize_swiglu_backward(gate_up, grad_act, expert_offsets, pow2)


def fp8_quantize_swiglu_backward_copies(
    gate_up: Tensor, grad_act: Tensor, expert_offsets: Tensor, *, pow2: bool = False, act_columns: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """gate_up (R, 2F) bf16 (gate columns then up columns, F a multiple of 128), grad_act (R, F) bf16 ->
    both FP8 copies of d gate_up, the SwiGLU backward (fp32, rounded once to bf16, as
    fp8_quantize_swiglu_backward computes it), from one pass and with no bf16 d gate_up in memory:
    (rows_q (R, 2F) e4m3, rows_scales (2F/128, fp8_scale_rows(R)) fp32 in the GEMM-A layout, padding
    columns 1: the gate/up dgrad's left operand, fp8_quantize_swiglu_backward's bytes; columns_q
    (2F, R_pad) e4m3, columns_scales (R_pad/128, 2F) fp32, R_pad = R rounded up to 128: the fc1 weight
    gradient's operand, fp8_quantize_columns' bytes of that d gate_up; act_q (F, R_pad) e4m3 and
    act_scales (R_pad/128, F) fp32 with act_columns, else None each: act = SwiGLU of the same gate_up
    quantized 1x128 along R, the fc2 weight gradient's operand, fp8_quantize_swiglu_columns' bytes,
    without a second read of gate_up). Rows at or past expert_offsets[-1] ((E + 1,) int32, read on the
    device) are not read (of either input) and quantize as zero rows in every copy (scale 1), the
    padding rows of the column copies too. Ref: fp8_quantize_swiglu_backward_copies_reference."""
    op = "fp8_quantize_swiglu_backward_copies"
    _check_flag(op, "act_columns", act_columns)  # (before the checks that end with the devices)
    check_fp8_quantize_swiglu_backward_args(gate_up, grad_act, expert_offsets, pow2, op=op)
    *copies, act_q, act_scales = torch.ops.megatron_mok.fp8_quantize_swiglu_backward_copies(
        gate_up, grad_act, expert_offsets, pow2, act_columns)
    return (*copies, act_q if act_columns else None, act_scales if act_columns else None)


def fp8_quantize_swiglu_backward_copies_reference(
    gate_up: Tensor, grad_act: Tensor, expert_offsets: Tensor, pow2: bool = False, act_columns: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """fp8_quantize_swiglu_backward_copies through PyTorch: fp8_quantize_swiglu_backward_reference's
    d gate_up (rows at or past expert_offsets[-1] zero), its row copy, fp8_quantize_columns_reference
    of it, and with act_columns fp8_quantize_swiglu_columns_reference of gate_up. Reads the offsets on
    the host: tests and references only."""
    grad_gate_up, rows_q, rows_scales = fp8_quantize_swiglu_backward_reference(gate_up, grad_act, expert_offsets, pow2)
    act = fp8_quantize_swiglu_columns_reference(gate_up, expert_offsets, pow2) if act_columns else (None, None)
    return (rows_q, rows_scales, *fp8_quantize_columns_reference(grad_gate_up, expert_offsets, pow2), *act)


def fp8_quantize_grad_gate_up_reference(
    grad_gate_up: Tensor, expert_offsets: Tensor, pow2: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """fp8_quantize_swiglu_backward's outputs from a bf16 d gate_up (R, 2F): it with its rows at or past
    expert_offsets[-1] zeroed, and quantization.quantize_rowwise of that with gemm_a_scales. Reads the
    offsets on the host: tests and references only."""
    end = max(0, min(grad_gate_up.shape[0], int(expert_offsets[-1])))
    grad_gate_up = grad_gate_up.clone()
    grad_gate_up[end:] = 0
    q, scales = quantization.quantize_rowwise(grad_gate_up, pow2)
    return grad_gate_up, q, quantization.gemm_a_scales(scales)


def fp8_quantize_swiglu_backward_reference(
    gate_up: Tensor, grad_act: Tensor, expert_offsets: Tensor, pow2: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """fp8_quantize_swiglu_backward through PyTorch: the reference backend's SwiGLU backward
    (backends/reference.py swiglu_backward: fp32, rounded once to bf16; torch's sigmoid, which may
    differ from the kernels' by an ulp), then fp8_quantize_grad_gate_up_reference. Reads the offsets
    on the host: tests and references only."""
    from megatron_mok.backends import reference  # (the backends import the ops: imported when called)

    return fp8_quantize_grad_gate_up_reference(reference.swiglu_backward(gate_up, grad_act), expert_offsets, pow2)


def fp8_quantize_weight(
    weight: Tensor, *, transposed: bool = True, pow2: bool = False, forward_copy: bool = True,
    expert_offsets: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """weight (E, N, K) bf16 or fp32, 128x128 blocks -> (q (E, N, K) e4m3 and scales (E, N/128, K/128)
    fp32, or None without forward_copy; q_t (E, K, N) e4m3 and scales_t (E, K/128, N/128) fp32, or None
    without transposed): the fprop operand and the dgrad operand, each only if asked for (at least
    one), in one pass. expert_offsets (E + 1,) int32 (a grouped GEMM's segments): only the experts
    with rows there (offsets[e] < offsets[e + 1]) are quantized, the other experts' parts of the
    copies are left unwritten, for a GEMM over those segments alone (it reads no block of an expert
    without rows). Ref: fp8_quantize_weight_reference."""
    check_fp8_quantize_weight_args(weight, transposed, pow2, forward_copy, expert_offsets)
    q, scales, q_t, scales_t = torch.ops.megatron_mok.fp8_quantize_weight(weight, transposed, pow2, forward_copy,
                                                                          expert_offsets)
    return (q if forward_copy else None, scales if forward_copy else None,
            q_t if transposed else None, scales_t if transposed else None)


def fp8_quantize_weight_reference(
    weight: Tensor, pow2: bool = False, *, transposed: bool = True, forward_copy: bool = True
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """quantization.quantize_weight and quantization.transpose_weight of it, each copy None where
    fp8_quantize_weight's flags leave it out."""
    q, scales = quantization.quantize_weight(weight, pow2)
    q_t, scales_t = quantization.transpose_weight(q, scales)
    return (q if forward_copy else None, scales if forward_copy else None,
            q_t if transposed else None, scales_t if transposed else None)


def fp8_transpose_weight(q: Tensor, scales: Tensor, expert_offsets: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """A weight's 128x128 quantization, q (E, N, K) e4m3 with scales (E, N/128, K/128) fp32 (from
    fp8_quantize_weight or quantization.quantize_weight) -> its transposed copy (q_t (E, K, N) e4m3,
    scales_t (E, K/128, N/128) fp32): a 128x128 block transposes exactly, so these are the bytes
    fp8_quantize_weight(weight, transposed=True) makes from the weight itself, moved instead of
    quantized again. expert_offsets: as fp8_quantize_weight's (only the experts with rows there).
    Ref: fp8_transpose_weight_reference."""
    check_fp8_transpose_weight_args(q, scales, expert_offsets)
    return torch.ops.megatron_mok.fp8_transpose_weight(q, scales, expert_offsets)


def fp8_transpose_weight_reference(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """quantization.transpose_weight."""
    return quantization.transpose_weight(q, scales)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _check_flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        _fail(op, f"{name} must be a bool, got {value!r}")


def _check_tensor(op: str, name: str, t, dtype: torch.dtype, dim: int, shape: str, optional: bool = False) -> None:
    """t a tensor of dtype with dim dimensions (shape: how the message writes them)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(op, f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        _fail(op, f"{name} must be {shape}, got {tuple(t.shape)}")


def _check_bf16_rows(op: str, x, name: str = "x") -> None:
    _check_tensor(op, name, x, torch.bfloat16, 2, "(R, C)")
    if x.shape[1] <= 0 or x.shape[1] % FP8_BLOCK:
        _fail(op, f"{name}'s columns (C) must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {x.shape[1]}")


def _check_placement(op: str, tensors: dict, aligned: int = 1) -> None:
    """Contiguity, then 16-byte alignment of the first `aligned` tensors (the kernels' 16-byte loads),
    then devices: all on the first tensor's CUDA device."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            _fail(op, f"{name} must be contiguous")
    for name, t in list(tensors.items())[:aligned]:
        if t.data_ptr() % 16:
            _fail(op, f"{name} must start 16-byte aligned (a view that starts mid-row is not)")
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device.type != "cuda" or t.device != first.device:
            _fail(op, f"{name} must be a CUDA tensor on {first_name}'s device ({first.device}), got {t.device}")


def _check_row_index(op: str, row_index) -> None:
    _check_tensor(op, "row_index", row_index, torch.int64, 1, "(R,)", optional=True)


def check_fp8_quantize_rows_args(x, row_index, source_scales, gemm_a_scales, pow2) -> None:
    """ValueErrors naming the argument, before any kernel runs: types, dtypes, shapes and the
    multiple of 128 first, then contiguity, alignment and devices (all but the device checkable
    with CPU tensors)."""
    op = "fp8_quantize_rows"
    _check_bf16_rows(op, x)
    tensors = {"x": x}
    if row_index is not None:
        _check_row_index(op, row_index)
        tensors["row_index"] = row_index
    for name, value in (("source_scales", source_scales), ("gemm_a_scales", gemm_a_scales), ("pow2", pow2)):
        _check_flag(op, name, value)
    if not (source_scales or gemm_a_scales):
        _fail(op, "at least one of source_scales and gemm_a_scales must be True (q without scales is no operand)")
    _check_placement(op, tensors)


def check_fp8_quantize_columns_args(x, expert_offsets, pow2, row_index=None, row_weights=None, *,
                                    op: str = "fp8_quantize_columns", x_name: str = "x") -> None:
    """As check_fp8_quantize_rows_args, for fp8_quantize_columns (and, as op, its form over the ranks'
    regions, whose x is x_name)."""
    _check_bf16_rows(op, x, x_name)
    tensors = {x_name: x}
    if row_index is not None:
        _check_row_index(op, row_index)
        tensors["row_index"] = row_index
    if row_weights is not None:
        if row_index is None:
            _fail(op, "row_weights needs row_index (the weights go with gathered rows)")
        _check_tensor(op, "row_weights", row_weights, torch.float32, 1, "(R,)")
        if row_weights.shape != row_index.shape:
            _fail(op, f"row_weights must have row_index's shape {tuple(row_index.shape)}, got {tuple(row_weights.shape)}")
        tensors["row_weights"] = row_weights
    if expert_offsets is not None:
        if not isinstance(expert_offsets, torch.Tensor):
            _fail(op, f"expert_offsets must be a tensor or None, got {type(expert_offsets).__name__}")
        if expert_offsets.dtype != torch.int32:
            _fail(op, f"expert_offsets must be torch.int32, got {expert_offsets.dtype}")
        if expert_offsets.dim() != 1 or expert_offsets.shape[0] < 1:
            _fail(op, f"expert_offsets must be (E + 1,), got {tuple(expert_offsets.shape)}")
        tensors["expert_offsets"] = expert_offsets
    _check_flag(op, "pow2", pow2)
    _check_placement(op, tensors)


def check_fp8_quantize_columns_from_peers_args(own, peer_ptrs, expert_offsets, pow2, row_index, row_weights=None) -> None:
    """As check_fp8_quantize_columns_args (own for x; row_index required), and peer_ptrs: a list of one
    to limits.MAX_EP_RANKS int device addresses, none null, each 16-byte aligned."""
    op = "fp8_quantize_columns_from_peers"
    if not isinstance(peer_ptrs, (list, tuple)) or not 1 <= len(peer_ptrs) <= MAX_EP_RANKS:
        _fail(op, f"peer_ptrs must be a list of 1 to {MAX_EP_RANKS} device addresses (one per rank), got {peer_ptrs!r}")
    for rank, address in enumerate(peer_ptrs):
        if isinstance(address, bool) or not isinstance(address, int) or address <= 0 or address % 16:
            _fail(op, f"peer_ptrs[{rank}] must be a non-null 16-byte aligned device address (int), got {address!r}")
    if row_index is None:
        _fail(op, "row_index is required (the rows of the group to quantize)")
    check_fp8_quantize_columns_args(own, expert_offsets, pow2, row_index, row_weights, op=op, x_name="own")


def check_fp8_quantize_swiglu_args(gate_up, expert_offsets, pow2, op: str = "fp8_quantize_swiglu") -> None:
    """As check_fp8_quantize_rows_args, for fp8_quantize_swiglu and fp8_quantize_swiglu_columns (op)."""
    _check_swiglu_inputs(op, gate_up, expert_offsets, pow2)
    _check_placement(op, {"gate_up": gate_up, "expert_offsets": expert_offsets})


def _check_swiglu_inputs(op: str, gate_up, expert_offsets, pow2) -> None:
    """gate_up (R, 2F) bf16 with F a multiple of 128, expert_offsets (E + 1,) int32, pow2 a bool."""
    _check_tensor(op, "gate_up", gate_up, torch.bfloat16, 2, "(R, 2F)")
    if gate_up.shape[1] <= 0 or gate_up.shape[1] % (2 * FP8_BLOCK):
        _fail(op, f"gate_up's columns (2F) must be twice a positive multiple of {FP8_BLOCK} (F, the act columns, "
                  f"a multiple of {FP8_BLOCK} for FP8 blockwise), got {gate_up.shape[1]}")
    _check_tensor(op, "expert_offsets", expert_offsets, torch.int32, 1, "(E + 1,)")
    if expert_offsets.shape[0] < 1:
        _fail(op, f"expert_offsets must be (E + 1,), got {tuple(expert_offsets.shape)}")
    _check_flag(op, "pow2", pow2)


def check_fp8_quantize_swiglu_backward_args(gate_up, grad_act, expert_offsets, pow2,
                                            op: str = "fp8_quantize_swiglu_backward") -> None:
    """As check_fp8_quantize_rows_args, for fp8_quantize_swiglu_backward (and its op `op`,
    fp8_quantize_swiglu_backward_copies): gate_up's and the offsets' checks of fp8_quantize_swiglu,
    then grad_act (R, F) bf16 beside gate_up."""
    _check_swiglu_inputs(op, gate_up, expert_offsets, pow2)
    _check_tensor(op, "grad_act", grad_act, torch.bfloat16, 2, "(R, F)")
    wanted = (gate_up.shape[0], gate_up.shape[1] // 2)
    if tuple(grad_act.shape) != wanted:
        _fail(op, f"grad_act must be (R, F) = {wanted} for gate_up {tuple(gate_up.shape)}, got {tuple(grad_act.shape)}")
    _check_placement(op, {"gate_up": gate_up, "grad_act": grad_act, "expert_offsets": expert_offsets}, aligned=2)


def check_fp8_quantize_weight_args(weight, transposed, pow2, forward_copy=True, expert_offsets=None) -> None:
    """As check_fp8_quantize_rows_args, for fp8_quantize_weight."""
    op = "fp8_quantize_weight"
    if not isinstance(weight, torch.Tensor):
        _fail(op, f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, f"weight must be torch.bfloat16 or torch.float32, got {weight.dtype}")
    if weight.dim() != 3:
        _fail(op, f"weight must be (E, N, K), got {tuple(weight.shape)}")
    for name, size in (("N (weight's rows per expert)", weight.shape[1]), ("K (weight's columns)", weight.shape[2])):
        if size <= 0 or size % FP8_BLOCK:
            _fail(op, f"{name} must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {size}")
    _check_flag(op, "transposed", transposed)
    _check_flag(op, "pow2", pow2)
    _check_flag(op, "forward_copy", forward_copy)
    if not (transposed or forward_copy):
        _fail(op, "forward_copy or transposed must be True (at least one copy)")
    _check_weight_copy_offsets(op, expert_offsets, weight.shape[0])
    _check_placement(op, {"weight": weight} | ({"expert_offsets": expert_offsets} if expert_offsets is not None else {}))


def check_fp8_transpose_weight_args(q, scales, expert_offsets=None) -> None:
    """As check_fp8_quantize_rows_args, for fp8_transpose_weight."""
    op = "fp8_transpose_weight"
    _check_tensor(op, "q", q, E4M3, 3, "(E, N, K)")
    for name, size in (("N (q's rows per expert)", q.shape[1]), ("K (q's columns)", q.shape[2])):
        if size <= 0 or size % FP8_BLOCK:
            _fail(op, f"{name} must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {size}")
    _check_tensor(op, "scales", scales, torch.float32, 3, "(E, N/128, K/128)")
    wanted = (q.shape[0], q.shape[1] // FP8_BLOCK, q.shape[2] // FP8_BLOCK)
    if tuple(scales.shape) != wanted:
        _fail(op, f"scales must be (E, N/128, K/128) = {wanted} for q {tuple(q.shape)}, got {tuple(scales.shape)}")
    _check_weight_copy_offsets(op, expert_offsets, q.shape[0])
    _check_placement(op, {"q": q, "scales": scales} | ({"expert_offsets": expert_offsets} if expert_offsets is not None else {}))


def _check_weight_copy_offsets(op: str, expert_offsets, experts: int) -> None:
    """None, or a grouped GEMM's segments (E + 1,) int32 (which experts a weight copy is made for)."""
    if expert_offsets is None:
        return
    _check_tensor(op, "expert_offsets", expert_offsets, torch.int32, 1, "(E + 1,)", optional=True)
    if expert_offsets.shape[0] != experts + 1:
        _fail(op, f"expert_offsets must be (E + 1,) = ({experts + 1},) for {experts} experts, "
                  f"got {tuple(expert_offsets.shape)}")
