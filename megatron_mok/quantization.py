"""The FP8 blockwise recipe, exactly (docs/design.md §12): the oracle of every FP8 kernel.

Notation: R rows, C columns of a high-precision matrix; E experts, N output columns, K the reduction
dimension of a GEMM; a block is limits.FP8_BLOCK (128) values along the reduction dimension (1x128)
or a 128x128 tile of a weight. Quantized data is torch.float8_e4m3fn, scales are float32, and
value = q * scale.

Kernels must give the same q and scales bit for bit (tests compare them exactly); their GEMMs agree
with `promoted_block_matmul` to the tensor cores' accumulation (SQNR, §12.3).

A block's partial product P_b is exact here, whatever the summation order: every E4M3 value is a
multiple of 2^-9 (the smallest subnormal) and at most 448, so a product of two is a multiple of 2^-18
below 2^18, and a sum of 128 of them a multiple of 2^-18 below 2^25: an integer times 2^-18 below
2^43, which float64 (53 bits) holds exactly at every partial sum. So P_b is computed in float64 and
rounded once to float32, and the reference GEMMs are bitwise the same for any BLAS, any row grouping
and any split of the rows (receive windows, expert-parallel ranks).

`fp8_segment_matmul` and `fp8_segment_weight_grad` take any segments and read the offsets on the
host (tests and tools); the layer's reference backend runs `fp8_grouped_matmul` and
`fp8_grouped_weight_grad`, which need every segment to start at a multiple of 128 rows (the FP8
schedule's alignment) and never synchronize with the host. On such segments both give the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_mok.limits import FP8_BLOCK, FP8_E4M3_MAX, fp8_scale_rows
from megatron_mok.schedule import take_rows

E4M3 = torch.float8_e4m3fn
Tensor = torch.Tensor

# Gathered weight blocks of one batch of fp8_grouped_matmul stay below this many bytes (float64).
_GATHER_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """The options of the FP8 blockwise recipe a call runs (MoKConfig.precision="fp8_blockwise").

    pow2_scales: every scale a quantization makes a power of two (block_scale's pow2). The down
        dgrad's rows w * dY carry dY's scale times the route weight w (docs/design.md §12.4), which
        is not one.
    weight_grad: the weight gradients in FP8 (both operands 1x128 along tokens); False: in the
        activation dtype, as without FP8.
    cache_weights: each weight's forward FP8 copy kept until the weight changes
        (fp8_weights.quantized); False: quantized in every forward and freed after the pass.
    cache_transposed_weights: with cache_weights, the dgrads' transposed copy kept beside the
        forward copy (fp8_weights.kept_transposed; the kernel backend makes both in one pass);
        False: the kernel backend makes it range of experts by range in every backward and frees it
        after each dgrad (the reference backend caches it beside the forward copy either way)."""

    pow2_scales: bool = False
    weight_grad: bool = True
    cache_weights: bool = True
    cache_transposed_weights: bool = False


@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """Rows quantized 1x128 along their length, the row-wise source layout of §12.2: what a rank
    publishes and the exchange moves in FP8, and the FP8 GEMMs' left operand.

    values: (R, C) e4m3; scales: (R, C/128) fp32, a row's scales contiguous (they travel with it)."""

    values: Tensor
    scales: Tensor

    @staticmethod
    def quantize(x: Tensor, pow2: bool = False) -> "QuantizedRows":
        """x (R, C) bf16/fp32 -> its 1x128 quantization along C."""
        return QuantizedRows(*quantize_rowwise(x, pow2))

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    def dequantize(self) -> Tensor:
        """(R, C) fp32."""
        return dequantize_rowwise(self.values, self.scales)

    def gather(self, index: Tensor, valid: Tensor, scale_factor: Tensor | None = None) -> "QuantizedRows":
        """Rows index (N,) int64 of these rows; where valid (N,) bool is False the row is an all-zero
        block (values 0, scales 1). scale_factor (N,) fp32 multiplies a row's scales (its E4M3 values
        unchanged): the pulled route row w * dY of §12.4."""
        values = take_rows(self.values.view(torch.uint8), index)  # (E4M3's +0 is the byte 0)
        values = torch.where(valid.unsqueeze(1), values, torch.zeros((), dtype=torch.uint8, device=values.device))
        scales = take_rows(self.scales, index)
        if scale_factor is not None:
            scales = scales * scale_factor.unsqueeze(1)
        scales = torch.where(valid.unsqueeze(1), scales, torch.ones((), dtype=scales.dtype, device=scales.device))
        return QuantizedRows(values.view(E4M3), scales)


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
    pow2: the smallest power of two >= amax / 448. A NaN or inf amax gives a NaN or inf scale. A
    block whose amax / 448 underflows fp32 to 0 (amax below about 3.1e-43: fp32 values only, every
    bf16 value is larger) gets fp32's least subnormal, 2^-149, instead (a power of two): its values
    then quantize to their multiples of 2^-149 (at most 224) rather than 0 / 0 = NaN and +-448."""
    amax = amax.float()
    # A tensor divisor, never the Python number: torch computes `cuda_tensor / python_number` as a
    # multiplication by the number's rounded reciprocal (1/448 is inexact in fp32), which differs
    # from the IEEE quotient in about half of all amax values, and from what the same call gives on
    # CPU. tensor / tensor is IEEE division on every device.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    if pow2:
        regular = torch.isfinite(scale) & (scale > 0)
        scale = torch.where(regular, _pow2_at_least(torch.where(regular, scale, torch.ones_like(scale))), scale)
    # scale is 0 exactly where amax is 0 or amax / 448 underflows (a NaN amax gives a NaN scale).
    return torch.where(scale == 0, torch.where(amax == 0, 1.0, 2.0**-149), scale)


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
    # x.t() is a view: made contiguous first, so that q is (C, R) with tokens contiguous in memory
    # (the weight-gradient kernel reads it K-major), not a transposed view of an (R, C) tensor.
    q, scale = quantize_blocks(x.t().contiguous().reshape(cols, rows // FP8_BLOCK, FP8_BLOCK), pow2)
    return q.reshape(cols, rows), scale.t().contiguous()


def as_bf16_pairs(values: Tensor) -> Tensor:
    """(R, C) E4M3 -> the same bytes as (R, C/2) bf16 pairs (C even): how the row kernels, which move
    bf16 and fp32 rows and copy a bf16 value's 16 bits unchanged, move E4M3 rows."""
    return values.contiguous().view(torch.uint8).view(torch.bfloat16)


def from_bf16_pairs(pairs: Tensor) -> Tensor:
    """as_bf16_pairs undone: (R, C/2) bf16 -> (R, C) E4M3, the same bytes."""
    return pairs.view(torch.uint8).view(E4M3)


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
    out = sum over blocks b ascending of (sa[b, :, None] * sb[b, None, :]) * P_b in fp32, P_b the exact
    product of block b's E4M3 values rounded once to fp32 (module docstring)."""
    m, k = qa.shape
    n = qb.shape[0]
    _check_multiple("the reduction dimension (K)", k)
    out = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    fa, fb = qa.double(), qb.double()
    for block in range(k // FP8_BLOCK):
        cols = slice(block * FP8_BLOCK, (block + 1) * FP8_BLOCK)
        partial = (fa[:, cols] @ fb[:, cols].t()).float()  # exact, rounded once (module docstring)
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


def _tile_experts(offsets: Tensor, num_tiles: int) -> Tensor:
    """(num_tiles,) int64: the segment holding each 128-row tile (its first row), or E for a tile at
    or past offsets[-1]. Every segment starts at a multiple of 128 rows, so a tile lies in one segment."""
    starts = torch.arange(num_tiles, device=offsets.device, dtype=torch.int64) * FP8_BLOCK
    return torch.searchsorted(offsets[1:].to(torch.int64).contiguous(), starts, right=True)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]))


