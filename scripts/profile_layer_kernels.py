"""Where a mok layer step spends its GPU time: every kernel of forward (and backward) by name,
from torch.profiler, beside the step's event-timed wall time (the difference is the GPU idling
between kernels, e.g. waiting for the CPU to launch them).

    python3 scripts/profile_layer_kernels.py [--shapes deepseek_v3,qwen3_30b] [--expert-gemm auto] [--backward] [--timeline]
        [--precision fp8_blockwise] [--exchange direct,symmetric] [--push-kernel] [--table-copy]
        [--tuning NAME=VALUE ...]

Each step's kernels are also summed by stage (STAGES: the quantization kernels of the FP8 recipe in
a stage of their own, so their share of the layer shows), each with its share of the kernels' time;
with FP8, each quantization launch of one step is listed on its own with its share. --exchange
symmetric runs the layer as one rank of megatron_mok.emulation over the in-kernel exchange (EP = 1:
the path of a real EP launch, its pulls, pushes and signals, without another rank's traffic);
several, comma-separated, profile each in turn. --push-kernel: FP8's rows pushed by the push kernel
after the GEMMs (tuning.FP8_PUSH_IN_EPILOGUE off). --table-copy: over the exchange, forward's route
table copied out of the combine region before the combine reads it, instead of kept by the combine
as it reads (functional._combine_keeping_table). --tuning: a backends.tuning setting for the whole run,
e.g. FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS=True (the value a Python literal; a name tuning lacks, or a
value of another type than tuning's, is an error naming it).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, make_inputs  # noqa: E402
from timing import median_ms  # noqa: E402

from megatron_mok import MoKConfig, mok_moe  # noqa: E402
from megatron_mok.emulation import EmulatedGroup  # noqa: E402

STEPS = 5


def apply_tuning(settings: list[str]) -> None:
    """Each NAME=VALUE set on backends.tuning before the first call (the FP8 stage table is made at the
    first call per setting): VALUE a Python literal of the type tuning's own value has."""
    import ast

    from megatron_mok.backends import tuning

    for setting in settings:
        name, _, text = setting.partition("=")
        if not name.isupper() or not hasattr(tuning, name):
            raise SystemExit(f"--tuning {setting!r}: backends.tuning has no setting {name!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--tuning {setting!r}: {text!r} is not a Python literal") from None
        if type(value) is not type(getattr(tuning, name)):
            raise SystemExit(f"--tuning {setting!r}: {name} is {type(getattr(tuning, name)).__name__}, "
                             f"got {type(value).__name__}")
        setattr(tuning, name, value)

# (stage, substrings of a kernel's name, lower case): the first stage whose substring a kernel's name
# holds; every other kernel (torch's elementwise ops, copies, fills) is "other".
STAGES = (
    ("quantize (FP8)", ("quantize_", "transpose_weight")),  # (the weights' transposed FP8 copies too)
    ("schedule", ("count_routes", "place_routes", "invert_slots")),
    ("grouped GEMMs", ("gemm", "wgrad", "cutlass", "sm90_xmma", "nvjet")),
    ("dispatch / pull", ("scatter_rows", "fill_unscattered", "gather", "dispatch", "pull")),
    ("SwiGLU", ("swiglu",)),
    ("combine / push", ("combine", "push_rows", "route_weight_grads")),
    ("exchange signals", ("exchange_",)),
)


def stage_of(kernel: str) -> str:
    name = kernel.lower()
    return next((stage for stage, keys in STAGES if any(key in name for key in keys)), "other")


def stage_table(rows: list[tuple[str, int, float]]) -> list[tuple[str, float, float]]:
    """(stage, GPU microseconds per step, share of the kernels' time) from kernel_table's rows."""
    totals: dict[str, float] = collections.defaultdict(float)
    for kernel, _, us in rows:
        totals[stage_of(kernel)] += us
    whole = sum(totals.values()) or 1.0
    return sorted(((stage, us, us / whole) for stage, us in totals.items()), key=lambda r: -r[1])


