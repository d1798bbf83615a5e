"""Layer specs for users who build Megatron models in code."""

from __future__ import annotations

from functools import partial
from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.moe_module_specs import _build_shared_experts
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mok.megatron.experts import MoKGroupedExperts
from megatron_mok.megatron.grouped_mm_experts import GroupedMMExperts
from megatron_mok.megatron.moe_layer import MoKMoELayer


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def get_mok_moe_module_spec(use_te: Optional[bool] = None):
    """The MoE module spec of a MoK layer: Megatron's router and shared experts, MoK's experts.

    use_te: build the shared experts from Transformer Engine linears (default: if installed).
    """
    return _moe_module_spec(MoKGroupedExperts, use_te)


def get_grouped_mm_moe_module_spec(use_te: Optional[bool] = None):
    """The MoE module spec of a layer whose experts run on torch's grouped GEMM (GroupedMMExperts)
    under Megatron's dispatchers (alltoall, allgather, flex); use_te as for the MoK spec."""
    return _moe_module_spec(GroupedMMExperts, use_te)


def _moe_module_spec(experts, use_te: Optional[bool]):
    if use_te is None:
        use_te = _transformer_engine_available()
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    shared_mlp = MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(),
        linear_fc2=backend.row_parallel_linear(),
        activation_func=backend.activation_func(),
    )
    return partial(
        MoKMoELayer,
        submodules=MoESubmodules(
            experts=experts, shared_experts=partial(_build_shared_experts, submodules=shared_mlp)
        ),
    )


def get_gpt_layer_with_mok_spec(
    num_experts: int,
    use_te: Optional[bool] = None,
    qk_layernorm: bool = False,
    normalization: Optional[str] = None,
    **kwargs,
) -> ModuleSpec:
    """A GPT layer spec (Transformer Engine's when installed, else Megatron's local one) whose MLP
    is the MoK MoE layer. Extra keyword arguments go to Megatron's layer-spec function.

    normalization: "LayerNorm" or "RMSNorm", for the local spec (which otherwise builds apex's
    FusedLayerNorm where apex is installed, and that refuses RMSNorm); TE's norms read
    `config.normalization` themselves.
    """
    return _gpt_layer_spec(MoKGroupedExperts, num_experts, use_te, qk_layernorm, normalization, **kwargs)


def get_gpt_layer_with_grouped_mm_experts_spec(
    num_experts: int,
    use_te: Optional[bool] = None,
    qk_layernorm: bool = False,
    normalization: Optional[str] = None,
    **kwargs,
) -> ModuleSpec:
    """The GPT layer spec of `get_gpt_layer_with_mok_spec` with GroupedMMExperts as the experts,
    for Megatron's dispatchers (alltoall, allgather, flex)."""
    return _gpt_layer_spec(GroupedMMExperts, num_experts, use_te, qk_layernorm, normalization, **kwargs)


def _gpt_layer_spec(experts, num_experts, use_te, qk_layernorm, normalization, **kwargs) -> ModuleSpec:
    if use_te is None:
        use_te = _transformer_engine_available()
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True, qk_layernorm=qk_layernorm, **kwargs
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=qk_layernorm,
            normalization=normalization,
            **kwargs,
        )
    spec.submodules.mlp = _moe_module_spec(experts, use_te)
    return spec
