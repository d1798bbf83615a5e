"""Per-rank memory of the MoK layer at EP = 1, 2, 4, 8 at one per-rank shape, emulated ranks on one
GPU (the in-kernel exchange), beside the stated bound (megatron_mok.memory.layer_memory_bound):

    python3 scripts/ep_memory.py [--shape deepseek_v3] [--ranks 1,2,4,8] [--routing uniform]
                                 [--precision fp8_blockwise [--no-fp8-weight-cache]]

Each rank's forward and backward are measured alone (tests/comm/emulated_memory.py), after a warm-up
call, so the figures are what one real rank allocates: held (what a forward leaves for backward,
y included) and peak (forward + backward, above what was allocated before the forward). The
symmetric regions are allocated once per process and layer shape before the first call and are
shared by every layer of that shape: listed apart. EP = 1 is the one-rank kernel (no exchange).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts (emulation.py)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "comm"))
from emulated_memory import per_rank_memory  # noqa: E402

from megatron_mok import MoKConfig  # noqa: E402
from megatron_mok.emulation import EmulatedGroup  # noqa: E402
from megatron_mok.memory import layer_memory_bound  # noqa: E402

# name: per-rank (tokens, hidden, ffn, local experts, topk)
SHAPES = {
    "deepseek_v3": (8192, 7168, 2048, 32, 8),
    "qwen3_30b": (16384, 2048, 768, 16, 8),
    "small": (1024, 1024, 512, 8, 8),
}


def make_ranks(num_ranks, t, h, f, e, k, routing, seed):
    """make_problem's layout, generated in bf16 on the device (the fp32 intermediates of the test's
    generator would not fit at the DeepSeek-V3 shape at EP = 8)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    num_experts = num_ranks * e
    x = torch.randn(num_ranks, t, h, **bf16)
    scores = torch.rand(num_ranks, t, num_experts, device="cuda", generator=gen)
    if routing == "skewed":
        scores[..., : max(1, num_experts // 8)] += 2.0
    ids = scores.topk(k, dim=-1).indices
    del scores
    if routing == "one_expert_rank0":
        ids.fill_(0)
    weights = torch.rand(num_ranks, t, k, device="cuda", generator=gen)
    fc1 = torch.randn(num_experts, 2 * f, h, **bf16).mul_(h**-0.5)
    fc2 = torch.randn(num_experts, h, f, **bf16).mul_(f**-0.5)
    grad = torch.randn(num_ranks, t, h, **bf16)
    return x, ids, weights, fc1, fc2, grad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek_v3", choices=SHAPES)
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--routing", default="uniform", choices=("uniform", "skewed", "one_expert_rank0"))
    parser.add_argument("--factor", type=float, default=MoKConfig().receive_capacity_factor)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8_blockwise"))
    parser.add_argument("--no-fp8-weight-cache", action="store_true",
                        help="with fp8_blockwise: MoKConfig.fp8_cache_weights=False")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    t, h, f, e, k = SHAPES[args.shape]
    config = MoKConfig(backend="kernel", receive_capacity_factor=args.factor, precision=args.precision,
                       fp8_cache_weights=not args.no_fp8_weight_cache)
    rows = []
    for num_ranks in (int(r) for r in args.ranks.split(",")):
        problem = make_ranks(num_ranks, t, h, f, e, k, args.routing, 7)
        group = None if num_ranks == 1 else EmulatedGroup(num_ranks, "cuda", exchange="symmetric")
        stats = per_rank_memory(group, problem, e, config)
        bound = layer_memory_bound(num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k, num_ranks=num_ranks, config=config)
        rows.append(dict(
            ranks=num_ranks, held=max(s["held"] for s in stats), peak=max(s["peak"] for s in stats),
            bound_held=bound.held, bound_peak=bound.peak, symmetric=bound.symmetric,
            window_rows=bound.window_rows, windows=bound.num_windows,
        ))
        del problem, group, stats
        torch.cuda.empty_cache()
        print(f"EP={num_ranks}: done", flush=True)
    mb = lambda b: b / 2**20  # noqa: E731
    base = rows[0] if rows[0]["ranks"] == 1 else None
    cache = "" if args.precision == "bf16" else f", weight cache {config.fp8_cache_weights}"
    print(f"\n{args.shape} per rank (T, H, F, E, K) = {SHAPES[args.shape]}, routing {args.routing}, factor {args.factor}, "
          f"{args.precision}{cache}")
    print(f"{'EP':>3} {'windows':>7} {'held MB':>8} {'x EP1':>6} {'peak MB':>8} {'x EP1':>6} {'bound held/peak MB':>19} {'symmetric MB':>13}")
    for r in rows:
        rel = (lambda key: f"{r[key] / base[key]:.3f}") if base else (lambda key: "-")
        print(f"{r['ranks']:>3} {r['windows']:>7} {mb(r['held']):8.0f} {rel('held'):>6} {mb(r['peak']):8.0f} {rel('peak'):>6} "
              f"{mb(r['bound_held']):>9.0f}/{mb(r['bound_peak']):<9.0f} {mb(r['symmetric']):13.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, routing=args.routing, precision=args.precision,
                                                   fp8_cache_weights=config.fp8_cache_weights, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
