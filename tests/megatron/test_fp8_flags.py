"""The experts' FP8 through Megatron's flags (docs/design.md §12): `--mok-precision`, `--fp8-format e4m3
--fp8-recipe blockwise`, the refused FP8 settings (each error names its flag), the one notice line,
and a mok MoE layer that runs its experts in FP8.

Cases that register() run in fresh interpreters (it changes process-wide Megatron state), several
cases per interpreter (importing Megatron takes ~5 s).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megatron_mok.megatron import fallbacks


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def _lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(" => ", 1) for line in result.stdout.splitlines() if " => " in line)


# (case, TransformerConfig overrides, Megatron flags parsed as the global args, the flag the error must name or None)
CONFIG_CASES = [
    ("e4m3 delayed", dict(fp8="e4m3", fp8_recipe="delayed"), [], "--fp8-recipe delayed is not supported with mok"),
    ("e4m3 tensorwise", dict(fp8="e4m3", fp8_recipe="tensorwise"), [], "--fp8-recipe tensorwise"),
    ("e4m3 mxfp8", dict(fp8="e4m3", fp8_recipe="mxfp8"), [], "--fp8-recipe mxfp8"),
    ("hybrid blockwise", dict(fp8="hybrid", fp8_recipe="blockwise"), [], "--fp8-format hybrid is not supported with mok"),
    ("fp4", dict(fp4="e2m1"), [], "--fp4-format is not supported with mok"),
    ("router padding", dict(moe_router_padding_for_quantization=True), [], "--moe-router-padding-for-quantization"),
    # The deprecated spelling becomes the one above in Megatron's __post_init__, after mok's check.
    ("router padding, deprecated", dict(moe_router_padding_for_fp8=True), [], "--moe-router-padding-for-fp8"),
    (
        "mok-precision, hidden 32",
        dict(),
        ["--mok-precision", "fp8_blockwise"],
        "--hidden-size 32 must be a multiple of 128",
    ),
    (
        "mok-precision, ffn 16",
        dict(hidden_size=128),
        ["--mok-precision", "fp8_blockwise"],
        "--moe-ffn-hidden-size 16 must be a multiple of 128",
    ),
    (
        "mok-precision, kernel backend",
        dict(hidden_size=128, moe_ffn_hidden_size=128),
        ["--mok-precision", "fp8_blockwise", "--mok-backend", "kernel"],
        None,
    ),
    (
        "fp8 blockwise, hidden 32",
        dict(fp8="e4m3", fp8_recipe="blockwise"),
        [],
        "--hidden-size 32 must be a multiple of 128",
    ),
    ("mok-precision, 128", dict(hidden_size=128, moe_ffn_hidden_size=128), ["--mok-precision", "fp8_blockwise"], None),
    # moe_ffn_hidden_size unset: Megatron's __post_init__ gives the experts ffn_hidden_size, after the check.
    (
        "mok-precision, ffn_hidden 192, moe ffn unset",
        dict(hidden_size=128, moe_ffn_hidden_size=None, ffn_hidden_size=192),
        ["--mok-precision", "fp8_blockwise"],
        "--ffn-hidden-size (the experts' FFN size when --moe-ffn-hidden-size is unset) 192 must be a multiple of 128",
    ),
    (
        "mok-precision, ffn_hidden 256, moe ffn unset",
        dict(hidden_size=128, moe_ffn_hidden_size=None, ffn_hidden_size=256),
        ["--mok-precision", "fp8_blockwise"],
        None,
    ),
    # fp16 activations: the experts take bf16 or fp32 (else the first step's x check would fail).
    ("fp16", dict(fp16=True), [], "--fp16 is not supported with mok"),
    ("fp16, fp8 experts", dict(hidden_size=128, moe_ffn_hidden_size=128, fp16=True), ["--mok-precision", "fp8_blockwise"], "--fp16"),
    # The weight cache's flags with BF16 experts: nothing would read them.
    ("cache flag, bf16 experts", dict(), ["--mok-fp8-cache-transposed-weights"], "--mok-fp8-cache-transposed-weights sets the FP8 experts' weight cache, but the experts run bf16"),
    ("no-cache flag, bf16 experts", dict(), ["--mok-no-fp8-weight-cache"], "--mok-no-fp8-weight-cache sets"),
    ("cache flag, mok-precision bf16", dict(), ["--mok-precision", "bf16", "--mok-fp8-cache-transposed-weights"], "--mok-fp8-cache-transposed-weights sets"),
    ("cache flag, fp8 experts", dict(hidden_size=128, moe_ffn_hidden_size=128), ["--mok-precision", "fp8_blockwise", "--mok-fp8-cache-transposed-weights"], None),
    ("both cache flags, fp8 experts", dict(hidden_size=128, moe_ffn_hidden_size=128), ["--mok-precision", "fp8_blockwise", "--mok-fp8-cache-transposed-weights", "--mok-no-fp8-weight-cache"], "--mok-fp8-cache-transposed-weights keeps the transposed copies beside the cached forward copies: it cannot go with --mok-no-fp8-weight-cache"),
    # Another dispatcher: mok's FP8 flags would be ignored (BF16 experts where FP8 was asked for).
    ("alltoall, mok-precision", dict(dispatcher="alltoall", hidden_size=128, moe_ffn_hidden_size=128), ["--mok-precision", "fp8_blockwise"], "--mok-precision fp8_blockwise: mok's FP8 experts need --moe-token-dispatcher-type mok (this model's is alltoall"),
    ("alltoall, cache flags", dict(dispatcher="alltoall"), ["--mok-no-fp8-weight-cache"], "--mok-no-fp8-weight-cache: mok's FP8 experts need"),
    ("alltoall, mok-precision bf16", dict(dispatcher="alltoall"), ["--mok-precision", "bf16"], None),
    ("alltoall, no mok flag", dict(dispatcher="alltoall"), [], None),
]


@pytest.fixture(scope="module")
def config_errors() -> dict[str, str]:
    """Each CONFIG_CASES case's result of building its TransformerConfig: the error, or NO ERROR."""
    code = f"""
    import sys
    sys.path.insert(0, "tests")
    import megatron_mok
    megatron_mok.register()
    import megatron_harness as mh
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    for case, overrides, flags, _ in {CONFIG_CASES!r}:
        dispatcher = overrides.pop("dispatcher", "mok")
        sys.argv = ["x", "--moe-token-dispatcher-type", dispatcher, "--num-experts", "8", *flags]
        global_vars._GLOBAL_ARGS = parse_args()
        try:
            mh.transformer_config(dispatcher, num_layers=1, **overrides)
            print(case, "=> NO ERROR")
        except Exception as error:
            print(case, "=>", type(error).__name__, str(error).replace(chr(10), " "))
    """
    return _lines(_run(code))


