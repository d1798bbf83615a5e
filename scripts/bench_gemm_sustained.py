"""Each FP8 GEMM run back to back for a few seconds, long enough for the card's power limit to set its
clock, with nvidia-smi sampling the SM clock and power meanwhile: the steady rate of ours and of
torch's beside the clock each one runs at, and the share of the tensor cores' E4M3 peak at that
clock (132 SMs x 8192 FLOP per SM per cycle on an H100 / H200 SXM).

    python3 scripts/bench_gemm_sustained.py [--shape dense_8192] [--projection fc1] [--seconds 3] \
        [--variants overlap,wide] [--clusters 1,2]

Kernels: torch's FP8 rowwise GEMM (grouped; CUTLASS, no promotion), at one expert torch's dense
FP8 blockwise GEMM (cuBLASLt, promotion per 128 of K), and ours in each mainloop of --variants at
each cluster size of --clusters (default: tuning's).
The short interleaved timing of scripts/bench_expert_gemm.py gives rates at whatever clock the card
had; this gives each kernel's own steady state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_expert_gemm import (  # noqa: E402
    FP8_PROJECTIONS,
    SHAPES,
    make_fp8_inputs,
    torch_fp8_blockwise_dense,
    torch_fp8_blockwise_ready,
    torch_fp8_rowwise,
)

from megatron_mok import ops  # noqa: E402
from megatron_mok.backends.tuning import FP8_EXPERT_GEMM_CLUSTER_M, FP8_EXPERT_GEMM_GROUP_M  # noqa: E402

FLOP_PER_SM_CYCLE_E4M3 = 8192  # dense wgmma E4M3 on sm_90: 1979 TFLOP/s at 1830 MHz on 132 SMs


def sustained(fn, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """(ms per call over `seconds` of back-to-back calls, nvidia-smi's (SM MHz, W) samples meanwhile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, began = 0, time.time()
    start.record()
    while time.time() - began < seconds:
        for _ in range(20):  # (the host queues ahead; the wall clock only bounds the loop)
            fn()
        calls += 20
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    out, _ = sampler.communicate()
    samples = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except (ValueError, IndexError):
            continue
    # The second half of the samples: the clock after the power limit has acted.
    return start.elapsed_time(end) / calls, samples[len(samples) // 2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="dense_8192", choices=list(SHAPES))
    parser.add_argument("--projection", default="fc1", choices=[p for p in FP8_PROJECTIONS if "+" not in p])
    parser.add_argument("--variants", default="overlap")
    parser.add_argument("--clusters", default=str(FP8_EXPERT_GEMM_CLUSTER_M),
                        help="cluster sizes (CTAs sharing a B tile by multicast), comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    t, h, f, e, k = SHAPES[args.shape]
    s = make_fp8_inputs(SHAPES[args.shape], seed=0)
    a_name, w_name, flops_per_row = FP8_PROJECTIONS[args.projection]
    flops = t * k * flops_per_row(h, f)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = {"torch fp8 rowwise": lambda: torch_fp8_rowwise(s, a_name, w_name)}
    if e == 1 and torch_fp8_blockwise_ready([s], a_name, w_name):
        fns["torch fp8 blockwise"] = lambda: torch_fp8_blockwise_dense(s, a_name, w_name)
    clusters = [int(c) for c in args.clusters.split(",")]
    for variant in args.variants.split(","):
        for cluster_m in clusters:
            name = f"ours {variant}" + (f" c{cluster_m}" if len(clusters) > 1 else "")
            fns[name] = lambda v=variant, c=cluster_m: ops.fp8_expert_gemm(
                *s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], c, FP8_EXPERT_GEMM_GROUP_M, variant=v)
    print(f"device: {torch.cuda.get_device_name()}; {args.shape} {args.projection}, {args.seconds} s per kernel; "
          "MHz and W: medians of the second half of nvidia-smi's samples")
    print(f"{'kernel':<22} {'TFLOP/s':>8} {'SM MHz':>7} {'W':>6} {'peak at MHz':>12} {'share':>6}")
    for name, fn in fns.items():
        ms, samples = sustained(fn, args.seconds)
        tflops = flops / ms / 1e9
        mhz = statistics.median(m for m, _ in samples) if samples else float("nan")
        watts = statistics.median(w for _, w in samples) if samples else float("nan")
        peak = sms * FLOP_PER_SM_CYCLE_E4M3 * mhz * 1e6 / 1e12
        print(f"{name:<22} {tflops:8.0f} {mhz:7.0f} {watts:6.0f} {peak:12.0f} {tflops / peak:6.1%}", flush=True)
        time.sleep(2)  # (cool down between kernels, so each starts from the same state)


if __name__ == "__main__":
    main()
