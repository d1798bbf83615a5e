"""Run a Megatron-LM checkout's own training script with the MoK plugin registered.

    python -m megatron_mok.launch path/to/Megatron-LM/pretrain_gpt.py [Megatron arguments]
    torchrun --nproc-per-node 8 -m megatron_mok.launch path/to/pretrain_gpt.py ...

`--moe-token-dispatcher-type mok` then works in that script: register() widens Megatron's
choices and makes Megatron's MoE specs build the MoK layer. Without Transformer Engine or apex the
flags that switch Megatron to its local implementation and unfused kernels are added, as in
`megatron_mok.pretrain` (megatron_mok/megatron/fallbacks.py). Without CUDA, the CPU patches are
applied too (pass the CPU flags yourself: --distributed-backend gloo --use-cpu-initialization, see
README).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m megatron_mok.launch path/to/script.py [arguments]")
    script = Path(argv[0]).resolve()
    if not script.is_file():
        raise SystemExit(f"megatron_mok.launch: no such script: {script}")

    from megatron_mok.arguments import set_single_process_env
    from megatron_mok.megatron.fallbacks import fallback_argv

    script_argv = fallback_argv([("the command line", argv[1:])])
    set_single_process_env()
    from megatron_mok.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()

    import megatron_mok
    from megatron_mok.megatron import gpt_training

    megatron_mok.register()
    gpt_training.use_prebuilt_dataset_helpers()
    gpt_training.add_tokens_per_second_to_log()

    # The script's own imports (e.g. Megatron-LM's top-level packages) resolve from its folder.
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *script_argv]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
