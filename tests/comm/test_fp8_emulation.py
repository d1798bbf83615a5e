"""FP8 blockwise across expert-parallel ranks (docs/design.md §12): emulated ranks over the
collective exchange, bitwise equal to EP = 1 on the concatenated problem, in one window and in
several; and what crosses ranks is FP8 where the recipe says so.

Why bitwise: a rank quantizes its own rows (1x128 along H: a row's quantization does not depend on
the other rows), the exchange moves the bytes, every row's FP8 GEMM sums exact block products in the
same order wherever it runs, the schedule orders an expert's rows alike on its owner and at EP = 1
(source rank, token, k; segments from a multiple of 128), so every 128-row block of the weight
gradients holds the same rows, and those are added in row order into one fp32 total, window by
window or at once (backends/weight_grads.py Fp32Carried).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.comm.exchange import CollectiveExchange
from megatron_mok.emulation import EmulatedGroup, EmulatedRankGroup
from megatron_mok.functional import plan_for
from megatron_mok.quantization import E4M3
from test_emulation import ROUTINGS, assert_bitwise, make_problem, run_concatenated, run_emulated

FP8 = MoKConfig(precision="fp8_blockwise")

# (num_ranks, num_tokens, hidden, ffn, local_experts, topk)
CASES = {
    "r2": (2, 9, 128, 128, 2, 3),
    "r4": (4, 5, 256, 128, 2, 2),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_fp8_equals_ep1_bitwise(case, routing):
    num_ranks, t, h, f, e, k = CASES[case]
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.bfloat16, zlib.crc32(f"fp8/{case}/{routing}".encode()))
    got = run_emulated(EmulatedGroup(num_ranks, "cpu"), problem, e, FP8)
    assert_bitwise(got, run_concatenated(problem, FP8), f"fp8 {case}/{routing}")


@pytest.mark.parametrize("routing", ["uniform", "one_expert_rank0", "dropped"])
def test_windowed_emulated_fp8_equals_ep1_bitwise(monkeypatch, routing):
    """Several receive windows (the collective exchange made windowed, as tests/api/test_receive.py
    does): gate/up recomputed from FP8 rows per window in backward, the FP8 weight gradients added
    window by window, bitwise the one-window pass."""
    num_ranks, t, h, f, e, k = 4, 64, 128, 128, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.bfloat16, 21)
    want = run_concatenated(problem, FP8)
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    config = MoKConfig(precision="fp8_blockwise", receive_capacity_factor=0.3)
    group = EmulatedGroup(num_ranks, "cpu")
    assert plan_for(CollectiveExchange(group.ranks[0]), t, k, e, config).num_windows > 2
    assert_bitwise(run_emulated(group, problem, e, config), want, f"fp8 windowed {routing}")


def test_fp8_rows_cross_ranks_as_fp8(monkeypatch):
    """Forward gathers x as E4M3 bytes and fp32 scales, never in the activation dtype; backward
    gathers dY as FP8 (the dgrads) and in the activation dtype (the fc2 weight gradient's operand),
    and x in the activation dtype (the fc1 weight gradient's operand) (docs/design.md §12.4)."""
    num_ranks, t, h, f, e, k = CASES["r2"]
    problem = make_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.bfloat16, 5)
    gathered: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    phase = ["forward"]
    real_all_gather = EmulatedRankGroup.all_gather

    def recording_all_gather(self, tensor):
        if self.rank == 0:
            gathered.append((phase[0], tensor.dtype, tuple(tensor.shape)))
        return real_all_gather(self, tensor)

    monkeypatch.setattr(EmulatedRankGroup, "all_gather", recording_all_gather)
    group = EmulatedGroup(num_ranks, "cpu")
    x, ids, weights, fc1, fc2, grad = problem
    xs = [x[r].clone().requires_grad_() for r in range(num_ranks)]
    ys = group.mok_moe(xs, list(ids), list(weights), [fc1[r * e:(r + 1) * e] for r in range(num_ranks)],
                       [fc2[r * e:(r + 1) * e] for r in range(num_ranks)], config=FP8)
    phase[0] = "backward"
    torch.autograd.backward(ys, list(grad))
    rows, scales = (t, h), (t, h // 128)
    forward = [(dtype, shape) for p, dtype, shape in gathered if p == "forward"]
    backward = [(dtype, shape) for p, dtype, shape in gathered if p == "backward"]
    assert (torch.uint8, rows) in forward and (torch.float32, scales) in forward, forward
    assert (torch.bfloat16, rows) not in forward, "forward gathered rows in bf16"
    assert backward.count((torch.uint8, rows)) == 1 and backward.count((torch.bfloat16, rows)) == 2, backward
    assert E4M3.itemsize == 1  # (the bytes gathered are the E4M3 values)
