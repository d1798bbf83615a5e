"""The float64 oracle of the MoK layer and the tolerance schemes every test in tests/ uses.

Oracle: an independent float64 computation of the layer (the exact formula), route by route.

Tolerance schemes (the reasoning lives here; a test names the scheme and its parameters):
1. Exact (`torch.equal`): integer results (routing, schedules), data movement, EP against EP = 1,
   reruns, and anything that runs the same arithmetic in the same order.
2. Reordered sums, elementwise (`assert_close_reordered_sum`): two sums of the same terms in
   different orders (window partials, another kernel's reduction order), bounded by the terms'
   absolute sum S = sum_i |a_i * b_i|, never by the result, which may cancel.
3. Norm-relative (`assert_norm_relative`): ||got - want|| / ||want|| <= k * u_dtype against the
   float64 oracle (`oracle_bound`), or a count of roundings apart (`roundings_bound`).
4. Units in the last place, elementwise (`assert_within_ulps`): two roundings of nearly the same
   value to a narrow dtype.
5. A multiple of a same-precision reference's error against an exact one
   (`assert_within_same_precision`, FlashAttention-3's scheme): the GPU kernels against the bf16
   PyTorch reference, both measured against the fp32 reference.
6. SQNR (`sqnr_db`) for FP8: its error is set by E4M3's 3-bit mantissa, relative to the signal's norm.
"""

from __future__ import annotations

