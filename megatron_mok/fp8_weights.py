"""The expert weights' FP8 copies, quantized 128x128 once per weight version (docs/design.md §12.4).

    quantized(fc1, pow2)             (E, 2F, H) e4m3 + (E, 2F/128, H/128) fp32: fprop's right operand
    quantized_transposed(fc1, pow2)  (E, H, 2F) e4m3 + (E, H/128, 2F/128) fp32: dgrad's (sm90's FP8
                                     wgmma takes K-major operands only; 128x128 blocks transpose exactly)

Two makers of the same bits: the reference backend's (kernels=False: quantization.quantize_weight and
transpose_weight, PyTorch on any device) and the kernel backend's (kernels=True: the one-pass
quantization kernel ops.fp8_quantize_weight, bitwise the reference, tests/ops/test_gpu_fp8_quant.py).
Each caches its own copies, so the reference stays an oracle independent of the kernels.

A copy is cached per weight tensor (held weakly: it goes with the tensor) and is valid while the
tensor's version counter, data pointer, shape, strides and dtype are what they were when it was
made and its storage is the one it was made from (a weak reference: a storage freed by a `.data =`
rebinding whose address a new storage reuses does not pass), for the same pow2 choice. In-place updates through the tensor (`w.mul_()`, `w.copy_()` under
no_grad, every torch.optim optimizer's update) advance the version counter, so the next call
quantizes again. Writes through `w.data` do not (torch gives `.data` a fresh version counter), and
Megatron's optimizers write the model weights so (`model_param.data.copy_(main_param)`): so the
cache also empties after every torch.optim optimizer step (a global step hook, registered with the
first cached weight; Megatron's optimizers wrap torch.optim ones and copy into the model weights after
their step, before the next forward). Code that writes weights through `.data` outside an optimizer
step calls `clear()`.

Another tensor object over a cached weight's bytes (a detached alias: what non-reentrant
checkpointing hands backward, a reentrant recompute's detached inputs) reads the weight's copies
where both it and the weight are as they were when the copies were made (_aliased_entry), rather
than quantizing and caching copies of its own. A `.data` view is such an object with a version
counter of its own: a write through it is a write through `.data` (above), for the weight and its
aliases alike.

Forward takes `quantized`, backward `quantized_transposed`; between them autograd refuses in-place
changes of a saved weight, so both read one version. The reference caches the transposed copy beside
the forward one (made from it on first use). The kernel maker does so only where asked
(Fp8Recipe.cache_transposed_weights: `quantized(keep_transposed=True)` makes both copies in one
pass of the quantization kernel, and `kept_transposed` hands the kept copy to the dgrads, so no
backward of that weight version makes it again). Otherwise its transposed copy is made
when a dgrad asks for it and dies with that GEMM, so a layer holds one FP8 copy per weight (half the
bf16 weight's bytes) between its passes, not two. It is made from the cached forward copy
(ops.fp8_transpose_weight: 128x128 blocks transpose exactly, so moving the bytes gives the bits a
quantization of the weight gives, for a read of one byte per element) and, where none is cached
(cache=False, a capture, an inference tensor), from the weight (ops.fp8_quantize_weight). The dgrads
make their transposed copies range of experts by range (transposed_experts), each range's copy freed
after its GEMM, so that only a fraction of a transposed copy exists at a time, and of the experts
with rows in the GEMM's segments only: a backward over several receive windows (each holding a few
experts' rows) transposes each expert about once in all, and holds no copy between its windows.
Likewise a backward window's recomputed gate/up takes the cached forward copy, or without one a
copy of its experts with rows, made range of experts by range for that GEMM alone
(forward_experts). A forward over
several windows without the cache (cache=False) quantizes each weight's forward copy once for all of
them (copies_held), and so does the reference backend's backward with its whole forward and
transposed copies (the kernel backend's backward makes only the per-GEMM copies above, held by no
block).
Inside a CUDA-graph capture nothing is cached or read from the cache: the graph quantizes on every
replay, and a captured forward over several windows quantizes each weight's forward copy once for
all of them (copies_held, as without the cache), not once per window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from megatron_mok import ops
from megatron_mok.ops.fp8_quant import kernel_ready
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
    # The weight's storage then, held weakly (holding it would keep a replaced weight's bytes alive):
    # a storage freed since (a `.data =` rebinding) invalidates the entry even where a new storage
    # took its address, which the stamp's data pointer alone cannot tell.
    storage: StorageWeakRef
    transposed: Optional[QuantizedWeight] = None

    def made_from(self, weight: Tensor, stamp: tuple) -> bool:
        """Whether this entry is the quantization of weight as it is now (its stamp)."""
        return self.stamp == stamp and not self.storage.expired() and self.storage.cdata == weight.untyped_storage()._cdata


# weight tensor -> {(pow2, kernels): _Entry}. Emulated ranks run their passes in threads: one lock.
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Where each weight _CACHE holds an entry of lies (_place: its storage and first byte) -> that
# weight, held weakly: how another tensor object over the same bytes (an alias) finds the weight's
# entry (_aliased_entry). The first byte too: weights can be views into one buffer (Megatron's
# contiguous parameter buffer), so one storage holds several.
_OWNERS: dict[tuple[int, int], weakref.ref] = {}
_LOCK = threading.Lock()
# The copies held by copies_held in this thread (a pass's windows): the kernel maker's transposed
# copies and the uncached forward copies, {(id(weight), pow2, kernels, which): QuantizedWeight}, or
# None outside such a block.
_HELD = threading.local()
_step_hook = None


def _place(weight: Tensor) -> tuple[int, int]:
    return weight.untyped_storage()._cdata, weight.data_ptr()


def _stamp(weight: Tensor) -> tuple:
    return (weight._version, weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device,
            weight.is_neg(), weight.is_conj())


def _quantize(weight: Tensor, pow2: bool, kernels: bool) -> QuantizedWeight:
    with torch.no_grad():
        if kernels:
            q, scales, _, _ = ops.fp8_quantize_weight(kernel_ready(weight.detach()), transposed=False, pow2=pow2)
            return QuantizedWeight(q, scales)
        return QuantizedWeight(*quantize_weight(weight.detach(), pow2))


def _quantize_both(weight: Tensor, pow2: bool) -> tuple[QuantizedWeight, QuantizedWeight]:
    """The kernel maker's forward and transposed copies in one pass (one read of the weight)."""
    with torch.no_grad():
        q, scales, q_t, scales_t = ops.fp8_quantize_weight(kernel_ready(weight.detach()), transposed=True, pow2=pow2)
    return QuantizedWeight(q, scales), QuantizedWeight(q_t, scales_t)


