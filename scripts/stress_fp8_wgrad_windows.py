"""The FP8 weight gradient over receive windows, run after run, in every mainloop: the windows of
tests/ops/test_gpu_fp8_wgrad.py (one expert over several windows, empty experts between filled ones) at
model shapes, in the accumulate form (each window adding to the fp32 total, the last one rounding into
the bf16 result, and the same into fp32 only) and in the windowed form (each expert rounded by the
window that ends it, carries between windows), against one pass, bit for bit. Prints how many runs differed per case. A race shows here as a
few runs in many (the overlap mainloop's before its proxy fences: 8 of 16); the GPU test runs the
case that caught it 16 times.

    python3 scripts/stress_fp8_wgrad_windows.py      # repository root, a Hopper GPU, the extension built
"""

from __future__ import annotations

import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"),
                os.path.join(os.path.dirname(__file__), "..", "tests", "ops")]

from megatron_mok import ops  # noqa: E402
from megatron_mok.ops.fp8_wgrad import FP8_WGRAD_VARIANTS  # noqa: E402
from test_gpu_fp8_wgrad import (  # noqa: E402
    WINDOW_ROUTINGS, make_case, nan_carries, operands, run_windowed, run_windows, window_operands,
)

ROUTINGS = {**WINDOW_ROUTINGS, "many_empty": [0, 0, 700, 0, 0, 0, 130, 0, 0, 1500, 0, 0]}
SHAPES = {"deepseek_v3_dw2": (7168, 2048), "deepseek_v3_dw1": (4096, 7168), "qwen3_30b_dw2": (2048, 768)}
WINDOWS = (256, 1024)
RUNS, RUNS_OF_THE_CAUGHT_CASE = 8, 48  # the caught case: deepseek_v3_dw2, one_expert_spans_windows, 1024


def differing_runs(case, want, windows, variant, runs):
    """Runs that differed from one pass's: (the accumulate form's bf16 result, its fp32 total, the windowed
    form's bf16 result)."""
    rounded_wrong = total_wrong = windowed_wrong = 0
    for _ in range(runs):
        out = torch.full(want.shape, float("nan"), device="cuda")
        rounded = torch.full(want.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        run_windows(windows, case["offsets"], out, variant, rounded)
        rounded_wrong += not torch.equal(rounded.view(torch.int16), want.bfloat16().view(torch.int16))
        out.fill_(float("nan"))
        run_windows(windows, case["offsets"], out, variant)
        total_wrong += not torch.equal(out, want)
        rounded.fill_(float("nan"))
        run_windowed(windows, case["offsets"], rounded, nan_carries(*want.shape[1:]), variant)
        windowed_wrong += not torch.equal(rounded.view(torch.int16), want.bfloat16().view(torch.int16))
    return rounded_wrong, total_wrong, windowed_wrong


def main():
    rows = []
    for shape, (m, n) in SHAPES.items():
        for routing, counts in ROUTINGS.items():
            case = make_case(counts, m, n, seed=7)
            want = ops.fp8_expert_wgrad(*operands(case))
            for window in WINDOWS:
                windows = window_operands(case, window)
                caught = (shape, routing, window) == ("deepseek_v3_dw2", "one_expert_spans_windows", 1024)
                runs = RUNS_OF_THE_CAUGHT_CASE if caught else RUNS
                for variant in FP8_WGRAD_VARIANTS:
                    rows.append((shape, routing, window, variant, runs, *differing_runs(case, want, windows, variant, runs)))
    torch.cuda.synchronize()
    print(f"kernel failure record: {ops.last_failure()}")
    print("| shape | routing | window | mainloop | runs | accumulate form: bf16 differed | fp32 differed | "
          "windowed form: bf16 differed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    wrong = sum(sum(r[5:]) for r in rows)
    print(f"runs that differed: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
