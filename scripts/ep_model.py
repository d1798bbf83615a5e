"""The EP cost model: bytes each rank moves in each pass of a MoE layer at EP = R in one node, and the
layer time they predict beside a measured compute-only time.

    python scripts/ep_model.py [--ep 8] [--bench docs/log/bench_layer_2026-12-01.json] [--link-gbs 370]

Per rank, uniform routing, T tokens per rank, top-K, hidden H, activation bytes s:
- dispatch (forward pull) and reverse-combine (backward pull of dY): a destination reads each source
  token once however many of its routes it owns (the token-major gather), so a token row crosses the
  link once per distinct destination rank: T * u * H * s bytes per rank with
  u = R * (1 - (1 - 1/R)^K) destinations per token, of which the share (R - 1) / R is off-GPU;
- combine (forward push) and reverse-dispatch (backward push of dX): one row per route:
  T * K * H * s * (R - 1) / R off-GPU bytes per rank.
Compute-only time: the EP = 1 kernel layer on the per-rank shape (T tokens, E/R local experts: each
rank computes T*K rows when the routing is uniform), from a bench_layer.py JSON (`mok_kernel`).

Predictions (per layer, forward + backward, per rank):
- mok (communication overlapped with the expert GEMMs): max(compute, bytes / link rate), plus the
  part no GEMM overlaps: the first minibatch's pull and the last one's push (one minibatch each);
- NCCL all-to-all + grouped GEMM (serialized): the PyTorch pipeline's time (`pytorch` of the same
  JSON) + bytes / link rate.
The multi-GPU run checks these against measurements (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_mok.limits import DISPATCH_MINIBATCH_ROWS  # noqa: E402

# name: (tokens per rank, hidden, ffn, experts, topk); the bench_layer.py shape with the same per-rank
# problem at EP = 8, if it ran one.
SHAPES = {
    "deepseek_v3": ((8192, 7168, 2048, 256, 8), "deepseek_v3"),
    "qwen3_235b": ((8192, 4096, 1536, 128, 8), "qwen3_235b"),
    "qwen3_30b": ((16384, 2048, 768, 128, 8), None),  # bench_layer runs it at EP = 1 (128 experts)
}


def pass_bytes(tokens: int, hidden: int, topk: int, ranks: int, elem_bytes: int = 2) -> dict[str, float]:
    """Off-GPU bytes one rank sends or receives in each pass (uniform routing)."""
    off_gpu = (ranks - 1) / ranks
    destinations = ranks * (1 - (1 - 1 / ranks) ** topk)
    pull = tokens * destinations * hidden * elem_bytes * off_gpu
    push = tokens * topk * hidden * elem_bytes * off_gpu
    return {"dispatch": pull, "combine": push, "reverse_combine": pull, "reverse_dispatch": push}


FORWARD = ("dispatch", "combine")
FORWARD_BACKWARD = ("dispatch", "combine", "reverse_combine", "reverse_dispatch")


def predict_ms(
    compute_ms: float, pytorch_ms: float, passes: dict[str, float], which: tuple[str, ...], hidden: int, link_gbs: float
) -> tuple[float, float]:
    """(mok, NCCL all-to-all + grouped GEMM) predicted ms of the passes `which` (FORWARD or
    FORWARD_BACKWARD) from the compute-only times of mok and of the PyTorch pipeline: mok overlaps
    the bytes with its GEMMs except one minibatch per pass (the first pull's, the last push's); the
    serialized pipeline adds them."""
    comm_ms = sum(passes[p] for p in which) / (link_gbs * 1e9) * 1e3
    exposed = len(which) * DISPATCH_MINIBATCH_ROWS * hidden * 2 / (link_gbs * 1e9) * 1e3
    return max(compute_ms, comm_ms) + exposed, pytorch_ms + comm_ms


def predict(bench: dict | None, name: str, ranks: int, link_gbs: float) -> dict:
    (t, h, f, e, k), bench_shape = SHAPES[name]
    passes = pass_bytes(t, h, k, ranks)
    total = sum(passes.values())
    comm_ms = total / (link_gbs * 1e9) * 1e3
    row = {"shape": name, "bytes_mb": {p: b / 2**20 for p, b in passes.items()}, "comm_ms": comm_ms}
    measured = None
    if bench is not None and bench_shape is not None:
        measured = next((r for r in bench["results"] if r["shape"] == bench_shape), None)
    if measured is None:
        row["note"] = "no compute-only measurement of the per-rank shape"
        return row
    compute = measured["mok_kernel"]["fwd_bwd_ms"]
    pytorch = measured["pytorch"]["fwd_bwd_ms"]
    mok_ms, serialized_ms = predict_ms(compute, pytorch, passes, FORWARD_BACKWARD, h, link_gbs)
    row.update(compute_ms=compute, mok_ms=mok_ms, serialized_ms=serialized_ms)
    row["mok_speedup"] = row["serialized_ms"] / row["mok_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--bench", default=str(Path(__file__).resolve().parents[1] / "docs/log/bench_layer_2026-12-01.json"))
    parser.add_argument("--link-gbs", type=float, default=370.0, help="reachable NVLink rate per direction, GB/s")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    bench = json.loads(Path(args.bench).read_text()) if args.bench and Path(args.bench).exists() else None
    rows = [predict(bench, name, args.ep, args.link_gbs) for name in SHAPES]
    print(f"EP = {args.ep}, {args.link_gbs:g} GB/s per direction; bytes per rank per layer (MB, off-GPU)")
    print(f"{'shape':<13}{'dispatch':>10}{'combine':>10}{'rev_comb':>10}{'rev_disp':>10}{'comm ms':>9}"
          f"{'compute':>9}{'mok ms':>8}{'a2a+gg':>8}{'x':>6}")
    for row in rows:
        b = row["bytes_mb"]
        tail = "  " + row["note"] if "note" in row else (
            f"{row['compute_ms']:>9.2f}{row['mok_ms']:>8.2f}{row['serialized_ms']:>8.2f}{row['mok_speedup']:>6.2f}"
        )
        print(f"{row['shape']:<13}{b['dispatch']:>10.0f}{b['combine']:>10.0f}{b['reverse_combine']:>10.0f}"
              f"{b['reverse_dispatch']:>10.0f}{row['comm_ms']:>9.2f}" + tail)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
