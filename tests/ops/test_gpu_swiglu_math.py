"""The SwiGLU math's batched fast path (csrc/common/swiglu_math.cuh: swiglu_values,
swiglu_backward_values) against the IEEE division it replaces, bit for bit, for every fp32 gate (all
2^32 bit patterns; skipped without a Hopper GPU and the built extension; run on the device).

Through ops.swiglu_forward / swiglu_backward on fp32 rows, which round nothing: with up = 1 and
d act = 1 the forward's output is silu(gate) itself, the backward's d up is gate * sigmoid(gate) and
its d gate sigmoid + silu * (1 - sigmoid), each against backends/reference.py's swiglu and
swiglu_backward on the same rows (torch's silu and sigmoid: x / (1 + exp(-x)) and 1 / (1 + exp(-x))
with IEEE divisions, the formulas the kernels computed before the fast path). Tolerance: none; a NaN
is a NaN.

The kernels decide per thread's pack of values whether all of them take the fast path or all the
IEEE division. So each gate is tested in a pack of copies of itself (every value takes its own
decision: the fast path wherever its range check admits it), and then the gates in order (packs of
neighbours, where an out-of-range neighbour sends in-range values to the IEEE division). Every fp32
gate's SwiGLU forward and backward in every kernel that calls these functions (the BF16 and FP8
SwiGLU kernels, bf16 gates among them) is then the IEEE formulas' bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ops
from megatron_mok.backends import reference
from cuda_checks import NEEDS_HOPPER_KERNELS

pytestmark = NEEDS_HOPPER_KERNELS

CHUNK = 1 << 26  # gates per launch
COPIES = 8  # a pack's values: at most 8 (bf16's 16-byte packs), a divisor of it for fp32's
FFN = 1 << 12


def _gates(first: int, count: int) -> torch.Tensor:
    """The fp32 gates of bit patterns first .. first + count - 1."""
    bits = torch.arange(first, first + count, device="cuda", dtype=torch.int64)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _rows(gate: torch.Tensor, up_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """gate (n,) -> gate_up (n / FFN, 2 FFN) fp32 with up = up_value, and one expert's offsets."""
    rows = gate.numel() // FFN
    gate_up = torch.cat([gate.view(rows, FFN), torch.full((rows, FFN), up_value, device="cuda")], dim=1)
    return gate_up, torch.tensor([0, rows], dtype=torch.int32, device="cuda")


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    if not bool(same.all()):
        bad = (~same).nonzero()[:4].flatten()
        raise AssertionError(f"{what}: {int((~same).sum())} values differ, e.g. at {bad.tolist()}: "
                             f"got {got.flatten()[bad].tolist()}, want {want.flatten()[bad].tolist()}")


def _check(gate: torch.Tensor, what: str) -> None:
    gate_up, offsets = _rows(gate, 1.0)
    _assert_same_bits(ops.swiglu_forward(gate_up, offsets), reference.swiglu(gate_up), f"{what}: silu")
    grad_act = torch.ones((gate_up.shape[0], FFN), device="cuda")
    _assert_same_bits(ops.swiglu_backward(gate_up, grad_act, offsets),
                      reference.swiglu_backward(gate_up, grad_act), f"{what}: d gate, d up")


@pytest.mark.parametrize("packs", ["copies", "neighbours"])
def test_every_fp32_gates_swiglu_is_the_ieee_formulas(packs):
    per_launch = CHUNK // COPIES if packs == "copies" else CHUNK
    for first in range(0, 1 << 32, per_launch):
        gate = _gates(first, per_launch)
        if packs == "copies":
            gate = gate.repeat_interleave(COPIES)
        _check(gate, f"{packs}, gate bits [{first:#x}, {first + per_launch:#x})")
