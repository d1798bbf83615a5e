"""`register()`: teaches an installed megatron-core the `mok` dispatcher type.

- widens TransformerConfig.moe_token_dispatcher_type's Literal, from which Megatron's argument
  parser takes the choices of --moe-token-dispatcher-type;
- adds MoK's own flags (--mok-backend, --mok-expert-gemm, --mok-dispatch-ring-minibatches,
  --mok-exchange, --mok-precision, --mok-no-fp8-weight-cache, --mok-fp8-cache-transposed-weights,
  --mok-grouped-mm-experts) to every Megatron argument parser;
- checks mok's unsupported combinations when a TransformerConfig is built;
- makes Megatron's MoE specs build MoKMoELayer, which is MoELayer unless the type is mok (with
  --mok-grouped-mm-experts, MoELayer with GroupedMMExperts).
"""

from __future__ import annotations

import argparse
import functools
import typing

from megatron_mok.config import BACKENDS, EXCHANGES, EXPERT_GEMMS, PRECISIONS, MoKConfig
from megatron_mok.limits import DISPATCH_MINIBATCH_ROWS

DISPATCHER_TYPE = "mok"
_registered = False


def is_registered() -> bool:
    return _registered


def add_mok_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds MoK's flags and `mok` to --moe-token-dispatcher-type's choices (idempotent)."""
    for action in parser._actions:
        if "--moe-token-dispatcher-type" in action.option_strings and action.choices is not None:
            if DISPATCHER_TYPE not in action.choices:
                action.choices = (*action.choices, DISPATCHER_TYPE)
        if "--mok-backend" in action.option_strings:
            return parser
    group = parser.add_argument_group(title="mok")
    group.add_argument(
        "--mok-backend",
        choices=BACKENDS,
        default="auto",
        help="Implementation of the mok dispatcher: auto (fused kernel where it can run, else the "
        "PyTorch reference), reference, or kernel.",
    )
    group.add_argument(
        "--mok-expert-gemm",
        choices=EXPERT_GEMMS,
        default="auto",
        help="GEMMs of the kernel backend's expert projections, forward and backward: sm90 "
        "(megatron_mok's TMA + wgmma kernels, SwiGLU fused), grouped_mm (torch's CUTLASS grouped GEMM "
        "+ SwiGLU kernels), or auto (per projection the one measured faster on the H200).",
    )
    group.add_argument(
        "--mok-dispatch-ring-minibatches",
        type=int,
        default=MoKConfig.dispatch_ring_minibatches,
        help="Ring buffer of the sm90 gate/up GEMM's in-kernel dispatch, in minibatches of "
        f"{DISPATCH_MINIBATCH_ROWS} rows "
        "(bounded whatever the routing; backward gathers the rows again for the fc1 weight gradient); "
        "0 keeps every dispatched row from forward to backward instead.",
    )
    group.add_argument(
        "--mok-exchange",
        choices=EXCHANGES,
        default="auto",
        help="How rows cross expert-parallel ranks: symmetric (the in-kernel exchange through "
        "symmetric memory: GPUs of one node with peer access), collective (torch.distributed "
        "all-gather / all-to-all, anywhere), or auto (symmetric wherever every rank of the group reaches "
        "every other on one node and the extension is loaded, else collective; rank 0 prints which and why).",
    )
    group.add_argument(
        "--mok-precision",
        choices=PRECISIONS,
        default=None,
        help="Precision of the routed experts' GEMMs: bf16, or fp8_blockwise (DeepSeek-V3's recipe: E4M3, "
        "1x128 activation and 128x128 weight scales, fp32 promotion every 128 of K; hidden and expert ffn "
        "sizes multiples of 128). Default: fp8_blockwise under --fp8-format e4m3 --fp8-recipe blockwise "
        "(Transformer Engine runs the dense layers), else bf16. --mok-precision fp8_blockwise without "
        "--fp8-format runs the experts alone in FP8 (no Transformer Engine needed). With mok only: "
        "fp8_blockwise with another dispatcher is an error (its experts would ignore it).",
    )
    group.add_argument(
        "--mok-no-fp8-weight-cache",
        action="store_true",
        help="With FP8 experts: quantize each expert weight in every forward and free the FP8 copy after "
        "the pass, instead of keeping it until the optimizer step (MoKConfig.fp8_cache_weights=False): "
        "no FP8 weight copy held between passes (half the experts' bf16 weight bytes per MoE layer), "
        "for one weight quantization more per microbatch.",
    )
    group.add_argument(
        "--mok-fp8-cache-transposed-weights",
        action="store_true",
        help="With FP8 experts and the weight cache: keep each expert weight's transposed FP8 copy (the "
        "dgrads' operand) beside the forward copy until the optimizer step, made in the same pass "
        "(MoKConfig.fp8_cache_transposed_weights=True), so no backward makes it again: the cache then "
        "holds the experts' bf16 weight bytes per MoE layer instead of half of them.",
    )
    group.add_argument(
        "--mok-grouped-mm-experts",
        action="store_true",
        help="With Megatron's own dispatchers (alltoall, allgather, flex): compute the routed experts "
        "with torch's grouped GEMM (GroupedMMExperts: TEGroupedMLP's parameters and checkpoint layout, "
        "no Transformer Engine) instead of the experts the layer spec names (SequentialMLP without TE).",
    )
    return parser


def _widen_dispatcher_literal() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    if DISPATCHER_TYPE not in choices:
        widened = typing.Literal[(*choices, DISPATCHER_TYPE)]
        field.type = widened
        TransformerConfig.__annotations__["moe_token_dispatcher_type"] = widened


def _check_configs_on_build() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mok.megatron.checks import check_mok_config

    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        # Ours first: for mok, one message naming the flag beats Megatron's generic asserts.
        check_mok_config(self)
        original(self, *args, **kwargs)

    TransformerConfig.__post_init__ = post_init


def _add_arguments_to_megatron_parsers() -> None:
    from megatron.training import arguments

    original = arguments.add_megatron_arguments

    @functools.wraps(original)
    def add_megatron_arguments(parser):
        return add_mok_arguments(original(parser))

    arguments.add_megatron_arguments = add_megatron_arguments


def _use_mok_layer_in_specs() -> None:
    from megatron.core.models.gpt import moe_module_specs

    from megatron_mok.megatron.moe_layer import MoKMoELayer

    moe_module_specs.MoELayer = MoKMoELayer


def register() -> None:
    """Idempotent; call before Megatron parses arguments or builds models."""
    global _registered
    if _registered:
        return
    _widen_dispatcher_literal()
    _check_configs_on_build()
    _add_arguments_to_megatron_parsers()
    _use_mok_layer_in_specs()
    _registered = True