def kernel_table(step, steps: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches per step, GPU microseconds per step), largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    rows = [(name, count // steps, us / steps) for name, (count, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def kernel_timeline(step) -> list[tuple[float, float, str]]:
    """(start relative to the first kernel, duration, name) in microseconds of one step's kernels,
    in launch order: the gaps between them are the GPU's idle time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    first = kernels[0][0] if kernels else 0.0
    return [(start - first, end - start, name) for start, end, name in kernels]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="deepseek_v3,qwen3_30b")
    parser.add_argument("--expert-gemm", default="auto")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--timeline", action="store_true", help="also each kernel's start, duration and the gap before it")
    parser.add_argument("--cprofile", action="store_true", help="also the host's Python time per function for one step")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8_blockwise"))
    parser.add_argument("--push-kernel", action="store_true",
                        help="FP8 over the exchange: the rows pushed by the push kernel, not the GEMMs' epilogue")
    parser.add_argument("--exchange", default="direct",
                        help="direct (mok_moe on one GPU) or symmetric (one emulated rank over the in-kernel exchange); comma-separated")
    parser.add_argument("--table-copy", action="store_true",
                        help="over the exchange: forward's route table copied from the region, not kept by the combine")
    parser.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                        help="a backends.tuning setting for the whole run (repeatable)")
    args = parser.parse_args()
    apply_tuning(args.tuning)
    if args.table_copy:
        from megatron_mok.comm.symmetric_exchange import PushedRows

        PushedRows.table_in_reused_buffer = False  # functional then takes table(keep=True), a copy
    if args.push_kernel:
        from megatron_mok.backends import tuning

        tuning.FP8_PUSH_IN_EPILOGUE = False
    exchanges = args.exchange.split(",")
    unknown = sorted(set(exchanges) - {"direct", "symmetric"})
    if unknown:
        raise SystemExit(f"--exchange: unknown {unknown}; expected direct or symmetric")
    group = EmulatedGroup(1, "cuda", exchange="symmetric") if "symmetric" in exchanges else None
    for name, exchange in ((n, e) for n in args.shapes.split(",") for e in exchanges):
        s = make_inputs(SHAPES[name], seed=0)
        config = MoKConfig(backend="kernel", expert_gemm=args.expert_gemm, precision=args.precision,
                           **({"exchange": "symmetric"} if exchange == "symmetric" else {}))

        def step(_=None, s=s, config=config, exchange=exchange):
            leaves = [s[n].detach().requires_grad_(args.backward) for n in ("x", "weights", "fc1", "fc2")]
            if exchange == "symmetric":
                (y,) = group.mok_moe([leaves[0]], [s["ids"]], [leaves[1]], [leaves[2]], [leaves[3]], config=config)
            else:
                y = mok_moe(leaves[0], s["ids"], leaves[1], leaves[2], leaves[3], config=config)
            if args.backward:
                y.backward(s["grad"])

        wall_ms = median_ms(step, [None], reps=10)
        # Ten steps queued back to back: the host runs ahead, so its launch overhead is hidden as in
        # a training loop whose GPU is busy.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            step()
        end.record()
        end.synchronize()
        queued_ms = start.elapsed_time(end) / 10
        rows = kernel_table(step, STEPS)
        busy_ms = sum(us for _, _, us in rows) / 1e3
        what = "forward+backward" if args.backward else "forward"
        print(f"\n{name} {what}, {exchange}, expert_gemm={args.expert_gemm}, {args.precision}: wall {wall_ms:.3f} ms, kernels "
              f"{busy_ms:.3f} ms (idle {wall_ms - busy_ms:.3f} ms); queued back to back {queued_ms:.3f} ms per step")
        print(f"  {'us/step':>9} {'share':>6}  stage")
        for stage, us, share in stage_table(rows):
            print(f"  {us:9.1f} {100 * share:5.1f}%  {stage}")
        print(f"  {'us/step':>9} {'calls':>5}  kernel")
        for kernel, calls, us in rows:
            print(f"  {us:9.1f} {calls:5d}  {kernel[:110]}")
        if args.precision != "bf16":
            # Each quantization launch of one step on its own (the recipe's bound: none above 5% of
            # the layer's kernels), in launch order.
            launches = [(us, kernel) for _, us, kernel in kernel_timeline(step) if stage_of(kernel) == "quantize (FP8)"]
            print(f"  each quantization launch of one step, in launch order ({len(launches)}; share of the kernels' {busy_ms:.3f} ms):")
            for us, kernel in launches:
                print(f"  {us:9.1f} {100 * us / (busy_ms * 1e3):5.1f}%  {kernel[:100]}")
            if launches:
                print(f"  largest: {100 * max(us for us, _ in launches) / (busy_ms * 1e3):.1f}% of the step's kernels")
        if args.cprofile:
            import cProfile
            import pstats

            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10):
                step()
            profiler.disable()
            torch.cuda.synchronize()
            print("  host time of 10 steps (cProfile, cumulative):")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        if args.timeline:
            print(f"  {'start us':>9} {'gap us':>8} {'us':>8}  kernel")
            previous_end = 0.0
            for start, duration, kernel in kernel_timeline(step):
                print(f"  {start:9.1f} {start - previous_end:8.1f} {duration:8.1f}  {kernel[:100]}")
                previous_end = start + duration


if __name__ == "__main__":
    main()
