"""What receive windows cost one rank: the layer's forward + backward over the in-kernel exchange
at EP = 1 (one rank of megatron_mok.emulation, so no other rank shares the GPU) in one window and in
several (MoKConfig.receive_capacity_factor below 1 splits a rank's rows into windows, as a routing
that sends a rank more rows than the factor does at EP > 1), BF16 and FP8 blockwise, and for FP8 the
dgrads multiplied in one expert range per window or in tuning.FP8_DGRAD_EXPERT_RANGES ranges,
(--columns-from-peers) the FP8 weight gradients' operands quantized straight from the ranks' regions
(tuning.FP8_WGRAD_COLUMNS_FROM_PEERS) or from pulled rows, (--push-in-epilogue) the FP8 GEMMs'
rows pushed by their epilogue (tuning.FP8_PUSH_IN_EPILOGUE) or by the push kernel after them, and
(--gemm-variants overlap,wide) the plain FP8 GEMMs' mainloop, the storing and the pushing ones alike
(tuning.FP8_EXPERT_GEMM_VARIANT, FP8_PUSH_GEMM_VARIANT).

    python scripts/bench_windows.py [--shapes deepseek_v3,qwen3_30b] [--factors 1.0,0.25] [--columns-from-peers]
        [--push-in-epilogue] [--gemm-variants overlap,wide]

Each row: ms forward + backward (median, fresh inputs alternated, L2 flushed: scripts/timing.py),
the windows, and the ratio to the same precision's one-window row of tuning's settings, same run.
"""

from __future__ import annotations

import argparse
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


# The FP8 settings a row may change, as (tuning attribute, values to try when its option is given).
# GEMM_VARIANTS stands for two attributes, set to one value (VARIANT_ATTRIBUTES).
SETTINGS = ("FP8_DGRAD_EXPERT_RANGES", "FP8_WGRAD_COLUMNS_FROM_PEERS", "FP8_PUSH_IN_EPILOGUE", "GEMM_VARIANTS")
VARIANT_ATTRIBUTES = ("FP8_EXPERT_GEMM_VARIANT", "FP8_PUSH_GEMM_VARIANT")


def tuning_settings() -> dict:
    """tuning's values of SETTINGS (GEMM_VARIANTS: the (store, push) pair)."""
    values = {name: getattr(tuning, name) for name in SETTINGS[:-1]}
    values["GEMM_VARIANTS"] = tuple(getattr(tuning, name) for name in VARIANT_ATTRIBUTES)
    return values


def apply(settings: dict) -> None:
    for name, value in settings.items():
        if name == "GEMM_VARIANTS":
            for attribute, variant in zip(VARIANT_ATTRIBUTES, value):
                setattr(tuning, attribute, variant)
        else:
            setattr(tuning, name, value)


def step(group: EmulatedGroup, config: MoKConfig, settings: dict):
    def run(inputs):
        apply(settings)
        leaves = [inputs[name].detach().requires_grad_() for name in ("x", "weights", "fc1", "fc2")]
        (y,) = group.mok_moe([leaves[0]], [inputs["ids"]], [leaves[1]], [leaves[2]], [leaves[3]], config=config)
        y.backward(inputs["grad"])

    return run


def fp8_settings(args) -> list[dict]:
    """Every combination of the settings tried: tuning's value, and the alternatives the options ask for."""
    default = tuning_settings()
    choices = {
        "FP8_DGRAD_EXPERT_RANGES": sorted({1, default["FP8_DGRAD_EXPERT_RANGES"]}),
        "FP8_WGRAD_COLUMNS_FROM_PEERS": [False, True] if args.columns_from_peers else [default["FP8_WGRAD_COLUMNS_FROM_PEERS"]],
        "FP8_PUSH_IN_EPILOGUE": [False, True] if args.push_in_epilogue else [default["FP8_PUSH_IN_EPILOGUE"]],
        "GEMM_VARIANTS": ([(v, v) for v in args.gemm_variants.split(",")] if args.gemm_variants
                          else [default["GEMM_VARIANTS"]]),
    }
    combos = [{}]
    for name in SETTINGS:
        combos = [dict(c, **{name: v}) for c in combos for v in choices[name]]
    return combos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="deepseek_v3,qwen3_30b")
    parser.add_argument("--factors", default="1.0,0.25")
    parser.add_argument("--columns-from-peers", action="store_true",
                        help="FP8 rows with the weight gradients' operands from pulled rows and from the regions")
    parser.add_argument("--push-in-epilogue", action="store_true",
                        help="FP8 rows with the rows pushed by the push kernel and by the GEMMs' epilogue")
    parser.add_argument("--gemm-variants", default="",
                        help="FP8 rows with each of these mainloops (ops.fp8_gemm.FP8_PUSH_GEMM_VARIANTS) in the "
                             "storing and the pushing GEMMs alike, e.g. overlap,wide")
    args = parser.parse_args()
    default = tuning_settings()
    group = EmulatedGroup(1, "cuda", exchange="symmetric")
    rows = []
    try:
        for name in args.shapes.split(","):
            t, h, f, e, k = SHAPES[name]
            inputs = [make_inputs(SHAPES[name], seed) for seed in (1, 2)]
            fns, windows = {}, {}
            for factor in (float(v) for v in args.factors.split(",")):
                for precision in ("bf16", "fp8_blockwise"):
                    config = MoKConfig(backend="kernel", precision=precision, exchange="symmetric",
                                       receive_capacity_factor=factor)
                    bound = layer_memory_bound(num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k,
                                               num_ranks=1, config=config, windowed=True)
                    for settings in (fp8_settings(args) if precision == "fp8_blockwise" else [default]):
                        key = (precision, factor, *(settings[n] for n in SETTINGS))
                        fns[key], windows[key] = step(group, config, settings), bound.num_windows
            times = median_ms_interleaved(fns, inputs, warmup=3, reps=10)
            for key, ms in times.items():
                base = min(v for other, v in times.items()
                           if other[0] == key[0] and windows[other] == 1 and other[2:] == tuple(default[n] for n in SETTINGS))
                rows.append((name, *key, windows[key], ms, ms / base))
    finally:
        apply(default)
    print(f"\n{torch.cuda.get_device_name()}\n")
    print("| shape | precision | factor | windows | dgrad ranges | wgrad operands | push | GEMMs (store, push) | "
          "fwd+bwd ms | vs one window |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: |")
    for name, precision, factor, ranges, from_peers, push, variants, m, ms, ratio in rows:
        operands = "from the regions" if from_peers else "pulled rows"
        pushed = "GEMM epilogue" if push else "push kernel"
        print(f"| {name} | {precision} | {factor} | {m} | {ranges} | {operands} | {pushed} | {', '.join(variants)} | "
              f"{ms:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
