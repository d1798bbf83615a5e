"""The FP8 down-projection dgrad with the SwiGLU backward in its epilogue
(ops.fp8_expert_gemm_swiglu_backward) against the two launches it replaces (ops.fp8_expert_gemm, then
ops.fp8_quantize_swiglu_backward), and the dgrad alone, at the model shapes of
scripts/bench_expert_gemm.py; CUDA events, warm-up, medians over two alternating input sets
(scripts/timing.py).

    python3 scripts/bench_swiglu_backward_epilogue.py [--shapes deepseek_v3_ep8,qwen3_30b]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_expert_gemm import SHAPES, make_fp8_inputs  # noqa: E402
from timing import median_ms_interleaved  # noqa: E402

from megatron_mok import ops  # noqa: E402
from megatron_mok.backends import tuning  # noqa: E402
from megatron_mok.ops.fp8_gemm import FP8_SWIGLU_BACKWARD_GEMM_VARIANTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek_v3_ep8,qwen3_30b")
    args = parser.parse_args()
    launch = (tuning.FP8_EXPERT_GEMM_CLUSTER_M, tuning.FP8_EXPERT_GEMM_GROUP_M)
    variant = tuning.FP8_EXPERT_GEMM_VARIANT
    print(f"device: {torch.cuda.get_device_name()}; ms, medians; cluster_m {launch[0]}, group_m {launch[1]}")
    print(f"{'shape':<16} {'dgrad alone':>12} {'two launches':>13} " +
          " ".join(f"{'epilogue ' + v:>17}" for v in FP8_SWIGLU_BACKWARD_GEMM_VARIANTS))
    for name in args.shapes.split(","):
        sets = [make_fp8_inputs(SHAPES[name], seed) for seed in range(2)]

        def dgrad(s):
            return ops.fp8_expert_gemm(*s["grad_out_fp8"], *s["fc2_t_fp8"], s["offsets"], *launch, variant=variant)

        fns = {
            "dgrad alone": dgrad,
            "two launches": lambda s: ops.fp8_quantize_swiglu_backward(s["gate_up"], dgrad(s), s["offsets"]),
        }
        for v in FP8_SWIGLU_BACKWARD_GEMM_VARIANTS:
            fns["epilogue " + v] = lambda s, v=v: ops.fp8_expert_gemm_swiglu_backward(
                *s["grad_out_fp8"], *s["fc2_t_fp8"], s["offsets"], *launch, gate_up=s["gate_up"], variant=v)
        ms = median_ms_interleaved(fns, sets)
        print(f"{name:<16} {ms['dgrad alone']:12.3f} {ms['two launches']:13.3f} " +
              " ".join(f"{ms['epilogue ' + v]:17.3f}" for v in FP8_SWIGLU_BACKWARD_GEMM_VARIANTS), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
