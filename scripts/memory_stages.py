"""Where the one-rank layer's memory peaks: each stage of a forward and backward (megatron_mok/backends/
stages.py, as functional runs them) with the memory allocated when it starts, the most allocated while
it runs and what it leaves, in MB above what was allocated before the forward (the inputs, weights
and weight cache of a warm-up call excluded, as scripts/ep_memory.py counts them).

    python3 scripts/memory_stages.py [--shape deepseek_v3] [--precision fp8_blockwise]
                                     [--no-fp8-weight-cache] [--routing uniform] [--factor 0.25]
                                     [--push-kernel]

--factor runs the rank over the in-kernel exchange (one rank of megatron_mok.emulation) with that
MoKConfig.receive_capacity_factor: below 1 its rows go through several receive windows, as an EP > 1
rank's do (its symmetric regions are not in the figures: scripts/ep_memory.py counts them).
--push-kernel: FP8's rows pushed by the push kernel after the GEMMs instead of by their epilogue
(tuning.FP8_PUSH_IN_EPILOGUE off).

A weight gradient's stages (weight_grad_window, weight_grad_into, segment_weight_grad) include the
result they write into; the layer's own peak is the largest "peak" of the table. One GPU, EP = 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "comm"))
from test_emulation import make_problem  # noqa: E402

from megatron_mok import MoKConfig, fp8_weights, functional, mok_moe  # noqa: E402
from megatron_mok.emulation import EmulatedGroup  # noqa: E402
from ep_memory import SHAPES  # noqa: E402

MB = 1 << 20


def recorded_stages(stages, records: list, base: int, overall: list):
    """stages with each callable field wrapped: (name, MB at entry, peak MB during, MB at exit) appended
    to records per call; overall[0] keeps the most allocated before each stage's peak counter is reset,
    so that the call's peak is its largest (between the stages too)."""
    def wrap(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            overall[0] = max(overall[0], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            result = fn(*args, **kwargs)
            torch.cuda.synchronize()
            records.append((name, (before - base) / MB, (torch.cuda.max_memory_allocated() - base) / MB,
                            (torch.cuda.memory_allocated() - base) / MB))
            return result
        return run

    changes = {field.name: wrap(field.name, getattr(stages, field.name)) for field in dataclasses.fields(stages)
               if callable(getattr(stages, field.name))}
    return dataclasses.replace(stages, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek_v3", choices=sorted(SHAPES))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8_blockwise"))
    parser.add_argument("--no-fp8-weight-cache", action="store_true")
    parser.add_argument("--routing", default="uniform")
    parser.add_argument("--factor", type=float, default=None)
    parser.add_argument("--push-kernel", action="store_true", help="tuning.FP8_PUSH_IN_EPILOGUE off")
    args = parser.parse_args()
    if args.push_kernel:
        from megatron_mok.backends import tuning

        tuning.FP8_PUSH_IN_EPILOGUE = False
    t, h, f, e, k = SHAPES[args.shape]
    config = MoKConfig(backend="kernel", precision=args.precision, fp8_cache_weights=not args.no_fp8_weight_cache)
    group = None
    if args.factor is not None:
        config = dataclasses.replace(config, exchange="symmetric", receive_capacity_factor=args.factor)
        group = EmulatedGroup(1, "cuda", exchange="symmetric")
    x, ids, weights, fc1, fc2, grad = make_problem(1, t, h, f, e, k, args.routing, "cuda", torch.bfloat16, 31)
    x, ids, weights, grad = x[0], ids[0], weights[0], grad[0]
    leaves = [v.detach().requires_grad_() for v in (x, weights, fc1, fc2)]

    def call():
        if group is None:
            y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)
        else:
            (y,) = group.mok_moe([leaves[0]], [ids], [leaves[1]], [leaves[2]], [leaves[3]], config=config)
        y.backward(grad)
        for leaf in leaves:
            leaf.grad = None

    call()  # warm-up: the weight cache (if any) made, the kernels loaded
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    records: list = []
    overall = [0]
    original = functional.stages_for
    functional.stages_for = lambda *a, **kw: recorded_stages(original(*a, **kw), records, base, overall)
    try:
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        whole = (max(overall[0], torch.cuda.max_memory_allocated()) - base) / MB
    finally:
        functional.stages_for = original
    cached = fp8_weights.cached_count()
    windows = "" if args.factor is None else f"symmetric exchange, factor {args.factor}, "
    print(f"{args.shape} (T, H, F, E, K) = {(t, h, f, e, k)}, {args.precision}, routing {args.routing}, {windows}"
          f"weight cache {'on' if config.fp8_cache_weights else 'off'} ({cached} weights cached, not counted)")
    print(f"{'stage':<24} {'at entry MB':>12} {'peak MB':>9} {'at exit MB':>11}")
    for name, before, peak, after in records:
        print(f"{name:<24} {before:12.0f} {peak:9.0f} {after:11.0f}")
    print(f"the call's peak: {whole:.0f} MB above what was allocated before it")


if __name__ == "__main__":
    main()
