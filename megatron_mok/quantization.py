"""The FP8 blockwise recipe, exactly (docs/design.md §12): the oracle of every FP8 kernel.

Notation: R rows, C columns of a high-precision matrix; E experts, N output columns, K the reduction
dimension of a GEMM; a block is limits.FP8_BLOCK (128) values along the reduction dimension (1x128)
or a 128x128 tile of a weight. Quantized data is torch.float8_e4m3fn, scales are float32, and
value = q * scale.

Kernels must give the same q and scales bit for bit (tests compare them exactly); their GEMMs agree
with `promoted_block_matmul` to the tensor cores' accumulation (SQNR, §12.3).
"""

from __future__ import annotations

import torch

from megatron_mok.limits import FP8_BLOCK, FP8_E4M3_MAX, fp8_scale_rows

E4M3 = torch.float8_e4m3fn
Tensor = torch.Tensor


def _check_multiple(name: str, size: int, multiple: int = FP8_BLOCK) -> None:
    if size % multiple != 0:
        raise ValueError(f"{name} must be a multiple of {multiple} for FP8 blockwise, got {size}")


def _pow2_at_least(scale: Tensor) -> Tensor:
    """scale (...) fp32, positive and finite -> the smallest power of two >= scale, exactly and alike
    on every device: from the bits (a mantissa other than zero moves the exponent up one), not from
    torch.ldexp or torch.pow, which compute 2**e in floating point. fp32's subnormals (< 2**-126)
    are lifted by 2**64 into the normal range and brought back, both products exact."""
    tiny = scale < 2.0**-126
    bits = torch.where(tiny, scale * 2.0**64, scale).view(torch.int32)
    rounded = torch.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)
    return torch.where(tiny, rounded * 2.0**-64, rounded)


