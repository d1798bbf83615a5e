"""The windowed weight gradient (ops.expert_gemm_wgrad_window, csrc/gemm/expert_wgrad_sm90.cuh)
against one expert_gemm_wgrad over the whole schedule (skipped without a Hopper GPU and the built
extension; run on the device).

Exact, no tolerance: each tile's K loop is one chain of wgmma over its segment's 64-row K blocks,
and the windows split it only at K-block boundaries, carrying the fp32 accumulators bit for bit,
so the windows' out must equal the whole-schedule kernel's (itself checked against fp32 in
test_gpu_expert_gemm.py). Rows past the last segment hold large finite garbage, and some segments
end inside a K block next to another expert's rows: a window that read past a segment would change
the bits. out and the carries start as NaN, so an element no window writes shows as well.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import ops
from cuda_checks import NEEDS_HOPPER_KERNELS, TRAP_SCRIPT_TAIL, run_until_trap

pytestmark = NEEDS_HOPPER_KERNELS

# name: (m, n) of the weight gradient, (grad's columns, inputs' columns).
SHAPES = {
    "minimum": (8, 8),
    "one_tile": (128, 256),
    "partial_tiles": (200, 328),  # neither a multiple of the 128 x 256 tile
    "deepseek_v3_fc1": (4096, 7168),  # d fc1 = d gate_up^T . rows: 2F = 4096, H = 7168
}

# name: (segment rows per expert, rows past the last segment). A segment that a window boundary
# splits starts on a multiple of 64 (the caller's segment alignment; WINDOWS are multiples of 128).
ROUTINGS = {
    "uniform": ([256, 256, 256, 256], 40),
    "one_expert_spans_windows": ([0, 2496, 0], 24),  # 20, 10 and 3 windows of 128, 256, 1024
    "empty_experts": ([0, 192, 0, 0, 320, 0, 0], 64),  # empty first, inside, and last two
    # Segments end on window boundaries, and the empty last expert sits exactly at the schedule's
    # end (no rows past it): the last window stores it.
    "ends_on_window_boundaries": ([128, 128, 256, 512, 0], 0),
    # Segments end inside K blocks, next to the following expert's rows (offsets 0, 64, 101, 128,
    # 328, 341, 341); only expert 3 is split, at 256, on its own K blocks.
    "ends_inside_k_blocks": ([64, 37, 27, 200, 13, 0], 83),
}

WINDOWS = [128, 256, 1024]


def make_schedule(routing, m, n, seed):
    """grad (rows, m), inputs (rows, n) bf16 and offsets (E + 1,) int32 on the GPU; the rows past the
    last segment are garbage of magnitude 1e4 (finite, so that equality can hold)."""
    counts, tail = ROUTINGS[routing]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    rows = offsets[-1] + tail
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grad = torch.randn(rows, m, device="cuda", generator=gen).bfloat16()
    inputs = torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
    grad[offsets[-1]:] = (1e4 * torch.randn(tail, m, device="cuda", generator=gen)).bfloat16()
    inputs[offsets[-1]:] = (1e4 * torch.randn(tail, n, device="cuda", generator=gen)).bfloat16()
    return grad, inputs, torch.tensor(offsets, dtype=torch.int32, device="cuda"), offsets


def assert_boundaries_split_only_aligned_segments(offsets, rows, window):
    """The routing's own contract (the kernel would trap otherwise): every segment a window boundary
    falls strictly inside starts on a multiple of 64."""
    for boundary in range(window, rows, window):
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            if lo < boundary < hi:
                assert lo % 64 == 0, f"segment [{lo}, {hi}) split at {boundary}: not a routing of this test"


def run_windows(grad, inputs, offsets, window, out, carries):
    """The caller's loop: windows [w * window, ...) in order, the carries alternating by parity, None
    where no expert can carry (into the first window, out of the last)."""
    rows = grad.shape[0]
    num_windows = -(-rows // window)
    for w in range(num_windows):
        begin, end = w * window, min((w + 1) * window, rows)
        last = w == num_windows - 1
        ops.expert_gemm_wgrad_window(
            grad[begin:end], inputs[begin:end], offsets, begin, last, out,
            carries[w % 2] if w > 0 else None, None if last else carries[(w + 1) % 2],
        )


def nan_buffers(grad, inputs, num_experts):
    m, n = grad.shape[1], inputs.shape[1]
    out = torch.full((num_experts, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    carries = [torch.full((ops.wgrad_carry_numel(m, n),), float("nan"), device="cuda") for _ in range(2)]
    return out, carries


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_windows_equal_the_whole_schedule_bitwise(shape, routing, window):
    m, n = SHAPES[shape]
    grad, inputs, offsets, offsets_host = make_schedule(routing, m, n, seed=zlib.crc32(f"{shape}{routing}".encode()) % 1000)
    assert_boundaries_split_only_aligned_segments(offsets_host, grad.shape[0], window)
    want = ops.expert_gemm_wgrad(grad, inputs, offsets)
    out, carries = nan_buffers(grad, inputs, len(offsets_host) - 1)
    run_windows(grad, inputs, offsets, window, out, carries)
    assert torch.equal(out, want), f"{int((out != want).sum())} elements differ (NaN: {int(out.isnan().sum())})"
    assert ops.last_failure() is None


@pytest.mark.parametrize("routing", ["one_expert_spans_windows", "ends_inside_k_blocks"])
def test_windows_are_bitwise_reproducible(routing):
    grad, inputs, offsets, offsets_host = make_schedule(routing, 200, 328, seed=11)
    results = []
    for _ in range(2):
        out, carries = nan_buffers(grad, inputs, len(offsets_host) - 1)
        run_windows(grad, inputs, offsets, 128, out, carries)
        results.append(out)
    assert torch.equal(results[0], results[1])


def test_registration_and_fake():
    """The schema declares what the op writes (out, carry_out) and the fake matches it."""
    grad, inputs, offsets, offsets_host = make_schedule("one_expert_spans_windows", 64, 256, seed=12)
    out, carries = nan_buffers(grad, inputs, len(offsets_host) - 1)
    args = (grad[128:256], inputs[128:256], offsets, 128, False, out, carries[0], carries[1])
    torch.library.opcheck(torch.ops.megatron_mok.expert_gemm_wgrad_window.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_carry_buffers_are_checked_on_the_gpu_too():
    grad, inputs, offsets, offsets_host = make_schedule("uniform", 64, 256, seed=13)
    out, carries = nan_buffers(grad, inputs, len(offsets_host) - 1)
    with pytest.raises(ValueError, match="carry_in and carry_out must not share storage"):
        ops.expert_gemm_wgrad_window(grad[:128], inputs[:128], offsets, 0, False, out, carries[0], carries[0])
    with pytest.raises(ValueError, match=r"carry_out must be None or float32 \(wgrad_carry_numel"):
        ops.expert_gemm_wgrad_window(grad[:128], inputs[:128], offsets, 0, False, out, None, carries[0][:-1])
    # The C++ op checks the same without the wrapper.
    with pytest.raises(RuntimeError, match="carry_out must be None or a contiguous float32"):
        torch.ops.megatron_mok.expert_gemm_wgrad_window(grad[:128], inputs[:128], offsets, 0, False, out, None,
                                                        carries[0][:-1])
    with pytest.raises(RuntimeError, match="window_begin must be a non-negative multiple of 64"):
        torch.ops.megatron_mok.expert_gemm_wgrad_window(grad[:128], inputs[:128], offsets, 32, False, out, None, None)
    assert ops.last_failure() is None


# A window of one segment-splitting call whose device-side check fails; {call} is the op's
# arguments after grad, inputs (the first `window` rows from `begin`), offsets.
TRAP_SCRIPT = """
import torch
from megatron_mok import ops
m, n = 64, 256
offsets = torch.tensor({offsets}, dtype=torch.int32, device="cuda")
rows = {offsets}[-1]
grad = torch.randn(rows, m, device="cuda").bfloat16()
inputs = torch.randn(rows, n, device="cuda").bfloat16()
out = torch.zeros(len({offsets}) - 1, m, n, dtype=torch.bfloat16, device="cuda")
carries = [torch.zeros(ops.wgrad_carry_numel(m, n), device="cuda") for _ in range(2)]
begin, end = {begin}, {begin} + {window}
ops.expert_gemm_wgrad_window(grad[begin:end], inputs[begin:end], offsets, begin, {last}, out, {carry_in}, {carry_out})
""" + TRAP_SCRIPT_TAIL

# name: (offsets, window_begin, window rows, last_window, carry_in, carry_out, the record's words)
TRAPS = {
    # Expert 1 [96, 512) goes on past 128, 32 rows into a K block.
    "boundary_inside_a_k_block": ([0, 96, 512], 0, 128, False, "None", "carries[1]",
                                  "splits a carried expert's segment inside a 64-row K block"),
    "missing_carry_out": ([0, 512], 0, 256, False, "None", "None", "continues past the window but carry_out is None"),
    "missing_carry_in": ([0, 512], 256, 256, True, "None", "None", "continues into the window but carry_in is None"),
}


@pytest.mark.parametrize("case", list(TRAPS))
def test_a_failed_carry_check_traps_with_its_name(case):
    offsets, begin, window, last, carry_in, carry_out, words = TRAPS[case]
    script = TRAP_SCRIPT.format(offsets=offsets, begin=begin, window=window, last=last, carry_in=carry_in,
                                carry_out=carry_out)
    record, out, _ = run_until_trap(script)
    assert words in record and "kernel expert_wgrad" in record, out