def fp8_grouped_matmul(
    q_rows: Tensor, scale_rows: Tensor, q_weight: Tensor, scale_weight: Tensor, offsets: Tensor
) -> Tensor:
    """The grouped FP8 GEMM of fprop and dgrad in the layer (§12.3), without host synchronization.

    q_rows (R, K) e4m3 in schedule order, scale_rows (R, K/128) fp32 (row-wise), q_weight (E, N, K)
    e4m3, scale_weight (E, N/128, K/128) fp32, offsets (E + 1,) int, every offset a multiple of 128
    -> (R, N) fp32: row r of segment e times q_weight[e]ᵀ, promoted per K block in ascending order;
    rows at or past offsets[-1] are zero. Bitwise fp8_segment_matmul's result on such segments.

    Each 128-row tile lies in one segment (the alignment), so its expert is found on the device and
    the tiles are multiplied in batches against their experts' gathered weight blocks."""
    rows, k = q_rows.shape
    experts, n, _ = q_weight.shape
    _check_multiple("the reduction dimension (K)", k)
    num_tiles = -(-rows // FP8_BLOCK)
    k_blocks = k // FP8_BLOCK
    tile_expert = _tile_experts(offsets, num_tiles)  # (tiles,) in [0, E]
    out = torch.zeros(num_tiles, FP8_BLOCK, n, dtype=torch.float32, device=q_rows.device)
    # Padded as bytes (a zero byte is E4M3's +0): no float8 kernel needed.
    a_all = _pad_rows(q_rows.view(torch.uint8), num_tiles * FP8_BLOCK).view(q_rows.dtype)
    a_all = a_all.view(num_tiles, FP8_BLOCK, k_blocks, FP8_BLOCK)
    sa_all = _pad_rows(scale_rows[:, :k_blocks], num_tiles * FP8_BLOCK).view(num_tiles, FP8_BLOCK, k_blocks)
    # The products and scalings of many (tile, K block) pairs per batch of launches (a few launches
    # per batch rather than per K block: the emulated symmetric group queues every rank's backward
    # behind its peers' signals, and a stream's queue of launches is finite: emulation.py). A K
    # chunk's float64 weight copy, and a batch's gathered float64 weight blocks and partial products
    # together, stay within _GATHER_BYTES (the batch's other temporaries are each no larger than its
    # partials). The additions into a tile stay one per K block, in ascending K order.
    block_bytes = n * FP8_BLOCK * 8  # one expert's (N, 128) float64 weight block, or one tile's partial
    chunk = max(1, min(k_blocks, _GATHER_BYTES // ((experts + 1) * block_bytes)))
    for k0 in range(0, k_blocks, chunk):
        kc = min(chunk, k_blocks - k0)
        cols = slice(k0 * FP8_BLOCK, (k0 + kc) * FP8_BLOCK)
        # Expert E (the tiles past the end) multiplies by zeros with scale 1.
        w = F.pad(q_weight[:, :, cols].double(), (0, 0, 0, 0, 0, 1))  # (E + 1, N, kc * 128)
        sw = F.pad(scale_weight[:, :, k0:k0 + kc], (0, 0, 0, 0, 0, 1), value=1.0).repeat_interleave(FP8_BLOCK, dim=1)  # (E + 1, N, kc)
        batch = max(1, _GATHER_BYTES // (2 * kc * block_bytes))
        for first in range(0, num_tiles, batch):
            tiles = slice(first, min(first + batch, num_tiles))
            count = tiles.stop - tiles.start
            experts_of = tile_expert[tiles]
            a = a_all[tiles, :, k0:k0 + kc].double().permute(0, 2, 1, 3).reshape(count * kc, FP8_BLOCK, FP8_BLOCK)
            b = w.index_select(0, experts_of).view(count, n, kc, FP8_BLOCK).permute(0, 2, 3, 1).reshape(count * kc, FP8_BLOCK, n)
            partial = torch.bmm(a, b).float().view(count, kc, FP8_BLOCK, n)  # exact, rounded once
            sa = sa_all[tiles, :, k0:k0 + kc].permute(0, 2, 1).unsqueeze(3)  # (count, kc, 128, 1)
            sb = sw.index_select(0, experts_of).permute(0, 2, 1).unsqueeze(2)  # (count, kc, 1, N)
            contribution = (sa * sb) * partial
            for j in range(kc):
                out[tiles] += contribution[:, j]
    out = out.view(num_tiles * FP8_BLOCK, n)[:rows]
    in_segment = torch.arange(rows, device=out.device) < offsets[-1]
    return torch.where(in_segment.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def fp8_grouped_weight_grad(
    q_grad: Tensor, scale_grad: Tensor, q_inputs: Tensor, scale_inputs: Tensor, offsets: Tensor, out: Tensor
) -> None:
    """The FP8 weight gradient (§12.3), added block by block into `out`, without host synchronization.

    q_grad (N, R) e4m3 column-wise, scale_grad (R/128, N) fp32, q_inputs (K, R) e4m3 column-wise,
    scale_inputs (R/128, K) fp32, offsets (E + 1,) int, every offset a multiple of 128; out (E + 1, N,
    K) fp32: expert e's row gets (scale_grad[b] ⊗ scale_inputs[b]) * P_b for each block b of its
    segment, in ascending order; row E takes the blocks at or past offsets[-1] (zeros), the caller
    drops it. Adding the rows of a schedule window by window (its windows start at multiples of 128)
    runs the same additions in the same order as adding them at once: bitwise the same sum, and
    bitwise fp8_segment_weight_grad's on one window."""
    n, rows = q_grad.shape
    k = q_inputs.shape[0]
    _check_multiple("the number of rows (tokens)", rows)
    num_blocks = rows // FP8_BLOCK
    tile_expert = _tile_experts(offsets, num_blocks)
    # The blocks' products and scalings in batches, as fp8_grouped_matmul's and for its reason, a
    # batch's float64 partial products within _GATHER_BYTES; the additions stay one per block, in
    # ascending order.
    batch = max(1, _GATHER_BYTES // (n * k * 8))
    for first in range(0, num_blocks, batch):
        count = min(batch, num_blocks - first)
        cols = slice(first * FP8_BLOCK, (first + count) * FP8_BLOCK)
        grad = q_grad[:, cols].double().view(n, count, FP8_BLOCK).transpose(0, 1)  # (count, N, 128)
        inputs = q_inputs[:, cols].double().view(k, count, FP8_BLOCK).permute(1, 2, 0)  # (count, 128, K)
        partial = torch.bmm(grad, inputs).float()  # each block's product exact in float64, rounded once
        scales = scale_grad[first:first + count].unsqueeze(2) * scale_inputs[first:first + count].unsqueeze(1)
        contribution = scales * partial  # (count, N, K)
        for j in range(count):
            # One index: each element of out[e] gets exactly one addition (deterministic on CUDA too).
            block = first + j
            out.index_add_(0, tile_expert[block:block + 1], contribution[j:j + 1])
