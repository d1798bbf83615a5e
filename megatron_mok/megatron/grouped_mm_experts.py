"""`GroupedMMExperts`: Megatron's routed experts on torch's grouped GEMM, without Transformer Engine.

The expert module a user without Transformer Engine could run in place of SequentialMLP's Python
loop over experts: what TEGroupedMLP computes (fc1 of every local expert in one grouped GEMM, the
routing-weighted activation, fc2 in one grouped GEMM), with torch's grouped GEMM
(`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`) in place of TE's GroupedLinear. On an
sm90 GPU in bf16 that is torch's CUTLASS grouped GEMM; on a CPU torch's own implementation, one
matmul per group. Both are differentiable through autograd, so the backward is torch's as well.
`scripts/throughput.py` runs it as the dispatcher `alltoall_grouped` (Megatron's `alltoall` with
`--mok-grouped-mm-experts`).

Parameters and checkpoints mirror TEGroupedMLP with `moe_single_grouped_weight` (TE >= 2.14: one
grouped weight per linear):
- `linear_fc1.weight` (E_local, 2F, H), each expert's gate rows then up rows, and
  `linear_fc2.weight` (E_local, H, F), initialized per expert in SequentialMLP's order;
- a plain state dict also loads from TEGroupedMLP's per-expert layout (`linear_fc1.weight0` ...
  `weight{E_local-1}`, each (2F, H)) and from a flat (E_local * 2F, H) grouped weight; TE's
  `_extra_state` entries (FP8 metadata: this module runs in the parameters' dtype) are dropped;
- the sharded (`torch_dist`) state dict is SequentialMLP's and TEGroupedMLP's:
  `experts.linear_fc1.weight` per global expert, split into gate and up halves as Megatron's SwiGLU
  factory splits it, so checkpoints interchange with `alltoall` (SequentialMLP or TEGroupedMLP)
  and `mok` both ways.

Notation: N dispatched rows on this rank (sum of tokens_per_expert), E_local local experts,
H hidden, F expert FFN (moe_ffn_hidden_size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mok.megatron.experts import GroupedExpertWeights

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
# torch's grouped GEMM needs every row of its operands to start on a 16-byte boundary.
_ROW_ALIGNMENT_BYTES = 16


def unsupported(config: TransformerConfig) -> list[str]:
    """What GroupedMMExperts does not run, each naming the flag to change."""
    problems = []

    def flag(condition: bool, message: str) -> None:
        if condition:
            problems.append(message)

    flag(not config.gated_linear_unit, "gated experts only: pass --swiglu")
    flag(
        bool(config.bias_activation_fusion) and config.activation_func is not F.silu,
        "the fused activation is SwiGLU's only: pass --no-bias-swiglu-fusion for other gated activations",
    )
    flag(bool(config.add_bias_linear), "experts have no bias: pass --disable-bias-linear")
    flag(bool(config.moe_apply_probs_on_input), "--moe-apply-probs-on-input is not supported")
    flag(bool(config.moe_latent_size), "--moe-latent-size is not supported")
    flag(config.fp8 is not None or config.fp4 is not None, "--fp8-format/--fp4-format need Transformer Engine's experts")
    flag((config.expert_tensor_parallel_size or 1) > 1, "--expert-tensor-parallel-size must be 1")
    flag(bool(config.use_te_activation_func), "--use-te-activation-func needs Transformer Engine")
    flag(config.moe_mlp_glu_interleave_size is not None, "--moe-mlp-glu-interleave-size is not supported")
    flag(
        bool(config.delay_wgrad_compute or config.overlap_dispatch_backward_with_experts_wgrad),
        "--delay-wgrad-compute / --overlap-dispatch-backward-with-experts-wgrad are not supported",
    )
    flag(
        config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or ()),
        "--recompute-modules moe_act is not supported",
    )
    flag(bool(config.fine_grained_activation_offloading), "--fine-grained-activation-offloading is not supported")
    element_bytes = torch.empty((), dtype=config.params_dtype).element_size()
    for name, size in (("--hidden-size", config.hidden_size), ("--moe-ffn-hidden-size", config.moe_ffn_hidden_size)):
        flag(
            size * element_bytes % _ROW_ALIGNMENT_BYTES != 0,
            f"{name} {size}: torch's grouped GEMM needs rows of a multiple of {_ROW_ALIGNMENT_BYTES} bytes "
            f"({_ROW_ALIGNMENT_BYTES // element_bytes} elements of {config.params_dtype})",
        )
    return problems


class GroupedLinearWeight(torch.nn.Module):
    """One linear's grouped weight, as TE's GroupedLinear keeps it with single_grouped_weight:
    `weight` (E_local, out_features, in_features)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        num_experts, out_features, in_features = self.weight.shape
        grouped = f"{prefix}weight"
        per_expert = [f"{prefix}weight{e}" for e in range(num_experts)]
        if grouped not in state_dict and all(key in state_dict for key in per_expert):
            state_dict[grouped] = torch.stack([state_dict.pop(key) for key in per_expert])
        value = state_dict.get(grouped)
        if isinstance(value, torch.Tensor) and value.shape == (num_experts * out_features, in_features):
            state_dict[grouped] = value.view(num_experts, out_features, in_features)
        for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state")]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def weighted_activation(config: TransformerConfig, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Megatron's expert activation scaled by each row's routing weight, with the functions
    MLP.forward (SequentialMLP's experts) calls for the same config.

    Args:
        fc1: (N, 2F), gate columns then linear columns.
        probs: (N,) routing weights (float32 from Megatron's router).
    Returns:
        (N, F) in fc1's dtype.
    """
    probs = probs.unsqueeze(-1)  # (N, 1)
    if config.bias_activation_fusion:  # SwiGLU (unsupported() rejects the rest); dtype handled inside
        return weighted_bias_swiglu_impl(fc1, None, probs, config.activation_func_fp8_input_store)
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    if (clamp := config.activation_func_clamp_value) is not None:
        gate = gate.clamp(min=None, max=clamp)
        linear = linear.clamp(min=-clamp, max=clamp)
    activated = config.activation_func(gate) * (linear + config.glu_linear_offset)
    return (activated * probs).to(fc1.dtype)


def group_ends(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(E_local,) int32 cumulative row counts on `device`: the `offs` of torch's grouped GEMM.

    Megatron's alltoall dispatcher leaves tokens_per_expert on the host (it synchronized to size its
    all-to-all); the sum runs there and one small copy goes to the device, without waiting for it."""
    ends = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    return ends.to(device, non_blocking=True)


class GroupedMMExperts(GroupedExpertWeights):
    """The routed experts of one Megatron MoE layer on torch's grouped GEMM (module docstring)."""

    def _check(self, config: TransformerConfig) -> None:
        problems = unsupported(config)
        if problems:
            raise ValueError("GroupedMMExperts (--mok-grouped-mm-experts): " + "; ".join(problems))

    def _hold(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter) -> None:
        self.linear_fc1 = GroupedLinearWeight(fc1)
        self.linear_fc2 = GroupedLinearWeight(fc2)

    def _grouped_weights(self) -> tuple[tuple[str, torch.Tensor, str, bool], ...]:
        return (
            ("linear_fc1.weight", self.linear_fc1.weight, "linear_fc1.weight", True),
            ("linear_fc2.weight", self.linear_fc2.weight, "linear_fc2.weight", False),
        )

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """
        Args:
            permuted_local_hidden_states: (N, H) rows grouped by local expert, in expert order.
            tokens_per_expert: (E_local,) integer rows of each local expert (host or device).
            permuted_probs: (N,) each row's routing weight.
        Returns:
            ((N, H) in the rows' dtype, None): no bias, as SequentialMLP without one.
        """
        rows = permuted_local_hidden_states
        hidden = self.linear_fc1.weight.shape[2]
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise ValueError(f"permuted_local_hidden_states: expected (N, {hidden}), got {tuple(rows.shape)}")
        if tokens_per_expert.shape != (self.num_local_experts,) or tokens_per_expert.is_floating_point():
            raise ValueError(
                f"tokens_per_expert: expected ({self.num_local_experts},) integers, "
                f"got {tuple(tokens_per_expert.shape)} {tokens_per_expert.dtype}"
            )
        if permuted_probs.shape != (rows.shape[0],):
            raise ValueError(f"permuted_probs: expected ({rows.shape[0]},), got {tuple(permuted_probs.shape)}")
        # Rows past the last group would stay unwritten; the count is checkable only where it is on
        # the host already (reading it from the device would synchronize).
        if tokens_per_expert.device.type == "cpu" and int(tokens_per_expert.sum()) != rows.shape[0]:
            raise ValueError(
                f"tokens_per_expert: sums to {int(tokens_per_expert.sum())}, but "
                f"permuted_local_hidden_states has {rows.shape[0]} rows"
            )
        ends = group_ends(tokens_per_expert, rows.device)
        fc1 = _grouped_mm(rows, self.linear_fc1.weight.transpose(-2, -1), offs=ends)  # (N, 2F)
        activated = weighted_activation(self.config, fc1, permuted_probs)  # (N, F)
        return _grouped_mm(activated, self.linear_fc2.weight.transpose(-2, -1), offs=ends), None  # (N, H)
