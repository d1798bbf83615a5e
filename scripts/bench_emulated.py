"""Emulated expert parallelism on one GPU: R ranks (megatron_mok.emulation.EmulatedGroup) against
EP = 1 on the same total problem, same run: bitwise check, then forward+backward time.

    python3 scripts/bench_emulated.py [--ranks 2,8] [--exchange symmetric,collective] [--shape small]

What it shows is the protocol's overhead (the exchange's kernels, copies and waits; each rank's
stream gets the whole GPU, not 1/R of it), not NVLink: every rank's "peer" is the same HBM. A failure
prints the exception and `ops.last_failure()` (a trapped bounded wait names its phase, peer, call).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

# Before CUDA starts: the emulated symmetric ranks need every kernel loaded up front (emulation.py).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "comm"))
from timing import median_ms  # noqa: E402
from test_emulation import make_problem, run_concatenated, run_emulated  # noqa: E402

from megatron_mok import MoKConfig, mok_moe, ops  # noqa: E402
from megatron_mok.emulation import EmulatedGroup  # noqa: E402

# name: total (tokens, hidden, ffn, experts, topk) of the group; each rank gets tokens / R and
# experts / R
SHAPES = {
    "small": (2048, 1024, 512, 32, 8),
    "deepseek_v3": (8192, 7168, 2048, 32, 8),
    "qwen3_30b": (16384, 2048, 768, 128, 8),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8")
    parser.add_argument("--exchange", default="symmetric,collective")
    parser.add_argument("--shape", default="small", choices=SHAPES)
    parser.add_argument("--expert-gemm", default="auto")
    parser.add_argument("--no-time", action="store_true", help="check only")
    parser.add_argument("--graph", action="store_true", help="also time each step captured in one CUDA graph (no host launch cost)")
    args = parser.parse_args()
    config = MoKConfig(backend="kernel", expert_gemm=args.expert_gemm)
    t, h, f, e, k = SHAPES[args.shape]
    rows = []
    failed = False
    for num_ranks in (int(r) for r in args.ranks.split(",")):
        problem = make_problem(num_ranks, t // num_ranks, h, f, e // num_ranks, k, "uniform", "cuda", torch.bfloat16, 5)
        want = run_concatenated(problem, config)
        ep1_ms = None if args.no_time else median_ms(lambda p: run_concatenated(p, config), [problem])
        ep1_graph_ms = graph_ms(concatenated_step(problem, config)) if args.graph and not args.no_time else None
        for exchange in args.exchange.split(","):
            group = EmulatedGroup(num_ranks, "cuda", exchange=exchange)
            try:
                got = run_emulated(group, problem, e // num_ranks, config)
                torch.cuda.synchronize()
                equal = torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
            except Exception:  # noqa: BLE001 (reported, then the next case)
                print(f"R={num_ranks} {exchange}: FAILED\n{traceback.format_exc()}\nrecord: {ops.last_failure()}", flush=True)
                return 1  # a trapped kernel leaves the CUDA context unusable
            ms = None
            if not args.no_time:
                ms = median_ms(lambda p: run_emulated(group, p, e // num_ranks, config), [problem])
            failed |= not equal
            rows.append((num_ranks, exchange, equal, ms, ep1_ms))
            if args.graph and not args.no_time and exchange == "symmetric":
                rows.append((num_ranks, "symm graph", equal, graph_ms(emulated_step(group, problem, e // num_ranks, config)), ep1_graph_ms))
            print(f"R={num_ranks} {exchange}: bitwise {'equal' if equal else 'DIFFERENT'}", flush=True)
    print(f"\nshape {args.shape} (total T, H, F, E, K = {SHAPES[args.shape]}), forward+backward, {config.expert_gemm}")
    print(f"{'ranks':>5} {'exchange':<11} {'bitwise':<9} {'emulated ms':>12} {'EP=1 ms':>9} {'overhead':>9}")
    for num_ranks, exchange, equal, ms, ep1 in rows:
        over = f"{ms / ep1:.2f}x" if ms and ep1 else "-"
        print(f"{num_ranks:>5} {exchange:<11} {'equal' if equal else 'DIFFERENT':<9} "
              f"{_ms(ms):>12} {_ms(ep1):>9} {over:>9}")
    return 1 if failed else 0


def concatenated_step(problem, config):
    """EP = 1 on the concatenated problem, forward + backward, static leaves (for graph capture)."""
    x, ids, weights, fc1, fc2, grad = problem
    r, t, h = x.shape
    leaves = [a.clone().requires_grad_() for a in (x.reshape(r * t, h), weights.reshape(r * t, -1), fc1, fc2)]
    ids_flat, grad_flat = ids.reshape(r * t, -1), grad.reshape(r * t, h)

    def step():
        for leaf in leaves:
            leaf.grad = None
        mok_moe(leaves[0], ids_flat, leaves[1], leaves[2], leaves[3], config=config).backward(grad_flat)
    return step


def emulated_step(group, problem, local_experts, config):
    """Every emulated rank's forward + backward, static leaves (for graph capture)."""
    x, ids, weights, fc1, fc2, grad = problem
    r, e = group.num_ranks, local_experts
    xs = [x[k].clone().requires_grad_() for k in range(r)]
    ws = [weights[k].clone().requires_grad_() for k in range(r)]
    fc1s = [fc1[k * e:(k + 1) * e].clone().requires_grad_() for k in range(r)]
    fc2s = [fc2[k * e:(k + 1) * e].clone().requires_grad_() for k in range(r)]
    leaves = [*xs, *ws, *fc1s, *fc2s]

    def step():
        for leaf in leaves:
            leaf.grad = None
        ys = group.mok_moe(xs, [ids[k] for k in range(r)], ws, fc1s, fc2s, config=config)
        torch.autograd.backward(ys, [grad[k] for k in range(r)])
    return step


def graph_ms(step) -> float:
    """Median ms of replaying `step` captured in one CUDA graph (warmed up eagerly first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(lambda _: graph.replay(), [None])


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
