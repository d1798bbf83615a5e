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

    python3 scripts/bench_expert_gemm.py --fp8 [--shapes ...] [--fp8-clusters 1,2] [--fp8-variants default,overlap]
        [--fp8-group-m 16]

prints the FP8 blockwise grouped GEMM (ops.fp8_expert_gemm) instead, per projection out = a . w_e^T
with segments padded to 128 rows (the FP8 recipe's schedule): fc1 (N 2F, K H), fc2 (N H, K F), and
the dgrads dgrad_fc2 (d act: N F, K H) and dgrad_fc1 (d rows: N H, K 2F) through the transposed
weight copies; fc1+swiglu is fc1 with SwiGLU (ours: ops.fp8_expert_gemm_swiglu, act quantized 1x128
in the epilogue). Columns, one interleaved run on the same inputs: torch's bf16 grouped_mm, our bf16
sm90 kernel (K-major weights), torch._scaled_grouped_mm with FP8 rowwise scales (one scale per row
of a and per output column of w_e, no promotion: torch has no grouped blockwise FP8 on sm90), and
ours per mainloop variant (ops.fp8_gemm.FP8_GEMM_VARIANTS; fc1+swiglu: FP8_SWIGLU_GEMM_VARIANTS), cluster
size and raster group (g<group_m> in the column name when several are given). Quantization is done
before timing for every FP8 column (GEMMs only).
A second table, the FP8 weight gradients (ops.fp8_expert_wgrad, both operands quantized 1x128 along
tokens): wgrad_fc1 (d fc1 (2F, H) = d gate_up^T . rows) and wgrad_fc2 (d fc2 (H, F) = dY^T . act),
beside torch's bf16 grouped_mm (offsets on K), our bf16 sm90 wgrad kernel (bf16 out) and, where torch
has it, torch._scaled_grouped_mm k-grouped with rowwise scales; ours per mainloop
(ops.fp8_wgrad.FP8_WGRAD_VARIANTS) writing the bf16 gradient (`rounded`: one window, as the layer runs
it), the launched one accumulating into an fp32 out (`fp8 acc`: a later receive window's accumulate
form, out read and written), and the whole pass over 8 receive windows of whole blocks: `windowed 8`,
the windowed form the layer runs (each expert rounded by the window that ends it, one (m, n) carry
between windows), and `acc form 8`, the accumulate form (the first window writing an fp32 total of
every expert, the others adding to it, the last rounding all of it). TFLOP/s count the routed rows only (2 * t * topk * N * K), as for the GEMMs.

    python3 scripts/bench_expert_gemm.py --fp8-quant [--shapes ...]

prints the FP8 quantization kernels (ops.fp8_quantize_rows / _columns / _weight) beside the same
functions of megatron_mok/quantization.py run by torch on the GPU, in one interleaved run on the same
inputs: rows of x (T, H), the dispatch's gather of x into the schedule's rows (segments padded to 128,
-1 rows zero), act (R, F) 1x128 along F; the weight-gradient operands (act, the dispatched rows, dY,
d gate_up) 1x128 along tokens up to the schedule's end; fc1 and fc2 128x128 with their transposed
copies. GB/s counts the bytes the op must move once: every input element read once (a gathered row
once per output row; the columns' rows up to the schedule's end) and every output byte written once,
scales included; L2 is flushed before each
rep (timing.py), so this is HBM traffic over time. The H200's HBM3e peaks at 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import dense_gemm_tflops, median_ms_interleaved  # noqa: E402

from megatron_mok import MoKConfig, build_schedule, ops, quantization  # noqa: E402
from megatron_mok.backends import tuning  # noqa: E402
from megatron_mok.ops.fp8_gemm import FP8_GEMM_VARIANTS, FP8_SWIGLU_GEMM_VARIANTS  # noqa: E402
from megatron_mok.ops.fp8_wgrad import FP8_WGRAD_VARIANTS  # noqa: E402
from megatron_mok.schedule import build_schedule_from_gathered  # noqa: E402
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
    # One expert, every token routed to it: fc1 is the dense 8192^3 GEMM, where torch has FP8 blockwise
    # (torch fp8 bw column), so our mainloop is compared with cuBLASLt's blockwise one without grouping.
    "dense_8192": (8192, 8192, 4096, 1, 1),
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


# The FP8 projections: (a's name, w's name, routed flops per (t * topk) row as a function of h, f).
FP8_PROJECTIONS = {
    "fc1": ("rows", "fc1", lambda h, f: 2 * 2 * f * h),
    "fc2": ("act", "fc2", lambda h, f: 2 * h * f),
    "dgrad_fc2": ("grad_out", "fc2_t", lambda h, f: 2 * f * h),
    "dgrad_fc1": ("gate_up", "fc1_t", lambda h, f: 2 * h * 2 * f),
    # fc1 with SwiGLU after it: ours in the epilogue, act quantized 1x128 (ops.fp8_expert_gemm_swiglu);
    # the bf16 columns with SwiGLU (torch: its grouped_mm + the SwiGLU kernel; ours: in the epilogue);
    # torch's FP8 rowwise + the SwiGLU kernel, act left in bf16.
    "fc1+swiglu": ("rows", "fc1", lambda h, f: 2 * 2 * f * h),
}


# The FP8 weight gradients: (grad's name, inputs' name, routed flops per (t * topk) row as a function of
# h, f); out[e] (N, K) = grad[e]^T . inputs[e] over the expert's rows.
FP8_WGRAD_PROJECTIONS = {
    "wgrad_fc1": ("gate_up", "rows", lambda h, f: 2 * 2 * f * h),
    "wgrad_fc2": ("grad_out", "act", lambda h, f: 2 * h * f),
}


def make_fp8_inputs(shape, seed, columnwise=False):
    """Operands of the FP8 projections: a schedule padded to 128 rows per segment, bf16 rows with zero
    padding rows, weights (E, N, K) bf16 contiguous (the dgrads' transposed), and every operand
    quantized as the recipe does (blockwise for ours, rowwise for torch's); columnwise: also the
    weight gradients' column-wise operands."""
    t, h, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=e, segment_alignment=128)
    rows = schedule.slot_to_route.shape[0]
    padding = (schedule.slot_to_route < 0).unsqueeze(1)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16()
    s = dict(offsets=schedule.expert_offsets, fc1=fc1, fc2=fc2,
             fc1_t=fc1.transpose(1, 2).contiguous(), fc2_t=fc2.transpose(1, 2).contiguous())
    for name, cols in (("rows", h), ("act", f), ("grad_out", h), ("gate_up", 2 * f)):
        s[name] = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16().masked_fill(padding, 0)
    for name in ("rows", "act", "grad_out", "gate_up"):
        q, scales = quantization.quantize_rowwise(s[name])
        s[name + "_fp8"] = (q, quantization.gemm_a_scales(scales))
        s[name + "_row_scales"] = scales
        amax = s[name].float().abs().amax(dim=1).clamp(min=1e-12)
        s[name + "_rowwise"] = ((s[name].float() * (448 / amax)[:, None]).to(torch.float8_e4m3fn), amax / 448)
    for name in ("fc1", "fc2"):
        q, scales = quantization.quantize_weight(s[name])
        s[name + "_fp8"] = (q, scales)
        s[name + "_t_fp8"] = quantization.transpose_weight(q, scales)
    for name in ("fc1", "fc2", "fc1_t", "fc2_t"):
        amax = s[name].float().abs().amax(dim=2).clamp(min=1e-12)  # (E, N)
        s[name + "_rowwise"] = ((s[name].float() * (448 / amax)[:, :, None]).to(torch.float8_e4m3fn), amax / 448)
    # The weight gradients' operands, column-wise (1x128 along tokens): the rows padded with zero rows to
    # a multiple of 128 (past the last segment: no expert reads them).
    padded = -(-rows // 128) * 128
    for name in ("rows", "act", "grad_out", "gate_up") if columnwise else ():
        s[name + "_col"] = quantization.quantize_columnwise(torch.nn.functional.pad(s[name], (0, 0, 0, padded - rows)))
    return s


def torch_fp8_rowwise(s, a_name, w_name):
    qa, sa = s[a_name + "_rowwise"]
    qw, sw = s[w_name + "_rowwise"]
    return torch._scaled_grouped_mm(qa, qw.transpose(1, 2), sa, sw, offs=s["offsets"][1:], out_dtype=torch.bfloat16)


def torch_fp8_blockwise_ready(input_sets, a_name, w_name) -> bool:
    """Whether torch's dense FP8 blockwise GEMM runs on these operands: finds its scale layouts for
    each input set (torch_fp8_blockwise_dense, outside any timing), or prints why it cannot."""
    try:
        for s in input_sets:
            torch_fp8_blockwise_dense(s, a_name, w_name)
    except (ImportError, RuntimeError) as error:
        print(f"torch FP8 blockwise unavailable: {str(error)[:1200]}")
        return False
    return True


def torch_fp8_blockwise_dense(s, a_name, w_name):
    """torch.nn.functional.scaled_mm with 1x128 blocks for a and 128x128 for w on the one expert's operands
    (dense: torch has no grouped blockwise FP8 on sm90). The scale layouts torch takes are found once, by
    checking each candidate's output against ours (relative error under 1e-2), outside the timed calls."""
    from torch.nn.functional import ScalingType, scaled_mm

    key = ("torch fp8 bw", a_name, w_name)
    if key not in s:
        rows = int(s["offsets"][-1])  # the expert's rows (the schedule's capacity holds padding past them)
        qa = s[a_name + "_fp8"][0][:rows]
        qw, w_scales = s[w_name + "_fp8"]
        a_scales = s[a_name + "_row_scales"][:rows]  # (M, K / 128) fp32
        expected = ops.fp8_expert_gemm(*s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], 1,
                                       tuning.FP8_EXPERT_GEMM_GROUP_M)[:rows].float()
        mat_b = qw[0].t()  # (K, N), column-major
        chosen, tried = None, []
        for sa in (a_scales.t().contiguous().t(), a_scales):
            for sb in (w_scales[0].t(), w_scales[0], w_scales[0].t().contiguous(), w_scales[0].t().contiguous().t()):
                try:
                    out = scaled_mm(qa, mat_b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                                    output_dtype=torch.bfloat16)
                except (RuntimeError, ValueError, TypeError) as error:
                    tried.append(f"{tuple(sa.stride())} {tuple(sb.shape)}{tuple(sb.stride())}: {str(error)[:160]}")
                    continue
                relative = ((out.float() - expected).norm() / expected.norm()).item()
                if relative < 1e-2:
                    chosen = (qa, mat_b, sa, sb)
                    break
                tried.append(f"{tuple(sa.stride())} {tuple(sb.shape)}{tuple(sb.stride())}: relative error {relative:.3g}")
            if chosen:
                break
        s[key] = chosen if chosen else "; ".join(tried)
    if not isinstance(s[key], tuple):
        raise RuntimeError(f"no scale layout of torch's FP8 blockwise scaled_mm matches ours: {s[key]}")
    qa, mat_b, sa, sb = s[key]
    return scaled_mm(qa, mat_b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                     output_dtype=torch.bfloat16)


