"""The FP8 quantization kernels (ops.fp8_quantize_rows, fp8_quantize_swiglu, fp8_quantize_columns,
fp8_quantize_swiglu_columns, fp8_quantize_swiglu_backward, fp8_quantize_swiglu_backward_copies,
fp8_quantize_weight, fp8_transpose_weight;
csrc/quant/) against megatron_mok/quantization.py run on the same GPU tensors (skipped without a
Hopper GPU and the built extension; run on the device).

Tolerance: none. The kernels compute docs/design.md §12.1 exactly as the reference does (the same
amax, the IEEE quotient amax / 448, the IEEE quotient v / scale, round-to-nearest-even E4M3 with
saturation), so q and the scales are compared bit for bit (tests/oracle.py's scheme 1), with one
allowance: a NaN is a NaN. Where a block holds NaN or inf, the NaN bytes may be 0x7F or 0xFF and the
NaN scales may carry any payload; only their places must agree (the kernels write 0x7F with the
quotient's sign, torch keeps the sign its NaN has; neither sign is part of the contract).

The data: Gaussian rows of a wide dynamic range, all-zero blocks (with -0.0), NaN and +-inf, bf16's
subnormal range (and fp32's for weights, down to an amax / 448 that underflows to 0), amax near bf16's max
beside tiny values, E4M3 rounding ties at scale 1, and amax / 448 an exact power of two (the
kernels' multiply path without pow2); each with and without pow2 scales; odd and zero row counts.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import ops, quantization
from megatron_mok.limits import fp8_scale_rows
from cuda_checks import NEEDS_HOPPER_KERNELS, poison_allocator, run_until_trap

pytestmark = NEEDS_HOPPER_KERNELS

E4M3 = torch.float8_e4m3fn
KINDS = ["gaussian", "zero_blocks", "nan_inf", "subnormal", "extreme", "ties", "pow2_quotients"]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 100_000


def values(kind: str, shape: tuple, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A (..., R, C) tensor of `kind` on the GPU, in `dtype`. Zero blocks are planted per op (their
    geometry differs); here every kind but gaussian plants its values at scattered places."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen)
    # Magnitudes from 1e-3 to 1e3 across the last-but-one dimension: blocks of different scales.
    x *= 10.0 ** (torch.rand(shape[:-1] + (1,), device="cuda", generator=gen) * 6 - 3)
    flat = x.view(-1)
    n = flat.numel()
    if n == 0:
        return x.to(dtype)

    def places(count: int) -> torch.Tensor:
        return torch.randint(0, n, (max(1, min(count, n // 4)),), device="cuda", generator=gen)

    if kind == "nan_inf":
        flat[places(n // 3000 + 1)] = float("nan")
        flat[places(n // 3000 + 1)] = float("inf")
        flat[places(n // 3000 + 1)] = float("-inf")
    elif kind == "subnormal":
        tiny = 2.0**-149 if dtype == torch.float32 else 2.0**-133  # the dtype's smallest subnormal
        x.copy_(torch.randn(shape, device="cuda", generator=gen) * 2.0**-128)  # mostly subnormal
        flat[places(n // 7)] *= 2.0**6  # some normal values among them
        flat[places(n // 11)] = tiny
    elif kind == "extreme":
        flat.mul_(1e35).clamp_(-3.3e38, 3.3e38)
        flat[places(n // 200)] = 3.3e38
        flat[places(n // 50)] = 1e-30  # beside 3e38: their quotients underflow to zero
    elif kind == "ties":
        # Scale 1 (a +-448 in every 128 values along the last dimension), the rest E4M3 values and
        # the midpoints between neighbours, normal and subnormal: each midpoint rounds to the even one.
        table = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 1.5 * 2.0**-9, 240.0, 232.0,
                              0.0625, 0.0703125, 416.0, 432.0, 1.0, 2.0**-9], device="cuda")
        pick = torch.randint(0, table.numel(), shape, device="cuda", generator=gen)
        sign = torch.randint(0, 2, shape, device="cuda", generator=gen) * 2 - 1
        x.copy_(table[pick] * sign)
        x[..., ::128] = 448.0 * sign[..., ::128]
        if len(shape) >= 2:
            x[..., ::128, :] = 448.0  # the columns' blocks run along the rows: a 448 in each of them too
    elif kind == "pow2_quotients":
        # Blocks whose amax / 448 is exactly 2^k: the multiply path without pow2 scales.
        x.clamp_(-50.0, 50.0)
        x[..., ::64] = 56.0  # 448 * 2^-3
        if len(shape) >= 2:
            x[..., ::64, :] = -56.0
    elif kind != "gaussian" and kind != "zero_blocks":
        raise ValueError(kind)
    return x.to(dtype)


def nan_bytes(q: torch.Tensor) -> torch.Tensor:
    return (q.view(torch.uint8) & 0x7F) == 0x7F


def assert_q_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == E4M3 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    differ = (g != w) & ~(nan_bytes(got) & nan_bytes(want))
    count = int(differ.sum())
    if count:
        at = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(f"{what}: {count} of {g.numel()} bytes differ, first at {at}: {int(g[at]):#04x} "
                             f"against {int(w[at]):#04x}")


def assert_scales_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    both_nan = torch.isnan(got) & torch.isnan(want)
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~both_nan
    count = int(differ.sum())
    if count:
        at = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(f"{what}: {count} of {got.numel()} scales differ, first at {at}: {float(got[at])!r} "
                             f"against {float(want[at])!r}")


# ---- rows: 1x128 along the columns --------------------------------------------------------------

# name: (rows, columns): odd and zero row counts, one block, DeepSeek-V3's H, F, 2F.
ROW_SHAPES = {
    "one_block": (1, 128),
    "odd_rows": (7, 384),
    "no_rows": (0, 256),
    "deepseek_v3_h": (515, 7168),
    "deepseek_v3_f": (1001, 2048),
    "deepseek_v3_2f": (333, 4096),
}


def row_values(kind, rows, cols, seed):
    x = values(kind, (rows, cols), seed)
    if kind == "zero_blocks" and rows:
        blocks = x.view(rows, cols // 128, 128)
        blocks[:, ::3] = 0.0
        blocks[::2, 1::3] = -0.0
        blocks[1::2, 1::3, ::2] = -0.0  # a block of -0.0 and 0.0
    return x


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(ROW_SHAPES))
def test_rows_equal_quantize_rowwise(shape, kind, pow2):
    rows, cols = ROW_SHAPES[shape]
    x = row_values(kind, rows, cols, seed_of(shape, kind))
    poison_allocator()
    q, scales, gemm_a = ops.fp8_quantize_rows(x, pow2=pow2)
    want_q, want_scales, want_gemm_a = ops.fp8_quantize_rows_reference(x, pow2=pow2)
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales (source layout)")
    assert_scales_equal(gemm_a, want_gemm_a, "scales (GEMM-A layout, padding columns 1)")


@pytest.mark.parametrize("layouts", [(True, False), (False, True)], ids=["source_only", "gemm_a_only"])
def test_rows_one_layout_only(layouts):
    source, gemm_a = layouts
    x = row_values("gaussian", 13, 256, seed=3)
    q, scales, a_scales = ops.fp8_quantize_rows(x, source_scales=source, gemm_a_scales=gemm_a)
    want_q, want_scales, want_gemm_a = ops.fp8_quantize_rows_reference(x)
    assert_q_equal(q, want_q, "q")
    assert (scales is None) != source and (a_scales is None) != gemm_a
    if source:
        assert_scales_equal(scales, want_scales, "scales")
    else:
        assert_scales_equal(a_scales, want_gemm_a, "gemm_a scales")


# ---- SwiGLU of gate/up, quantized 1x128 along F ---------------------------------------------------

# name: (rows, F, the schedule's end): the end inside the rows, at them, at zero; no rows; DeepSeek-V3's
# and Qwen3-30B's F; more units than one pass of the grid.
SWIGLU_SHAPES = {
    "one_block": (3, 128, 3),
    "end_inside_odd_rows": (77, 384, 50),
    "nothing_written": (40, 128, 0),
    "no_rows": (0, 256, 0),
    "deepseek_v3_f": (1001, 2048, 900),
    "qwen3_30b_f": (515, 768, 515),
    # More (row, block) units than the resident warps take in one pass: the grid-stride step runs.
    "many_units": (9001, 1024, 8990),
}


def swiglu_case(shape, kind, name):
    """(gate_up (rows, 2F) bf16 with NaN rows at or past the end, as the GEMM leaves them unwritten,
    offsets (3,) int32 ending there, rows, F, end) of a SWIGLU_SHAPES entry."""
    rows, ffn, end = SWIGLU_SHAPES[shape]
    gate_up = row_values(kind, rows, 2 * ffn, seed_of(name, shape, kind))
    gate_up[end:] = float("nan")
    offsets = torch.tensor([0, end // 2, end], dtype=torch.int32, device="cuda")
    return gate_up, offsets, rows, ffn, end


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SWIGLU_SHAPES))
def test_swiglu_equals_swiglu_then_quantize_rowwise(shape, kind, pow2):
    """act = quantize_rowwise of silu(gate) * up rounded to bf16; rows at or past the end hold NaN here
    (the GEMM never wrote them) and must quantize as zero rows, never read."""
    gate_up, offsets, _, _, end = swiglu_case(shape, kind, "swiglu")
    poison_allocator()
    act, act_scales = ops.fp8_quantize_swiglu(gate_up, offsets, pow2=pow2)
    want_act, want_scales = ops.fp8_quantize_swiglu_reference(gate_up, offsets, pow2)
    assert_q_equal(act, want_act, "act")
    assert_scales_equal(act_scales, want_scales, "act scales (GEMM-A layout, padding columns 1)")
    assert not bool(nan_bytes(act[end:]).any()) and bool((act_scales[:, end:] == 1).all())
    if kind == "gaussian":  # what it replaces: the SwiGLU kernel, then the row quantization
        act_bf16 = ops.swiglu_forward(gate_up, offsets)
        q, _, gemm_a = ops.fp8_quantize_rows(act_bf16, source_scales=False, pow2=pow2)
        assert_q_equal(act, q, "act against swiglu_forward + fp8_quantize_rows")
        assert_scales_equal(act_scales, gemm_a, "act scales against swiglu_forward + fp8_quantize_rows")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SWIGLU_SHAPES))
def test_swiglu_columns_equal_swiglu_then_quantize_columnwise(shape, kind, pow2):
    """The fc2 weight gradient's act operand (ops.fp8_quantize_swiglu_columns): quantize_columnwise of
    silu(gate) * up rounded to bf16, rows at or past the end (NaN here: the GEMM never wrote them)
    zero and never read; against what it replaces too, the SwiGLU kernel then the column quantization,
    byte for byte."""
    gate_up, offsets, rows, ffn, _ = swiglu_case(shape, kind, "swiglu_columns")
    poison_allocator()
    q, scales = ops.fp8_quantize_swiglu_columns(gate_up, offsets, pow2=pow2)
    want_q, want_scales = ops.fp8_quantize_swiglu_columns_reference(gate_up, offsets, pow2)
    padded = -(-rows // 128) * 128
    assert q.shape == (ffn, padded) and scales.shape == (padded // 128, ffn)
    assert_q_equal(q, want_q, "act columns")
    assert_scales_equal(scales, want_scales, "act column scales")
    if kind == "gaussian":
        act = ops.swiglu_forward(gate_up, offsets)
        got_q, got_scales = ops.fp8_quantize_columns(act, offsets, pow2=pow2)
        assert_q_equal(q, got_q, "act columns against swiglu_forward + fp8_quantize_columns")
        assert_scales_equal(scales, got_scales, "act column scales against swiglu_forward + fp8_quantize_columns")


def assert_bf16_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, a NaN matching any NaN."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    differ = (got.view(torch.int16) != want.view(torch.int16)) & ~(torch.isnan(got) & torch.isnan(want))
    count = int(differ.sum())
    if count:
        at = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(f"{what}: {count} of {got.numel()} values differ, first at {at}: {float(got[at])!r} "
                             f"against {float(want[at])!r}")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SWIGLU_SHAPES))
def test_swiglu_backward_equals_swiglu_backward_then_quantize_rowwise(shape, kind, pow2):
    """ops.fp8_quantize_swiglu_backward against the SwiGLU backward kernel's d gate_up, bit for bit, and
    its quantization by the reference (quantize_rowwise, the GEMM-A layout) byte for byte: the op must
    compute the SwiGLU backward as that kernel does, value for value (the reference backend's torch
    formula may differ from it by an ulp, the SwiGLU kernel's own tolerance,
    tests/backends/test_gpu_kernels.py). Rows at or past the end hold NaN in both inputs (never written)
    and must come out as zero rows, never read. Against what it replaces too: the SwiGLU backward
    kernel, then the row quantization kernel."""
    gate_up, offsets, rows, ffn, end = swiglu_case(shape, kind, "swiglu_backward")
    grad_act = row_values(kind, rows, ffn, seed_of("swiglu_backward_grad", shape, kind))
    grad_act[end:] = float("nan")
    poison_allocator()
    grad_gate_up, q, scales = ops.fp8_quantize_swiglu_backward(gate_up, grad_act, offsets, pow2=pow2)
    kernel_grad = ops.swiglu_backward(gate_up, grad_act, offsets)
    want_grad, want_q, want_scales = ops.fp8_quantize_grad_gate_up_reference(kernel_grad, offsets, pow2)
    assert q.shape == (rows, 2 * ffn) and scales.shape == (2 * ffn // 128, fp8_scale_rows(rows))
    assert_bf16_equal(grad_gate_up, want_grad, "d gate_up against swiglu_backward")
    assert_q_equal(q, want_q, "d gate_up rows")
    assert_scales_equal(scales, want_scales, "d gate_up row scales (GEMM-A layout, padding columns 1)")
    assert not bool(grad_gate_up[end:].view(torch.int16).any())
    assert not bool(q[end:].view(torch.uint8).any()) and bool((scales[:, end:] == 1).all())
    if kind == "gaussian":
        got_q, _, gemm_a = ops.fp8_quantize_rows(kernel_grad, source_scales=False, pow2=pow2)
        assert_q_equal(q, got_q, "rows against swiglu_backward + fp8_quantize_rows")
        assert_scales_equal(scales, gemm_a, "row scales against swiglu_backward + fp8_quantize_rows")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SWIGLU_SHAPES))
def test_swiglu_backward_copies_equal_the_two_launches(shape, kind, pow2):
    """ops.fp8_quantize_swiglu_backward_copies (both FP8 copies of d gate_up from one pass, no bf16
    d gate_up) against the reference's quantizations of the SwiGLU backward kernel's d gate_up (its
    rows at or past the end zeroed): the row copy as quantize_rowwise with GEMM-A scales, the column
    copy as quantize_columnwise over the rows padded to 128, byte for byte; and against the launches
    it replaces (fp8_quantize_swiglu_backward, then fp8_quantize_columns of its d gate_up), byte for
    byte, so the layer's bits do not depend on tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS. Rows at or
    past the end hold NaN in both inputs (never written) and must quantize as zero rows in both copies,
    never read; the column copy's padding rows are zeros too."""
    gate_up, offsets, rows, ffn, end = swiglu_case(shape, kind, "swiglu_backward_copies")
    grad_act = row_values(kind, rows, ffn, seed_of("swiglu_backward_copies_grad", shape, kind))
    grad_act[end:] = float("nan")
    poison_allocator()
    rows_q, rows_scales, columns_q, columns_scales, no_act_q, no_act_scales = ops.fp8_quantize_swiglu_backward_copies(
        gate_up, grad_act, offsets, pow2=pow2)
    assert no_act_q is None and no_act_scales is None
    padded = -(-rows // 128) * 128
    assert rows_q.shape == (rows, 2 * ffn) and rows_scales.shape == (2 * ffn // 128, fp8_scale_rows(rows))
    assert columns_q.shape == (2 * ffn, padded) and columns_scales.shape == (padded // 128, 2 * ffn)
    kernel_grad = ops.swiglu_backward(gate_up, grad_act, offsets)
    want_grad, want_rows_q, want_rows_scales = ops.fp8_quantize_grad_gate_up_reference(kernel_grad, offsets, pow2)
    want_columns_q, want_columns_scales = ops.fp8_quantize_columns_reference(want_grad, offsets, pow2)
    assert_q_equal(rows_q, want_rows_q, "d gate_up rows")
    assert_scales_equal(rows_scales, want_rows_scales, "d gate_up row scales (GEMM-A layout, padding columns 1)")
    assert_q_equal(columns_q, want_columns_q, "d gate_up columns")
    assert_scales_equal(columns_scales, want_columns_scales, "d gate_up column scales")
    assert not bool(rows_q[end:].view(torch.uint8).any()) and bool((rows_scales[:, end:] == 1).all())
    assert not bool(columns_q[:, end:].view(torch.uint8).any())
    grad_gate_up, two_rows_q, two_rows_scales = ops.fp8_quantize_swiglu_backward(gate_up, grad_act, offsets, pow2=pow2)
    two_columns_q, two_columns_scales = ops.fp8_quantize_columns(grad_gate_up, offsets, pow2=pow2)
    assert_q_equal(rows_q, two_rows_q, "rows against fp8_quantize_swiglu_backward")
    assert_scales_equal(rows_scales, two_rows_scales, "row scales against fp8_quantize_swiglu_backward")
    assert_q_equal(columns_q, two_columns_q, "columns against fp8_quantize_swiglu_backward + fp8_quantize_columns")
    assert_scales_equal(columns_scales, two_columns_scales,
                        "column scales against fp8_quantize_swiglu_backward + fp8_quantize_columns")
    # With act's column copy (the kernel's other form: a third tile, two CTAs per SM): the same d gate_up
    # copies, and act's copy as fp8_quantize_swiglu_columns makes it from gate_up.
    poison_allocator()
    *copies, act_q, act_scales = ops.fp8_quantize_swiglu_backward_copies(gate_up, grad_act, offsets, pow2=pow2,
                                                                         act_columns=True)
    for got, want, what in zip(copies, (rows_q, rows_scales, columns_q, columns_scales),
                               ("rows", "row scales", "columns", "column scales")):
        (assert_q_equal if got.dtype == E4M3 else assert_scales_equal)(got, want, f"{what} with act's columns")
    assert act_q.shape == (ffn, padded) and act_scales.shape == (padded // 128, ffn)
    want_act_q, want_act_scales = ops.fp8_quantize_swiglu_columns_reference(gate_up, offsets, pow2)
    assert_q_equal(act_q, want_act_q, "act columns")
    assert_scales_equal(act_scales, want_act_scales, "act column scales")
    kernel_act_q, kernel_act_scales = ops.fp8_quantize_swiglu_columns(gate_up, offsets, pow2=pow2)
    assert_q_equal(act_q, kernel_act_q, "act columns against fp8_quantize_swiglu_columns")
    assert_scales_equal(act_scales, kernel_act_scales, "act column scales against fp8_quantize_swiglu_columns")


# name: (source rows, the index): repeats, reversed order, -1 rows, all -1, an empty source.
GATHERS = {
    "routes": (50, [3, 3, -1, 49, 0, 7, 7, 7, -1, 12] * 7 + [48, -1]),
    "reversed": (300, list(range(299, -1, -1))),
    "all_padding": (5, [-1] * 9),
    "empty_source": (0, [-1, -1, -1]),
    "schedule_like": (8192, None),  # slot_to_route // topk of a real top-8 schedule padded to 128
}


def gather_index(name, src_rows, seed):
    if name != "schedule_like":
        return torch.tensor(GATHERS[name][1], dtype=torch.int64, device="cuda")
    from megatron_mok.schedule import build_schedule_from_gathered

    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(src_rows, 32, device="cuda", generator=gen).topk(8, dim=1).indices
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=32, segment_alignment=128)
    return schedule.slot_to_route.div(8, rounding_mode="floor")  # -1 stays -1


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", ["gaussian", "zero_blocks", "nan_inf"])
@pytest.mark.parametrize("gather", list(GATHERS))
def test_gathered_rows_equal_quantize_rowwise_of_the_gathered_rows(gather, kind, pow2):
    src_rows = GATHERS[gather][0]
    cols = 7168 if gather == "schedule_like" else 256
    x = row_values(kind, src_rows, cols, seed_of(gather, kind))
    index = gather_index(gather, src_rows, seed=5)
    poison_allocator()
    q, scales, gemm_a = ops.fp8_quantize_rows(x, index, pow2=pow2)
    want_q, want_scales, want_gemm_a = ops.fp8_quantize_rows_reference(x, index, pow2=pow2)
    assert q.shape == (index.shape[0], cols) and gemm_a.shape == (cols // 128, fp8_scale_rows(index.shape[0]))
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")
    assert_scales_equal(gemm_a, want_gemm_a, "gemm_a scales")


TRAP_SCRIPT = """
import torch
from megatron_mok import ops
x = torch.randn(20, 256, device="cuda").bfloat16()
index = torch.tensor({index}, dtype=torch.int64, device="cuda")
ops.fp8_quantize_rows(x, index)
try:
    torch.cuda.synchronize()
    print("no error")
except Exception as error:
    print("error:", type(error).__name__)
print("record:", ops.last_failure())
"""


@pytest.mark.parametrize("index", [[0, 20], [-2, 1]], ids=["past_the_end", "below_minus_one"])
def test_a_row_index_out_of_range_traps_with_its_name(index):
    record, out, _ = run_until_trap(TRAP_SCRIPT.format(index=index))
    assert "row_index holds a row outside" in record and "kernel fp8_quantize_rows/fp8_quantize_columns" in record, out


# ---- columns: 1x128 along the rows (tokens), transposed ---------------------------------------

# name: (rows, columns, the schedule's end row or None): rows not a multiple of 128, an end inside
# the last block and inside an earlier one, one row, none, DeepSeek-V3's H and F over a schedule.
COLUMN_SHAPES = {
    "one_block": (128, 128, None),
    "one_row": (1, 128, None),
    "no_rows": (0, 256, None),
    "ragged_rows": (300, 256, None),
    "end_in_last_block": (300, 256, 290),
    "end_in_an_earlier_block": (640, 384, 200),
    "end_zero": (256, 128, 0),
    "deepseek_v3_h": (4096 + 77, 7168, 4096),
    "deepseek_v3_f": (8192 + 3, 2048, 8192 - 128 + 5),
}


def column_values(kind, rows, cols, end, seed):
    x = values(kind, (rows, cols), seed)
    if kind == "zero_blocks" and rows:
        x[: min(rows, 128), ::3] = 0.0
        x[: min(rows, 128), 1::3] = -0.0
    if end is not None:
        x[end:] = float("nan")  # past the schedule's end: must never be read
    return x


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(COLUMN_SHAPES))
def test_columns_equal_quantize_columnwise(shape, kind, pow2):
    rows, cols, end = COLUMN_SHAPES[shape]
    x = column_values(kind, rows, cols, end, seed_of(shape, kind))
    offsets = None if end is None else torch.tensor([0, end // 2, end], dtype=torch.int32, device="cuda")
    poison_allocator()
    q, scales = ops.fp8_quantize_columns(x, offsets, pow2=pow2)
    want_q, want_scales = ops.fp8_quantize_columns_reference(x, offsets, pow2=pow2)
    padded = -(-rows // 128) * 128
    assert q.shape == (cols, padded) and scales.shape == (padded // 128, cols)
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")


def test_columns_of_segments_equal_the_weight_gradient_operand():
    """Over a schedule padded to 128 rows per segment, the columns' blocks are per expert: the op's
    operands give quantization.fp8_segment_weight_grad what quantize_columnwise's give it."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    offsets_host = [0, 256, 256, 640, 768]
    rows = offsets_host[-1] + 40  # a tail past the schedule
    dy = torch.randn(rows, 256, device="cuda", generator=gen).bfloat16()
    x = torch.randn(rows, 384, device="cuda", generator=gen).bfloat16()
    offsets = torch.tensor(offsets_host, dtype=torch.int32, device="cuda")
    got = quantization.fp8_segment_weight_grad(*ops.fp8_quantize_columns(dy, offsets), *ops.fp8_quantize_columns(x, offsets),
                                              offsets)
    end = offsets_host[-1]
    want = quantization.fp8_segment_weight_grad(*quantization.quantize_columnwise(dy[:end]),
                                               *quantization.quantize_columnwise(x[:end]), offsets)
    assert torch.equal(got, want)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", ["gaussian", "zero_blocks", "nan_inf"])
@pytest.mark.parametrize("gather", list(GATHERS))
def test_gathered_columns_equal_quantize_columnwise_of_the_gathered_rows(gather, kind, pow2):
    """The fc1 weight gradient's operand straight from the token rows: bitwise the gathered rows'
    column quantization (-1 rows zero), with the schedule's end inside the index: the entries past it
    hold an index out of range, which must not be read."""
    src_rows = GATHERS[gather][0]
    cols = 7168 if gather == "schedule_like" else 256
    x = row_values(kind, src_rows, cols, seed_of(gather, kind))
    index = gather_index(gather, src_rows, seed=6)
    rows = index.shape[0]
    end = rows - rows // 3
    index[end:] = src_rows + 5  # past the end: never read
    offsets = torch.tensor([0, end // 2, end], dtype=torch.int32, device="cuda")
    poison_allocator()
    q, scales = ops.fp8_quantize_columns(x, offsets, pow2=pow2, row_index=index)
    want_q, want_scales = ops.fp8_quantize_columns_reference(x, offsets, pow2=pow2, row_index=index.clamp(max=src_rows - 1)
                                                             if src_rows else index.clamp(max=-1))
    padded = -(-rows // 128) * 128
    assert q.shape == (cols, padded) and scales.shape == (padded // 128, cols)
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", ["gaussian", "zero_blocks", "nan_inf"])
@pytest.mark.parametrize("tokens,experts", [(1000, 8), (8192, 32), (3, 4)])
def test_weighted_gathered_columns_equal_the_pulled_rows_quantized(tokens, experts, kind, pow2):
    """The fc2 weight gradient's w * dY operand straight from dY and the route weights: bitwise the
    weighted pull kernel's rows (ops.pull_grad_rows) quantized column-wise, over a real top-8 schedule
    (segments padded to 128, -1 rows, rows past the end unwritten by the pull and not read here)."""
    from megatron_mok.schedule import build_schedule_from_gathered

    topk, cols = min(8, experts), 256 if tokens < 8192 else 7168
    gen = torch.Generator(device="cuda").manual_seed(seed_of(tokens, experts, kind))
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=experts, segment_alignment=128)
    dy = row_values(kind, tokens, cols, seed_of("dy", tokens, kind))
    weights = torch.rand(tokens, topk, device="cuda", generator=gen)
    weights[0, 0] = 0.0  # a zero weight: its row quantizes as the pull's zeros (+0 or -0 alike)
    route, offsets = schedule.slot_to_route, schedule.expert_offsets
    poison_allocator()
    pulled = ops.pull_grad_rows(dy, weights.reshape(-1), route, topk, offsets)
    want_q, want_scales = ops.fp8_quantize_columns(pulled, offsets, pow2=pow2)
    token = torch.where(route >= 0, route // topk, route)
    row_weights = weights.reshape(-1)[route.clamp(min=0)]
    q, scales = ops.fp8_quantize_columns(dy, offsets, pow2=pow2, row_index=token, row_weights=row_weights)
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")


COLUMNS_TRAP_SCRIPT = TRAP_SCRIPT.replace("ops.fp8_quantize_rows(x, index)", "ops.fp8_quantize_columns(x, row_index=index)")


@pytest.mark.parametrize("index", [[0, 20], [-2, 1]], ids=["past_the_end", "below_minus_one"])
def test_a_columns_row_index_out_of_range_traps_with_its_name(index):
    record, out, _ = run_until_trap(COLUMNS_TRAP_SCRIPT.format(index=index))
    assert "row_index holds a row outside" in record and "kernel fp8_quantize_rows/fp8_quantize_columns" in record, out


# ---- columns gathered from the ranks' regions (expert parallelism's symmetric regions) ------------

def _regions(num_ranks, tokens, cols, kind, seed):
    """num_ranks separate (tokens, cols) bf16 allocations standing for the ranks' copies of a region
    (each its own cudaMalloc block, as the peers' mappings are), and their addresses in rank order."""
    regions = [row_values(kind, tokens, cols, seed_of(seed, rank)).clone() for rank in range(num_ranks)]
    return regions, [region.data_ptr() for region in regions]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", ["gaussian", "zero_blocks", "nan_inf"])
@pytest.mark.parametrize("num_ranks,tokens,experts", [(1, 1000, 8), (2, 300, 4), (3, 129, 6), (8, 1024, 32)])
def test_columns_from_peers_equal_the_columns_of_the_concatenated_regions(num_ranks, tokens, experts, kind, pow2):
    """ops.fp8_quantize_columns_from_peers over R separate regions, gathered (the fc1 weight
    gradient's x rows) and weighted (fc2's w * dY, the route weights copied out of the ranks'
    regions as the backend does): bitwise fp8_quantize_columns of the regions concatenated, over a
    real top-k schedule of the group's routes (segments padded to 128, -1 rows, the rows past the
    schedule's end holding an index out of range, never read); own is a rank other than 0."""
    from megatron_mok.schedule import build_schedule_from_gathered

    topk, cols = min(8, experts), 7168 if tokens >= 1024 else 256
    gen = torch.Generator(device="cuda").manual_seed(seed_of(num_ranks, tokens, kind))
    ids = torch.rand(num_ranks, tokens, num_ranks * experts, device="cuda", generator=gen).topk(topk, dim=2).indices
    schedule = build_schedule_from_gathered(ids, rank=num_ranks - 1, num_local_experts=experts, segment_alignment=128)
    assert int(schedule.expert_offsets[-1]) > 0
    route, offsets = schedule.slot_to_route, schedule.expert_offsets
    regions, ptrs = _regions(num_ranks, tokens, cols, kind, ("x", num_ranks, tokens))
    weight_regions = [torch.rand(tokens * topk, device="cuda", generator=gen) for _ in range(num_ranks)]
    own, own_weights = regions[-1], weight_regions[-1]
    row = torch.where(route >= 0, route // topk, route)
    end = int(offsets[-1])
    row[end:] = num_ranks * tokens + 5  # past the schedule's end: never read
    poison_allocator()
    want = ops.fp8_quantize_columns(torch.cat(regions), offsets, pow2=pow2, row_index=row)
    got = ops.fp8_quantize_columns_from_peers(own, ptrs, offsets, pow2=pow2, row_index=row)
    assert_q_equal(got[0], want[0], "q")
    assert_scales_equal(got[1], want[1], "scales")
    flat = ops.gather_peer_regions(own_weights, [w.data_ptr() for w in weight_regions]).reshape(-1)
    assert torch.equal(flat, torch.cat(weight_regions))
    row_weights = flat[route.clamp(min=0)]
    want = ops.fp8_quantize_columns(torch.cat(regions), offsets, pow2=pow2, row_index=row, row_weights=row_weights)
    got = ops.fp8_quantize_columns_from_peers(own, ptrs, offsets, pow2=pow2, row_index=row, row_weights=row_weights)
    assert_q_equal(got[0], want[0], "weighted q")
    assert_scales_equal(got[1], want[1], "weighted scales")


def test_columns_from_peers_read_each_rank_where_it_lies():
    """Each rank's region read at its own address: every rank's rows distinct (rank r's rows all
    2^r), so a wrong base or a row counted from the wrong rank changes the quantized columns; against
    the rows picked out by hand (rank, token) and quantized from one tensor."""
    num_ranks, tokens, cols = 4, 130, 128
    regions = [torch.full((tokens, cols), float(2**rank), device="cuda", dtype=torch.bfloat16) for rank in range(num_ranks)]
    picks = [(0, 0), (0, tokens - 1), (1, 0), (2, 7), (3, tokens - 1), None]
    row = torch.tensor([-1 if p is None else p[0] * tokens + p[1] for p in picks], dtype=torch.int64, device="cuda")
    rows = torch.stack([torch.zeros(cols, device="cuda", dtype=torch.bfloat16) if p is None else regions[p[0]][p[1]]
                        for p in picks])
    q, scales = ops.fp8_quantize_columns_from_peers(regions[2], [r.data_ptr() for r in regions], row_index=row)
    want_q, want_scales = ops.fp8_quantize_columns(rows)
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")


# Two regions of 20 rows (x and its copy): the group's rows are [0, 40).
COLUMNS_FROM_PEERS_TRAP_SCRIPT = TRAP_SCRIPT.replace(
    "ops.fp8_quantize_rows(x, index)",
    "y = x.clone()\nops.fp8_quantize_columns_from_peers(x, [x.data_ptr(), y.data_ptr()], row_index=index)")


def test_a_columns_from_peers_row_past_the_group_traps_with_its_name():
    """A row index at or past R * T (the group's rows) traps with the row index's failure record."""
    record, out, _ = run_until_trap(COLUMNS_FROM_PEERS_TRAP_SCRIPT.format(index=[0, 40]))
    assert "row_index holds a row outside" in record and "kernel fp8_quantize_rows/fp8_quantize_columns" in record, out


# ---- weights: 128x128 blocks and the transposed copy --------------------------------------------

# name: (experts, N, K): one block, several, DeepSeek-V3's fc2 as stored (H x F) and fc1 (2F x H).
WEIGHT_SHAPES = {
    "one_block": (1, 128, 128),
    "several": (3, 256, 384),
    "deepseek_v3_fc2": (2, 7168, 2048),
    "deepseek_v3_fc1": (1, 4096, 7168),
}


def weight_values(kind, shape, dtype, seed):
    w = values(kind, shape, seed, dtype)
    if kind == "zero_blocks":
        w[:, :128, :128] = 0.0
        w[:, 128:256, 128:256] = -0.0
    if kind == "subnormal" and dtype == torch.float32:
        # A block of +-2^-145 and zeros: amax / 448 underflows to 0, so the scale is fp32's least
        # subnormal 2^-149 and the values quantize to +-16 and 0 (no NaN), in the kernel as in the
        # reference.
        block = w[:, :128, :128]
        block.copy_(torch.sign(block) * 2.0**-145)
        block[:, ::7] = 0.0
    return w


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(WEIGHT_SHAPES))
def test_weight_equals_quantize_weight_and_its_transpose(shape, kind, dtype, pow2):
    w = weight_values(kind, WEIGHT_SHAPES[shape], dtype, seed_of(shape, kind, str(dtype)))
    poison_allocator()
    q, scales, q_t, scales_t = ops.fp8_quantize_weight(w, pow2=pow2)
    want = ops.fp8_quantize_weight_reference(w, pow2=pow2)
    for got, ref, what in zip((q, scales, q_t, scales_t), want, ("q", "scales", "q_t", "scales_t")):
        (assert_q_equal if got.dtype == E4M3 else assert_scales_equal)(got, ref, what)


def test_weight_without_the_transposed_copy():
    w = weight_values("gaussian", (2, 256, 128), torch.bfloat16, seed=4)
    q, scales, q_t, scales_t = ops.fp8_quantize_weight(w, transposed=False)
    want_q, want_scales = quantization.quantize_weight(w)
    assert q_t is None and scales_t is None
    assert_q_equal(q, want_q, "q")
    assert_scales_equal(scales, want_scales, "scales")


@pytest.mark.parametrize("pow2", [False, True])
def test_weight_transposed_copy_alone(pow2):
    """forward_copy=False (the kernel backend's dgrad copy): q_t and scales_t as the full call's, no
    forward copy returned."""
    w = weight_values("gaussian", WEIGHT_SHAPES[next(iter(WEIGHT_SHAPES))], torch.bfloat16, seed=5)
    poison_allocator()
    q, scales, q_t, scales_t = ops.fp8_quantize_weight(w, pow2=pow2, forward_copy=False)
    assert q is None and scales is None
    want = ops.fp8_quantize_weight_reference(w, pow2=pow2)
    assert_q_equal(q_t, want[2], "q_t")
    assert_scales_equal(scales_t, want[3], "scales_t")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(WEIGHT_SHAPES))
def test_transposed_copy_from_the_quantized_weight(shape, kind, dtype, pow2):
    """fp8_transpose_weight of the 128x128 quantization: quantization.transpose_weight's bytes, and
    so the transposed copy fp8_quantize_weight makes from the weight itself (NaN blocks included)."""
    w = weight_values(kind, WEIGHT_SHAPES[shape], dtype, seed_of("transpose", shape, kind, str(dtype)))
    q, scales, from_weight, from_weight_scales = ops.fp8_quantize_weight(w, pow2=pow2)
    poison_allocator()
    q_t, scales_t = ops.fp8_transpose_weight(q, scales)
    want_q_t, want_scales_t = ops.fp8_transpose_weight_reference(q, scales)
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8)), "q_t: not the bytes of q transposed"
    assert torch.equal(scales_t.view(torch.int32), want_scales_t.view(torch.int32)), "scales_t"
    assert_q_equal(q_t, from_weight, "q_t against the copy quantized from the weight")
    assert_scales_equal(scales_t, from_weight_scales, "scales_t against the copy quantized from the weight")


# Segments of a grouped GEMM over 5 experts: experts 1 and 3 without rows, as in a receive window
# that holds a few of the experts.
SEGMENT_OFFSETS = [0, 130, 130, 300, 300, 301]


@pytest.mark.parametrize("copy", ["forward", "transposed", "both", "from_forward_copy"])
def test_weight_copies_for_segments_equal_the_whole_copies_where_read(copy):
    """expert_offsets (the copies of a GEMM over those segments, e.g. a receive window's): every
    block of an expert with rows is the whole copy's, bit for bit (the blocks of experts without rows
    are left unwritten: no GEMM over those segments reads them); offsets with no rows at all and
    offsets with every expert give the same."""
    w = weight_values("gaussian", (5, 2048, 7168), torch.bfloat16, seed=11)
    whole = ops.fp8_quantize_weight(w)
    for offsets_host in (SEGMENT_OFFSETS, [0, 1, 2, 3, 4, 5], [7] * 6):
        offsets = torch.tensor(offsets_host, dtype=torch.int32, device="cuda")
        with_rows = [e for e in range(5) if offsets_host[e] < offsets_host[e + 1]]
        poison_allocator()
        if copy == "from_forward_copy":
            got = (None, None) + ops.fp8_transpose_weight(whole[0], whole[1], offsets)
        else:
            got = ops.fp8_quantize_weight(w, transposed=copy != "forward", forward_copy=copy != "transposed",
                                          expert_offsets=offsets)
        for g, want, what in zip(got, whole, ("q", "scales", "q_t", "scales_t")):
            if g is None:
                continue
            for e in with_rows:
                (assert_q_equal if g.dtype == E4M3 else assert_scales_equal)(g[e], want[e], f"{what}[{e}]")


# ---- the quotient v / scale, exhaustively over bf16 ---------------------------------------------

def every_bf16_quotient_block(first_amax_bits: int, end_amax_bits: int) -> torch.Tensor:
    """(blocks, 128) bf16 on the GPU: for every amax A with bits in [first, end) (positive, finite),
    blocks holding A in column 0 and, in the other 127, every bf16 value v with |v| <= A, both signs
    (+-0 included; the last block of an A repeats A where its values run out). So each block's scale
    is RN(A / 448) and every pair (scale, v) a block of bf16 values can quantize appears once."""
    amax_bits = torch.arange(first_amax_bits, end_amax_bits, device="cuda", dtype=torch.int64)
    values_per_amax = 2 * (amax_bits + 1)  # magnitudes 0 .. A, two signs each
    blocks_per_amax = (values_per_amax + 126) // 127
    block_amax = torch.repeat_interleave(amax_bits, blocks_per_amax)
    first_block = torch.cumsum(blocks_per_amax, 0) - blocks_per_amax
    block_in_amax = torch.arange(block_amax.numel(), device="cuda") - torch.repeat_interleave(first_block, blocks_per_amax)
    index = block_in_amax[:, None] * 127 + torch.arange(127, device="cuda")[None, :]  # (blocks, 127)
    magnitude, negative = index // 2, index % 2
    bits = torch.where(magnitude <= block_amax[:, None], magnitude | (negative << 15), block_amax[:, None])
    bits = torch.cat([block_amax[:, None], bits], dim=1)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # the int16 holding those 16 bits
    return bits.to(torch.int16).view(torch.bfloat16)


def test_every_bf16_quotient_gives_the_ieee_quotients_byte():
    """The quantizer's reciprocal path (Fp8BlockQuantizer kReciprocal, every scale of a bf16 block but
    the tiny ones) against torch's IEEE division, for every bf16 value and every scale a block of bf16
    values can have (about 1.07e9 pairs, all of them): the E4M3 bytes and scales of the rows kernel
    against the reference, and of the columns kernel (the blocks laid along its tokens) against the
    rows kernel. The weight kernel and the SwiGLU epilogue call the same device function. (Which path
    the kernel takes for a block is not observable here: this holds whichever it takes.)"""
    top = 0x7F80  # +inf's bits: every finite positive amax below it
    edges = [1] + [int(top * (i / 8) ** 0.5) for i in range(1, 8)] + [top]  # about equal work per chunk
    for first, end in zip(edges, edges[1:]):
        blocks = every_bf16_quotient_block(first, end)
        pad = -blocks.shape[0] % 1024  # whole 128 x 1024 tiles for the columns kernel
        if pad:
            blocks = torch.cat([blocks, blocks.new_zeros((pad, 128))])
        x = blocks.view(-1, 1024)
        q, scales, _ = ops.fp8_quantize_rows(x, gemm_a_scales=False)
        want_q, want_scales = quantization.quantize_rowwise(x)
        assert_q_equal(q, want_q, f"rows, amax bits [{first:#x}, {end:#x})")
        assert_scales_equal(scales, want_scales, f"rows' scales, amax bits [{first:#x}, {end:#x})")
        del want_q, want_scales
        q_c, scales_c = ops.fp8_quantize_columns(x.t().contiguous())
        assert torch.equal(q_c.view(torch.uint8), q.view(torch.uint8)), f"columns, amax bits [{first:#x}, {end:#x})"
        assert torch.equal(scales_c.t().view(torch.int32), scales.view(torch.int32))


# ---- every op: the reference's scale on this device, determinism, graphs, registration ------------

def test_reference_scale_is_the_same_on_the_gpu_and_the_cpu():
    """quantization.block_scale divides by a tensor, so CUDA gives the IEEE quotient the CPU gives
    (a Python-number divisor would be a product with fp32(1/448) on CUDA: ~55% of these differ)."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    amax = torch.randn(1 << 16, device="cuda", generator=gen).abs().bfloat16().float()
    for pow2 in (False, True):
        got = quantization.block_scale(amax, pow2).cpu()
        assert torch.equal(got.view(torch.int32), quantization.block_scale(amax.cpu(), pow2).view(torch.int32))


def op_cases():
    """(name, op, args) of each op on small inputs."""
    x = row_values("gaussian", 37, 384, seed=1)
    index = torch.tensor([5, -1, 36, 0, 0, 12, -1], dtype=torch.int64, device="cuda")
    offsets = torch.tensor([0, 128, 200], dtype=torch.int32, device="cuda")
    w = weight_values("gaussian", (2, 256, 384), torch.bfloat16, seed=2)
    return [
        ("rows", torch.ops.megatron_mok.fp8_quantize_rows.default, (x, None, True, True, False)),
        ("gathered_rows", torch.ops.megatron_mok.fp8_quantize_rows.default, (x, index, True, True, True)),
        ("columns", torch.ops.megatron_mok.fp8_quantize_columns.default, (x, offsets, False)),
        # (gathered and weighted: the fc2 weight gradient's w * dY operand, 7 rows padded to 128)
        ("weighted_columns", torch.ops.megatron_mok.fp8_quantize_columns.default,
         (x, offsets, False, index, torch.rand(7, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)))),
        ("weight", torch.ops.megatron_mok.fp8_quantize_weight.default, (w, True, False, True)),
        ("weight_transposed_only", torch.ops.megatron_mok.fp8_quantize_weight.default, (w, True, False, False)),
        ("transpose_weight", torch.ops.megatron_mok.fp8_transpose_weight.default, ops.fp8_quantize_weight(w, transposed=False)[:2]),
        # (F = 384: three blocks a row; rows 20.. past the schedule's end)
        ("swiglu", torch.ops.megatron_mok.fp8_quantize_swiglu.default,
         (row_values("gaussian", 37, 768, seed=3), torch.tensor([0, 9, 20], dtype=torch.int32, device="cuda"), False)),
        # (two 128-row blocks of act columns; rows 150.. past the schedule's end)
        ("swiglu_columns", torch.ops.megatron_mok.fp8_quantize_swiglu_columns.default,
         (row_values("gaussian", 200, 512, seed=4), torch.tensor([0, 128, 150], dtype=torch.int32, device="cuda"), False)),
        # (F = 256: two blocks each of d gate and d up a row; 130 rows, the GEMM-A scales padded to 132;
        # rows 129.. past the schedule's end)
        ("swiglu_backward", torch.ops.megatron_mok.fp8_quantize_swiglu_backward.default,
         (row_values("gaussian", 130, 512, seed=5), row_values("gaussian", 130, 256, seed=6),
          torch.tensor([0, 128, 129], dtype=torch.int32, device="cuda"), False)),
        # (the same inputs, both copies: two 128-row blocks of columns, the second holding 2 rows and
        # 126 padding rows)
        ("swiglu_backward_copies", torch.ops.megatron_mok.fp8_quantize_swiglu_backward_copies.default,
         (row_values("gaussian", 130, 512, seed=5), row_values("gaussian", 130, 256, seed=6),
          torch.tensor([0, 128, 129], dtype=torch.int32, device="cuda"), False)),
        # (and act's column copy from the same pass)
        ("swiglu_backward_copies_act", torch.ops.megatron_mok.fp8_quantize_swiglu_backward_copies.default,
         (row_values("gaussian", 130, 512, seed=5), row_values("gaussian", 130, 256, seed=6),
          torch.tensor([0, 128, 129], dtype=torch.int32, device="cuda"), False, True)),
    ]


def same_outputs(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == E4M3 else x, y.view(torch.uint8) if y.dtype == E4M3 else y)
               for x, y in zip(a, b))


@pytest.mark.parametrize("case", [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
                         ids=["rows", "gathered_rows", "columns", "weighted_columns", "weight", "transpose_weight", "swiglu",
                              "swiglu_columns", "swiglu_backward", "swiglu_backward_copies",
                              "swiglu_backward_copies_act"])
def test_deterministic_and_graph_replay_equals_eager(case):
    _, op, args = op_cases()[case]
    first = [t.clone() for t in op(*args)]
    assert same_outputs(op(*args), first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        op(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(*args)
    for _ in range(2):
        for t in captured:
            t.view(torch.uint8).fill_(0xFF)  # every byte must be written again by the replay
        graph.replay()
        torch.cuda.synchronize()
        assert same_outputs(captured, first)


@pytest.mark.parametrize("case", [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
                         ids=["rows", "gathered_rows", "columns", "weighted_columns", "weight", "transpose_weight", "swiglu",
                              "swiglu_columns", "swiglu_backward", "swiglu_backward_copies",
                              "swiglu_backward_copies_act"])
def test_registration_fake_no_mutation_and_compile(case):
    """The fake impl agrees with the kernel (opcheck's test_faketensor), no input is written, and
    torch.compile(fullgraph=True) of the op gives the eager bytes."""
    _, op, args = op_cases()[case]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    eager = op(*args)
    for was, now in zip(before, tensors):
        assert torch.equal(was, now), "an input was written"
    # A fresh Dynamo cache per case: the lambda below is one code object, and one compile per case
    # of it would reach Dynamo's recompile limit (8) within this test's cases.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    assert same_outputs(compiled(*args), eager)
    assert ops.last_failure() is None
