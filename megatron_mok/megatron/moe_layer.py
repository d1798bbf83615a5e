"""The MoE layer that runs its routed experts through `mok_moe`.

A MoELayer subclass (TransformerLayer checks isinstance): the router, aux losses, shared experts,
recompute and everything outside the routed path stay Megatron's. With any other dispatcher type
it is exactly Megatron's MoELayer, so `register()` can put it into Megatron's own specs; there, with
`--mok-grouped-mm-experts` (or `config.mok_grouped_mm_experts = True`), its experts are
GroupedMMExperts whatever experts the spec names.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mok.config import MoKConfig
from megatron_mok.megatron.checks import check_mok_config, expert_precision, parsed_args
from megatron_mok.megatron.dispatcher import MoKTokenDispatcher
from megatron_mok.megatron.experts import MoKGroupedExperts
from megatron_mok.megatron.grouped_mm_experts import GroupedMMExperts
from megatron_mok.moe import mok_moe


def grouped_mm_experts_requested(config: TransformerConfig) -> bool:
    """`config.mok_grouped_mm_experts` if set, else `--mok-grouped-mm-experts`."""
    explicit = getattr(config, "mok_grouped_mm_experts", None)
    if explicit is not None:
        return bool(explicit)
    return bool(getattr(parsed_args(), "mok_grouped_mm_experts", False))


# The one-time lines of mok_config_for, as printed.
precision_notes: set[str] = set()


def _note_precision(config: TransformerConfig, precision: str) -> None:
    """One line per process (rank 0 prints it) when the experts run FP8 and the rest of the model
    does not (no --fp8-format): the user asked for FP8 and gets it only there."""
    if precision != "fp8_blockwise" or getattr(config, "fp8", None) is not None:
        return
    line = (
        "megatron_mok: --mok-precision fp8_blockwise: only the routed experts run FP8 (blockwise E4M3); "
        "every other layer keeps its precision (no --fp8-format)"
    )
    if line not in precision_notes:
        precision_notes.add(line)
        if os.environ.get("RANK", "0") == "0":
            print(line, flush=True)


def _bf16_layer(config: TransformerConfig, layer_number: Optional[int]) -> bool:
    """Whether Megatron runs this layer in BF16 inside an FP8 model (--first-last-layers-bf16 with
    --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16; layer_number global, from 1):
    Megatron's own rule, so the experts follow the rest of their layer."""
    if layer_number is None or not getattr(config, "first_last_layers_bf16", False):
        return False
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return bool(is_first_last_bf16_layer(config, layer_number - 1))


def _megatron_fp8_settings(config: TransformerConfig, layer_number: Optional[int], mok: MoKConfig) -> MoKConfig:
    """mok with Megatron's FP8 settings that reach the experts: BF16 experts in a layer Megatron keeps
    BF16 (_bf16_layer), and BF16 expert weight gradients under --no-fp8-wgrad (Megatron's "the
    wgrad computation in higher precision")."""
    if mok.precision != "fp8_blockwise":
        return mok
    if _bf16_layer(config, layer_number):
        return dataclasses.replace(mok, precision="bf16")
    if getattr(config, "fp8_wgrad", True) is False and mok.fp8_weight_grad:
        return dataclasses.replace(mok, fp8_weight_grad=False)
    return mok


