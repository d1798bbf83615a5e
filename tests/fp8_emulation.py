"""An independent emulation of the FP8 blockwise layer (docs/design.md §12), route by route.

Built from megatron_mok/quantization.py's quantize and dequantize functions and float64 math only:
no schedule, no grouped GEMM, no stage of the backends. Every operand the recipe quantizes is
quantized and dequantized here, each GEMM runs in float64 on the dequantized values, and every value
the recipe rounds to the activation dtype is rounded so here. What differs from the reference backend
is only where the arithmetic is exact there and float64 here, or float32 there and float64 here.

Notation: T tokens, H hidden, F ffn, E experts (global ids), K topk.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_mok.limits import FP8_BLOCK
from megatron_mok.quantization import (
    dequantize_rowwise,
    dequantize_weight,
    quantize_columnwise,
    quantize_rowwise,
    quantize_weight,
)


@dataclasses.dataclass
class Fp8Result:
    y: torch.Tensor  # (T, H)
    x: torch.Tensor  # d x (T, H)
    topk_weights: torch.Tensor  # (T, K) float32
    fc1: torch.Tensor  # (E, 2F, H)
    fc2: torch.Tensor  # (E, H, F)


def _rowwise(t: torch.Tensor, pow2: bool) -> torch.Tensor:
    """(R, C) -> its 1x128 quantization along C, dequantized, float64."""
    return dequantize_rowwise(*quantize_rowwise(t, pow2)).double()


def _weight(w: torch.Tensor, pow2: bool) -> torch.Tensor:
    """(E, N, K) -> its 128x128 quantization, dequantized, float64."""
    return dequantize_weight(*quantize_weight(w, pow2)).double()


def _columnwise_blocks(t: torch.Tensor, pow2: bool) -> torch.Tensor:
    """(R, C), R rows of one expert in schedule order -> the same rows after the 1x128 quantization
    along the rows, blocks of 128 from the first row, the last block filled with zero rows; float64 (R, C)."""
    rows = t.shape[0]
    padded = F.pad(t, (0, 0, 0, -(-rows // FP8_BLOCK) * FP8_BLOCK - rows))
    q, scale = quantize_columnwise(padded, pow2)  # (C, R_pad), (R_pad/128, C)
    values = q.double().view(q.shape[0], -1, FP8_BLOCK) * scale.double().t().unsqueeze(-1)
    return values.reshape(q.shape[0], -1).t()[:rows]


def fp8_layer(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    grad_y: torch.Tensor,
    *,
    pow2: bool = False,
    fp8_weight_grad: bool = True,
) -> Fp8Result:
    """The layer and its gradients under the recipe. Every argument holds the whole problem (global
    expert ids, all experts); an expert's rows are its routes in (token, k) order, as the schedule
    orders them at EP = 1 (and at any EP, with tokens numbered across ranks)."""
    dtype = x.dtype
    rnd = lambda t: t.to(dtype).double()  # noqa: E731 (a value the recipe rounds to the activation dtype)
    num_tokens, topk = topk_ids.shape
    ffn = fc2.shape[2]
    w1, w2 = _weight(fc1, pow2), _weight(fc2, pow2)
    x_q, dy_q = _rowwise(x, pow2), _rowwise(grad_y, pow2)
    w = topk_weights.double()

    y = torch.zeros(num_tokens, x.shape[1], dtype=torch.float64)
    d_x = torch.zeros_like(y)
    d_w = torch.zeros(num_tokens, topk, dtype=torch.float64)
    d_fc1 = torch.zeros(fc1.shape, dtype=torch.float64)
    d_fc2 = torch.zeros(fc2.shape, dtype=torch.float64)
    for expert in range(fc1.shape[0]):
        tokens, ks = (topk_ids == expert).nonzero(as_tuple=True)  # (token, k) ascending: the schedule's order
        if tokens.numel() == 0:
            continue
        gate_up = rnd(x_q[tokens] @ w1[expert].t())  # (rows, 2F)
        gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
        act = rnd(F.silu(gate) * up)
        down = rnd(_rowwise(act.to(dtype), pow2) @ w2[expert].t())  # (rows, H)
        route_w = w[tokens, ks].unsqueeze(1)
        y.index_put_((tokens,), route_w * down, accumulate=True)

        d_w[tokens, ks] = (grad_y.double()[tokens] * down).sum(1)
        grad_rows = dy_q[tokens] * route_w  # the pulled FP8 rows: dY's values, scales times w
        d_act = rnd(grad_rows @ w2[expert])  # (rows, F): with fc2ᵀ (the transposed quantization is exact)
        sig = torch.sigmoid(gate)
        d_gate_up = rnd(torch.cat((d_act * up * (sig + gate * sig * (1 - sig)), d_act * gate * sig), dim=1))
        d_rows = rnd(_rowwise(d_gate_up.to(dtype), pow2) @ w1[expert])  # (rows, H)
        d_x.index_put_((tokens,), d_rows, accumulate=True)

        # The weight gradients from the values in the activation dtype (w * dY, act; d gate_up, x).
        grad_hp = (grad_y.float()[tokens] * topk_weights[tokens, ks].unsqueeze(1)).to(dtype)
        rows_hp = x[tokens]
        operands = ((grad_hp, act.to(dtype), d_fc2), (d_gate_up.to(dtype), rows_hp, d_fc1))
        for grad_out, inputs, total in operands:
            if fp8_weight_grad:
                total[expert] = _columnwise_blocks(grad_out, pow2).t() @ _columnwise_blocks(inputs, pow2)
            else:
                total[expert] = grad_out.double().t() @ inputs.double()
    return Fp8Result(y.to(dtype), d_x.to(dtype), d_w.float(), d_fc1.to(dtype), d_fc2.to(dtype))
