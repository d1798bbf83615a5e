"""One launch each of the sm90 expert GEMM (gate/up: from dispatched rows, and dispatching) and torch's
grouped GEMM on a benchmark shape, for ncu.

    ncu --clock-control none --kernel-name regex:'expert_gemm|cutlass|sm90' --launch-skip 2 \
        --section SpeedOfLight --section WarpStateStats python3 scripts/profile_expert_gemm.py --shape deepseek_v3_ep8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_expert_gemm import SHAPES, make_inputs  # noqa: E402

from megatron_mok import ops  # noqa: E402
from megatron_mok.backends.kernel import segment_matmul  # noqa: E402
from megatron_mok.backends.tuning import EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="deepseek_v3_ep8", choices=list(SHAPES))
    parser.add_argument("--projection", default="down", choices=("down", "gate_up"))
    args = parser.parse_args()
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