def fp8_column(variant: str, cluster_m: int, group_m: int | None = None) -> str:
    name = f"fp8 c{cluster_m}" if variant == "default" else f"fp8 {variant} c{cluster_m}"
    return name if group_m is None else f"{name}g{group_m}"


def torch_fp8_rowwise_wgrad(s, grad_name, inputs_name):
    """torch._scaled_grouped_mm k-grouped (2-D x 2-D, the offsets on K) on the column-wise E4M3 data with
    unit rowwise scales: its time, not a result (torch has no blockwise scales here)."""
    qg, _ = s[grad_name + "_col"]
    qx, _ = s[inputs_name + "_col"]
    key = (grad_name, inputs_name, "unit rowwise scales")
    if key not in s:  # made once, outside the timed calls
        experts = s["offsets"].shape[0] - 1
        s[key] = (torch.ones(experts * qg.shape[0], device="cuda"), torch.ones(experts * qx.shape[0], device="cuda"))
    scale_g, scale_x = s[key]
    return torch._scaled_grouped_mm(qg, qx.t(), scale_g, scale_x, offs=s["offsets"][1:], out_dtype=torch.bfloat16)


WGRAD_ACCUMULATE_VARIANT = tuning.FP8_WGRAD_VARIANT
WGRAD_WINDOWS = 8
WGRAD_COLUMNS = ("torch bf16", "ours bf16", "torch fp8 rw", *(f"fp8 {v}" for v in FP8_WGRAD_VARIANTS), "fp8 acc",
                 f"windowed {WGRAD_WINDOWS}", f"acc form {WGRAD_WINDOWS}")


