"""The FP8 quantization kernels alone (csrc/quant/), each launch of the FP8 layer's step at a benchmark
shape, in GB/s of the bytes it must move (its input read once, its E4M3 output and scales written
once), beside the same run's device copy of as many bytes (torch's `copy_` of a bf16 tensor into
another: what HBM gives a streaming kernel here).

    python scripts/bench_quantize.py [--shapes deepseek_v3,qwen3_30b]

Per shape (T tokens, H, F, E experts, top-k; C = the schedule's rows, segments padded to 128):
    x rows            ops.fp8_quantize_rows of x (T, H): what a rank publishes
    dY rows           the same for dY
    d gate_up rows    (C, 2F)
    act rows, SwiGLU of gate_up  ops.fp8_quantize_swiglu of (C, 2F): the forward's act (C, F)
    dY columns        ops.fp8_quantize_columns of (C, H) bf16 rows: the fc2 weight gradient's operand
    act columns       (C, F)
    d gate_up columns (C, 2F)
    d gate_up and its rows, SwiGLU backward  ops.fp8_quantize_swiglu_backward of gate_up (C, 2F) and
                      d act (C, F): d gate_up in bf16 and quantized 1x128 along 2F in one launch (what
                      backward runs with FP8 weight gradients), beside
    the same, two launches  ops.swiglu_backward, then d gate_up rows (what it replaces)
    d gate_up's two copies, one pass  ops.fp8_quantize_swiglu_backward_copies of gate_up (C, 2F) and
                      d act (C, F): both E4M3 copies (1x128 along 2F and along C) and their scales, no
                      bf16 d gate_up (tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS), beside
    the same, SwiGLU backward then columns  ops.fp8_quantize_swiglu_backward, then d gate_up columns
                      (what backward runs without it)
    ... and act's columns, one pass  the same op with act_columns: act's column copy from the same
                      gate_up read (tuning.FP8_ACT_COLUMNS_IN_ONE_PASS), beside
    the one pass, then act columns  the op without it, then ops.fp8_quantize_swiglu_columns
    x columns, gathered  (C, H) rows gathered from x by the schedule (row_index): fc1's weight gradient
    w dY columns, gathered  (C, H) rows w * dY gathered from dY by the schedule with each row's route
                      weight (row_index, row_weights): fc2's weight gradient operand as backward makes
                      it, beside
    w dY pulled, then columns  ops.pull_grad_rows (bf16 rows), then dY columns (what it replaces)
    fc1 / fc2         ops.fp8_quantize_weight, forward copy (the cache's, once per weight version)
    fc1 / fc2 transposed  the dgrads' copy, from the bf16 weight (forward_copy=False)
    fc1 / fc2 moved   the same copy by ops.fp8_transpose_weight from the forward copy
    ..., for segments  the same with the schedule's expert_offsets (every expert has rows), and with
                      offsets where an eighth of the experts have rows (a receive window's at EP 8:
                      bytes counted for those experts only; the others' CTAs return at once)
Fresh random data (two sets, alternated), L2 flushed before each rep, medians of 10 after 3 warm-ups
(scripts/timing.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import SHAPES  # noqa: E402
from timing import median_ms_interleaved  # noqa: E402

from megatron_mok import ops  # noqa: E402
from megatron_mok.schedule import build_schedule_from_gathered  # noqa: E402

NUM_SETS = 2


def make_set(shape, seed):
    t, h, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=e, segment_alignment=128)
    rows = schedule.slot_to_route.shape[0]
    token_of_slot = torch.where(schedule.slot_to_route >= 0, schedule.slot_to_route // k, -1)

    def randn(*size):
        return torch.randn(*size, device="cuda", generator=gen).bfloat16()

    s = dict(x=randn(t, h), dy=randn(t, h), dgate_up=randn(rows, 2 * f), dy_rows=randn(rows, h), act=randn(rows, f),
             index=token_of_slot, offsets=schedule.expert_offsets, route=schedule.slot_to_route, topk=k,
             weights=torch.rand(t * k, device="cuda", generator=gen),
             fc1=(randn(e, 2 * f, h) / h**0.5).bfloat16(), fc2=(randn(e, h, f) / f**0.5).bfloat16())
    s["row_weights"] = s["weights"][s["route"].clamp(min=0)]
    for name in ("fc1", "fc2"):
        s[name + "_fp8"] = ops.fp8_quantize_weight(s[name], transposed=False)[:2]
    # Segments where only the first eighth of the experts (at least one) have rows.
    eighth = max(1, e // 8)
    s["eighth_offsets"] = torch.cat([torch.arange(eighth + 1, device="cuda", dtype=torch.int32) * 128,
                                     torch.full((e - eighth,), eighth * 128, device="cuda", dtype=torch.int32)])
    return s


def rows_bytes(r, c):  # bf16 in, e4m3 out, both scale layouts
    return r * c * 3 + 2 * r * (c // 128) * 4


def _two_launches(s):
    """What ops.fp8_quantize_swiglu_backward replaces: the SwiGLU backward kernel (bf16 d gate_up), then
    its row quantization (GEMM-A scales)."""
    grad_gate_up = ops.swiglu_backward(s["dgate_up"], s["act"], s["offsets"])
    return ops.fp8_quantize_rows(grad_gate_up, source_scales=False)


def _swiglu_backward_then_columns(s):
    """What ops.fp8_quantize_swiglu_backward_copies replaces: the SwiGLU backward with d gate_up's row
    copy (bf16 d gate_up written), then d gate_up's column copy (read back)."""
    grad_gate_up, rows_q, rows_scales = ops.fp8_quantize_swiglu_backward(s["dgate_up"], s["act"], s["offsets"])
    return rows_q, rows_scales, *ops.fp8_quantize_columns(grad_gate_up, s["offsets"])


