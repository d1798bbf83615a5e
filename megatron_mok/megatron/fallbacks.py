"""Megatron flags for a machine without Transformer Engine or apex.

megatron-core 0.19's defaults assume both. What breaks without them, read from its source
(megatron/training/arguments.py defaults; the modules named below):

- `--transformer-impl transformer_engine` (default): the TE layer spec; without TE
  `TypeError: 'NoneType' object is not callable`.
- RoPE fusion (on unless `--no-rope-fusion`), RoPE models: TE's fused RoPE; without TE,
  TransformerConfig raises "apply_rope_fusion is not available".
- persist layer norm (on unless `--no-persist-layer-norm`), local impl: torch norms
  (`WrappedTorchNorm`: the local spec's norm without apex, and RMSNorm always) assert it is off.
- gradient accumulation fusion (on): apex's `fused_weight_gradient_mlp_cuda` in every local linear,
  GPTModel's output layer under the TE spec too; without it `ColumnParallelLinear` raises.
- masked softmax fusion (on), local impl: apex's `scaled_masked_softmax_cuda` and
  `scaled_upper_triang_masked_softmax_cuda` (local `DotProductAttention`, bf16/fp16, seq <= 4096);
  without them `ImportError` in the first forward.

Not needed: the bias-SwiGLU, bias-GeLU and bias-dropout-add fusions are `torch.compile`
functions (megatron/core/jit.py), with or without TE and apex; the attention backend (`auto`)
only matters to TE's attention.

`resolve()` adds the flags a missing package calls for (unless the config or command line set
them already) and refuses explicit requests for a missing package, before Megatron starts.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# (name, argv) pairs, later ones overriding earlier ones (argparse: last wins).
Sources = Sequence[tuple[str, Sequence[str]]]
# Returns None when the module imports, else why not.
Probe = Callable[[str], Optional[str]]

TE_MODULE = "transformer_engine.pytorch"
APEX_NORM_MODULE = "apex.normalization"
APEX_GRAD_ACCUM_MODULE = "fused_weight_gradient_mlp_cuda"
APEX_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
ROPE_TYPES = ("rope", "mrope")


class MissingPackageError(ValueError):
    """An explicit request (config or command line) for a package that is not importable."""


@functools.cache
def import_error(module: str) -> Optional[str]:
    """None if `module` imports here, else the exception it raised, in one line."""
    try:
        importlib.import_module(module)
    except Exception as error:  # TE raises OSError/RuntimeError too when its libraries are missing
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to `flag` (`--flag v` or `--flag=v`), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _has(argv: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _where(sources: Sources, flag: str) -> str:
    """The name of the last source that sets `flag`."""
    return next(name for name, argv in reversed(list(sources)) if _has(argv, flag))


@dataclass(frozen=True)
class Resolution:
    added: tuple[str, ...]  # flags to append to the Megatron argv
    message: Optional[str]  # the one line to print, None when nothing was added


# Explicit requests that need Transformer Engine: (flag, value or None for any value).
_NEEDS_TE = (("--transformer-impl", "transformer_engine"), ("--fp8-format", None))


def resolve(sources: Sources, probe: Probe = import_error) -> Resolution:
    """The flags that make `sources` run with what is importable here.

    Raises MissingPackageError naming the flag, where it came from and the package when an
    explicit request needs a missing package.
    """
    argv = [arg for _, part in sources for arg in part]
    te_error = probe(TE_MODULE)
    if te_error is not None:
        for flag, wanted in _NEEDS_TE:
            value = _value(argv, flag)
            if value is not None and (wanted is None or value == wanted):
                given = f"{flag} {value}"
                hint = ""
                if flag == "--fp8-format" and _value(argv, "--moe-token-dispatcher-type") == "mok":
                    hint = "; with mok, --mok-precision fp8_blockwise runs the routed experts in FP8 without it"
                raise MissingPackageError(
                    f"{given} (from {_where(sources, flag)}) needs Transformer Engine, but "
                    f"{TE_MODULE} does not import here ({te_error}); install transformer_engine "
                    f"or drop {flag} (megatron_mok then runs Megatron's local implementation){hint}"
                )

    added: list[str] = []
    reasons: list[str] = []  # why, in order, each once

    def add(reason: str, *flag: str) -> None:
        if not _has(argv, flag[0]):
            added.extend(flag)
            if reason not in reasons:
                reasons.append(reason)

    impl = _value(argv, "--transformer-impl") or "transformer_engine"
    if te_error is not None:
        if impl == "transformer_engine":
            add("no transformer_engine", "--transformer-impl", "local")
            impl = "local"
        if (_value(argv, "--position-embedding-type") or "learned_absolute") in ROPE_TYPES:
            add("no transformer_engine", "--no-rope-fusion")
    if impl == "local":
        if probe(APEX_NORM_MODULE) is not None:
            add("no apex", "--no-persist-layer-norm")
        elif (_value(argv, "--normalization") or "LayerNorm") == "RMSNorm":
            add("torch RMSNorm has no persistent kernel", "--no-persist-layer-norm")
    if probe(APEX_GRAD_ACCUM_MODULE) is not None:
        add("no apex", "--no-gradient-accumulation-fusion")
    if impl == "local" and any(probe(m) is not None for m in APEX_SOFTMAX_MODULES):
        add("no apex", "--no-masked-softmax-fusion")

    if not added:
        return Resolution(added=(), message=None)
    why = ", ".join(reasons)
    message = f"megatron_mok: added {' '.join(added)} ({why}: Megatron's local implementation and unfused kernels)"
    return Resolution(added=tuple(added), message=message)


def fallback_argv(sources: Sources, probe: Probe = import_error) -> list[str]:
    """The launchers' entry: `sources` joined plus the added flags; prints the one line on rank 0;
    exits with the error's message for an explicit request of a missing package."""
    try:
        resolution = resolve(sources, probe)
    except MissingPackageError as error:
        raise SystemExit(f"megatron_mok: {error}") from None
    if resolution.message is not None and os.environ.get("RANK", "0") == "0":
        print(resolution.message, flush=True)
    return [arg for _, part in sources for arg in part] + list(resolution.added)
