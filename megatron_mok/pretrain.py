"""Train a GPT-MoE on mock data through Megatron's own training loop.

    python -m megatron_mok.pretrain                       # tiny config, mok, CPU or GPU
    python -m megatron_mok.pretrain --config proxy_1gpu --train-iters 20
    torchrun --nproc-per-node 8 -m megatron_mok.pretrain --config proxy_8gpu

Arguments are Megatron's; `--config NAME` picks configs/NAME.yaml (default: tiny) and later
command-line flags override it. Without CUDA the run uses gloo and the reference backend. Without
Transformer Engine or apex, the flags that switch Megatron to its local implementation and unfused
kernels are added and named in one line (megatron_mok/megatron/fallbacks.py); an explicit request
for a missing package (`--transformer-impl transformer_engine` without it) stops with an error
before Megatron starts.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from megatron_mok.arguments import build_megatron_argv, set_single_process_env

    argv = list(sys.argv[1:] if argv is None else argv)
    megatron_argv = build_megatron_argv(argv)
    set_single_process_env()

    from megatron_mok.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()  # no-op where CUDA exists

    import megatron_mok
    from megatron_mok.megatron import gpt_training

    megatron_mok.register()
    gpt_training.use_prebuilt_dataset_helpers()
    gpt_training.add_tokens_per_second_to_log()

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = [sys.argv[0], *megatron_argv]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(
        pretrain_cfg_container_from_args(args),
        gpt_training.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        gpt_training.forward_step,
        model_provider=gpt_training.model_provider,
    )


if __name__ == "__main__":
    main()
