"""Run Megatron's training loop (``megatron.training.pretrain``) on a CPU-only host.

Megatron-LM assumes a CUDA device throughout: it allocates bookkeeping tensors with
``device="cuda"`` / ``device=torch.cuda.current_device()``, moves models with ``.cuda()``,
synchronises timers with ``torch.cuda.synchronize()``, creates CUDA streams (DDP setup, the
MoE all-to-all dispatcher) and checks ``param.type() == "torch.cuda.FloatTensor"``.
Whatever has a Megatron flag is handled with flags (see ``docs/cpu.md``: gloo,
``--inference-rng-tracker``, ``--rerun-mode disabled``, ...); :func:`apply_cpu_patches`
covers the rest with a few process-wide patches.

Nothing is patched when ``torch.cuda.is_available()``, so calling :func:`apply_cpu_patches`
unconditionally is safe on GPU hosts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_patches"]

_CPU = torch.device("cpu")
_applied = False


def _is_cuda_device(device: object) -> bool:
    """True for anything naming a CUDA device: "cuda", "cuda:1", torch.device("cuda"), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int is an ordinal of the current accelerator (e.g. torch.cuda.current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


# Recent torch: calls func skipping one level of __torch_function__ dispatch (else None).
_redispatch: Optional[Callable[..., Any]] = getattr(torch.overrides, "redispatch_function", None)
_AUTOGRAD_ENTRY_POINTS = frozenset(
    (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects every CUDA placement made through torch functions to the CPU.

    Megatron has dozens of ``torch.tensor(..., device="cuda")`` style allocations (pretrain's
    start-time all-reduce, training_log's loss dict, the data-loader flags broadcast, the
    timers' all-gather buffer, DDP grad buffers, router and optimizer scratch tensors, ...).
    One global function mode covers them all; ``torch.set_default_device`` is built on the
    same mechanism.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        # get_model's model_module.cuda(...) and get_batch-style tensor.cuda() stay on the CPU.
        if func is torch.Tensor.cuda:
            return args[0]
        # optimizer.py, distrib_optimizer.py, clip_grads.py want type() == "torch.cuda.FloatTensor".
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        # device="cuda" / device=torch.cuda.current_device() in factories, .to(), .new_*().
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
        # tensor.to("cuda") / tensor.to(torch.cuda.current_device()) with a positional device.
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        # Keep the mode on during backward (handlers run with it off), for _AllToAll.backward etc.
        if func in _AUTOGRAD_ENTRY_POINTS and _redispatch is not None:
            with self:
                return _redispatch(func, types, args, kwargs)
        return func(*args, **kwargs)


class _NullEvent:
    """What _NullStream.record_event returns: CPU work is synchronous, so always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stand-in for torch.cuda.Stream: CPU ops run in program order, nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NullStream()


def _split_sizes_as_lists(all_to_all_single: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap dist.all_to_all_single so that tensor split sizes arrive as Python lists."""

    @functools.wraps(all_to_all_single)
    def wrapper(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, *args, **kwargs
        )

    return wrapper


def apply_cpu_patches() -> None:
    """Make ``megatron.training.pretrain`` runnable without a GPU; no-op when CUDA exists.

    Idempotent.  Call it before ``pretrain`` (it imports ``megatron.training``).
    """
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True

    cuda = torch.cuda
    # initialize._initialize_distributed/_set_random_seed skip mpu/RNG setup if device_count() == 0.
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    # Device argument all over (router, mappings, DDP buffers, timers); the mode maps 0 to CPU.
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    # initialize._initialize_distributed calls set_device(local_rank) once device_count() > 0.
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    # core/timers.py Timer.start/stop and training.post_training_step_callbacks synchronise.
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # training.get_model (DDP init) and MoEAlltoAllTokenDispatcher (D2H copies) create Streams.
    cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    # ...and wait on current_stream(); torch.cuda.stream(s) itself is a no-op without a GPU.
    cuda.current_stream = lambda device=None: _CURRENT_STREAM  # type: ignore[assignment]

    # Every device="cuda"/current_device() allocation, .cuda() move and type() check (see class).
    _CudaToCpuMode().__enter__()

    # MoEAlltoAllTokenDispatcher hands tensor split sizes to mappings._AllToAll on CPU (no D2H).
    torch.distributed.all_to_all_single = _split_sizes_as_lists(
        torch.distributed.all_to_all_single
    )

    # training.pretrain calls initialize_megatron() without allow_no_cuda, which asserts CUDA.
    import megatron.training.training as megatron_training

    megatron_training.initialize_megatron = functools.partial(
        megatron_training.initialize_megatron, allow_no_cuda=True
    )

    # Activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA generator's
    # state beside the CPU one; a CPU-only host has no CUDA generator, and CPU runs draw from the
    # CPU generator, which _get_all_rng_states already saves.
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
