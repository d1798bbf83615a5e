"""Tiny GPT-MoE trained by Megatron's own ``pretrain`` loop on mock data.

Runs unchanged on a CPU-only host (gloo, after ``apply_cpu_patches()``) and on a GPU host.
See notes/cpu_pretrain.md for the command lines.  Single process::

    python notes/cpu_pretrain_example.py <megatron flags>

or ``torchrun --nproc-per-node 2 notes/cpu_pretrain_example.py <flags>``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]


def _load_cpu_compat() -> Any:
    """Import megatron_mok/megatron/cpu_compat.py by path (the package may not be importable)."""
    path = REPO / "megatron_mok" / "megatron" / "cpu_compat.py"
    spec = importlib.util.spec_from_file_location("megatron_mok_cpu_compat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A plain `python script.py` has no torchrun environment; torch.distributed's env:// init
# (used by Megatron) needs these, and Megatron reads RANK/WORLD_SIZE/LOCAL_RANK itself.
for _key, _value in (
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29511"),
    ("RANK", "0"),
    ("WORLD_SIZE", "1"),
    ("LOCAL_RANK", "0"),
):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

_load_cpu_compat().apply_cpu_patches()  # no-op on a GPU host

from megatron.core.datasets import utils as dataset_utils  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.core import mpu  # noqa: E402


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships helpers_cpp.*.so but no Makefile, so the
    `make -C megatron/core/datasets` in initialize._compile_dependencies fails (CPU and GPU
    alike) and rank 0 exits.  Import the prebuilt extension instead of compiling it."""

    def compile_helpers() -> None:
        from megatron.core.datasets import helpers_cpp  # noqa: F401

    dataset_utils.compile_helpers = compile_helpers


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Any = None,
    pg_collection: Any = None,
) -> GPTModel:
    args = get_args()
    transformer_config = core_transformer_config_from_args(args)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, normalization=args.normalization
    )
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(num_samples: list[int]) -> list[Any]:
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
    )  # no blend -> config.mock is True
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()


# Every rank builds its own mock dataset (Megatron otherwise only builds on TP rank 0).
train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu")
    )


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    # [sum, count]: Megatron averages over all tokens of the global batch for the log line.
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    rerun_sm = get_rerun_state_machine()
    rerun_sm.validate_result(
        result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss",
        tolerance=0.0, fatal=True,
    )
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: GPTModel,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, Any]:
    batch = {k: (v.to(_device(), non_blocking=True) if v is not None else None)
             for k, v in next(data_iterator).items()}
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    _use_prebuilt_dataset_helpers()
    megatron_args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(
        pretrain_cfg_container_from_args(megatron_args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