def _cacheable(weight: Tensor) -> bool:
    """False for an inference tensor (it has no version counter, so nothing can tell whether it
    changed) and inside a CUDA-graph capture (a replay must quantize the weights it reads then, not a
    copy of their values at capture time)."""
    return not (weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()))


def _valid_entry(weight: Tensor, pow2: bool, kernels: bool) -> Optional[_Entry]:
    """The weight's cached entry if it is still valid, else None (nothing is quantized): its own, or,
    for another tensor object over a cached weight's bytes, that weight's (_aliased_entry)."""
    if not _cacheable(weight):
        return None
    stamp = _stamp(weight)
    with _LOCK:
        entries = _CACHE.get(weight)
        entry = entries.get((pow2, kernels)) if entries is not None else None
        if entry is not None:
            if entry.made_from(weight, stamp):
                return entry
            del entries[(pow2, kernels)]  # stale for good: its copies go now, whoever answers instead
        return _aliased_entry(weight, stamp, pow2, kernels)


def _aliased_entry(weight: Tensor, stamp: tuple, pow2: bool, kernels: bool) -> Optional[_Entry]:
    """The entry of the cached weight whose bytes weight starts at, where it is valid for both (the
    caller holds _LOCK). A weight can reach backward as another tensor object over the same bytes
    (the detached alias non-reentrant checkpointing unpacks, the detached inputs of a reentrant
    recompute): it finds the copies its forward made instead of caching copies of its own, which
    the memory bound does not count and which die with the alias. Valid for both: the alias's stamp is
    the entry's (same bytes, shape, strides, version count) and so is the cached weight's now, so an
    alias never reads a copy its weight would not (an old `.data` view keeps version 0 while the
    weight's counter moves on). An alias with a version counter of its own (a `.data` view) is the
    weight's `.data` limitation (the module's docstring): a write through it that no counter of the
    weight sees leaves both reading the copies made before, until `clear()`."""
    found = _owner(_place(weight))
    if found is None or found[0] is weight:
        return None
    owner, owner_stamp = found
    entry = _CACHE[owner].get((pow2, kernels))
    if entry is None or not entry.made_from(owner, owner_stamp) or not entry.made_from(weight, stamp):
        return None
    return entry


def _owner(place: tuple[int, int]) -> Optional[tuple[Tensor, tuple]]:
    """(the cached weight _OWNERS names for place, its stamp now) while it still lies there and holds
    a valid entry, else None (the caller holds _LOCK)."""
    owner_ref = _OWNERS.get(place)
    owner = owner_ref() if owner_ref is not None else None
    if owner is None or _place(owner) != place:
        return None
    stamp = _stamp(owner)
    entries = _CACHE.get(owner)
    if entries is None or not any(entry.made_from(owner, stamp) for entry in entries.values()):
        return None
    return owner, stamp