def wgrad_windows(s, grad_name, inputs_name):
    """The column-wise operands cut into WGRAD_WINDOWS receive windows of whole 128-row blocks, each
    (window_begin, qg, sg, qx, sx) contiguous as a window's caller holds them; made once, outside the
    timed calls."""
    key = (grad_name, inputs_name, "windows")
    if key not in s:
        (qg, sg), (qx, sx) = s[grad_name + "_col"], s[inputs_name + "_col"]
        rows = qg.shape[1]
        size = -(-rows // (WGRAD_WINDOWS * 128)) * 128
        s[key] = [(b, qg[:, b:b + size].contiguous(), sg[b // 128:(b + size) // 128], qx[:, b:b + size].contiguous(),
                   sx[b // 128:(b + size) // 128]) for b in range(0, rows, size)]
    return s[key]


def wgrad_table(name, shape, sets, labels) -> None:
    """The FP8 weight gradients' rows of one shape (module doc)."""
    t, h, f, e, k = shape
    for label in labels:
        grad_name, inputs_name, flops_per_row = FP8_WGRAD_PROJECTIONS[label]
        flops = t * k * flops_per_row(h, f)
        for s in sets:
            size = (e, s[grad_name].shape[1], s[inputs_name].shape[1])
            s["wgrad_out"] = torch.zeros(size, device="cuda")
            s["wgrad_rounded"] = torch.empty(size, dtype=torch.bfloat16, device="cuda")
            s["wgrad_carries"] = [torch.empty(size[1:], device="cuda") for _ in range(2)]

        def fp8(s, variant, accumulate=False):
            operands = (*s[grad_name + "_col"], *s[inputs_name + "_col"], s["offsets"])
            if accumulate:
                return ops.fp8_expert_wgrad(*operands, s["wgrad_out"], accumulate=True, variant=variant)
            return ops.fp8_expert_wgrad(*operands, rounded=s["wgrad_rounded"], variant=variant)

        def fp8_windows(s, windowed):
            windows = wgrad_windows(s, grad_name, inputs_name)
            carries = s["wgrad_carries"]
            for w, (begin, *operands) in enumerate(windows):
                last = w == len(windows) - 1
                if windowed:
                    ops.fp8_expert_wgrad(*operands, s["offsets"], window_begin=begin, rounded=s["wgrad_rounded"],
                                         carry=(carries[w % 2], carries[(w + 1) % 2]), variant=WGRAD_ACCUMULATE_VARIANT)
                else:
                    ops.fp8_expert_wgrad(*operands, s["offsets"], s["wgrad_out"], accumulate=w > 0, window_begin=begin,
                                         rounded=s["wgrad_rounded"] if last else None, variant=WGRAD_ACCUMULATE_VARIANT)
            return s["wgrad_rounded"]

        fns = {
            "torch bf16": lambda s: segment_weight_grad(s[grad_name], s[inputs_name], s["offsets"]),
            "ours bf16": lambda s: ops.expert_gemm_wgrad(s[grad_name], s[inputs_name], s["offsets"]),
            "torch fp8 rw": lambda s: torch_fp8_rowwise_wgrad(s, grad_name, inputs_name),
            **{f"fp8 {v}": (lambda s, v=v: fp8(s, v)) for v in FP8_WGRAD_VARIANTS},
            "fp8 acc": lambda s: fp8(s, WGRAD_ACCUMULATE_VARIANT, accumulate=True),
            f"windowed {WGRAD_WINDOWS}": lambda s: fp8_windows(s, windowed=True),
            f"acc form {WGRAD_WINDOWS}": lambda s: fp8_windows(s, windowed=False),
        }
        try:
            torch_fp8_rowwise_wgrad(sets[0], grad_name, inputs_name)
        except (RuntimeError, NotImplementedError, TypeError) as error:  # no k-grouped FP8 rowwise in this build
            print(f"torch._scaled_grouped_mm k-grouped unavailable: {str(error).splitlines()[0]}")
            del fns["torch fp8 rw"]
        ms_by = median_ms_interleaved(fns, sets)
        cell = {n: f"{flops / ms / 1e9:7.0f} ({ms:6.3f})" for n, ms in ms_by.items()}
        best = min(ms_by[f"fp8 {v}"] for v in FP8_WGRAD_VARIANTS)
        ratio = f"{ms_by['ours bf16'] / best:5.2f}"
        cols = " ".join(f"{cell.get(n, 'n/a'):>16}" for n in WGRAD_COLUMNS)
        print(f"{name:<16} {label:<10} {cols} {ratio}", flush=True)
        for s in sets:
            s.pop("wgrad_out", None)
            s.pop("wgrad_rounded", None)
            s.pop("wgrad_carries", None)
            s.pop((grad_name, inputs_name, "windows"), None)


def main_fp8(args) -> None:
    clusters = [int(v) for v in args.fp8_clusters.split(",")]
    variants = args.fp8_variants.split(",")
    unknown = [v for v in variants if v not in FP8_GEMM_VARIANTS]
    if unknown:
        raise SystemExit(f"--fp8-variants: {unknown} not in {FP8_GEMM_VARIANTS}")
    groups = [int(g) for g in args.fp8_group_m.split(",")]
    # (variant, cluster_m, group_m, column name); a raster group is a multiple of the cluster size
    ours = [(v, c, g, fp8_column(v, c, g if len(groups) > 1 else None))
            for v in variants for c in clusters for g in groups if g % c == 0]
    dense = dense_gemm_tflops()
    print(f"device: {torch.cuda.get_device_name()}; dense bf16 GEMM 8192^3: {dense:.0f} TFLOP/s")
    labels = args.fp8_projections.split(",")
    gemm_labels = [label for label in labels if label in FP8_PROJECTIONS]
    wgrad_labels = [label for label in labels if label in FP8_WGRAD_PROJECTIONS]
    unknown = [label for label in labels if label not in gemm_labels + wgrad_labels]
    if unknown:
        raise SystemExit(f"--fp8-projections: unknown {unknown}; known: {[*FP8_PROJECTIONS, *FP8_WGRAD_PROJECTIONS]}")
    width = max([16] + [len(column) for *_, column in ours])
    header = " ".join(f"{column:>{width}}" for *_, column in ours)
    wgrad_header = " ".join(f"{c:>16}" for c in WGRAD_COLUMNS)
    for name in args.shapes.split(","):
        t, h, f, e, k = shape = SHAPES[name]
        sets = [make_fp8_inputs(shape, seed, columnwise=bool(wgrad_labels)) for seed in range(2)]
        if gemm_labels:
            print("TFLOP/s (ms); x: our fastest FP8 column over torch FP8 rowwise; segments padded to 128 rows; "
                  "group_m", args.fp8_group_m)
            print(f"{'shape':<16} {'projection':<10} {'torch bf16':>16} {'ours bf16':>16} {'torch fp8 rw':>16} "
                  f"{header} {'x':>5}")
        for label in gemm_labels:
            a_name, w_name, flops_per_row = FP8_PROJECTIONS[label]
            flops = t * k * flops_per_row(h, f)
            fns = {
                "torch bf16": lambda s: segment_matmul(s[a_name], s[w_name], s["offsets"]),
                "ours bf16": lambda s: ops.expert_gemm(s[a_name], s[w_name], s["offsets"], tuning.EXPERT_GEMM_CLUSTER_M,
                                                       tuning.EXPERT_GEMM_GROUP_M),
                "torch fp8 rw": lambda s: torch_fp8_rowwise(s, a_name, w_name),
            }
            try:
                torch_fp8_rowwise(sets[0], a_name, w_name)
            except (RuntimeError, NotImplementedError) as error:  # no grouped FP8 rowwise in this build
                print(f"torch._scaled_grouped_mm unavailable: {str(error).splitlines()[0]}")
                del fns["torch fp8 rw"]
            if e == 1 and label in ("fc1", "fc2") and torch_fp8_blockwise_ready(sets, a_name, w_name):
                fns["torch fp8 bw"] = lambda s: torch_fp8_blockwise_dense(s, a_name, w_name)
            fp8_op = ops.fp8_expert_gemm
            if label == "fc1+swiglu":
                fp8_op = ops.fp8_expert_gemm_swiglu
                fns["torch bf16"] = lambda s: grouped_mm_gate_up(s["rows"], s["fc1"], s["offsets"])
                fns["ours bf16"] = lambda s: ops.expert_gemm_swiglu(
                    s["rows"], s["fc1"], s["offsets"], tuning.EXPERT_GEMM_CLUSTER_M, tuning.EXPERT_GEMM_GROUP_M
                )
                if "torch fp8 rw" in fns:
                    fns["torch fp8 rw"] = lambda s: ops.swiglu_forward(torch_fp8_rowwise(s, "rows", "fc1"), s["offsets"])
            for v, c, g, column in ours:
                if label == "fc1+swiglu" and v not in FP8_SWIGLU_GEMM_VARIANTS:
                    continue  # (no pingpong instance of the SwiGLU epilogue)
                fns[column] = lambda s, c=c, g=g, op=fp8_op, v=v: op(
                    *s[a_name + "_fp8"], *s[w_name + "_fp8"], s["offsets"], c, g, variant=v
                )
            ms_by = median_ms_interleaved(fns, sets)
            cell = {n: f"{flops / ms / 1e9:7.0f} ({ms:6.3f})" for n, ms in ms_by.items()}
            best = min((ms for n, ms in ms_by.items() if n.startswith("fp8 ")), default=None)
            ratio = f"{ms_by['torch fp8 rw'] / best:5.2f}" if "torch fp8 rw" in ms_by and best else "  n/a"
            cols = " ".join(f"{cell.get(n, 'n/a'):>16}" for n in ["torch bf16", "ours bf16", "torch fp8 rw"])
            fp8_cols = " ".join(f"{cell.get(column, 'n/a'):>{width}}" for *_, column in ours)
            print(f"{name:<16} {label:<10} {cols} {fp8_cols} {ratio}", flush=True)
            if "torch fp8 bw" in cell:
                print(f"{name:<16} {label:<10} torch FP8 blockwise (dense scaled_mm): {cell['torch fp8 bw']}", flush=True)
        if wgrad_labels:
            print("weight gradients, bf16 out; TFLOP/s (ms); x: ours bf16 over our fastest FP8 mainloop; "
                  f"fp8 acc: {WGRAD_ACCUMULATE_VARIANT}, accumulating into an fp32 out (a later receive window); "
                  f"windowed / acc form {WGRAD_WINDOWS}: the whole pass in {WGRAD_WINDOWS} windows, windowed form / "
                  "accumulate form")
            print(f"{'shape':<16} {'projection':<10} {wgrad_header} {'x':>5}")
            wgrad_table(name, shape, sets, wgrad_labels)
        del sets
        torch.cuda.empty_cache()


def torch_gather(x, index):
    """x[index] with zero rows for -1, without a host synchronization (the reference's mask indexing has one)."""
    return x.index_select(0, index.clamp(min=0)).masked_fill((index < 0).unsqueeze(1), 0)


def torch_columns(x, offsets):
    """quantization.quantize_columnwise of x with rows at or past offsets[-1] zeroed and padded to 128."""
    rows = x.shape[0]
    padded = -(-rows // 128) * 128
    kept = torch.arange(rows, device=x.device).unsqueeze(1) < offsets[-1]
    x = torch.cat([torch.where(kept, x, torch.zeros_like(x)), x.new_zeros(padded - rows, x.shape[1])])
    return quantization.quantize_columnwise(x)


def main_fp8_quant(args) -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    print("ms and GB/s (bytes moved once / time); x: ours over torch (quantization.py on the GPU)")
    print(f"{'shape':<16} {'op':<34} {'MB moved':>9} {'torch ms':>9} {'GB/s':>7} {'ours ms':>9} {'GB/s':>7} {'x':>6}")
    for name in args.shapes.split(","):
        t, h, f, e, k = SHAPES[name]
        sets = []
        for seed in range(2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
            schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=e, segment_alignment=128)
            rows = schedule.slot_to_route.shape[0]

            def randn(*shape):
                return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

            sets.append(dict(
                x=randn(t, h), index=schedule.slot_to_route.div(k, rounding_mode="floor"),
                offsets=schedule.expert_offsets, act=randn(rows, f), rows=randn(rows, h), grad_out=randn(rows, h),
                gate_up=randn(rows, 2 * f), fc1=randn(e, 2 * f, h), fc2=randn(e, h, f),
            ))
        rows = sets[0]["index"].shape[0]
        r_pad = -(-rows // 128) * 128
        end = int(sets[0]["offsets"][-1])  # the columns read rows up to the schedule's end (outside the timing)

        def row_bytes(r, c, layouts=2):
            return r * c * 3 + layouts * 4 * r * c // 128

        cases = {
            f"rows x ({t}, {h})": (
                lambda s: quantization.gemm_a_scales(quantization.quantize_rowwise(s["x"])[1]),
                lambda s: ops.fp8_quantize_rows(s["x"]),
                row_bytes(t, h)),
            f"gather x -> rows ({rows}, {h})": (
                lambda s: quantization.gemm_a_scales(quantization.quantize_rowwise(torch_gather(s["x"], s["index"]))[1]),
                lambda s: ops.fp8_quantize_rows(s["x"], s["index"]),
                row_bytes(rows, h)),
            f"rows act ({rows}, {f})": (
                lambda s: quantization.gemm_a_scales(quantization.quantize_rowwise(s["act"])[1]),
                lambda s: ops.fp8_quantize_rows(s["act"], source_scales=False),
                row_bytes(rows, f, layouts=1)),
        }
        for label, c in (("act", f), ("rows", h), ("grad_out", h), ("gate_up", 2 * f)):
            cases[f"columns {label} ({rows}, {c})"] = (
                lambda s, label=label: torch_columns(s[label], s["offsets"]),
                lambda s, label=label: ops.fp8_quantize_columns(s[label], s["offsets"]),
                end * c * 2 + r_pad * c + 4 * r_pad * c // 128)
        for label, (n, kk) in (("fc1", (2 * f, h)), ("fc2", (h, f))):
            cases[f"weight {label} ({e}, {n}, {kk}) + transposed"] = (
                lambda s, label=label: quantization.transpose_weight(*quantization.quantize_weight(s[label])),
                lambda s, label=label: ops.fp8_quantize_weight(s[label]),
                e * n * kk * 4 + 2 * 4 * e * n * kk // (128 * 128))
        for label, (torch_fn, ours_fn, moved) in cases.items():
            ms = median_ms_interleaved({"torch": torch_fn, "ours": ours_fn}, sets)
            gbs = {key: moved / value / 1e6 for key, value in ms.items()}
            print(f"{name:<16} {label:<34} {moved / 1e6:9.1f} {ms['torch']:9.3f} {gbs['torch']:7.0f} {ms['ours']:9.3f} "
                  f"{gbs['ours']:7.0f} {ms['torch'] / ms['ours']:6.2f}", flush=True)
        del sets
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp8", action="store_true", help="the FP8 blockwise grouped GEMM table instead")
    parser.add_argument("--fp8-quant", action="store_true", help="the FP8 quantization kernels' table instead")
    parser.add_argument("--fp8-clusters", default="1,2")
    parser.add_argument("--fp8-group-m", default=str(tuning.FP8_EXPERT_GEMM_GROUP_M),
                        help="comma-separated raster group sizes of the FP8 GEMM")
    parser.add_argument("--fp8-variants", default="default",
                        help=f"comma-separated mainloop variants of the FP8 GEMM, of {','.join(FP8_GEMM_VARIANTS)}")
    parser.add_argument("--fp8-projections", default=",".join([*FP8_PROJECTIONS, *FP8_WGRAD_PROJECTIONS]))
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
    if args.fp8:
        main_fp8(args)
        return
    if args.fp8_quant:
        main_fp8_quant(args)
        return
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
