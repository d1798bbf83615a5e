"""What `megatron.training.pretrain` needs to train a GPT-MoE on mock data: model provider,
dataset provider and forward step (the wheel of megatron-core ships no pretrain_gpt.py)."""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterator, Optional

import torch


def layer_spec(args: Any):
    """The GPT layer spec of Megatron's arguments: Transformer Engine's or the local one, with
    MoK's MoE layer when --moe-token-dispatcher-type is mok. (Megatron's specs build MoKMoELayer
    after `register()`: with --mok-grouped-mm-experts its experts are GroupedMMExperts.)"""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_mok.megatron.specs import get_gpt_layer_with_mok_spec

    use_te = args.transformer_impl == "transformer_engine"
    common = dict(qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention)
    if args.num_experts and args.moe_token_dispatcher_type == "mok":
        return get_gpt_layer_with_mok_spec(args.num_experts, use_te=use_te, normalization=args.normalization, **common)
    if use_te:  # TE's norms read config.normalization
        return get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm, **common)
    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, normalization=args.normalization, **common)


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Any = None,
    pg_collection: Any = None,
):
    """A GPTModel whose MoE layers use MoK's spec when --moe-token-dispatcher-type is mok."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    transformer_config = config if config is not None else core_transformer_config_from_args(args)
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(num_samples: list[int]):
    """Megatron's mock GPT dataset (no data files)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, num_samples, lambda: mpu.get_tensor_model_parallel_rank() == 0, config
    ).build()


# Every rank builds its own (cheap) mock dataset.
train_valid_test_datasets_provider.is_distributed = True


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, with [sum, count] reported as `lm loss`."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    get_rerun_state_machine().validate_result(
        result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss", tolerance=0.0, fatal=True
    )
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict], model, return_schedule_plan: bool = False):
    """One micro-batch: tokens -> per-token losses (masked and averaged by `loss_func`)."""
    batch = {k: (v.to(_device(), non_blocking=True) if v is not None else None) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships the compiled dataset helpers (helpers_cpp) but not the
    Makefile that initialize_megatron's `make` call expects; import the shipped build instead."""
    from megatron.core.datasets import utils as dataset_utils

    def compile_helpers() -> None:
        from megatron.core.datasets import helpers_cpp  # noqa: F401

    dataset_utils.compile_helpers = compile_helpers


_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+) \|")


def add_tokens_per_second_to_log() -> None:
    """Adds `tokens/s/GPU` beside Megatron's iteration time in its training log line."""
    from megatron.training import training

    original = training.print_rank_last

    def print_rank_last(message: str) -> None:
        match = _ELAPSED.search(message) if isinstance(message, str) else None
        if match:
            args = training.get_args()
            tokens = args.global_batch_size * args.seq_length
            per_gpu = tokens / (float(match.group(1)) / 1e3) / args.world_size
            message = message.replace(match.group(0), f"{match.group(0)} tokens/s/GPU: {per_gpu:.1f} |")
        original(message)

    training.print_rank_last = print_rank_last