import dataclasses
import math
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


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _expert_routes(topk_ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, k) of every route to `expert`, in (token, k) order."""
    return (topk_ids == expert).nonzero(as_tuple=True)


def route_outputs_float64(x: torch.Tensor, topk_ids: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """(T, K, H) float64: out[t, k] = fc2_e @ swiglu(fc1_e @ x_t) for e = topk_ids[t, k], zero for a
    dropped route (id -1). x (T, H), topk_ids (T, K), fc1 (E, 2F, H), fc2 (E, H, F) of *all* experts
    (global ids). Differentiable in x, fc1 and fc2."""
    x, fc1, fc2 = (t.double() for t in (x, fc1, fc2))
    out = x.new_zeros(topk_ids.shape[0], topk_ids.shape[1], x.shape[1])
    for expert in range(fc1.shape[0]):
        token, k = _expert_routes(topk_ids, expert)
        if token.numel():
            out = out.index_put((token, k), _swiglu(x[token] @ fc1[expert].t()) @ fc2[expert].t())
    return out


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
    y = (topk_weights.double().unsqueeze(-1) * route_outputs_float64(x, topk_ids, fc1, fc2)).sum(dim=1)
    if shared_fc1 is not None:
        y = y + _swiglu(x.double() @ shared_fc1.double().t()) @ shared_fc2.double().t()
    return y


def moe_float64_with_grads(
    x, topk_ids, topk_weights, fc1, fc2, grad, shared: tuple = (), device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """y (T, H) and the gradients of (x, topk_weights, fc1, fc2, *shared) for the output gradient
    grad (T, H), all float64 on `device` (the CPU by default; a GPU for DeepSeek-V3-sized weights,
    whose float64 copies and gradients are tens of GB and minutes of CPU time); zeros for an argument
    y does not depend on. Arguments as in moe_float64, on any device; shared: (shared_fc1, shared_fc2)
    or ()."""
    leaves = [t.detach().to(device, torch.float64).requires_grad_() for t in (x, topk_weights, fc1, fc2, *shared)]
    y = moe_float64(leaves[0], topk_ids.to(device), *leaves[1:])
    grads = torch.autograd.grad(y, leaves, grad.detach().to(device, torch.float64), allow_unused=True)
    return y.detach(), [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


def weight_grad_abs_sums(x, topk_ids, topk_weights, fc1, fc2, grad) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The terms' absolute sums of the expert weight gradients (scheme 2), float64.

    dfc1[e] = sum over e's routes r of d(gate_up)_r outer x_t(r), and dfc2[e] = sum_r (w_r grad_t(r))
    outer act_r: this returns sum_r |d(gate_up)_r| outer |x_t(r)| (E, 2F, H), sum_r |w_r grad_t(r)|
    outer |act_r| (E, H, F) and the number of routes of each expert (E,) int64 (the terms per
    element). Arguments as in moe_float64, grad (T, H) the output gradient.
    """
    x, topk_weights, fc1, fc2, grad = (t.detach().double() for t in (x, topk_weights, fc1, fc2, grad))
    abs_fc1, abs_fc2 = torch.zeros_like(fc1), torch.zeros_like(fc2)
    num_routes = torch.zeros(fc1.shape[0], dtype=torch.int64)
    for expert in range(fc1.shape[0]):
        token, k = _expert_routes(topk_ids, expert)
        num_routes[expert] = token.numel()
        if not token.numel():
            continue
        rows = x[token]  # (n, H)
        grad_out = topk_weights[token, k].unsqueeze(1) * grad[token]  # (n, H)
        act, grad_gate_up = torch.autograd.functional.vjp(_swiglu, rows @ fc1[expert].t(), grad_out @ fc2[expert])
        abs_fc1[expert] = grad_gate_up.abs().t() @ rows.abs()
        abs_fc2[expert] = grad_out.abs().t() @ act.abs()
    return abs_fc1, abs_fc2, num_routes


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


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand, half of torch.finfo(dtype).eps: fp32 2^-24, bf16 2^-8."""
    return torch.finfo(dtype).eps / 2


def _first_failure(excess: torch.Tensor, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> str:
    """The number of elements past their bound (NaN counts) and the worst one, for a message."""
    bad = ~(excess <= 0)
    flat = torch.where(bad, excess.nan_to_num(nan=float("inf")), -float("inf")).flatten()
    worst = int(flat.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), excess.shape))
    return (
        f"{int(bad.sum())} of {excess.numel()} elements past the bound; element {where}: "
        f"got {float(got.flatten()[worst]):.9g}, want {float(want.flatten()[worst]):.9g}, "
        f"bound {float(bound.flatten()[worst]):.3e}"
    )


# Scheme 2: reordered sums, elementwise.
# got and want are sums s = sum_{i<n} a_i b_i of the same n terms, each evaluated in floating point in
# its own order (a GEMM's blocking, window partials added afterwards, another kernel's tree). To first
# order, one evaluation's error is sum_j delta_j p_j over its n product and n - 1 addition roundings,
# |delta_j| <= u (the accumulation's unit roundoff, 2^-24 for fp32) and |p_j| <= S = sum_i |a_i b_i|
# (each p_j is a product or a partial sum), whatever the order. Hence
#   worst case: |s_hat - s| <= n u S (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1),
# and two evaluations differ by at most 2 n u S, or n u S when want is exact (sides=1).
# Rounded to nearest, the delta_j behave as independent and mean zero (Higham and Mary, "A new
# approach to probabilistic rounding error analysis", 2019): the difference is then a sum of at most
# 2 n sides such terms, each within u S, and Hoeffding's inequality gives
#   P(|got - want| > lambda sqrt(2 n sides) u S) <= 2 exp(-lambda^2 / 2).
# lambda = 8: 2 e^-32 ~ 3e-14 per element, negligible over every element the tests compare. The bound
# is the smaller of the two, min(sides n, lambda sqrt(2 n sides)) u S. It grows like sqrt(n), so one
# dropped or doubled term (~S / n on random data) stays visible: at n = 1024 it is ~3e-5 S against
# ~1e-3 S. Accumulators not known to round to nearest (tensor cores' fp32 accumulation may truncate)
# take the worst case only (round_to_nearest=False). A result rounded once more to out_dtype adds
# u_out |want| (first order). S comes from the same operands: the same contraction on |a| and |b|,
# in float64.
REORDER_LAMBDA = 8.0


def reordered_sum_bound(
    abs_sum: torch.Tensor,
    num_terms,
    *,
    sides: int = 2,
    round_to_nearest: bool = True,
    out_dtype: Optional[torch.dtype] = None,
    want: Optional[torch.Tensor] = None,
    accumulation: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Scheme 2's elementwise bound on |got - want| (float64, abs_sum's shape).

    abs_sum: S per element; num_terms: n, an int or a tensor broadcastable to abs_sum; sides: 2 when
    both got and want were evaluated in `accumulation`, 1 when want is exact; out_dtype: the dtype the
    accumulated result was rounded to afterwards (then want is needed).
    """
    if sides not in (1, 2):
        raise ValueError(f"sides must be 1 or 2, got {sides}")
    n = torch.as_tensor(num_terms, dtype=torch.float64, device=abs_sum.device)
    factor = sides * n
    if round_to_nearest:
        factor = torch.minimum(factor, REORDER_LAMBDA * torch.sqrt(2 * sides * n))
    bound = factor * unit_roundoff(accumulation) * abs_sum.double()
    if out_dtype is not None:
        bound = bound + unit_roundoff(out_dtype) * want.double().abs()
    return bound


