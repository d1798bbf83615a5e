"""Tiny GPT-MoE trained by Megatron's own ``pretrain`` loop on mock data.

Runs unchanged on a CPU-only host (gloo, after ``apply_cpu_patches()``) and on a GPU host,
where ``apply_cpu_patches()`` does nothing.  Command lines: notes/cpu_pretrain.md.

    python notes/cpu_pretrain_example.py <megatron flags>
    torchrun --nproc-per-node 2 notes/cpu_pretrain_example.py <megatron flags>
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional

# A plain `python script.py` has no torchrun environment, but Megatron reads RANK, WORLD_SIZE
# and LOCAL_RANK and initialises torch.distributed from env:// (MASTER_ADDR/MASTER_PORT).
for _name, _value in (
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29511"),
    ("RANK", "0"),
    ("WORLD_SIZE", "1"),
    ("LOCAL_RANK", "0"),
):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402


def _load_cpu_compat() -> ModuleType:
    """Import megatron_mok/megatron/cpu_compat.py by file path (no package install needed)."""
    path = Path(__file__).resolve().parents[1] / "megatron_mok" / "megatron" / "cpu_compat.py"
    spec = importlib.util.spec_from_file_location("megatron_mok_cpu_compat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_load_cpu_compat().apply_cpu_patches()  # no-op when torch.cuda.is_available()

from megatron.core.datasets import utils as dataset_utils  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402


def use_prebuilt_dataset_helpers() -> None:
    """Needed on CPU *and* GPU with the megatron-core wheel.

    initialize._compile_dependencies runs `make -C megatron/core/datasets` on rank 0 and exits
    if it fails; the wheel ships the built helpers_cpp extension but no Makefile, so make
    always fails.  Importing the prebuilt extension is all that step has to achieve.
    """

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
    """GPT with Megatron-Core's local (no Transformer Engine) layers; MoE via SequentialMLP."""
    args = get_args()
    layer_spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, normalization=args.normalization
    )
    return GPTModel(
        config=core_transformer_config_from_args(args),
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
    """Megatron's mock GPT dataset (synthetic token ramps); used when no data path is given."""
    args = get_args()
    config = GPTDatasetConfig(  # no blend given -> config.mock is True
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
        MockGPTDataset, num_samples, lambda: True, config
    ).build()


# Every rank builds its own (cheap) mock dataset and data loader; with TP = 1 there is no
# TP-rank-0 broadcast of batches to do.
train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token-summed LM loss; Megatron divides by the token count returned with it."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask)
    # [loss sum, token count]: the logged "lm loss" is averaged over the global batch's tokens.
    report = torch.cat([loss.detach().view(1), mask.sum().view(1)])
    return loss, mask.sum().to(torch.int), {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, Any]], model: GPTModel) -> tuple[Any, Any]:
    # pretrain_gpt.py's get_batch .cuda()s the batch; move it explicitly instead so the same
    # code runs on CPU and GPU.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    batch = {
        key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
        for key, value in next(data_iterator).items()
    }
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    use_prebuilt_dataset_helpers()
    megatron_args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(
        pretrain_cfg_container_from_args(megatron_args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
