"""The links between the ranks of one node as the in-kernel exchange uses them, beside a plain peer copy.

    torchrun --nproc-per-node 8 scripts/bench_nvlink.py [--shape deepseek_v3] [--json nvlink.json]

Per rank, at a per-rank layer shape (T tokens, H hidden, K top-k, E experts over the R ranks, uniform
routing), through the group's symmetric regions (the layer's own, comm/placement.py):
- pull: ops.dispatch_rows_from_peers, the dispatch of the first receive window (every row this
  rank's experts need; token-major, so a source row crosses the link once however many of its
  routes land here);
- push: ops.push_rows, the combine: every result row of that window into its source's combine region;
- copy: the same bytes as the pull, read from the peers' token regions by torch's copy_ (cudaMemcpy
  between the GPUs: the copy engines' rate, no kernel of ours);
- signal round: one all-to-all round of the exchange's signal protocol (begin, ready to every peer,
  wait for every peer's ready, free), its latency, averaged over --rounds.
Rates count only the bytes that cross between GPUs (rows from or to another rank), per rank and
direction. Each time is the median over --reps of one rank (CUDA events; the ranks lined up by a host
barrier before every rep), then the slowest rank. Every rank on one GPU (torchrun on a one-GPU
machine) runs the same code over CUDA IPC: that checks the path, its numbers measure nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name: (tokens per rank, hidden, experts in the group, topk)
SHAPES = {
    "deepseek_v3": (8192, 7168, 256, 8),
    "qwen3_30b": (16384, 2048, 128, 8),
    "small": (1024, 1024, 16, 4),  # a quick check of the path
}


def _peer_bytes(ptr: int, num_bytes: int):
    """A uint8 CUDA tensor over `num_bytes` at device address `ptr` (a peer's mapped region)."""
    import torch

    class Span:
        __cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    return torch.as_tensor(Span(), device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek_v3", choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100, help="signal rounds per timed rep")
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    args = parser.parse_args()

    import torch

    import ranks
    from megatron_mok import ops
    from megatron_mok.comm import get_expert_parallel_group
    from megatron_mok.receive import receive_plan, windows
    from megatron_mok.schedule import build_schedule_from_gathered

    rank, world, device = ranks.start()
    t, h, num_experts, k = SHAPES[args.shape]
    if num_experts % world:
        raise SystemExit(f"{num_experts} experts do not split over {world} ranks")
    e = num_experts // world
    import torch.distributed as dist

    group = get_expert_parallel_group(dist.group.WORLD, device)
    pool, reason = group.symmetric_pool()
    if pool is None:
        raise SystemExit(f"no symmetric memory over this group: {reason}")
    pool.prepare(t, h, k, torch.bfloat16)
    tokens = pool.region("tokens", t, h, 0, torch.bfloat16)
    combine = pool.region("combine", t, h, k, torch.bfloat16)

    # Every rank's routing, drawn from one seed on every rank (no exchange needed for the schedule).
    gen = torch.Generator(device=device).manual_seed(0)
    ids_all = torch.rand(world, t, num_experts, device=device, generator=gen).topk(k, dim=-1).indices
    schedule = build_schedule_from_gathered(ids_all, rank=rank, num_local_experts=e)
    plan = receive_plan(num_ranks=world, num_tokens=t, topk=k, num_local_experts=e, segment_alignment=1, factor=1.0, windowed=True)
    window = windows(schedule, plan)[0].schedule
    routes = window.slot_to_route[window.slot_to_route >= 0]
    source_rank = routes // (t * k)
    remote = routes[source_rank != rank]
    # Bytes setup, on the host once: rows that cross the link, per peer.
    pull_rows_per_peer = [int(torch.unique(remote[remote // (t * k) == p] // k).numel()) for p in range(world)]
    pull_bytes = sum(pull_rows_per_peer) * h * 2
    push_bytes = int(remote.numel()) * h * 2
    slot_rows = torch.randn(window.capacity, h, device=device).bfloat16()
    peer_tokens = [
        None if p == rank or not n else _peer_bytes(tokens.peer_ptrs[p], n * h * 2) for p, n in enumerate(pull_rows_per_peer)
    ]
    copy_into = torch.empty(max(pull_rows_per_peer) * h * 2, dtype=torch.uint8, device=device)

    def pull():
        ops.dispatch_rows_from_peers(tokens.own, list(tokens.peer_ptrs), window.slot_to_route, k, window.expert_offsets)

    def push():
        ops.push_rows(slot_rows, window.slot_to_route, k, t, combine.own, list(combine.peer_ptrs))

    def copy():
        for source in peer_tokens:
            if source is not None:
                copy_into[: source.numel()].copy_(source)

    phase = list(ops.exchange_phase_names()).index("routing")
    peer_signals = list(pool.signals.peer_ptrs)

    def signal_rounds():
        for _ in range(args.rounds):
            ops.exchange_begin(pool.calls, pool.signals.own, rank, phase)
            ops.exchange_signal(pool.calls, pool.signals.own, peer_signals, rank, phase, 0)
            ops.exchange_wait_ready(pool.calls, pool.signals.own, rank, phase)
            ops.exchange_signal(pool.calls, pool.signals.own, peer_signals, rank, phase, 1)

    times = [ranks.timed_ms(fn, args.warmup, args.reps) for fn in (pull, push, copy, signal_rounds)]
    pull_ms, push_ms, copy_ms, rounds_ms = ranks.max_over_ranks(times)
    sizes = ranks.max_over_ranks([pull_bytes, push_bytes])
    result = {
        "shape": args.shape, "ranks": world, "memory": group.symmetric_memory().kind, "shares_gpus": ranks.shares_gpus(),
        "pull_mb": sizes[0] / 2**20, "push_mb": sizes[1] / 2**20,
        "pull_ms": pull_ms, "push_ms": push_ms, "copy_ms": copy_ms,
        "pull_gbs": sizes[0] / pull_ms / 1e6, "push_gbs": sizes[1] / push_ms / 1e6, "copy_gbs": sizes[0] / copy_ms / 1e6,
        "signal_round_us": rounds_ms / args.rounds * 1e3,
    }
    if rank == 0:
        print(f"{world} ranks ({result['memory']}{', sharing GPUs: not a measurement' if result['shares_gpus'] else ''}), "
              f"{args.shape}: per rank, off-GPU bytes, the slowest rank")
        print(f"  pull  {result['pull_mb']:9.1f} MB {pull_ms:8.3f} ms {result['pull_gbs']:8.1f} GB/s")
        print(f"  push  {result['push_mb']:9.1f} MB {push_ms:8.3f} ms {result['push_gbs']:8.1f} GB/s")
        print(f"  copy  {result['pull_mb']:9.1f} MB {copy_ms:8.3f} ms {result['copy_gbs']:8.1f} GB/s")
        print(f"  signal round {result['signal_round_us']:.1f} us")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
