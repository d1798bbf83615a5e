"""The sm90 expert GEMM alone against torch's grouped GEMM (CUTLASS) on the same inputs.

    python3 scripts/bench_expert_gemm.py [--clusters 1,2] [--group-m 16] [--shapes deepseek_v3_ep8,...]

For each shape (a uniform random top-k routing through the real schedule), the projections:
- dispatch+gate_up+swiglu: torch = the dispatch kernel, grouped_mm and the SwiGLU kernel; mok = one
  sm90 kernel in which dispatch warps hand minibatches of rows to the GEMM through ready counters;
- dispatch_ring+gate_up+swiglu: the same with the rows in a ring buffer of --ring minibatches
  (MoKConfig's default size; slots reused once every tile has loaded them), not one row per route;
- gate_up+swiglu: the same from already-dispatched rows (mok: SwiGLU in the GEMM's epilogue);
- down;
- dgrad_down+swiglu_bwd: d gate_up from d out (torch: grouped_mm with fc2 transposed + the SwiGLU
  backward kernel; mok: one GEMM reading fc2 as stored, SwiGLU backward in its epilogue);
- dgrad_gate_up: d rows = d gate_up @ fc1[e] (mok: fc1 as stored);
- wgrad_gate_up / wgrad_down: d fc1[e] = d gate_up[e].T @ rows[e], d fc2[e] = d out[e].T @ act[e]
  (tokens as the reduction dimension; torch: grouped_mm with the offsets on K).
Each mok column is one (cluster size, raster group) setting. torch and every setting are timed in
turn, rep by rep (timing.median_ms_interleaved), so drift during the run does not favour the first.
Prints ms and TFLOP/s (2 * routed rows * N * K) beside a dense cuBLAS bf16 GEMM of the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import dense_gemm_tflops, median_ms_interleaved  # noqa: E402

from megatron_mok import MoKConfig, build_schedule, ops  # noqa: E402
from megatron_mok.backends import tuning  # noqa: E402
from megatron_mok.backends.kernel import (  # noqa: E402
    grouped_mm_dgrad_rows,
    grouped_mm_dgrad_swiglu,
    grouped_mm_gate_up,
    segment_matmul,
    segment_weight_grad,
)

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
    schedule = build_schedule(ids, num_local_experts=e)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    rows = schedule.slot_to_route.shape[0]
    return dict(
        x=x,
        schedule=schedule,
        rows=ops.dispatch_rows(x, schedule.slot_to_route, k),
        act=torch.randn(rows, f, device="cuda", generator=gen).bfloat16(),
        grad_out=torch.randn(rows, h, device="cuda", generator=gen).bfloat16(),
        gate_up=torch.randn(rows, 2 * f, device="cuda", generator=gen).bfloat16(),
        fc1=(torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
        fc2=(torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16(),
        offsets=schedule.expert_offsets,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clusters", default="1,2")
    parser.add_argument("--group-m", default=str(tuning.EXPERT_GEMM_GROUP_M), help="comma-separated raster group sizes")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--ring", type=int, default=MoKConfig().dispatch_ring_minibatches,
        help="ring buffer of the dispatch_ring row, in minibatches of limits.DISPATCH_MINIBATCH_ROWS rows (default: MoKConfig's)",
    )
    parser.add_argument(
        "--projections", default="dispatch+gate_up+swiglu,dispatch_ring+gate_up+swiglu,gate_up+swiglu,down,dgrad_down+swiglu_bwd,dgrad_gate_up,wgrad_gate_up,wgrad_down"
    )
    args = parser.parse_args()
    settings = [
        (c, g)
        for c, g in itertools.product((int(v) for v in args.clusters.split(",")), (int(v) for v in args.group_m.split(",")))
        if g % c == 0
    ]
    dense = dense_gemm_tflops()
    print(f"device: {torch.cuda.get_device_name()}; dense bf16 GEMM 8192^3: {dense:.0f} TFLOP/s")
    header = " ".join(f"{f'c{c}g{g} ms':>10} {'TFLOP/s':>7} {'x':>5}" for c, g in settings)
    print(f"{'shape':<16} {'projection':<24} {'torch ms':>9} {'TFLOP/s':>8} {header}")
    for name in args.shapes.split(","):
        t, h, f, e, k = shape = SHAPES[name]
        sets = [make_inputs(shape, seed) for seed in range(2)]
        cases = {
            "dispatch+gate_up+swiglu": (
                lambda s: grouped_mm_gate_up(ops.dispatch_rows(s["x"], s["schedule"].slot_to_route, k), s["fc1"], s["offsets"]),
                lambda s, c, g: ops.dispatch_expert_gemm_swiglu(
                    s["x"], s["schedule"].slot_to_route, k, s["fc1"], s["offsets"], c, g
                ),
                2 * t * k * 2 * f * h,
            ),
            # The same through the dispatch's ring buffer (--ring minibatches) instead of every row.
            "dispatch_ring+gate_up+swiglu": (
                lambda s: grouped_mm_gate_up(ops.dispatch_rows(s["x"], s["schedule"].slot_to_route, k), s["fc1"], s["offsets"]),
                lambda s, c, g: ops.dispatch_expert_gemm_swiglu(
                    s["x"], s["schedule"].slot_to_route, k, s["fc1"], s["offsets"], c, g, args.ring
                ),
                2 * t * k * 2 * f * h,
            ),
            "gate_up+swiglu": (
                lambda s: grouped_mm_gate_up(s["rows"], s["fc1"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm_swiglu(s["rows"], s["fc1"], s["offsets"], c, g),
                2 * t * k * 2 * f * h,
            ),
            "down": (
                lambda s: segment_matmul(s["act"], s["fc2"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm(s["act"], s["fc2"], s["offsets"], c, g),
                2 * t * k * h * f,
            ),
            # Backward (the sm90 dgrad GEMMs take clusters of 1 only; c > 1 runs them the same).
            "dgrad_down+swiglu_bwd": (
                lambda s: grouped_mm_dgrad_swiglu(s["grad_out"], s["fc2"], s["gate_up"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm_dgrad_swiglu(s["grad_out"], s["fc2"], s["offsets"], s["gate_up"], g),
                2 * t * k * h * f,
            ),
            "dgrad_gate_up": (
                lambda s: grouped_mm_dgrad_rows(s["gate_up"], s["fc1"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm_dgrad(s["gate_up"], s["fc1"], s["offsets"], g),
                2 * t * k * 2 * f * h,
            ),
            "wgrad_gate_up": (
                lambda s: segment_weight_grad(s["gate_up"], s["rows"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm_wgrad(s["gate_up"], s["rows"], s["offsets"]),
                2 * t * k * 2 * f * h,
            ),
            "wgrad_down": (
                lambda s: segment_weight_grad(s["grad_out"], s["act"], s["offsets"]),
                lambda s, c, g: ops.expert_gemm_wgrad(s["grad_out"], s["act"], s["offsets"]),
                2 * t * k * h * f,
            ),
        }
        for label in args.projections.split(","):
            torch_fn, mok_fn, flops = cases[label]
            fns = {"torch": torch_fn}
            fns.update({(c, g): (lambda s, c=c, g=g: mok_fn(s, c, g)) for c, g in settings})
            ms_by = median_ms_interleaved(fns, sets)
            ms_torch = ms_by["torch"]
            cells = []
            for c, g in settings:
                ms = ms_by[(c, g)]
                cells.append(f"{ms:10.3f} {flops / ms / 1e9:7.0f} {ms_torch / ms:5.2f}")
            print(f"{name:<16} {label:<24} {ms_torch:9.3f} {flops / ms_torch / 1e9:8.0f} " + " ".join(cells), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