def assert_close_reordered_sum(
    got: torch.Tensor, want: torch.Tensor, abs_sum: torch.Tensor, num_terms, *, msg: str, **bound_args
) -> None:
    """Scheme 2: |got - want| <= reordered_sum_bound(abs_sum, num_terms, **bound_args) elementwise."""
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bound = reordered_sum_bound(abs_sum, num_terms, want=want, **bound_args)
    excess = (got.double() - want.double()).abs() - bound
    assert bool((excess <= 0).all()), f"{msg}: reordered sums: {_first_failure(excess, got, want, bound)}"


# Scheme 3: norm-relative, relative_error(got, want) = ||got - want|| / ||want||.
# In the norm because a float path's error is relative to the signal (one element may cancel), while a
# wrong, missing or doubled route moves the norm by O(1 / sqrt(tokens)), far above every bound here.
# Against the float64 oracle, k u_dtype:
# - bf16 (u = 2^-8), k = 4: the oracle takes the same bf16 inputs, so the error is the path's roundings
#   to bf16, at most four along any value (gate/up, SwiGLU, down, the sum over k; the backward mirrors
#   them); each is <= u relative per element, so <= u in the norm, and four compound to <= 4u to first
#   order (the fp32 accumulation underneath is ~1e-5). Seen: <= 2.7u (1.03e-2, d topk_weights,
#   tests/api/test_mok_moe.py).
# - fp32 (u = 2^-24), k = 128: nothing is rounded to a narrower dtype, so the error is the reductions'.
#   A sum of n random-sign terms rounded to nearest drifts like a random walk: rms error
#   sqrt(sum_j (u^2 / 3) p_j^2) with p_j^2 ~ j sigma^2, i.e. ~ sqrt(n / 6) u of a result ~ sqrt(n) sigma.
#   A value passes through at most ~5 reductions (three forward; backward their mirrors and the weight
#   gradients' sum over rows) of n <= 1024 terms in the tests: <= 5 sqrt(1024 / 6) u ~ 65u; k = 128
#   leaves 2x over that estimate. Seen: <= 6u (3.6e-7, tests/api/test_mok_moe.py).
# Two evaluations of the same formula in one dtype, neither the oracle (another reduction order, another
# module): paths=2 doubles the bound (the triangle inequality through the exact result). A known number
# of roundings to a dtype apart: roundings_bound(dtype, count) = count u.
ORACLE_K = {torch.float32: 128, torch.bfloat16: 4}


def oracle_bound(dtype: torch.dtype, paths: int = 1) -> float:
    """Scheme 3's bound for a path in `dtype` against the float64 oracle (paths=1), or for two such
    paths against each other (paths=2)."""
    if paths not in (1, 2):
        raise ValueError(f"paths must be 1 or 2, got {paths}")
    return paths * ORACLE_K[dtype] * unit_roundoff(dtype)


