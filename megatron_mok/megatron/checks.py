"""Configurations `mok` does not support, rejected when the TransformerConfig is built
(before Megatron's own __post_init__ checks, so only fields as the user set them are read).

Each message names the command-line flag to change.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


def _unsupported(config: TransformerConfig) -> list[str]:
    problems = []

    def flag(condition: bool, message: str) -> None:
        if condition:
            problems.append(message)

    flag(bool(config.moe_shared_expert_overlap), "--moe-shared-expert-overlap is not supported with mok (drop the flag)")
    flag(
        bool(getattr(config, "overlap_moe_expert_parallel_comm", False)),
        "--overlap-moe-expert-parallel-comm is not supported with mok: the MoK kernel overlaps its own communication",
    )
    flag(
        bool(getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False)),
        "--overlap-dispatch-backward-with-experts-wgrad is not supported with mok",
    )
    flag(bool(getattr(config, "delay_wgrad_compute", False)), "--delay-wgrad-compute is not supported with mok")
    # Runs before TransformerConfig.__post_init__, which defaults expert-TP to TP.
    etp = config.expert_tensor_parallel_size
    if etp is None:
        etp = config.tensor_model_parallel_size
    flag(etp > 1, f"--expert-tensor-parallel-size {etp} is not supported with mok: use 1")
    flag(
        not config.gated_linear_unit or config.activation_func is not F.silu,
        "mok runs SwiGLU experts only: pass --swiglu",
    )
    flag(bool(config.add_bias_linear), "mok experts have no bias: pass --disable-bias-linear")
    flag(bool(config.moe_apply_probs_on_input), "--moe-apply-probs-on-input is not supported with mok")
    flag(bool(config.moe_latent_size), "--moe-latent-size is not supported with mok")
    flag(bool(config.moe_pad_expert_input_to_capacity), "--moe-pad-expert-input-to-capacity is not supported with mok")
    flag(config.fp8 is not None or config.fp4 is not None, "--fp8-format/--fp4-format are not supported with mok yet (BF16 only)")
    flag(
        getattr(config, "activation_func_clamp_value", None) is not None,
        "--activation-func-clamp-value is not supported with mok",
    )
    flag(bool(getattr(config, "glu_linear_offset", 0.0)), "--glu-linear-offset is not supported with mok")
    flag(
        config.tensor_model_parallel_size > 1 and not config.sequence_parallel,
        "mok with --tensor-model-parallel-size > 1 needs --sequence-parallel",
    )
    flag(
        getattr(config, "moe_router_padding_for_quantization", False),
        "--moe-router-padding-for-quantization is not supported with mok",
    )
    return problems


def check_mok_config(config: TransformerConfig) -> None:
    """Raises ValueError listing every unsupported setting when the dispatcher type is mok."""
    if config.moe_token_dispatcher_type != "mok":
        return
    problems = _unsupported(config)
    if problems:
        raise ValueError("--moe-token-dispatcher-type mok: " + "; ".join(problems))