def _pulled_then_columns(s):
    """What the weighted gathered columns replace: the weighted pull of bf16 w * dY rows, then their
    column quantization."""
    rows = ops.pull_grad_rows(s["dy"], s["weights"], s["route"], s["topk"], s["offsets"])
    return ops.fp8_quantize_columns(rows, s["offsets"])


def cases(s):
    """name -> (function of a set, bytes moved)."""
    t, h = s["x"].shape
    rows, f2 = s["dgate_up"].shape
    e, _, _ = s["fc1"].shape
    cols = lambda r, c: r * c * 3 + (r // 128 + 1) * c * 4  # noqa: E731
    weight = lambda w: w.numel() * 3 + w.numel() // 128**2 * 4  # noqa: E731
    moved = lambda w: w.numel() * 2 + w.numel() // 128**2 * 8  # noqa: E731
    swiglu_backward_bytes = rows * f2 * 3 + rows * f2 * 3 + rows * (f2 // 128) * 4
    # (gate_up (2 bytes a value) and d act (1 a gate_up column) in; two E4M3 copies and their scales out)
    copies_bytes = rows * f2 * 3 + rows * f2 * 2 + rows * (f2 // 128) * 4 + (rows // 128 + 1) * f2 * 4
    act_columns_bytes = rows * f2 // 2 + (rows // 128 + 1) * (f2 // 2) * 4  # act's E4M3 copy and scales out
    return {
        "x rows": (lambda s: ops.fp8_quantize_rows(s["x"]), rows_bytes(t, h)),
        "dY rows": (lambda s: ops.fp8_quantize_rows(s["dy"]), rows_bytes(t, h)),
        "d gate_up rows": (lambda s: ops.fp8_quantize_rows(s["dgate_up"]), rows_bytes(rows, f2)),
        # (gate_up's bf16 in, act's E4M3 out and its GEMM-A scales)
        "act rows, SwiGLU of gate_up": (lambda s: ops.fp8_quantize_swiglu(s["dgate_up"], s["offsets"]),
                                        rows * f2 * 2 + rows * f2 // 2 + rows * (f2 // 256) * 4),
        "dY columns": (lambda s: ops.fp8_quantize_columns(s["dy_rows"], s["offsets"]), cols(rows, h)),
        "act columns": (lambda s: ops.fp8_quantize_columns(s["act"], s["offsets"]), cols(rows, f2 // 2)),
        "d gate_up columns": (lambda s: ops.fp8_quantize_columns(s["dgate_up"], s["offsets"]), cols(rows, f2)),
        # (gate_up and d act in; d gate_up in bf16 and E4M3 out, with the scales. The two launches are
        # given the same bytes, the work's: their GB/s is the one launch's for the same result.)
        "d gate_up and its rows, SwiGLU backward": (
            lambda s: ops.fp8_quantize_swiglu_backward(s["dgate_up"], s["act"], s["offsets"]), swiglu_backward_bytes),
        "the same, two launches": (lambda s: _two_launches(s), swiglu_backward_bytes),
        # (gate_up and d act in; both E4M3 copies and their scales out. The two launches are given the
        # same bytes, the work's.)
        "d gate_up's two copies, one pass": (
            lambda s: ops.fp8_quantize_swiglu_backward_copies(s["dgate_up"], s["act"], s["offsets"]), copies_bytes),
        "the same, SwiGLU backward then columns": (_swiglu_backward_then_columns, copies_bytes),
        # (and act's column copy out too, gate_up read once; the pair is given the same bytes)
        "... and act's columns, one pass": (
            lambda s: ops.fp8_quantize_swiglu_backward_copies(s["dgate_up"], s["act"], s["offsets"], act_columns=True),
            copies_bytes + act_columns_bytes),
        "the one pass, then act columns": (
            lambda s: (ops.fp8_quantize_swiglu_backward_copies(s["dgate_up"], s["act"], s["offsets"]),
                       ops.fp8_quantize_swiglu_columns(s["dgate_up"], s["offsets"])),
            copies_bytes + act_columns_bytes),
        "x columns, gathered": (lambda s: ops.fp8_quantize_columns(s["x"], s["offsets"], row_index=s["index"]),
                                cols(rows, h)),
        # (The two rows are given the same bytes, the work's: dY rows gathered, E4M3 and scales out.)
        "w dY columns, gathered": (lambda s: ops.fp8_quantize_columns(
            s["dy"], s["offsets"], row_index=s["index"], row_weights=s["row_weights"]), cols(rows, h)),
        "w dY pulled, then columns": (_pulled_then_columns, cols(rows, h)),
        "fc1": (lambda s: ops.fp8_quantize_weight(s["fc1"], transposed=False), weight(s["fc1"])),
        "fc2": (lambda s: ops.fp8_quantize_weight(s["fc2"], transposed=False), weight(s["fc2"])),
        "fc1 transposed": (lambda s: ops.fp8_quantize_weight(s["fc1"], forward_copy=False), weight(s["fc1"])),
        "fc2 transposed": (lambda s: ops.fp8_quantize_weight(s["fc2"], forward_copy=False), weight(s["fc2"])),
        "fc1 moved": (lambda s: ops.fp8_transpose_weight(*s["fc1_fp8"]), moved(s["fc1"])),
        "fc2 moved": (lambda s: ops.fp8_transpose_weight(*s["fc2_fp8"]), moved(s["fc2"])),
        # The same with expert_offsets (every expert has rows), and with offsets where an eighth of
        # the experts have rows (a receive window's at EP 8).
        "fc1 moved, for segments": (lambda s: ops.fp8_transpose_weight(*s["fc1_fp8"], s["offsets"]), moved(s["fc1"])),
        "fc2 moved, for segments": (lambda s: ops.fp8_transpose_weight(*s["fc2_fp8"], s["offsets"]), moved(s["fc2"])),
        "fc1 moved, an eighth's segments": (lambda s: ops.fp8_transpose_weight(*s["fc1_fp8"], s["eighth_offsets"]),
                                            moved(s["fc1"]) // 8),
        "fc1 transposed, an eighth's segments": (
            lambda s: ops.fp8_quantize_weight(s["fc1"], forward_copy=False, expert_offsets=s["eighth_offsets"]),
            weight(s["fc1"]) // 8),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek_v3,qwen3_30b")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        sets = [make_set(shape, seed) for seed in range(NUM_SETS)]
        table = cases(sets[0])
        # The baseline: a bf16 device copy of about the bytes of the largest case (read + write).
        largest = max(nbytes for _, nbytes in table.values())
        for s in sets:
            s["copy_src"] = torch.randn(largest // 4, device="cuda").bfloat16()
            s["copy_dst"] = torch.empty_like(s["copy_src"])
        fns = {case: fn for case, (fn, _) in table.items()}
        fns["copy (baseline)"] = lambda s: s["copy_dst"].copy_(s["copy_src"])
        ms = median_ms_interleaved(fns, sets)
        copy_gbs = largest / ms["copy (baseline)"] / 1e6
        print(f"\n{name} (T, H, F, E, K = {shape}); baseline: bf16 copy of {largest / 1e9:.2f} GB, {copy_gbs:.0f} GB/s")
        print(f"| launch | us | GB moved | GB/s | of the copy's |\n| --- | ---: | ---: | ---: | ---: |")
        for case, (_, nbytes) in table.items():
            gbs = nbytes / ms[case] / 1e6
            print(f"| {case} | {ms[case] * 1e3:.1f} | {nbytes / 1e9:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} |")


if __name__ == "__main__":
    main()