def roundings_bound(dtype: torch.dtype, count: int) -> float:
    """Scheme 3's bound for two results `count` roundings to `dtype` apart: count * u_dtype."""
    return count * unit_roundoff(dtype)


def assert_norm_relative(got: torch.Tensor, want: torch.Tensor, bound: float, *, msg: str) -> None:
    """Scheme 3: relative_error(got, want) <= bound (NaN fails)."""
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = relative_error(got, want)
    assert error <= bound, f"{msg}: relative error {error:.3e} past {bound:.3e}"


# Scheme 4: units in the last place. Two roundings of nearly the same fp32 value to a narrow dtype (the
# same formula, one exp differing in its last fp32 bit) are equal or adjacent: one ulp apart, where an
# ulp of |v| in [2^e, 2^(e+1)) is 2^(e + 1 - p) for a p-bit significand (2^-7 to 2^-8 of |v| in bf16).
def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, *, msg: str) -> None:
    """Scheme 4: |got - want| <= ulps units in the last place (of got's dtype) of max(|got|, |want|)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{msg}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    finfo = torch.finfo(got.dtype)
    bits = 1 - int(math.log2(finfo.eps))  # p: significand bits with the implicit one
    magnitude = torch.maximum(got.float().abs(), want.float().abs())
    _, exponent = torch.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(magnitude), exponent - bits).clamp_min(finfo.tiny * finfo.eps)
    bound = ulps * ulp
    excess = (got.float() - want.float()).abs() - bound
    assert bool((excess <= 0).all()), f"{msg}: {ulps} ulp: {_first_failure(excess, got, want, bound)}"


# Scheme 5: a multiple of a same-precision reference's error (FlashAttention-3's test bound). The kernel
# and the bf16 PyTorch reference compute the same values in bf16 and round the same values once more or
# less, so against the fp32 reference the kernel's error is at most SAME_PRECISION_FACTOR = 2 times the
# reference's. The floor, 1e-6 of the signal, covers outputs the bf16 reference gets exactly right (e.g.
# all-zero gradients), where twice zero would demand bitwise equality.
SAME_PRECISION_FACTOR = 2.0
SAME_PRECISION_FLOOR = 1e-6


def assert_within_same_precision(got: torch.Tensor, same_precision: torch.Tensor, exact: torch.Tensor, *, msg: str) -> None:
    """Scheme 5 in the norm: relative_error(got, exact) <= 2 relative_error(same_precision, exact) + 1e-6."""
    err_got = relative_error(got.float(), exact.float())
    err_ref = relative_error(same_precision.float(), exact.float())
    bound = SAME_PRECISION_FACTOR * err_ref + SAME_PRECISION_FLOOR
    assert err_got <= bound, f"{msg}: kernel {err_got:.3e} vs bf16 reference {err_ref:.3e}"


def assert_every_row_within_same_precision(
    got: torch.Tensor, same_precision: torch.Tensor, exact: torch.Tensor, *, msg: str
) -> None:
    """Scheme 5 per row (token): each row's worst element error at most 2x the same-precision
    reference's worst element error, plus 1e-6 of the largest |exact|. A global norm could hide one
    wrong or missing route (its token's error would be the size of the route's whole contribution, far
    above bf16 rounding); a per-row bound cannot. got, same_precision, exact: (rows, columns)."""
    got, same_precision, exact = got.float(), same_precision.float(), exact.float()
    row_err = (got - exact).abs().amax(dim=1)  # (rows,)
    ref_worst = (same_precision - exact).abs().amax()
    bound = SAME_PRECISION_FACTOR * ref_worst + SAME_PRECISION_FLOOR * exact.abs().max()
    worst = int(row_err.argmax())
    assert row_err[worst] <= bound, (
        f"{msg}: token {worst} off by {row_err[worst]:.3e}, past 2x the bf16 reference's worst token ({ref_worst:.3e})"
    )
