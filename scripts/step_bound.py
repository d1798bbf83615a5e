"""What the FP8 layer's forward + backward can reach as it is built: each GEMM at a given FP8 rate,
each quantization pass moving its bytes at a given copy bandwidth, the other launches as measured, no
idle time. Arithmetic only (no GPU): the rates come from measurements (docs/performance.md).

    python3 scripts/step_bound.py [--gemm-tflops 1094] [--copy-gbs 3010] [--bf16-ms deepseek_v3=32.31,...]
                                  [--other-ms deepseek_v3=1.76,...] [--one-pass-copies [--act-in-pass]]

Per shape (T tokens, H, F, E experts, top-k; R = T*K routed rows, C = R + 64 E, the segments'
average padding to 128 rows):
    GEMMs      forward, dgrad and weight gradient of fc1 (2F x H) and fc2 (H x F): 3 * 6 * R * F * H
               FLOP at --gemm-tflops (cuBLASLt's FP8 blockwise GEMM at the H100's power cap: 1094)
    passes     the bytes each quantization launch of the step must read and write once (bf16 in,
               E4M3 and fp32 scales out), at --copy-gbs (a bf16 device copy on the H100: 3010):
               x and dY rows (T, H); act rows from gate_up (C, 2F); the SwiGLU backward (gate_up and
               d act in, d gate_up bf16 and E4M3 out); the column-wise operands of the weight
               gradients (d gate_up, act from gate_up, x and w dY gathered); the weights' forward
               copies and their transposed copies (once per weight version). --one-pass-copies: d
               gate_up's two copies from the SwiGLU backward's one pass
               (tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS: no bf16 d gate_up written, nor read for
               its column copy); --act-in-pass: act's column copy from that pass too
               (tuning.FP8_ACT_COLUMNS_IN_ONE_PASS: gate_up not read a second time for it)
    other      combine, dispatch and the rest, as the kernel profile measured them (--other-ms)
The bound is their sum; "cached" leaves out the weight copies (a later microbatch with
MoKConfig.fp8_cache_transposed_weights); the ratio is our BF16 kernel's measured time over it.
"""

from __future__ import annotations

import argparse

SHAPES = {
    # name: (tokens, hidden, ffn, experts, topk), bench_layer.py's
    "deepseek_v3": (8192, 7168, 2048, 32, 8),
    "qwen3_30b": (16384, 2048, 768, 128, 8),
}


def pass_bytes(t: int, h: int, f: int, e: int, k: int, one_pass_copies: bool = False,
               act_in_pass: bool = False) -> dict[str, int]:
    """The bytes each quantization launch of one forward + backward moves at least."""
    c = t * k + 64 * e
    scales = lambda n, cols: n * (cols // 128) * 4  # noqa: E731
    grad_gate_up_in = c * 2 * f * 2 + c * f * 2  # gate_up and d act, bf16
    if one_pass_copies:  # both E4M3 copies out, nothing else
        swiglu_backward = grad_gate_up_in + 2 * c * 2 * f + scales(c, 2 * f) * 2
        grad_gate_up_columns = 0
    else:  # d gate_up bf16 and its row copy out; the column copy reads the bf16 values back
        swiglu_backward = grad_gate_up_in + c * 2 * f * 3 + scales(c, 2 * f)
        grad_gate_up_columns = c * 2 * f * 3
    act_columns = c * 2 * f * 2 + c * f  # gate_up read again, act's E4M3 copy written
    if one_pass_copies and act_in_pass:  # only act's copy, written by the SwiGLU backward's pass
        swiglu_backward, act_columns = swiglu_backward + c * f, 0
    return {
        "x and dY rows": 2 * (t * h * 3 + scales(t, h)),
        "act rows": c * 2 * f * 2 + c * f + scales(c, f),
        "SwiGLU backward": swiglu_backward,
        "columns": grad_gate_up_columns + act_columns + 2 * c * h * 3,
        "weights": e * 3 * f * h * 3,
        "transposed weights": e * 3 * f * h * 2,
    }


def parse_pairs(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (pair.split("=") for pair in text.split(",") if pair)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm-tflops", type=float, default=1094.0)
    parser.add_argument("--copy-gbs", type=float, default=3010.0)
    parser.add_argument("--bf16-ms", default="deepseek_v3=32.31,qwen3_30b=9.17")
    parser.add_argument("--other-ms", default="deepseek_v3=1.76,qwen3_30b=1.08")
    parser.add_argument("--one-pass-copies", action="store_true",
                        help="d gate_up's two FP8 copies from the SwiGLU backward's one pass")
    parser.add_argument("--act-in-pass", action="store_true",
                        help="with --one-pass-copies: act's column copy from that pass too")
    args = parser.parse_args()
    bf16, other = parse_pairs(args.bf16_ms), parse_pairs(args.other_ms)
    print(f"GEMMs at {args.gemm_tflops:.0f} TFLOP/s, passes at {args.copy_gbs:.0f} GB/s; ms")
    print("| shape | GEMMs | passes (weights) | other | bound | BF16 / bound | cached bound | BF16 / it |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (t, h, f, e, k) in SHAPES.items():
        gemms = 3 * 6 * t * k * f * h / (args.gemm_tflops * 1e12) * 1e3
        passes = {what: nbytes / (args.copy_gbs * 1e9) * 1e3 for what, nbytes in pass_bytes(t, h, f, e, k, args.one_pass_copies, args.act_in_pass).items()}
        weights = passes["weights"] + passes["transposed weights"]
        bound = gemms + sum(passes.values()) + other[name]
        cached = bound - weights
        print(f"| {name} | {gemms:.2f} | {sum(passes.values()):.2f} ({weights:.2f}) | {other[name]:.2f} | "
              f"{bound:.2f} | {bf16[name] / bound:.2f}x | {cached:.2f} | {bf16[name] / cached:.2f}x |")


if __name__ == "__main__":
    main()
