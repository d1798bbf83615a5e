"""An independent float64 computation of the MoK layer, token by token (the exact formula)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Shape:
    """A test problem: tokens per rank, hidden, expert ffn, experts, top-k."""

    num_tokens: int
    hidden: int
    ffn: int
    num_experts: int
    topk: int


def moe_float64(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    shared_fc1: Optional[torch.Tensor] = None,
    shared_fc2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * fc2_e @ (silu(gate_e x_t) * up_e x_t) (+ shared expert), float64.

    fc1/fc2 hold *all* experts (global ids). Differentiable in every float argument.
    """
    x, topk_weights, fc1, fc2 = (t.double() for t in (x, topk_weights, fc1, fc2))
    ffn = fc1.shape[1] // 2
    rows = []
    for token in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, k])
            if expert < 0:
                continue
            gate_up = fc1[expert] @ x[token]
            act = F.silu(gate_up[:ffn]) * gate_up[ffn:]
            acc = acc + topk_weights[token, k] * (fc2[expert] @ act)
        rows.append(acc)
    y = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=torch.float64)
    if shared_fc1 is not None:
        shared_fc1, shared_fc2 = shared_fc1.double(), shared_fc2.double()
        gate_up = x @ shared_fc1.t()
        s = shared_fc1.shape[0] // 2
        y = y + (F.silu(gate_up[:, :s]) * gate_up[:, s:]) @ shared_fc2.t()
    return y


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero)."""
    got, want = got.double(), want.double()
    denom = want.norm()
    if denom == 0:
        return float((got - want).norm())
    return float((got - want).norm() / denom)


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 20*log10(||want|| / ||want - got||) in dB, float64 (inf when
    equal). The FP8 paths' measure (docs/design.md §12): their error is set by E4M3's 3-bit mantissa,
    so it is bounded relative to the signal's norm, not element by element."""
    got, want = got.double(), want.double()
    noise = (want - got).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(want.norm() / noise))
