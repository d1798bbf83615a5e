"""The expert weights' FP8 copies, quantized 128x128 once per weight version (docs/design.md §12.4).

    quantized(fc1, pow2)             (E, 2F, H) e4m3 + (E, 2F/128, H/128) fp32: fprop's right operand
    quantized_transposed(fc1, pow2)  (E, H, 2F) e4m3 + (E, H/128, 2F/128) fp32: dgrad's (sm90's FP8
                                     wgmma takes K-major operands only; 128x128 blocks transpose exactly)

A copy is cached per weight tensor (held weakly: it goes with the tensor) and is valid while the
tensor's version counter, data pointer, shape, strides and dtype are what they were when it was
made, for the same pow2 choice. In-place updates through the tensor (`w.mul_()`, `w.copy_()` under
no_grad, every torch.optim optimizer's update) advance the version counter, so the next call
quantizes again. Writes through `w.data` do not (torch gives `.data` a fresh version counter), and
Megatron's optimizers write the model weights so (`model_param.data.copy_(main_param)`): so the
cache also empties after every torch.optim optimizer step (a global step hook, registered with the
first cached weight; Megatron's optimizers wrap torch.optim ones and copy into the model weights after
their step, before the next forward). Code that writes weights through `.data` outside an optimizer
step calls `clear()`.

Forward takes `quantized`, backward `quantized_transposed` (made from the cached copy on first use);
between them autograd refuses in-place changes of a saved weight, so both read one version. Inside a
CUDA-graph capture nothing is cached or read from the cache: the graph quantizes on every replay.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron_mok.quantization import quantize_weight, transpose_weight

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """values (E, N, K) e4m3; scales (E, N/128, K/128) fp32."""

    values: Tensor
    scales: Tensor


@dataclasses.dataclass
class _Entry:
    stamp: tuple  # what the weight was when quantized (_stamp)
    weight: QuantizedWeight
    transposed: Optional[QuantizedWeight] = None


# weight tensor -> {pow2: _Entry}. Emulated ranks run their passes in threads: one lock.
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.Lock()
_step_hook = None


def _stamp(weight: Tensor) -> tuple:
    return (weight._version, weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)


def _entry(weight: Tensor, pow2: bool) -> Optional[_Entry]:
    """The weight's valid entry, quantized now if missing or stale; None where nothing is cached:
    for an inference tensor (it has no version counter, so nothing can tell whether it changed) and
    inside a CUDA-graph capture (a replay must quantize the weights it reads then, not a copy of
    their values at capture time)."""
    if weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    stamp = _stamp(weight)
    with _LOCK:
        entries = _CACHE.get(weight)
        entry = entries.get(pow2) if entries is not None else None
        if entry is not None and entry.stamp == stamp:
            return entry
    with torch.no_grad():
        entry = _Entry(stamp, QuantizedWeight(*quantize_weight(weight.detach(), pow2)))
    with _LOCK:
        _register_step_hook()
        _CACHE.setdefault(weight, {})[pow2] = entry
    return entry


def quantized(weight: Tensor, pow2: bool = False) -> QuantizedWeight:
    """weight (E, N, K) bf16/fp32, N and K multiples of 128 -> its 128x128 quantization (cached)."""
    entry = _entry(weight, pow2)
    if entry is None:
        with torch.no_grad():
            return QuantizedWeight(*quantize_weight(weight.detach(), pow2))
    return entry.weight


def quantized_transposed(weight: Tensor, pow2: bool = False) -> QuantizedWeight:
    """weight (E, N, K) -> the quantization of its transpose, (E, K, N) with (E, K/128, N/128) scales (cached)."""
    entry = _entry(weight, pow2)
    if entry is None:
        copy = quantized(weight, pow2)
        return QuantizedWeight(*transpose_weight(copy.values, copy.scales))
    with _LOCK:
        if entry.transposed is None:
            entry.transposed = QuantizedWeight(*transpose_weight(entry.weight.values, entry.weight.scales))
        return entry.transposed


def clear() -> None:
    """Drops every cached copy: the next call quantizes again."""
    with _LOCK:
        _CACHE.clear()


def cached_count() -> int:
    """Weights with a cached copy (for tests)."""
    with _LOCK:
        return len(_CACHE)


def _clear_after_step(optimizer, args, kwargs) -> None:
    clear()


def _register_step_hook() -> None:
    """Once per process (the caller holds _LOCK): empty the cache after every torch.optim step."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_clear_after_step)
