"""Builds small Megatron MoE layers and GPT models on CPU (gloo) for the plugin tests."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import megatron_mok
from megatron_mok.megatron.cpu_compat import apply_cpu_patches


def init_megatron(tp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """Model-parallel groups and RNG trackers for the current gloo process group."""
    apply_cpu_patches()
    megatron_mok.register()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    # The inference tracker with a forced reset keeps the CUDA RNG out of it (CPU runs).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    # CPU initialization draws from the default generator: the same seed on every rank gives
    # data-parallel replicas identical weights, as Megatron's broadcast at start-up would.
    torch.manual_seed(seed)


def transformer_config(dispatcher: str, *, tp: int = 1, ep: int = 1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dispatcher = megatron_dispatcher(dispatcher)
    values = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1,
    )
    values.update(overrides)
    return TransformerConfig(**values)


# Dispatcher names of the tests: Megatron's and mok, plus `alltoall_grouped`, Megatron's alltoall
# with GroupedMMExperts (the configs of both say alltoall).
GROUPED = "alltoall_grouped"


def megatron_dispatcher(dispatcher: str) -> str:
    return "alltoall" if dispatcher == GROUPED else dispatcher


def moe_layer(config, dispatcher: str):
    """A MoE layer from Megatron's local spec (alltoall), MoK's spec (mok) or the grouped-GEMM
    experts' spec (alltoall_grouped)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_mok.megatron.specs import get_grouped_mm_moe_module_spec, get_mok_moe_module_spec

    if dispatcher == "mok":
        builder = get_mok_moe_module_spec(use_te=False)
    elif dispatcher == GROUPED:
        builder = get_grouped_mm_moe_module_spec(use_te=False)
    else:
        builder = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return builder(config=config)


def gpt_model(config, dispatcher: str, vocab_size: int = 128, seq_length: int = 16):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mok.megatron.specs import get_gpt_layer_with_grouped_mm_experts_spec, get_gpt_layer_with_mok_spec

    if dispatcher == "mok":
        spec = get_gpt_layer_with_mok_spec(num_experts=config.num_moe_experts, use_te=False)
    elif dispatcher == GROUPED:
        spec = get_gpt_layer_with_grouped_mm_experts_spec(num_experts=config.num_moe_experts, use_te=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="learned_absolute",
    )


# Names of the grouped expert weights in a state dict, per dispatcher of the tests.
GROUPED_WEIGHT_NAMES = {
    "mok": {"linear_fc1": "weight1", "linear_fc2": "weight2"},
    GROUPED: {"linear_fc1": "linear_fc1.weight", "linear_fc2": "linear_fc2.weight"},
}


def grouped_expert_state(sequential_state: dict, num_local_experts: int, dispatcher: str = "mok") -> dict:
    """Converts a state dict with SequentialMLP experts to the grouped layout of `dispatcher`'s
    experts (MoKGroupedExperts or GroupedMMExperts)."""
    pattern = re.compile(r"^(.*?)experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")
    out, stacked = {}, {}
    for key, value in sequential_state.items():
        match = pattern.match(key)
        if match is None:
            out[key] = value
            continue
        head, index, linear, kind = match.groups()
        if kind == "weight":
            name = GROUPED_WEIGHT_NAMES[dispatcher][linear]
            stacked.setdefault(f"{head}experts.{name}", {})[int(index)] = value
    for key, per_expert in stacked.items():
        out[key] = torch.stack([per_expert[i] for i in range(num_local_experts)])
    return out


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True = masked (Megatron's convention)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(batch, 1, seq, seq)