def block_scale(amax: Tensor, pow2: bool = False) -> Tensor:
    """amax (...) fp32, each block's max |v| -> scale (...) fp32: amax / 448 (1 for an all-zero block).
    pow2: the smallest power of two >= amax / 448. A NaN or inf amax gives a NaN or inf scale."""
    amax = amax.float()
    # A tensor divisor, never the Python number: torch computes `cuda_tensor / python_number` as a
    # multiplication by the number's rounded reciprocal (1/448 is inexact in fp32), which differs
    # from the IEEE quotient in about half of all amax values, and from what the same call gives on
    # CPU. tensor / tensor is IEEE division on every device.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    if pow2:
        regular = torch.isfinite(scale) & (scale > 0)
        scale = torch.where(regular, _pow2_at_least(torch.where(regular, scale, torch.ones_like(scale))), scale)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_blocks(values: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """values (..., num_blocks, 128) -> (q (..., num_blocks, 128) e4m3, scale (..., num_blocks) fp32).

    q = e4m3(v / scale): fp32 division rounded to nearest, then round-to-nearest-even to E4M3 with
    saturation to +-448 (what CUDA's cvt.rn.satfinite does; |v / scale| <= 448 up to the division's
    rounding, so the clamp only catches that rounding). amax propagates NaN (torch.amax does)."""
    v = values.float()
    scale = block_scale(v.abs().amax(dim=-1), pow2)
    q = (v / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(E4M3)
    return q, scale


def quantize_rowwise(x: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """x (R, C), 1x128 blocks along C -> (q (R, C) e4m3, scale (R, C/128) fp32): the source layout,
    a row's scales contiguous (what a rank publishes and the exchange moves with the row)."""
    rows, cols = x.shape
    _check_multiple("the quantized dimension (columns)", cols)
    q, scale = quantize_blocks(x.reshape(rows, cols // FP8_BLOCK, FP8_BLOCK), pow2)
    return q.reshape(rows, cols), scale


def gemm_a_scales(scale: Tensor) -> Tensor:
    """Row-wise scales (R, C/128) -> the GEMM-A layout (C/128, R_pad) fp32, one K block's scales
    contiguous over rows, R_pad = limits.fp8_scale_rows(R). Padding columns hold 1 (never read for a
    written output)."""
    rows, blocks = scale.shape
    out = torch.ones(blocks, fp8_scale_rows(rows), dtype=torch.float32, device=scale.device)
    out[:, :rows] = scale.t()
    return out


def quantize_weight(weight: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """weight (E, N, K), 128x128 blocks -> (q (E, N, K) e4m3, scale (E, N/128, K/128) fp32)."""
    experts, n, k = weight.shape
    _check_multiple("a weight's rows (N)", n)
    _check_multiple("a weight's columns (K)", k)
    tiles = weight.reshape(experts, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK).transpose(2, 3)
    q, scale = quantize_blocks(tiles.reshape(experts, n // FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK * FP8_BLOCK), pow2)
    q = q.reshape(experts, n // FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK, FP8_BLOCK).transpose(2, 3)
    return q.reshape(experts, n, k), scale


def transpose_weight(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """A quantized weight (E, N, K) with (E, N/128, K/128) scales -> its transposed copy (E, K, N)
    with (E, K/128, N/128): the dgrads' right operand. 128x128 blocks transpose exactly, so this is
    the quantization of the transposed weight."""
    return q.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()


def quantize_columnwise(x: Tensor, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """x (R, C), 1x128 blocks along R (tokens) -> (q (C, R) e4m3, scale (R/128, C) fp32): the
    weight gradients' operands, tokens contiguous (K-major for a GEMM that reduces over tokens)."""
    rows, cols = x.shape
    _check_multiple("the number of rows (tokens)", rows)
    q, scale = quantize_blocks(x.t().reshape(cols, rows // FP8_BLOCK, FP8_BLOCK), pow2)
    return q.reshape(cols, rows), scale.t().contiguous()


def dequantize_rowwise(q: Tensor, scale: Tensor) -> Tensor:
    """q (R, C) e4m3, scale (R, C/128) -> (R, C) fp32."""
    return (q.float().reshape(q.shape[0], -1, FP8_BLOCK) * scale.unsqueeze(-1)).reshape(q.shape)


def dequantize_weight(q: Tensor, scale: Tensor) -> Tensor:
    """q (E, N, K) e4m3, scale (E, N/128, K/128) -> (E, N, K) fp32."""
    expanded = scale.repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)
    return q.float() * expanded


def promoted_block_matmul(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor) -> Tensor:
    """The FP8 GEMM with promotion per K block (§12.3).

    qa (M, K) e4m3, sa (K/128, M) fp32, qb (N, K) e4m3, sb (K/128, N) fp32 -> (M, N) fp32:
    out = sum over blocks b ascending of (sa[b, :, None] * sb[b, None, :]) * P_b, P_b the fp32 product
    of block b's E4M3 values (each product of two E4M3 values is exact in fp32)."""
    m, k = qa.shape
    n = qb.shape[0]
    _check_multiple("the reduction dimension (K)", k)
    out = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    fa, fb = qa.float(), qb.float()
    for block in range(k // FP8_BLOCK):
        cols = slice(block * FP8_BLOCK, (block + 1) * FP8_BLOCK)
        partial = fa[:, cols] @ fb[:, cols].t()
        out += (sa[block].unsqueeze(1) * sb[block].unsqueeze(0)) * partial
    return out


def fp8_segment_matmul(
    qa: Tensor, sa: Tensor, qw: Tensor, sw: Tensor, offsets: Tensor
) -> Tensor:
    """The grouped FP8 GEMM of fprop and dgrad, per expert segment.

    qa (R, K) e4m3 rows in schedule order, sa (K/128, R_pad) fp32 (GEMM-A layout), qw (E, N, K) e4m3,
    sw (E, N/128, K/128) fp32, offsets (E + 1,) int -> (R, N) fp32: rows of segment e times qw[e]ᵀ;
    rows at or past offsets[-1] are zero."""
    rows = qa.shape[0]
    out = torch.zeros(rows, qw.shape[1], dtype=torch.float32, device=qa.device)
    bounds = offsets.tolist()
    for expert in range(qw.shape[0]):
        begin, end = bounds[expert], bounds[expert + 1]
        if end > begin:
            # sb[b, n] = the weight's scale of (n // 128, b).
            sb = sw[expert].t().repeat_interleave(FP8_BLOCK, dim=1)
            out[begin:end] = promoted_block_matmul(qa[begin:end], sa[:, begin:end], qw[expert], sb)
    return out


def fp8_segment_weight_grad(
    qg: Tensor, sg: Tensor, qx: Tensor, sx: Tensor, offsets: Tensor
) -> Tensor:
    """The FP8 weight gradient, reducing over each expert segment's rows (tokens).

    qg (N, R) e4m3 column-wise, sg (R/128, N) fp32, qx (K, R) e4m3 column-wise, sx (R/128, K) fp32,
    offsets (E + 1,) int, every segment starting at a multiple of 128 -> (E, N, K) fp32; zeros for an
    empty expert."""
    experts = offsets.shape[0] - 1
    out = torch.zeros(experts, qg.shape[0], qx.shape[0], dtype=torch.float32, device=qg.device)
    bounds = offsets.tolist()
    for expert in range(experts):
        begin, end = bounds[expert], bounds[expert + 1]
        if end <= begin:
            continue
        if begin % FP8_BLOCK != 0:
            raise ValueError(f"offsets[{expert}] must be a multiple of {FP8_BLOCK} for the FP8 weight gradient, got {begin}")
        # A segment's last block may be partial (its tail rows past `end` belong to no expert): the
        # rows [end, round_up(end)) are padding, zero in both operands.
        stop = -(-end // FP8_BLOCK) * FP8_BLOCK
        blocks = slice(begin // FP8_BLOCK, stop // FP8_BLOCK)
        out[expert] = promoted_block_matmul(qg[:, begin:stop], sg[blocks], qx[:, begin:stop], sx[blocks])
    return out
