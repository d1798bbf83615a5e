"""Named Megatron argument sets (configs/*.yaml) turned into command-line arguments.

A config file is a YAML mapping of Megatron flags without the leading `--`: `true` passes a
store_true flag, `false` or null leaves it out, a list passes several values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = "tiny"

# Megatron flags a CPU-only run needs beyond the model's own (docs/cpu.md): gloo instead of NCCL,
# weights initialized on the host, the RNG tracker and rerun machine that do not read the CUDA
# RNG state. (The tiny config already turns off the fused GPU kernels.)
CPU_FLAGS = [
    "--distributed-backend", "gloo",
    "--use-cpu-initialization",
    "--inference-rng-tracker",
    "--rerun-mode", "disabled",
]


def resolve_config_path(name: str) -> Path:
    """A path as given, else configs/NAME(.yaml) of the repository."""
    candidates = [Path(name), REPO_CONFIGS / name, REPO_CONFIGS / f"{name}.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in REPO_CONFIGS.glob("*.yaml"))
    raise FileNotFoundError(f"--config {name!r}: no such file; known configs: {known}")


def config_to_argv(mapping: dict[str, Any], source: str = "config") -> list[str]:
    argv: list[str] = []
    for key, value in mapping.items():
        if not isinstance(key, str) or key.startswith("-"):
            raise ValueError(f"{source}: keys are flag names without '--', got {key!r}")
        flag = f"--{key}"
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def load_config(name: str) -> list[str]:
    import yaml

    path = resolve_config_path(name)
    with open(path) as handle:
        mapping = yaml.safe_load(handle) or {}
    if not isinstance(mapping, dict):
        raise ValueError(f"{path}: expected a mapping of flag: value")
    return config_to_argv(mapping, str(path))


def split_config_flag(argv: list[str]) -> tuple[str, list[str]]:
    """Removes `--config NAME` / `--config=NAME` from argv; returns (NAME or the default, rest)."""
    name, rest, i = DEFAULT_CONFIG, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file name")
            name, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def megatron_argv_sources(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(name, flags) in precedence order: CPU flags (without CUDA) < the named config < the
    command line (argparse: last wins)."""
    name, rest = split_config_flag(argv)
    base = [] if torch.cuda.is_available() else list(CPU_FLAGS)
    path = resolve_config_path(name).resolve()
    shown = path.relative_to(REPO_CONFIGS.parent) if path.is_relative_to(REPO_CONFIGS.parent) else path
    return [("megatron_mok's CPU flags", base), (str(shown), load_config(name)), ("the command line", rest)]


def build_megatron_argv(argv: list[str]) -> list[str]:
    """The sources above joined, plus the flags that make them run without Transformer Engine or
    apex where those are missing (megatron_mok/megatron/fallbacks.py)."""
    from megatron_mok.megatron.fallbacks import fallback_argv

    return fallback_argv(megatron_argv_sources(argv))


def set_single_process_env() -> None:
    """torch.distributed's env:// init needs these; torchrun sets them, a plain `python` does not."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
