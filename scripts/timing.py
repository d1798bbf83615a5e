"""The one timer of the benchmarks: CUDA events, warm-up, L2 flush, medians over fresh inputs."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # several times the H200's 60 MB L2


def median_ms(fn: Callable[[object], object], inputs: Sequence[object], warmup: int = 3, reps: int = 10) -> float:
    """Median time of fn(input) in ms, cycling through `inputs`, L2 flushed before each rep."""
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    for i in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_memory_mb(fn: Callable[[object], object], arg: object) -> float:
    """Peak allocated memory above what was allocated before one call, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(arg)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def dense_gemm_tflops(n: int = 8192) -> float:
    """cuBLAS bf16 n^3 GEMM rate on random data, the ceiling of every number beside it."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda _: a @ b, [None], warmup=5, reps=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12