def _entry(weight: Tensor, pow2: bool, kernels: bool, both: bool = False) -> Optional[_Entry]:
    """The weight's valid entry, quantized now if missing or stale (with both, the kernel maker's
    forward and transposed copies in one pass); None where nothing is cached (_cacheable)."""
    entry = _valid_entry(weight, pow2, kernels)  # (a stale entry's copies go there, before new ones are made)
    if entry is not None or not _cacheable(weight):
        return entry
    stamp, storage = _stamp(weight), StorageWeakRef(weight.untyped_storage())
    if both and kernels:
        forward, transposed = _quantize_both(weight, pow2)
        entry = _Entry(stamp, forward, storage, transposed)
    else:
        entry = _Entry(stamp, _quantize(weight, pow2, kernels), storage)
    with _LOCK:
        _register_step_hook()
        _CACHE.setdefault(weight, {})[(pow2, kernels)] = entry
        place = _place(weight)
        found = _owner(place)
        if found is None or found[0] is weight:  # (an alias that missed does not displace a valid owner)
            _OWNERS[place] = weakref.ref(weight)
        if len(_OWNERS) > 2 * len(_CACHE) + 64:  # lines of weights gone, moved or stale since
            for key in [key for key in _OWNERS if _owner(key) is None]:
                del _OWNERS[key]
    return entry


def quantized(weight: Tensor, pow2: bool = False, *, kernels: bool = False, cache: bool = True,
              keep_transposed: bool = False) -> QuantizedWeight:
    """weight (E, N, K) bf16/fp32, N and K multiples of 128 -> its 128x128 quantization (cached).
    kernels: made by ops.fp8_quantize_weight (a CUDA weight; the kernel backend) instead of PyTorch.
    cache=False (Fp8Recipe.cache_weights): never cached nor read from the cache, so the copy lives
    only as long as the caller (or a copies_held block around the pass) holds it. So too where nothing
    is cacheable (_cacheable: a CUDA-graph capture, an inference tensor) whatever cache says.
    keep_transposed (Fp8Recipe.cache_transposed_weights, with kernels and cache): a copy made now is
    made with its transposed copy in the same pass, which the entry keeps for kept_transposed."""
    entry = _entry(weight, pow2, kernels, both=keep_transposed) if cache else None
    if entry is None:  # cache=False, or nothing cacheable (a capture, an inference tensor)
        return _held_or_made((id(weight), pow2, kernels, "forward"), lambda: _quantize(weight, pow2, kernels))
    return entry.weight


def quantized_transposed(weight: Tensor, pow2: bool = False, *, kernels: bool = False, cache: bool = True) -> QuantizedWeight:
    """weight (E, N, K) -> the quantization of its transpose, (E, K, N) with (E, K/128, N/128) scales:
    cached beside quantized's copy (kernels=False), or made afresh by a kernel (kernels=True, never
    cached: see the module's docstring), from the cached forward copy where there is one, else from
    the weight. cache=False: as quantized's, nothing cached or read from the cache (the reference
    makes it from a fresh forward copy, the kernels from the weight). A copy not read from the cache
    is made once for a copies_held block that holds."""
    if kernels:
        return _held_or_made((id(weight), pow2, kernels, "transposed"),
                             lambda: transposed_experts(weight, 0, weight.shape[0], pow2, cache=cache))
    entry = _entry(weight, pow2, kernels) if cache else None
    if entry is None:
        return _held_or_made((id(weight), pow2, kernels, "transposed"), lambda: _transposed(quantized(weight, pow2, cache=False)))
    with _LOCK:
        if entry.transposed is None:
            entry.transposed = _transposed(entry.weight)
        return entry.transposed


def kept_transposed(weight: Tensor, pow2: bool = False) -> Optional[QuantizedWeight]:
    """The kernel maker's transposed copy of weight (E, N, K), (E, K, N) e4m3 and (E, K/128, N/128)
    fp32, kept in the cache beside the forward copy (Fp8Recipe.cache_transposed_weights): the one
    quantized(keep_transposed=True) made, else made now from the cached forward copy
    (ops.fp8_transpose_weight, every expert) and kept. It lives until the weight changes, like the
    forward copy. None where the weight has no valid cached forward copy (nothing cacheable: a
    CUDA-graph capture, an inference tensor; or bytes that are no cached weight's, as a saved-tensor
    hook's copy, or that changed since): the caller then makes its copies range by range as without
    the option. A backward never caches copies of its own: they would outlive it beside the forward's
    and the memory bound counts one kept pair per weight."""
    entry = _valid_entry(weight, pow2, True)
    if entry is None:
        return None
    with _LOCK:
        if entry.transposed is None:
            with torch.no_grad():
                entry.transposed = QuantizedWeight(*ops.fp8_transpose_weight(entry.weight.values, entry.weight.scales))
        return entry.transposed


