"""One launch each of the sm90 expert GEMM (gate/up: from dispatched rows, and dispatching) and torch's
grouped GEMM on a benchmark shape, for ncu; with --fp8, of the FP8 blockwise GEMM (every mainloop
variant) and torch's FP8 rowwise grouped GEMM on the same projection.

    ncu --clock-control none --kernel-name regex:'expert_gemm|cutlass|sm90' --launch-skip 2 \
        --section SpeedOfLight --section WarpStateStats python3 scripts/profile_expert_gemm.py --shape deepseek_v3_ep8
    ncu ... python3 scripts/profile_expert_gemm.py --fp8 --projection fc1      # (scripts/device_steps.sh fp8_profile)
    ncu ... python3 scripts/profile_expert_gemm.py --fp8 --projection wgrad_fc2  # the FP8 weight gradient's
                                                                     # mainloops (fp8_wgrad_profile)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_expert_gemm import (  # noqa: E402
    FP8_PROJECTIONS,
    FP8_WGRAD_PROJECTIONS,
    SHAPES,
    make_fp8_inputs,
    make_inputs,
    torch_fp8_blockwise_dense,
    torch_fp8_blockwise_ready,
    torch_fp8_rowwise,
)

from megatron_mok import ops  # noqa: E402
from megatron_mok.ops.fp8_gemm import FP8_GEMM_VARIANTS, FP8_SWIGLU_GEMM_VARIANTS  # noqa: E402
from megatron_mok.ops.fp8_wgrad import FP8_WGRAD_VARIANTS  # noqa: E402
from megatron_mok.backends.kernel import segment_matmul  # noqa: E402
from megatron_mok.backends.tuning import (  # noqa: E402
    EXPERT_GEMM_CLUSTER_M,
    EXPERT_GEMM_GROUP_M,
    FP8_EXPERT_GEMM_CLUSTER_M,
    FP8_EXPERT_GEMM_GROUP_M,
    FP8_EXPERT_GEMM_VARIANT,
)


def profile_fp8(shape: str, projection: str, variants=FP8_GEMM_VARIANTS, cluster_m: int = FP8_EXPERT_GEMM_CLUSTER_M) -> None:
    """Three launches each (ncu --launch-skip 2 keeps the last): torch's FP8 rowwise grouped GEMM (and
    at one expert its dense blockwise GEMM) and ours in every mainloop variant (fc1+swiglu: ours with the SwiGLU epilogue, in each variant it has,
    then our plain fc1 in the layer's variant beside it: what the epilogue costs)."""
    s = make_fp8_inputs(SHAPES[shape], seed=0)
    a_name, w_name, _ = FP8_PROJECTIONS[projection]
    launch = dict(cluster_m=cluster_m, group_m=max(FP8_EXPERT_GEMM_GROUP_M, cluster_m))
    # One expert (dense_8192): torch's dense FP8 blockwise GEMM too, after the rowwise one.
    blockwise = (SHAPES[shape][3] == 1 and projection in ("fc1", "fc2")
                 and torch_fp8_blockwise_ready([s], a_name, w_name))
    for _ in range(3):
        torch_fp8_rowwise(s, a_name, w_name)
        if blockwise:
            torch_fp8_blockwise_dense(s, a_name, w_name)
        if projection == "fc1+swiglu":
            for variant in FP8_SWIGLU_GEMM_VARIANTS:
                ops.fp8_expert_gemm_swiglu(*s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], **launch,
                                           variant=variant)
            ops.fp8_expert_gemm(*s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], **launch,
                                variant=FP8_EXPERT_GEMM_VARIANT)
            continue
        for variant in variants:
            ops.fp8_expert_gemm(*s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], **launch, variant=variant)
    torch.cuda.synchronize()


def profile_fp8_wgrad(shape: str, projection: str) -> None:
    """Three launches of each FP8 weight-gradient mainloop (ncu --launch-skip 2 per variant keeps the
    last), writing the bf16 gradient as the layer's one-window pass does (`rounded`)."""
    s = make_fp8_inputs(SHAPES[shape], seed=0, columnwise=True)
    grad_name, inputs_name, _ = FP8_WGRAD_PROJECTIONS[projection]
    operands = (*s[grad_name + "_col"], *s[inputs_name + "_col"], s["offsets"])
    experts = s["offsets"].shape[0] - 1
    rounded = torch.empty((experts, s[grad_name].shape[1], s[inputs_name].shape[1]), dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        for variant in FP8_WGRAD_VARIANTS:
            ops.fp8_expert_wgrad(*operands, rounded=rounded, variant=variant)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="deepseek_v3_ep8", choices=list(SHAPES))
    parser.add_argument("--projection", default=None,
                        help="down or gate_up (default down); with --fp8 one of "
                        + ", ".join([*FP8_PROJECTIONS, *FP8_WGRAD_PROJECTIONS]) + " (default fc1)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 blockwise GEMM's variants and torch's FP8 rowwise")
    parser.add_argument("--fp8-variants", default=",".join(FP8_GEMM_VARIANTS),
                        help="with --fp8: comma-separated ops.fp8_gemm.FP8_GEMM_VARIANTS to launch, in order")
    parser.add_argument("--fp8-cluster", type=int, default=FP8_EXPERT_GEMM_CLUSTER_M, choices=(1, 2),
                        help="with --fp8: CTAs per cluster of our plain FP8 GEMMs (default tuning's)")
    args = parser.parse_args()
    if args.fp8:
        projection = args.projection or "fc1"
        if projection in FP8_WGRAD_PROJECTIONS:
            profile_fp8_wgrad(args.shape, projection)
            return
        if projection not in FP8_PROJECTIONS:
            parser.error(f"--projection {projection}: with --fp8 one of {[*FP8_PROJECTIONS, *FP8_WGRAD_PROJECTIONS]}")
        variants = tuple(args.fp8_variants.split(","))
        unknown = [v for v in variants if v not in FP8_GEMM_VARIANTS]
        if unknown:
            parser.error(f"--fp8-variants: {unknown} not in {FP8_GEMM_VARIANTS}")
        profile_fp8(args.shape, projection, variants, args.fp8_cluster)
        return
    args.projection = args.projection or "down"
    if args.projection not in ("down", "gate_up"):
        parser.error(f"--projection {args.projection}: down or gate_up")
    s = make_inputs(SHAPES[args.shape], seed=0)
    a, w = (s["act"], s["fc2"]) if args.projection == "down" else (s["rows"], s["fc1"])
    for _ in range(3):  # the first two launches of each are skipped by --launch-skip 2
        segment_matmul(a, w, s["offsets"])
        if args.projection == "down":
            ops.expert_gemm(a, w, s["offsets"], EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M)
        else:
            ops.expert_gemm_swiglu(a, w, s["offsets"], EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M)
            k = s["schedule"].topk
            ops.dispatch_expert_gemm_swiglu(
                s["x"], s["schedule"].slot_to_route, k, w, s["offsets"], EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M
            )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