@pytest.mark.parametrize("case,overrides,flags,message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_fp8_settings_are_checked_when_the_config_is_built(config_errors, case, overrides, flags, message):
    error = config_errors[case]
    if message is None:
        assert error == "NO ERROR", error
    else:
        assert error.startswith("ValueError") and "--moe-token-dispatcher-type mok" in error and message in error, error


def test_fp8_blockwise_flags_pass_mok_checks():
    """--fp8-format e4m3 --fp8-recipe blockwise is no error of mok's (Megatron itself then needs
    Transformer Engine for FP8; without it, its own error follows ours)."""
    code = """
    import sys
    sys.path.insert(0, "tests")
    import megatron_mok
    megatron_mok.register()
    import megatron_harness as mh
    try:
        mh.transformer_config("mok", num_layers=1, hidden_size=128, moe_ffn_hidden_size=128, fp8="e4m3", fp8_recipe="blockwise")
        print("result => NO ERROR")
    except Exception as error:
        print("result =>", type(error).__name__, str(error).replace(chr(10), " "))
    """
    error = _lines(_run(code))["result"]
    assert "--moe-token-dispatcher-type mok" not in error, error


PRECISION = """
import sys
import megatron_mok
megatron_mok.register()
from megatron.training import global_vars
from megatron.training.arguments import parse_args
from megatron_mok.megatron.moe_layer import mok_config_for

class Config:
    fp8 = None
    fp8_recipe = "delayed"

def precision(flags, **fields):
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", *flags]
    global_vars._GLOBAL_ARGS = parse_args()
    config = Config()
    for name, value in fields.items():
        setattr(config, name, value)
    return mok_config_for(config).precision

print("default =>", precision([]))
print("mok-precision =>", precision(["--mok-precision", "fp8_blockwise"]))
print("again =>", precision(["--mok-precision", "fp8_blockwise"]))
print("fp8 blockwise =>", precision([], fp8="e4m3", fp8_recipe="blockwise"))
print("fp8 blockwise, mok-precision bf16 =>", precision(["--mok-precision", "bf16"], fp8="e4m3", fp8_recipe="blockwise"))
print("mok-precision under fp8 blockwise =>", precision(["--mok-precision", "fp8_blockwise"], fp8="e4m3", fp8_recipe="blockwise"))
"""


def test_the_experts_precision_follows_the_flags_with_one_notice_line():
    result = _run(PRECISION)
    got = _lines(result)
    assert got == {
        "default": "bf16",
        "mok-precision": "fp8_blockwise",
        "again": "fp8_blockwise",
        "fp8 blockwise": "fp8_blockwise",
        "fp8 blockwise, mok-precision bf16": "bf16",
        "mok-precision under fp8 blockwise": "fp8_blockwise",
    }, got
    notices = [line for line in result.stdout.splitlines() if "only the routed experts run FP8" in line]
    assert len(notices) == 1, result.stdout


WEIGHT_CACHE = PRECISION.split("print(")[0] + """
def cache(flags):
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", "--mok-precision", "fp8_blockwise", *flags]
    global_vars._GLOBAL_ARGS = parse_args()
    try:
        mok = mok_config_for(Config())
    except ValueError as error:
        return f"ValueError {error}"
    return f"{mok.fp8_cache_weights} {mok.fp8_cache_transposed_weights}"

print("default =>", cache([]))
print("no cache =>", cache(["--mok-no-fp8-weight-cache"]))
print("transposed kept =>", cache(["--mok-fp8-cache-transposed-weights"]))
print("both =>", cache(["--mok-no-fp8-weight-cache", "--mok-fp8-cache-transposed-weights"]))
"""


# (case, the explicit TransformerConfig.mok_config's fields, Megatron flags, the text the error must hold or None)
EXPLICIT_CASES = [
    ("default, no flags", dict(), [], None),
    ("bf16, cache flag", dict(), ["--mok-fp8-cache-transposed-weights"],
     "--mok-fp8-cache-transposed-weights asks for fp8_cache_transposed_weights=True, but TransformerConfig.mok_config"),
    ("fp8, cache flag", dict(precision="fp8_blockwise"), ["--mok-fp8-cache-transposed-weights"],
     "--mok-fp8-cache-transposed-weights asks for fp8_cache_transposed_weights=True"),
    ("fp8 kept, cache flag", dict(precision="fp8_blockwise", fp8_cache_transposed_weights=True),
     ["--mok-fp8-cache-transposed-weights"], None),
    ("fp8, no-cache flag", dict(precision="fp8_blockwise"), ["--mok-no-fp8-weight-cache"],
     "--mok-no-fp8-weight-cache asks for fp8_cache_weights=False"),
    ("bf16, mok-precision fp8", dict(), ["--mok-precision", "fp8_blockwise"],
     "--mok-precision fp8_blockwise asks for precision='fp8_blockwise'"),
    ("fp8, mok-precision fp8", dict(precision="fp8_blockwise"), ["--mok-precision", "fp8_blockwise"], None),
    ("reference, mok-backend kernel", dict(backend="reference"), ["--mok-backend", "kernel"],
     "--mok-backend kernel asks for backend='kernel'"),
    ("default, ring 0", dict(), ["--mok-dispatch-ring-minibatches", "0"],
     "--mok-dispatch-ring-minibatches 0 asks for dispatch_ring_minibatches=0"),
    ("collective, mok-exchange collective", dict(exchange="collective"), ["--mok-exchange", "collective"], None),
]


def test_flags_that_an_explicit_mok_config_would_ignore_are_refused():
    """TransformerConfig.mok_config, set in code, is taken as it is: a mok flag asking for another value
    of one of its fields is an error naming the flag and the field (it used to be ignored)."""
    code = f"""
    import sys
    sys.path.insert(0, "tests")
    import megatron_mok
    megatron_mok.register()
    import megatron_harness as mh
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron_mok import MoKConfig
    from megatron_mok.megatron.checks import check_mok_config
    for case, fields, flags, _ in {EXPLICIT_CASES!r}:
        # The config is built without the flags (mok_config is set after it is built, as in code) ...
        sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "8"]
        global_vars._GLOBAL_ARGS = parse_args()
        config = mh.transformer_config("mok", num_layers=1, hidden_size=128, moe_ffn_hidden_size=128)
        config.mok_config = MoKConfig(**fields)
        # ... and checked as the layer checks it when built, under the flags.
        sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "8", *flags]
        global_vars._GLOBAL_ARGS = parse_args()
        try:
            check_mok_config(config)
            print(case, "=> NO ERROR")
        except Exception as error:
            print(case, "=>", type(error).__name__, str(error).replace(chr(10), " "))
    """
    got = _lines(_run(code))
    for case, _, _, message in EXPLICIT_CASES:
        error = got[case]
        if message is None:
            assert error == "NO ERROR", (case, error)
        else:
            assert error.startswith("ValueError") and message in error, (case, error)


def test_the_fp8_weight_cache_flags_reach_the_config():
    got = _lines(_run(WEIGHT_CACHE))
    both = got.pop("both")
    assert got == {"default": "True False", "no cache": "False False", "transposed kept": "True True"}, got
    assert both.startswith("ValueError --mok-fp8-cache-transposed-weights") and "--mok-no-fp8-weight-cache" in both, both


LAYER_SETTINGS = PRECISION.split("print(")[0] + """
from megatron_mok import MoKConfig

def settings(flags, layer_number, **fields):
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", *flags]
    global_vars._GLOBAL_ARGS = parse_args()
    config = Config()
    config.num_layers, config.first_last_layers_bf16, config.fp8_wgrad = 4, False, True
    config.num_layers_at_start_in_bf16 = config.num_layers_at_end_in_bf16 = 1
    for name, value in fields.items():
        setattr(config, name, value)
    mok = mok_config_for(config, layer_number)
    return f"{mok.precision} {mok.fp8_weight_grad}"

fp8 = dict(fp8="e4m3", fp8_recipe="blockwise")
edges = dict(fp8, first_last_layers_bf16=True)
print("fp8, layer 1 =>", settings([], 1, **fp8))
for layer in (1, 2, 3, 4):
    print(f"first-last bf16, layer {layer} =>", settings([], layer, **edges))
print("first-last bf16, 2 at the start, layer 2 =>", settings([], 2, **edges, num_layers_at_start_in_bf16=2))
print("first-last bf16, no layer number =>", settings([], None, **edges))
print("mok-precision, first-last bf16, layer 4 =>", settings(["--mok-precision", "fp8_blockwise"], 4, first_last_layers_bf16=True))
print("explicit, first-last bf16, layer 1 =>", settings([], 1, **edges, mok_config=MoKConfig(precision="fp8_blockwise")))
print("no fp8 wgrad =>", settings([], 2, **fp8, fp8_wgrad=False))
print("mok-precision, no fp8 wgrad =>", settings(["--mok-precision", "fp8_blockwise"], 2, fp8_wgrad=False))
print("bf16, no fp8 wgrad =>", settings([], 2, fp8_wgrad=False))
"""


def test_fp8_experts_follow_the_bf16_layers_and_no_fp8_wgrad():
    """--first-last-layers-bf16: the experts of the layers Megatron keeps BF16 (its
    is_first_last_bf16_layer on the global layer number) run BF16, the others FP8, also under
    --mok-precision and an explicit MoKConfig; --no-fp8-wgrad: FP8 experts with BF16 weight
    gradients (MoKConfig.fp8_weight_grad=False); BF16 experts unchanged."""
    got = _lines(_run(LAYER_SETTINGS))
    assert got == {
        "fp8, layer 1": "fp8_blockwise True",
        "first-last bf16, layer 1": "bf16 True",
        "first-last bf16, layer 2": "fp8_blockwise True",
        "first-last bf16, layer 3": "fp8_blockwise True",
        "first-last bf16, layer 4": "bf16 True",
        "first-last bf16, 2 at the start, layer 2": "bf16 True",
        "first-last bf16, no layer number": "fp8_blockwise True",
        "mok-precision, first-last bf16, layer 4": "bf16 True",
        "explicit, first-last bf16, layer 1": "bf16 True",
        "no fp8 wgrad": "fp8_blockwise False",
        "mok-precision, no fp8 wgrad": "fp8_blockwise False",
        "bf16, no fp8 wgrad": "bf16 True",
    }, got


def test_a_bad_mok_precision_is_rejected_by_the_parser():
    code = """
    import sys
    import megatron_mok
    megatron_mok.register()
    from megatron.training.arguments import parse_args
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", "--mok-precision", "fp16"]
    parse_args()
    """
    result = _run(code)
    assert result.returncode == 2 and "--mok-precision" in result.stderr and "invalid choice" in result.stderr, result.stderr


def test_fp8_format_without_transformer_engine_points_mok_users_to_mok_precision():
    missing = lambda module: "ImportError: no" if module == fallbacks.TE_MODULE else None  # noqa: E731
    sources = [("the command line", ["--moe-token-dispatcher-type", "mok", "--fp8-format", "e4m3"])]
    with pytest.raises(fallbacks.MissingPackageError, match="--mok-precision fp8_blockwise runs the routed experts in FP8 without it"):
        fallbacks.resolve(sources, probe=missing)
    with pytest.raises(fallbacks.MissingPackageError) as error:
        fallbacks.resolve([("the command line", ["--fp8-format", "e4m3"])], probe=missing)
    assert "--mok-precision" not in str(error.value)


LAYER = """
import sys
sys.path.insert(0, "tests")
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
import megatron_harness as mh
mh.init_megatron()
from megatron.training import global_vars
from megatron.training.arguments import parse_args
from oracle import sqnr_db

def layer(flags):
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", *flags]
    global_vars._GLOBAL_ARGS = parse_args()
    config = mh.transformer_config("mok", num_layers=1, hidden_size=128, moe_ffn_hidden_size=128, num_moe_experts=4)
    return mh.moe_layer(config, "mok")

bf16 = layer([])
fp8 = layer(["--mok-precision", "fp8_blockwise"])
fp8.load_state_dict(bf16.state_dict())
print("precision =>", bf16.mok_config.precision, fp8.mok_config.precision)
gen = torch.Generator().manual_seed(3)
x = torch.randn(16, 2, 128, generator=gen)
grad = torch.randn(16, 2, 128, generator=gen)
results = []
for module in (bf16, fp8):
    xi = x.clone().requires_grad_()
    y, _ = module(xi)
    y.backward(grad)
    results.append((y.detach(), xi.grad, module.experts.weight1.grad, module.experts.weight2.grad))
for name, a, b in zip(("y", "dx", "dfc1", "dfc2"), *results):
    print(name, "=>", bool(torch.isfinite(b).all()), round(sqnr_db(b, a), 1))
# The global layer number Megatron's TransformerLayer hands its MoE layer after building it.
sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4", "--mok-precision", "fp8_blockwise"]
global_vars._GLOBAL_ARGS = parse_args()
edges = mh.moe_layer(mh.transformer_config("mok", num_layers=4, hidden_size=128, moe_ffn_hidden_size=128,
                                           num_moe_experts=4, first_last_layers_bf16=True), "mok")
numbered = []
for number in (1, 2, 4):
    edges.set_layer_number(number)
    numbered.append(edges.mok_config.precision)
print("layer numbers =>", " ".join(numbered))
"""


def test_a_mok_layer_runs_its_experts_in_fp8():
    """A Megatron MoE layer with --mok-precision fp8_blockwise against the same layer in fp32 (the
    harness's params dtype), same weights: finite, and within the recipe's noise (about 24 dB against
    unquantized values, tests/api/test_fp8_layer.py, 24.0-24.6 dB measured here; bar 20 dB), yet
    below 60 dB (it did run FP8: fp32 against itself would be exact)."""
    from distributed import free_port

    got = _lines(_run(LAYER.replace("{port}", str(free_port()))))
    assert got.pop("precision") == "bf16 fp8_blockwise", got
    # --first-last-layers-bf16 with four layers: the first and last layers' experts BF16.
    assert got.pop("layer numbers") == "bf16 fp8_blockwise bf16", got
    for name, value in got.items():
        finite, db = value.split()
        assert finite == "True" and 20.0 <= float(db) < 60.0, f"{name}: {value}"


NOTICE_BY_LAYER = LAYER_SETTINGS.split("fp8 = dict(")[0] + """
edges = dict(first_last_layers_bf16=True)
print("layer 1 =>", settings(["--mok-precision", "fp8_blockwise"], 1, **edges))
print("NOTICES after layer 1 =>", len(__import__("megatron_mok.megatron.moe_layer", fromlist=["x"]).precision_notes))
print("layer 2 =>", settings(["--mok-precision", "fp8_blockwise"], 2, **edges))
"""


def test_the_notice_line_comes_with_the_first_layer_whose_experts_run_fp8():
    """--first-last-layers-bf16 keeps layer 1's experts BF16: no "only the experts run FP8" line for
    it; layer 2's run FP8 and print it."""
    result = _run(NOTICE_BY_LAYER)
    got = _lines(result)
    assert got == {"layer 1": "bf16 True", "NOTICES after layer 1": "0", "layer 2": "fp8_blockwise True"}, got
    notices = [line for line in result.stdout.splitlines() if "only the routed experts run FP8" in line]
    assert len(notices) == 1, result.stdout
