"""The one timer of the benchmarks: CUDA events, warm-up, L2 flush, medians over fresh inputs."""

from __future__ import annotations

import statistics
from typing import Callable, Hashable, Mapping, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # several times the H200's 60 MB L2


def median_ms(fn: Callable[[object], object], inputs: Sequence[object], warmup: int = 3, reps: int = 10) -> float:
    """Median time of fn(input) in ms, cycling through `inputs`, L2 flushed before each rep."""
    return median_ms_interleaved({None: fn}, inputs, warmup, reps)[None]


def median_ms_interleaved(
    fns: Mapping[Hashable, Callable[[object], object]], inputs: Sequence[object], warmup: int = 3, reps: int = 10
) -> dict:
    """Median time in ms of each of `fns` on the same inputs, their reps taken in turn (rep i of
    every function before rep i + 1 of any): clock and temperature drift over the run then falls on
    all of them alike instead of on whichever ran last. L2 flushed before each rep."""
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for fn in fns.values():
        for i in range(warmup):
            fn(inputs[i % len(inputs)])
    times = {name: [] for name in fns}
    for i in range(reps):
        for name, fn in fns.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs[i % len(inputs)])
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def median_ms_queued(fn: Callable[[object], object], inputs: Sequence[object], warmup: int = 3, batches: int = 5,
                     per_batch: int = 6) -> float:
    """Median over batches of the time per call when `per_batch` calls (input sets alternated) are
    queued back to back between two events: the host runs ahead of the device as in a training
    loop, so host-side launch overhead is hidden unless the function synchronizes with the device."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(per_batch):
            fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_batch)
    return statistics.median(times)


def peak_memory_mb(fn: Callable[[object], object], arg: object) -> float:
    """Peak allocated memory above what was allocated before one call, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(arg)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def held_memory_mb(fn: Callable[[object], object], arg: object) -> float:
    """Memory still allocated while one call's result is alive (for a forward under autograd: the
    output and the activations saved for backward, what a training step holds per layer), in MB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    result = fn(arg)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / 2**20
    del result
    return held


def dense_gemm_tflops(n: int = 8192) -> float:
    """cuBLAS bf16 n^3 GEMM rate on random data, the ceiling of every number beside it."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda _: a @ b, [None], warmup=5, reps=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12
