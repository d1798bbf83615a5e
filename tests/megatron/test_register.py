"""`--moe-token-dispatcher-type mok` before and after register(), and the rejected combinations.

Each case runs in a fresh interpreter: register() changes process-wide Megatron state.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PARSE = """
import sys
from megatron.training.arguments import parse_args
sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4"]
{before}
args = parse_args()
print("PARSED", args.moe_token_dispatcher_type, getattr(args, "mok_backend", None))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_flag_rejected_before_register():
    result = _run(PARSE.format(before=""))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "invalid choice: 'mok'" in result.stderr


def test_flag_accepted_after_register():
    result = _run(PARSE.format(before="import megatron_mok; megatron_mok.register()"))
    assert result.returncode == 0, result.stderr
    assert "PARSED mok auto" in result.stdout


def test_moe_layer_refuses_mok_before_register_and_builds_after():
    code = """
    import sys
    sys.path.insert(0, "tests")
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron_mok.megatron.cpu_compat import apply_cpu_patches
    apply_cpu_patches()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1, inference_rng_tracker=True, force_reset_rng=True)
    import megatron_harness as mh
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    def build():
        spec = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)
        return spec(config=mh.transformer_config("mok", num_layers=1))
    try:
        build()
    except ValueError as error:
        print("REFUSED", error)
    import megatron_mok
    megatron_mok.register()
    layer = build()
    print("BUILT", type(layer).__name__, type(layer.token_dispatcher).__name__, type(layer.experts).__name__)
    """
    from distributed import free_port

    result = _run(code.replace("{port}", str(free_port())))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED Unsupported token dispatcher type: mok" in result.stdout
    assert "BUILT MoKMoELayer MoKTokenDispatcher MoKGroupedExperts" in result.stdout


UNSUPPORTED = [
    ("moe_shared_expert_overlap", dict(moe_shared_expert_overlap=True, moe_shared_expert_intermediate_size=16), "--moe-shared-expert-overlap"),
    ("expert TP 2", dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size"),
    ("not gated", dict(gated_linear_unit=False), "--swiglu"),
    ("bias", dict(add_bias_linear=True), "--disable-bias-linear"),
    ("probs on input", dict(moe_apply_probs_on_input=True, moe_router_topk=1), "--moe-apply-probs-on-input"),
    ("pad to capacity", dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0), "--moe-pad-expert-input-to-capacity"),
    ("delay wgrad", dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
    ("TP without SP", dict(tensor_model_parallel_size=2, sequence_parallel=False), "--sequence-parallel"),
    ("expert TP defaults to TP", dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=None), "--expert-tensor-parallel-size"),
]


@pytest.fixture(scope="module")
def unsupported_errors() -> dict[str, str]:
    """The error of every UNSUPPORTED case, from one interpreter (importing Megatron takes ~5 s)."""
    code = f"""
    import sys
    sys.path.insert(0, "tests")
    import megatron_mok
    megatron_mok.register()
    import megatron_harness as mh
    for case, overrides, _ in {UNSUPPORTED!r}:
        try:
            mh.transformer_config("mok", num_layers=1, **overrides)
            print(case, "=> NO ERROR")
        except Exception as error:
            print(case, "=>", type(error).__name__, str(error).replace(chr(10), " "))
    """
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(" => ", 1) for line in result.stdout.splitlines() if " => " in line)


@pytest.mark.parametrize("case,overrides,flag", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_combination_fails_at_config_time(unsupported_errors, case, overrides, flag):
    error = unsupported_errors[case]
    assert error.startswith("ValueError") and flag in error, error


def test_supported_config_builds():
    code = """
    import sys
    sys.path.insert(0, "tests")
    import megatron_mok
    megatron_mok.register()
    import megatron_harness as mh
    config = mh.transformer_config("mok", num_layers=1, moe_shared_expert_intermediate_size=16)
    print("OK", config.moe_token_dispatcher_type)
    """
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK mok" in result.stdout


def test_mok_flags_reach_the_layer_config():
    """--mok-backend, --mok-expert-gemm and --mok-dispatch-ring-minibatches end up in the MoKConfig
    the MoE layer runs with."""
    code = """
    import sys
    import megatron_mok
    megatron_mok.register()
    from megatron.training.arguments import parse_args
    from megatron.training import global_vars
    sys.argv = ["x", "--moe-token-dispatcher-type", "mok", "--num-experts", "4",
                "--mok-backend", "kernel", "--mok-expert-gemm", "sm90", "--mok-dispatch-ring-minibatches", "0"]
    global_vars._GLOBAL_ARGS = parse_args()
    from megatron_mok.megatron.moe_layer import mok_config_for
    class Config:
        pass
    print("CONFIG", mok_config_for(Config()))
    """
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "backend='kernel'" in result.stdout and "expert_gemm='sm90'" in result.stdout, result.stdout
    assert "dispatch_ring_minibatches=0" in result.stdout, result.stdout


def test_bad_expert_gemm_flag_is_rejected():
    result = _run(PARSE.format(before="import megatron_mok; megatron_mok.register(); sys.argv += ['--mok-expert-gemm', 'cublas']"))
    assert result.returncode == 2 and "--mok-expert-gemm" in result.stderr, result.stderr