def _transposed(copy: QuantizedWeight) -> QuantizedWeight:
    """The PyTorch maker's transposed copy of a forward copy."""
    return QuantizedWeight(*transpose_weight(copy.values, copy.scales))


def transposed_experts(
    weight: Tensor, first: int, end: int, pow2: bool = False, *, cache: bool = True,
    expert_offsets: Optional[Tensor] = None,
) -> QuantizedWeight:
    """The kernel maker's transposed copy of experts [first, end) of weight (E, N, K) alone ((end - first,
    K, N) e4m3 and (end - first, K/128, N/128) fp32): the cached forward copy's bytes of those experts,
    moved (a 128x128 block transposes exactly: the bits a quantization of the weight gives), where one
    is cached, else quantized from the weight's. expert_offsets (end - first + 1,) int32, the segments
    of the GEMM the copy is for: only the experts with rows there are made (the others' parts are left
    unwritten; that GEMM reads none of them), so the copies for the receive windows of one backward
    move each expert's blocks about once in all, not once per window. Never held (copies_held does not
    apply): a dgrad that multiplies expert range by expert range makes and frees one range's copy at a
    time, so no more than that range's bytes exist at once. (quantized_transposed(kernels=True) is this
    over all E experts.)"""
    if not 0 <= first < end <= weight.shape[0]:
        raise ValueError(f"transposed_experts: need 0 <= first < end <= E = {weight.shape[0]}, got [{first}, {end})")
    forward = _valid_entry(weight, pow2, True) if cache else None
    with torch.no_grad():
        if forward is not None:
            copy = forward.weight
            return QuantizedWeight(*ops.fp8_transpose_weight(copy.values[first:end], copy.scales[first:end],
                                                             expert_offsets))
        _, _, q_t, scales_t = ops.fp8_quantize_weight(kernel_ready(weight.detach()[first:end]), pow2=pow2,
                                                      forward_copy=False, expert_offsets=expert_offsets)
    return QuantizedWeight(q_t, scales_t)


def forward_experts(
    weight: Tensor, first: int, end: int, pow2: bool = False, *, cache: bool = True,
    expert_offsets: Optional[Tensor] = None,
) -> QuantizedWeight:
    """The kernel maker's forward copy of experts [first, end) of weight (E, N, K) for a GEMM over
    expert_offsets' segments ((end - first + 1,) int32): the cached copy's experts (a view, no bytes
    moved) where one is valid (cache), else those experts with rows there alone, quantized from the
    weight ((end - first, N, K) e4m3 and (end - first, N/128, K/128) fp32; the other experts' parts
    left unwritten), neither cached nor held: a backward window's recomputed gate/up, made range of
    experts by range like the dgrads (transposed_experts), so that without the cache no more than a
    range's share of fc1's copy exists at once and the windows of one backward quantize each expert
    about once in all."""
    if not 0 <= first < end <= weight.shape[0]:
        raise ValueError(f"forward_experts: need 0 <= first < end <= E = {weight.shape[0]}, got [{first}, {end})")
    entry = _valid_entry(weight, pow2, True) if cache else None
    if entry is not None:
        return QuantizedWeight(entry.weight.values[first:end], entry.weight.scales[first:end])
    with torch.no_grad():
        q, scales, _, _ = ops.fp8_quantize_weight(kernel_ready(weight.detach()[first:end]), transposed=False, pow2=pow2,
                                                  expert_offsets=expert_offsets)
    return QuantizedWeight(q, scales)


def _held_or_made(key: tuple, make) -> QuantizedWeight:
    """The copy copies_held holds under key in this thread, else make() (held from now on inside
    such a block)."""
    held = getattr(_HELD, "copies", None)
    if held is not None and key in held:
        return held[key]
    copy = make()
    if held is not None:
        held[key] = copy
    return copy


@contextlib.contextmanager
def copies_held(hold: bool):
    """With hold, the copies made afresh inside the block (in this thread) are made once and kept
    until it ends: the forward copies not read from the cache (cache=False, a capture, an inference
    tensor) and quantized_transposed's copies not read from the cache (not transposed_experts' or forward_experts', made for one GEMM each).
    A pass over several receive windows, whose every window reads the same weights, then quantizes
    each weight once instead of once per window (a weight cannot change inside one forward or
    backward: autograd refuses in-place changes of a saved tensor). Without hold nothing changes: one
    window keeps a single copy of each alive at a time."""
    if not hold or getattr(_HELD, "copies", None) is not None:
        yield
        return
    _HELD.copies = {}
    try:
        yield
    finally:
        _HELD.copies = None


def clear() -> None:
    """Drops every cached copy: the next call quantizes again."""
    with _LOCK:
        _CACHE.clear()
        _OWNERS.clear()


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
