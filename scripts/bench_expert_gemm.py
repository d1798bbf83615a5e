"""The sm90 expert GEMM alone (clusters of 1 and of 2 CTAs) against torch's grouped GEMM
(CUTLASS) on the same inputs.

    python3 scripts/bench_expert_gemm.py

For each shape (routed rows split over experts as a uniform top-k routing would): the gate/up
projection with SwiGLU (mok: one kernel; torch: grouped_mm + the SwiGLU kernel) and the down
projection. Prints ms and TFLOP/s (2 * rows * N * K) beside a dense cuBLAS bf16 GEMM of the same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import dense_gemm_tflops, median_ms  # noqa: E402

from megatron_mok import ops  # noqa: E402
from megatron_mok.kernels import grouped_mm_gate_up, segment_matmul  # noqa: E402

# name: (tokens, hidden, ffn, experts, topk)
SHAPES = {
    "deepseek_v3_ep8": (8192, 7168, 2048, 32, 8),
    "h4096_f1536": (8192, 4096, 1536, 16, 8),
    "qwen3_30b": (16384, 2048, 768, 128, 8),
}


def make_inputs(shape, seed):
    t, h, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=e).int()
    offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    rows = t * k
    return dict(
        x=torch.randn(rows, h, device="cuda", generator=gen).bfloat16(),
        act=torch.randn(rows, f, device="cuda", generator=gen).bfloat16(),
        fc1=(torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
        fc2=(torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16(),
        offsets=offsets,
    )


def main() -> None:
    dense = dense_gemm_tflops()
    print(f"device: {torch.cuda.get_device_name()}; dense bf16 GEMM 8192^3: {dense:.0f} TFLOP/s")
    print(f"{'shape':<16} {'projection':<14} {'torch ms':>9} {'TFLOP/s':>8} "
          f"{'mok c1 ms':>9} {'TFLOP/s':>8} {'mok c2 ms':>9} {'TFLOP/s':>8} {'c1 x':>6} {'c2 x':>6}")
    for name, shape in SHAPES.items():
        t, h, f, e, k = shape
        sets = [make_inputs(shape, seed) for seed in range(2)]
        cases = {
            "gate_up+swiglu": (
                lambda s: grouped_mm_gate_up(s["x"], s["fc1"], s["offsets"]),
                lambda s, c: ops.expert_gemm_swiglu(s["x"], s["fc1"], s["offsets"], c),
                2 * t * k * 2 * f * h,
            ),
            "down": (
                lambda s: segment_matmul(s["act"], s["fc2"], s["offsets"]),
                lambda s, c: ops.expert_gemm(s["act"], s["fc2"], s["offsets"], c),
                2 * t * k * h * f,
            ),
        }
        for label, (torch_fn, mok_fn, flops) in cases.items():
            ms_torch = median_ms(torch_fn, sets)
            ms_c1 = median_ms(lambda s: mok_fn(s, 1), sets)
            ms_c2 = median_ms(lambda s: mok_fn(s, 2), sets)
            print(
                f"{name:<16} {label:<14} {ms_torch:9.3f} {flops / ms_torch / 1e9:8.0f} {ms_c1:9.3f} "
                f"{flops / ms_c1 / 1e9:8.0f} {ms_c2:9.3f} {flops / ms_c2 / 1e9:8.0f} "
                f"{ms_torch / ms_c1:6.2f} {ms_torch / ms_c2:6.2f}"
            )
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
