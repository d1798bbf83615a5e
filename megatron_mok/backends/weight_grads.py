"""The expert weight gradients of a pass over receive windows (megatron_mok/receive.py).

A weight gradient sums over all of an expert's rows, and a windowed pass sees them window by
window. `accumulator_for` gives the stage that adds each window's rows, one per GEMM family:

- one window: the family's segment_weight_grad once, as without windows;
- sm90, several windows: ops.expert_gemm_wgrad_window, which carries the fp32 accumulators of the
  expert that straddles a window boundary into the next window, so the sum runs in the one-window
  kernel's order and the result is bitwise the one-window result (two carry buffers of one expert's
  gradient, alternating by window parity, since a window may read one expert's carry while it
  writes another's);
- grouped_mm and the reference, several windows: per-window partial gradients summed in fp32 in
  window order (deterministic; equal to one window's only up to rounding), in an fp32 (E, m, n)
  buffer;
- fp32_carried (the FP8 reference's weight gradients), any number of windows: each window's blocks
  added straight into one fp32 (E + 1, m, n) total in row order (Stages.weight_grad_into), so the sum
  is bitwise the one-window sum;
- fp8_kernel (the FP8 kernel backend's weight gradients), any number of windows: the stage
  (Stages.weight_grad_window) carries what it needs from window to window (several windows: the
  bf16 result and two (m, n) fp32 carries, backends/kernel_fp8.WindowedWeightGrad) and returns the
  result after the last.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from megatron_mok.receive import Window

Tensor = torch.Tensor
SegmentWeightGrad = Callable[[Tensor, Tensor, Tensor], Tensor]
WeightGradInto = Callable[[Tensor, Tensor, Tensor, Tensor], None]
# (grad_out, inputs, window, what the previous window returned) -> what the next takes; the result after the last
WeightGradWindow = Callable[[Tensor, Tensor, Window, Any], Any]


class WeightGradAccumulator(Protocol):
    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        """grad_out (W, m), inputs (W, n): the window's rows in its order."""
        ...

    def result(self) -> Tensor:
        """(E, m, n) in grad_out's dtype, after every window was added in order."""
        ...


class OneWindow:
    def __init__(self, segment_weight_grad: SegmentWeightGrad):
        self.segment_weight_grad = segment_weight_grad
        self.out: Optional[Tensor] = None

    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        self.out = self.segment_weight_grad(grad_out, inputs, window.schedule.expert_offsets)

    def result(self) -> Tensor:
        return self.out


class Fp32WindowSum:
    def __init__(self, segment_weight_grad: SegmentWeightGrad):
        self.segment_weight_grad = segment_weight_grad
        self.total: Optional[Tensor] = None  # (E, m, n) float32
        self.dtype: Optional[torch.dtype] = None

    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        partial = self.segment_weight_grad(grad_out, inputs, window.schedule.expert_offsets)
        self.dtype = grad_out.dtype
        # (add_ promotes the partial in place: no fp32 copy of it beside the sum)
        self.total = partial.float() if self.total is None else self.total.add_(partial)

    def result(self) -> Tensor:
        return self.total.to(self.dtype)


class CarriedWindows:
    def __init__(self):
        self.out: Optional[Tensor] = None  # (E, m, n)
        self.carries: list[Tensor] = []  # two (carry numel,) float32

    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        from megatron_mok import ops

        m, n = grad_out.shape[1], inputs.shape[1]
        if self.out is None:
            num_experts = window.full_offsets.shape[0] - 1
            self.out = grad_out.new_empty((num_experts, m, n))
            numel = ops.wgrad_carry_numel(m, n)
            self.carries = [torch.empty(numel, device=grad_out.device, dtype=torch.float32) for _ in range(2)]
        carry_in = None if window.index == 0 else self.carries[window.index % 2]
        carry_out = None if window.last else self.carries[(window.index + 1) % 2]
        ops.expert_gemm_wgrad_window(
            grad_out, inputs, window.full_offsets, window.begin, window.last, self.out, carry_in, carry_out
        )

    def result(self) -> Tensor:
        return self.out


class Fp32Carried:
    def __init__(self, weight_grad_into: WeightGradInto):
        self.weight_grad_into = weight_grad_into
        self.total: Optional[Tensor] = None  # (E + 1, m, n) float32; row E: rows past the segments
        self.dtype: Optional[torch.dtype] = None

    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        if self.total is None:
            num_experts = window.full_offsets.shape[0] - 1
            shape = (num_experts + 1, grad_out.shape[1], inputs.shape[1])
            self.total = torch.zeros(shape, dtype=torch.float32, device=grad_out.device)
            self.dtype = grad_out.dtype
        self.weight_grad_into(grad_out, inputs, window.schedule.expert_offsets, self.total)

    def result(self) -> Tensor:
        return self.total[:-1].to(self.dtype)


class StageCarried:
    def __init__(self, weight_grad_window: WeightGradWindow):
        self.weight_grad_window = weight_grad_window
        self.carried: Any = None  # what the stage hands from one window to the next

    def add(self, grad_out: Tensor, inputs: Tensor, window: Window) -> None:
        self.carried = self.weight_grad_window(grad_out, inputs, window, self.carried)

    def result(self) -> Tensor:
        return self.carried


def accumulator_for(
    family: str,
    segment_weight_grad: SegmentWeightGrad,
    num_windows: int,
    weight_grad_into: Optional[WeightGradInto] = None,
    weight_grad_window: Optional[WeightGradWindow] = None,
) -> WeightGradAccumulator:
    """family: the weight gradients' GEMM family ("sm90", "grouped_mm", "reference", "fp32_carried",
    which adds through weight_grad_into, or "fp8_kernel", whose weight_grad_window carries its own)."""
    if family == "fp8_kernel":
        return StageCarried(weight_grad_window)
    if family == "fp32_carried":
        return Fp32Carried(weight_grad_into)
    if num_windows == 1:
        return OneWindow(segment_weight_grad)
    if family == "sm90":
        return CarriedWindows()
    return Fp32WindowSum(segment_weight_grad)
