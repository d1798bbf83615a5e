"""The MoE layer at EP = R over one node, one GPU per rank: mok against the unfused baselines, one run.

    torchrun --nproc-per-node 8 scripts/bench_ep.py [--shapes deepseek_v3,qwen3_30b] [--nvlink nvlink.json] [--json ep.json]

Per rank T tokens, E/R local experts, uniform softmax top-k routing (scripts/ep_model.py SHAPES):
- `mok`: mok_moe over the group (MoKConfig defaults: the in-kernel exchange where the group has
  symmetric memory, the kernel backend);
- `a2a_grouped_mm`: NCCL all-to-all of the routed rows, torch's grouped GEMM (gate/up, SwiGLU, down),
  the all-to-all back, the weighted sum in fp32 (the split sizes reach the host, as in Megatron);
- `megatron_alltoall`: Megatron's MoELayer with the alltoall dispatcher (TEGroupedMLP with Transformer
  Engine, else SequentialMLP), its router included, where megatron-core imports.
Forward and forward + backward: each rank's median over --reps (CUDA events, the ranks lined up before
every rep), then the slowest rank. The fastest baseline is the reference of the × column. Beside each,
scripts/ep_model.py's prediction from this run's compute-only times (the EP = 1 kernel layer and the
EP = 1 PyTorch pipeline on one rank's problem: T tokens over its E/R experts) and the link rate
(--nvlink: the pull rate bench_nvlink.py measured, else --link-gbs).

Ranks sharing one GPU (torchrun on a one-GPU machine) run `mok` only (NCCL refuses two ranks on one
GPU): a check of the path, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("mok", "a2a_grouped_mm", "megatron_alltoall")
EXTRA_SHAPES = {"small": ((1024, 1024, 512, 16, 4), None)}  # a quick check of the path


def a2a_grouped_mm(x, ids, weights, fc1, fc2):
    """Every rank's routes sent to their experts' owners by NCCL all-to-all, grouped GEMMs there, the
    rows sent back and summed over k in fp32. Differentiable (the collectives' autograd versions)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.nn.functional import all_to_all_single

    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    world = dist.get_world_size()
    num_local = fc1.shape[0]
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by global expert: by owner, then its local expert
    send_counts = torch.bincount(flat, minlength=world * num_local).view(world, num_local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # (source rank, local expert)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # host sync
    recv = all_to_all_single(
        x.new_empty(sum(recv_splits), x.shape[1]), x.index_select(0, order // k), recv_splits, send_splits
    )
    local_expert = torch.repeat_interleave(torch.arange(num_local, device=x.device).repeat(world), recv_counts.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
    gate, up = grouped_mm(recv.index_select(0, by_expert), fc1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = grouped_mm(F.silu(gate) * up, fc2.transpose(1, 2), offs=offs)
    out = out.index_select(0, torch.argsort(by_expert))  # back to (source rank, route) order
    back = all_to_all_single(out.new_empty(t * k, out.shape[1]), out, send_splits, recv_splits)
    scaled = back.float() * weights.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32).index_add_(0, order // k, scaled)
    return y.to(x.dtype)


def main() -> int:
    import ep_model
    from bench_layer import megatron_alltoall_layer  # the same baseline layer as the one-rank bench

    shapes = {**ep_model.SHAPES, **EXTRA_SHAPES}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek_v3,qwen3_30b", help=f"comma-separated, of {sorted(shapes)}")
    parser.add_argument("--nvlink", type=Path, help="bench_nvlink.py's JSON: its pull rate is the link rate")
    parser.add_argument("--link-gbs", type=float, default=370.0, help="the link rate without --nvlink, GB/s per direction")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the rows here (rank 0)")
    args = parser.parse_args()
    names = args.shapes.split(",")
    for name in names:
        if name not in shapes:
            parser.error(f"unknown shape {name!r}; known: {sorted(shapes)}")

    import torch
    import torch.distributed as dist

    import ranks
    from bench_layer import pytorch_pipeline
    from megatron_mok import MoKConfig, mok_moe

    link_gbs = json.loads(args.nvlink.read_text())["pull_gbs"] if args.nvlink and args.nvlink.exists() else args.link_gbs
    # NCCL only where every rank has its own GPU (it refuses two ranks on one).
    rank, world, device = ranks.start(nccl=torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1")))
    shared = ranks.shares_gpus()
    rows = []
    for name in names:
        (t, h, f, e, k), _ = shapes[name]
        if e % world:
            raise SystemExit(f"{name}: {e} experts do not split over {world} ranks")
        local = e // world
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        x = torch.randn(t, h, device=device, generator=gen).bfloat16()
        weights, ids = torch.softmax(torch.randn(t, e, device=device, generator=gen), dim=1).topk(k, dim=1)
        weights = weights.float().contiguous()
        wgen = torch.Generator(device=device).manual_seed(rank)
        fc1 = (torch.randn(local, 2 * f, h, device=device, generator=wgen) / h**0.5).bfloat16()
        fc2 = (torch.randn(local, h, f, device=device, generator=wgen) / f**0.5).bfloat16()
        grad = torch.randn(t, h, device=device, generator=gen).bfloat16()
        # One rank's problem at EP = 1 (its tokens over its own experts): the compute-only times.
        local_ids = ids % local

        def run(layer, *inputs, backward):
            leaves = [a.detach().requires_grad_(backward and a.is_floating_point()) for a in inputs]
            y = layer(*leaves)
            if backward:
                y.backward(grad)

        methods = {
            "mok": lambda *a: mok_moe(*a, group=dist.group.WORLD),
            "compute_only_mok": lambda x_, i_, w_, f1, f2: mok_moe(x_, local_ids, w_, f1, f2, config=MoKConfig()),
            "compute_only_pytorch": lambda x_, i_, w_, f1, f2: pytorch_pipeline(x_, local_ids, w_, f1, f2),
        }
        notes = {}
        if shared:
            notes["a2a_grouped_mm"] = notes["megatron_alltoall"] = "not run: NCCL refuses ranks sharing a GPU"
        else:
            methods["a2a_grouped_mm"] = a2a_grouped_mm
            megatron_layer, notes["megatron_alltoall"] = megatron_alltoall_layer((t, h, f, e, k), world)
            if megatron_layer is not None:
                # (its router picks its own routes from x; the weights given are not used)
                methods["megatron_alltoall"] = lambda *a, m=megatron_layer: m(a[0].view(t, 1, h))[0].view(t, h)
        row = {"shape": name, "per_rank": dict(tokens=t, hidden=h, ffn=f, experts=e, local_experts=local, topk=k), "notes": notes}
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            times = {}
            for method, fn in methods.items():
                times[method] = ranks.timed_ms(lambda: run(fn, x, ids, weights, fc1, fc2, backward=backward), args.warmup, args.reps)
            slowest = dict(zip(times, ranks.max_over_ranks(list(times.values()))))
            passes = ep_model.pass_bytes(t, h, k, world)
            which = ep_model.FORWARD if mode == "fwd" else ep_model.FORWARD_BACKWARD
            predicted = ep_model.predict_ms(slowest["compute_only_mok"], slowest["compute_only_pytorch"], passes, which, h, link_gbs)
            row[mode] = dict(ms=slowest, predicted_ms=dict(mok=predicted[0], a2a_grouped_mm=predicted[1]))
        rows.append(row)
        torch.cuda.empty_cache()
    if rank == 0:
        _print_table(rows, world, link_gbs, shared)
        if args.json:
            args.json.write_text(json.dumps(dict(ranks=world, link_gbs=link_gbs, shares_gpus=shared, rows=rows), indent=1))
    dist.barrier()
    return 0


def _print_table(rows, world: int, link_gbs: float, shared: bool) -> None:
    print(f"EP = {world}{' (ranks sharing GPUs: not a measurement)' if shared else ''}; predictions at {link_gbs:.0f} GB/s")
    print("| shape | pass | method | ms | predicted ms | × best baseline |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for row in rows:
        for mode in ("fwd", "fwd_bwd"):
            ms, predicted = row[mode]["ms"], row[mode]["predicted_ms"]
            baselines = [ms[m] for m in ("a2a_grouped_mm", "megatron_alltoall") if m in ms]
            best = min(baselines) if baselines else None
            for method in METHODS:
                if method not in ms:
                    print(f"| {row['shape']} | {mode} | `{method}` | n/a ({row['notes'].get(method, '')}) | | |")
                    continue
                ratio = f"{best / ms[method]:.2f}" if best else ""
                guess = f"{predicted[method]:.2f}" if method in predicted else ""
                print(f"| {row['shape']} | {mode} | `{method}` | {ms[method]:.2f} | {guess} | {ratio} |")
            print(f"| {row['shape']} | {mode} | compute only (EP = 1 kernel / PyTorch) | "
                  f"{ms['compute_only_mok']:.2f} / {ms['compute_only_pytorch']:.2f} | | |")


if __name__ == "__main__":
    sys.exit(main())
