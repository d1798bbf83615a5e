"""One kernel-backend forward of a benchmark shape, for `ncu --profile-from-start off`.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        python3 scripts/profile_forward.py --shape deepseek_v3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, make_inputs  # noqa: E402

from megatron_mok import MoKConfig, mok_moe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="deepseek_v3", choices=list(SHAPES))
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    args = parser.parse_args()
    s = make_inputs(SHAPES[args.shape], seed=0)
    config = MoKConfig(backend="kernel")

    def step():
        leaves = [s[n].detach().requires_grad_(args.backward) for n in ("x", "weights", "fc1", "fc2")]
        y = mok_moe(leaves[0], s["ids"], leaves[1], leaves[2], leaves[3], config=config)
        if args.backward:
            y.backward(s["grad"])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