def mok_config_for(config: TransformerConfig, layer_number: Optional[int] = None) -> MoKConfig:
    """The MoKConfig of a model's MoE layer number layer_number (global, from 1; None: any layer):
    `config.mok_config` if set (as it is: check_mok_config refuses a flag asking otherwise), else
    from `--mok-backend`, `--mok-expert-gemm`, `--mok-dispatch-ring-minibatches`, `--mok-exchange`,
    `--mok-no-fp8-weight-cache`, `--mok-fp8-cache-transposed-weights` and the precision
    (checks.expert_precision: `--mok-precision`, or Megatron's --fp8-format e4m3 --fp8-recipe
    blockwise), else default; either way FP8 experts follow --first-last-layers-bf16 (BF16 in the
    layers Megatron keeps BF16) and --no-fp8-wgrad (BF16 weight gradients)."""
    explicit = getattr(config, "mok_config", None)
    if explicit is not None:
        if not isinstance(explicit, MoKConfig):
            raise TypeError(f"TransformerConfig.mok_config must be a MoKConfig, got {type(explicit).__name__}")
        return _megatron_fp8_settings(config, layer_number, explicit)
    args = parsed_args()
    fields = {"precision": expert_precision(config)}
    for flag, field in (
        ("mok_backend", "backend"),
        ("mok_expert_gemm", "expert_gemm"),
        ("mok_dispatch_ring_minibatches", "dispatch_ring_minibatches"),
        ("mok_exchange", "exchange"),
    ):
        value = getattr(args, flag, None) if args is not None else None
        if value is not None:
            fields[field] = value
    if args is not None and getattr(args, "mok_no_fp8_weight_cache", False):
        fields["fp8_cache_weights"] = False
    if args is not None and getattr(args, "mok_fp8_cache_transposed_weights", False):
        if not fields.get("fp8_cache_weights", True):
            raise ValueError("--mok-fp8-cache-transposed-weights keeps the transposed copies beside the cached "
                             "forward copies: it cannot go with --mok-no-fp8-weight-cache")
        fields["fp8_cache_transposed_weights"] = True
    mok = _megatron_fp8_settings(config, layer_number, MoKConfig(**fields))
    # After the layer's settings: no line where --first-last-layers-bf16 keeps these experts BF16.
    _note_precision(config, mok.precision)
    return mok


class MoKMoELayer(MoELayer):
    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ) -> None:
        if config.moe_token_dispatcher_type != "mok":
            if submodules is not None and grouped_mm_experts_requested(config):
                submodules = dataclasses.replace(submodules, experts=GroupedMMExperts)
            super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
            self.uses_mok = False
            return
        check_mok_config(config)
        if grouped_mm_experts_requested(config):
            raise ValueError(
                "--mok-grouped-mm-experts chooses the experts of Megatron's dispatchers (alltoall, "
                "allgather, flex); mok computes its own: drop the flag or pick another dispatcher"
            )
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if submodules is None:
            raise ValueError("MoKMoELayer needs MoESubmodules (router and shared experts)")
        # Whatever experts the spec names, MoK keeps its weights grouped.
        submodules = dataclasses.replace(submodules, experts=MoKGroupedExperts)
        # MoELayer.__init__ picks its dispatcher from a fixed list; let it build the allgather one
        # (no buffers, no streams) and replace it below.
        config.moe_token_dispatcher_type = "allgather"
        try:
            super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        finally:
            config.moe_token_dispatcher_type = "mok"
        self.uses_mok = True
        self.token_dispatcher = MoKTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
        )
        self.mok_group = pg_collection.tp_ep
        self.mok_config = mok_config_for(config, layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's TransformerLayer gives its MoE layer the global layer number after building it:
        the experts' precision follows it (--first-last-layers-bf16)."""
        super().set_layer_number(layer_number)
        if getattr(self, "uses_mok", False):
            self.mok_config = mok_config_for(self.config, layer_number)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Dispatch, expert FFN and combine in one `mok_moe` call.

        Args:
            hidden_states: (num_tokens, hidden) this rank's tokens.
            probs: (num_tokens, topk) float32 routing weights from the dispatcher.
        """
        if not self.uses_mok:
            return super().routed_experts_compute(hidden_states, probs)
        output = mok_moe(
            hidden_states.contiguous(),
            self.token_dispatcher.topk_ids,
            probs,
            self.experts.weight1,
            self.experts.weight2,
            group=self.mok_group,
            config=self.mok_config,
        )
        return output, None
