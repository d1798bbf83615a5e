"""Configurations `mok` does not support, rejected when the TransformerConfig is built
(before Megatron's own __post_init__ checks, so only fields as the user set them are read).

Each message names the command-line flag to change.

Precision: the routed experts run MoKConfig.precision `expert_precision(config)`: "fp8_blockwise"
under `--fp8-format e4m3 --fp8-recipe blockwise` (Transformer Engine, where present, runs the dense
layers in that recipe as it does without mok) or `--mok-precision fp8_blockwise` (the experts alone,
e.g. without Transformer Engine), else "bf16". Any other FP8 format or recipe is an error naming the
flag: mok's experts run DeepSeek-V3's E4M3 blockwise recipe only (docs/design.md §12).
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mok.config import MoKConfig
from megatron_mok.limits import FP8_BLOCK

FP8_FLAGS = "--fp8-format e4m3 --fp8-recipe blockwise"


def parsed_args() -> Optional[object]:
    """Megatron's parsed arguments, None where there are none (a model built outside its launcher)."""
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def _recipe_name(config: TransformerConfig) -> str:
    recipe = getattr(config, "fp8_recipe", None)  # a str, or megatron.core.enums.Fp8Recipe (a str enum)
    return getattr(recipe, "value", recipe)


def megatron_fp8_blockwise(config: TransformerConfig) -> bool:
    """Whether the model runs FP8 through Megatron's flags in the recipe mok's experts run."""
    return getattr(config, "fp8", None) == "e4m3" and _recipe_name(config) == "blockwise"


def expert_precision(config: TransformerConfig) -> str:
    """The routed experts' MoKConfig.precision: `config.mok_config`'s if set, else --mok-precision,
    else "fp8_blockwise" under --fp8-format e4m3 --fp8-recipe blockwise, else "bf16"."""
    explicit = getattr(config, "mok_config", None)
    if explicit is not None and hasattr(explicit, "precision"):
        return explicit.precision
    chosen = getattr(parsed_args(), "mok_precision", None)
    if chosen is not None:
        return chosen
    return "fp8_blockwise" if megatron_fp8_blockwise(config) else "bf16"


def expert_ffn_size(config: TransformerConfig) -> tuple[str, Optional[int]]:
    """(the flag that sets it, the experts' FFN size F) as Megatron's __post_init__ will settle it from
    the fields as set: moe_ffn_hidden_size, else ffn_hidden_size, else 4 * hidden_size."""
    if config.moe_ffn_hidden_size is not None:
        return "--moe-ffn-hidden-size", config.moe_ffn_hidden_size
    if config.ffn_hidden_size is not None:
        return "--ffn-hidden-size (the experts' FFN size when --moe-ffn-hidden-size is unset)", config.ffn_hidden_size
    hidden = config.hidden_size
    return "--hidden-size (4 x it is the experts' FFN size when neither FFN size is set)", (
        None if hidden is None else 4 * hidden
    )


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
    flag(config.fp4 is not None, "--fp4-format is not supported with mok: its experts run bf16 or FP8 blockwise")
    flag(
        config.fp8 is not None and config.fp8 != "e4m3",
        f"--fp8-format {config.fp8} is not supported with mok: its experts' FP8 is E4M3 throughout ({FP8_FLAGS})",
    )
    flag(
        config.fp8 is not None and _recipe_name(config) != "blockwise",
        f"--fp8-recipe {_recipe_name(config)} is not supported with mok: its experts run DeepSeek-V3's blockwise "
        f"recipe ({FP8_FLAGS}, or --mok-precision fp8_blockwise for the experts alone)",
    )
    flag(
        bool(getattr(config, "fp16", False)),
        "--fp16 is not supported with mok: its experts take bf16 or fp32 activations (pass --bf16)",
    )
    precision = expert_precision(config)
    cache_flags = _set_fp8_cache_flags()
    if getattr(config, "mok_config", None) is not None:
        problems.extend(_flags_against_explicit_config(config.mok_config))
    elif precision != "fp8_blockwise":
        for name in cache_flags:
            flag(True, f"{name} sets the FP8 experts' weight cache, but the experts run {precision} (pass "
                       f"--mok-precision fp8_blockwise or {FP8_FLAGS}, or drop the flag)")
    elif len(cache_flags) == len(FP8_CACHE_FLAGS):
        flag(True, "--mok-fp8-cache-transposed-weights keeps the transposed copies beside the cached forward "
                   "copies: it cannot go with --mok-no-fp8-weight-cache (drop one)")
    if precision == "fp8_blockwise":
        for name, size in (("--hidden-size", config.hidden_size), expert_ffn_size(config)):
            flag(
                size is not None and size % FP8_BLOCK != 0,
                f"{name} {size} must be a multiple of {FP8_BLOCK} for the experts' FP8 blockwise recipe",
            )
    flag(
        getattr(config, "activation_func_clamp_value", None) is not None,
        "--activation-func-clamp-value is not supported with mok",
    )
    flag(bool(getattr(config, "glu_linear_offset", 0.0)), "--glu-linear-offset is not supported with mok")
    flag(
        config.tensor_model_parallel_size > 1 and not config.sequence_parallel,
        "mok with --tensor-model-parallel-size > 1 needs --sequence-parallel",
    )
    # (--moe-router-padding-for-fp8, its deprecated spelling, becomes it in Megatron's __post_init__,
    # after this check.)
    flag(
        bool(getattr(config, "moe_router_padding_for_quantization", False))
        or bool(getattr(config, "moe_router_padding_for_fp8", False)),
        "--moe-router-padding-for-quantization (or --moe-router-padding-for-fp8) is not supported with mok",
    )
    return problems


