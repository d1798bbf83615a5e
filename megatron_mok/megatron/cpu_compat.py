"""Run Megatron's training loop (``megatron.training.pretrain``) on a CPU-only host.

Megatron-LM assumes a CUDA device everywhere: it allocates bookkeeping tensors with
``device="cuda"`` / ``device=torch.cuda.current_device()``, moves models and batches with
``.cuda()``, synchronises timers with ``torch.cuda.synchronize()`` and creates CUDA streams
and events (DDP init, MoE all-to-all dispatcher).  Everything that has a Megatron flag is
handled by flags (see ``notes/cpu_pretrain.md``); :func:`apply_cpu_patches` covers the rest
with a handful of process-wide monkeypatches.

The patches are applied only when ``torch.cuda.is_available()`` is False, so calling
:func:`apply_cpu_patches` unconditionally is safe on GPU machines.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_patches"]

_CPU = torch.device("cpu")
_applied = False


def _is_cuda_device(device: object) -> bool:
    """True for anything that names a CUDA device: "cuda", "cuda:0", torch.device("cuda"), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # A bare int is how torch.cuda.current_device() (patched to 0 below) names a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU.

    Megatron has dozens of ``torch.tensor(..., device="cuda")`` style allocations (pretrain's
    start-time all-reduce, training_log's loss dict, the data-loader flags broadcast, the
    timers' all-gather buffer, DDP grad buffers, router aux-loss tensors, ...); a single
    function mode fixes them all instead of one patch per call site.  It is the same
    mechanism ``torch.set_default_device`` uses.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        # get_model's model_module.cuda(...) and get_batch-style batch[k].cuda() become no-ops.
        if func is torch.Tensor.cuda:
            return args[0]
        # The optimizers (Float16/distributed) and clip_grads check
        # param.type() == "torch.cuda.FloatTensor"; report CPU tensors under the CUDA name.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        # Pinned host memory needs an accelerator; nothing to pin for on a CPU-only host.
        if func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
        # tensor.to("cuda") / tensor.to(torch.cuda.current_device()) with a positional device.
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Stand-in for torch.cuda.Event: CPU ops are synchronous, so every event is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _NullStream:
    """Stand-in for torch.cuda.Stream: CPU work runs in program order, so nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NullStream()


def _null_stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _split_sizes_as_lists(all_to_all_single: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap dist.all_to_all_single so that tensor split sizes are passed as Python lists."""

    @functools.wraps(all_to_all_single)
    def wrapper(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                input_split_sizes: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                 *args, **kwargs)

    return wrapper


def apply_cpu_patches() -> None:
    """Make ``megatron.training.pretrain`` runnable without a GPU (no-op when CUDA exists).

    Idempotent.  Must be called before ``pretrain`` (ideally right after importing torch).
    """
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True

    cuda = torch.cuda
    # initialize._initialize_distributed only builds the model-parallel groups and
    # _set_random_seed only creates the RNG tracker when device_count() > 0.
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    # Used as a device argument all over Megatron (router, tensor_parallel mappings, DDP
    # buffers, timers); 0 is then mapped to the CPU by _CudaToCpuMode.
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    # initialize._initialize_distributed calls set_device(local_rank) when device_count() > 0.
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    # Timers.start/stop(barrier=...) and post_training_step_callbacks synchronise the device.
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # get_model wraps DDP construction in a side stream; the MoE alltoall dispatcher keeps a
    # D2H stream and records/synchronises an event on it.
    cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    cuda.Event = _NullEvent  # type: ignore[assignment,misc]
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    cuda.stream = _null_stream_context  # type: ignore[assignment]

    # Device remapping for explicit device="cuda" allocations and .cuda() moves (see class).
    _CudaToCpuMode().__enter__()

    # MoEAlltoAllTokenDispatcher copies its EP/TP split sizes to host lists only when they
    # are CUDA tensors (maybe_move_tensor_to_cpu checks is_cuda); on CPU they reach
    # tensor_parallel.mappings._AllToAll as tensors, which all_to_all_single rejects.
    torch.distributed.all_to_all_single = _split_sizes_as_lists(
        torch.distributed.all_to_all_single
    )

    # pretrain() calls initialize_megatron() without allow_no_cuda, which asserts CUDA exists.
    import megatron.training.training as mt_training

    init = mt_training.initialize_megatron
    mt_training.initialize_megatron = functools.partial(init, allow_no_cuda=True)
