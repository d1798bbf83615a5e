"""What receive windows cost one rank: the layer's forward + backward over the in-kernel exchange
at EP = 1 (one rank of megatron_mok.emulation, so no other rank shares the GPU) in one window and in
several (MoKConfig.receive_capacity_factor below 1 splits a rank's rows into windows, as a routing
that sends a rank more rows than the factor does at EP > 1), BF16 and FP8 blockwise, and for FP8 the
dgrads multiplied in one expert range per window or in tuning.FP8_DGRAD_EXPERT_RANGES ranges, and
(--columns-from-peers) the FP8 weight gradients' operands quantized straight from the ranks' regions
(tuning.FP8_WGRAD_COLUMNS_FROM_PEERS) beside the pulled rows.

    python scripts/bench_windows.py [--shapes deepseek_v3,qwen3_30b] [--factors 1.0,0.25] [--columns-from-peers]

Each row: ms forward + backward (median, fresh inputs alternated, L2 flushed: scripts/timing.py),
the windows, and the ratio to the same precision's one-window row of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, make_inputs  # noqa: E402
from timing import median_ms_interleaved  # noqa: E402

from megatron_mok import MoKConfig  # noqa: E402
from megatron_mok.backends import tuning  # noqa: E402
from megatron_mok.emulation import EmulatedGroup  # noqa: E402
from megatron_mok.memory import layer_memory_bound  # noqa: E402


def step(group: EmulatedGroup, config: MoKConfig, ranges: int, from_peers: bool):
    def run(inputs):
        tuning.FP8_DGRAD_EXPERT_RANGES = ranges
        tuning.FP8_WGRAD_COLUMNS_FROM_PEERS = from_peers
        leaves = [inputs[name].detach().requires_grad_() for name in ("x", "weights", "fc1", "fc2")]
        (y,) = group.mok_moe([leaves[0]], [inputs["ids"]], [leaves[1]], [leaves[2]], [leaves[3]], config=config)
        y.backward(inputs["grad"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="deepseek_v3,qwen3_30b")
    parser.add_argument("--factors", default="1.0,0.25")
    parser.add_argument("--columns-from-peers", action="store_true",
                        help="FP8 rows with the weight gradients' operands quantized from the ranks' regions too")
    args = parser.parse_args()
    default_ranges, default_from_peers = tuning.FP8_DGRAD_EXPERT_RANGES, tuning.FP8_WGRAD_COLUMNS_FROM_PEERS
    peers_choices = sorted({default_from_peers, True}) if args.columns_from_peers else [default_from_peers]
    group = EmulatedGroup(1, "cuda", exchange="symmetric")
    rows = []
    for name in args.shapes.split(","):
        t, h, f, e, k = SHAPES[name]
        inputs = [make_inputs(SHAPES[name], seed) for seed in (1, 2)]
        fns, windows = {}, {}
        for factor in (float(v) for v in args.factors.split(",")):
            for precision, ranges_list in (("bf16", [default_ranges]), ("fp8_blockwise", sorted({1, default_ranges}))):
                config = MoKConfig(backend="kernel", precision=precision, exchange="symmetric", receive_capacity_factor=factor)
                bound = layer_memory_bound(num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k,
                                           num_ranks=1, config=config, windowed=True)
                for ranges in ranges_list:
                    for from_peers in peers_choices if precision == "fp8_blockwise" else [default_from_peers]:
                        key = (precision, factor, ranges, from_peers)
                        fns[key], windows[key] = step(group, config, ranges, from_peers), bound.num_windows
        times = median_ms_interleaved(fns, inputs, warmup=3, reps=10)
        tuning.FP8_DGRAD_EXPERT_RANGES, tuning.FP8_WGRAD_COLUMNS_FROM_PEERS = default_ranges, default_from_peers
        for key, ms in times.items():
            precision = key[0]
            base = min(v for k, v in times.items()
                       if k[0] == precision and windows[k] == 1 and k[2] == default_ranges and k[3] == default_from_peers)
            rows.append((name, *key, windows[key], ms, ms / base))
    print(f"\n{torch.cuda.get_device_name()}\n")
    print("| shape | precision | factor | windows | dgrad ranges | wgrad operands | fwd+bwd ms | vs one window |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for name, precision, factor, ranges, from_peers, m, ms, ratio in rows:
        operands = "from the regions" if from_peers else "pulled rows"
        print(f"| {name} | {precision} | {factor} | {m} | {ranges} | {operands} | {ms:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