# The flags of mok's FP8 experts' weight cache, as (flag, the parsed argument's name).
FP8_CACHE_FLAGS = (
    ("--mok-no-fp8-weight-cache", "mok_no_fp8_weight_cache"),
    ("--mok-fp8-cache-transposed-weights", "mok_fp8_cache_transposed_weights"),
)


def _set_fp8_cache_flags() -> list[str]:
    args = parsed_args()
    return [name for name, field in FP8_CACHE_FLAGS if getattr(args, field, False)]


# mok's flags that set a field of the layer's MoKConfig, as (flag, the parsed argument's name, the
# field, the argument's value when the flag is absent, the field's value a switch asks for: None
# where the argument's value is the field's).
MOK_CONFIG_FLAGS = (
    ("--mok-backend", "mok_backend", "backend", "auto", None),
    ("--mok-expert-gemm", "mok_expert_gemm", "expert_gemm", "auto", None),
    ("--mok-dispatch-ring-minibatches", "mok_dispatch_ring_minibatches", "dispatch_ring_minibatches",
     MoKConfig.dispatch_ring_minibatches, None),
    ("--mok-exchange", "mok_exchange", "exchange", "auto", None),
    ("--mok-precision", "mok_precision", "precision", None, None),
    ("--mok-no-fp8-weight-cache", "mok_no_fp8_weight_cache", "fp8_cache_weights", False, False),
    ("--mok-fp8-cache-transposed-weights", "mok_fp8_cache_transposed_weights", "fp8_cache_transposed_weights",
     False, True),
)


def _flags_against_explicit_config(explicit) -> list[str]:
    """The flags set that ask for another value of a field than TransformerConfig.mok_config, the
    layer config set in code, gives it: mok_config_for takes that config as it is, so each such flag
    would be ignored."""
    args = parsed_args()
    if args is None or not hasattr(explicit, "precision"):
        return []
    problems = []
    for name, argument, field, absent, switched in MOK_CONFIG_FLAGS:
        given = getattr(args, argument, absent)
        if given == absent:
            continue
        wanted, shown = (given, f"{name} {given}") if switched is None else (switched, name)
        if getattr(explicit, field) != wanted:
            problems.append(f"{shown} asks for {field}={wanted!r}, but TransformerConfig.mok_config (set in code, "
                            f"and taken as it is) has {field}={getattr(explicit, field)!r}: drop the flag or set "
                            f"the field there")
    return problems


def _fp8_flags_without_mok() -> list[str]:
    """The flags set that ask for mok's FP8 experts: with another dispatcher nothing would read them,
    and the experts would run BF16 where the user asked for FP8."""
    args = parsed_args()
    names = ["--mok-precision fp8_blockwise"] if getattr(args, "mok_precision", None) == "fp8_blockwise" else []
    return names + _set_fp8_cache_flags()


def check_mok_config(config: TransformerConfig) -> None:
    """Raises ValueError listing every unsupported setting when the dispatcher type is mok, and
    naming mok's FP8 flags when they are set for another dispatcher (which would ignore them)."""
    if config.moe_token_dispatcher_type != "mok":
        ignored = _fp8_flags_without_mok()
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)}: mok's FP8 experts need --moe-token-dispatcher-type mok (this model's is "
                f"{config.moe_token_dispatcher_type}, whose experts would ignore it): pass it, or drop the flag"
            )
        return
    problems = _unsupported(config)
    if problems:
        raise ValueError("--moe-token-dispatcher-type mok: " + "; ".join(problems))
