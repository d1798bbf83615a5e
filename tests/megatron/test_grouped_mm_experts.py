"""GroupedMMExperts (torch's grouped GEMM) against Megatron's SequentialMLP on the same weights, rows
and routing weights: output and the gradients of rows, routing weights and both weights; its
layouts (TEGroupedMLP's plain state dicts load), its refusals, and `--mok-grouped-mm-experts`
choosing it inside Megatron's own MoE spec.

Tolerance: tests/oracle.py's scheme 5 (a multiple of a same-precision reference's error): both
modules are measured against a float64 evaluation of the same formula on the same (rounded) inputs,
and GroupedMMExperts' norm-relative error must stay within 2x SequentialMLP's (plus 1e-6). Both run
the same operations in the same precision with fp32 accumulation (fp32 on the CPU, bf16 on the GPU)
and differ at most in the order of the sums inside each GEMM, so their errors are alike in size; a
row on the wrong expert, a swapped gate/up half or a lost routing weight makes the error O(1) (a
routing weight's square root in place of it, tried: 0.26-0.83 against 1.2e-7). Experts without
rows get exactly zero weight gradients.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed

# E local experts, H hidden, F expert FFN (fp32 rows of 128 and 64 bytes, bf16 of 64 and 32).
NUM_EXPERTS, HIDDEN, FFN = 4, 32, 16
# name -> rows of each local expert
CASES = {
    "one_row_each": [1, 1, 1, 1],
    "an_expert_without_rows": [3, 0, 5, 2],
    "all_rows_on_one_expert": [0, 0, 12, 0],
    "many_rows": [40, 24, 33, 31],
}
RESULTS = ("output", "rows grad", "probs grad", "fc1 grad", "fc2 grad")


def _config(**overrides):
    import megatron_harness as mh

    values = dict(num_layers=1, num_moe_experts=NUM_EXPERTS, hidden_size=HIDDEN, moe_ffn_hidden_size=FFN)
    values.update(overrides)
    return mh.transformer_config("alltoall", **values)


def _float64_experts(x, counts, probs, fc1, fc2) -> dict:
    """The experts' formula in float64 with autograd: per expert e and its rows r,
    out[r] = probs[r] * (silu(x[r] @ gate_e.T) * (x[r] @ up_e.T)) @ fc2_e.T."""
    x, probs, fc1, fc2 = (t.detach().double().requires_grad_() for t in (x, probs, fc1, fc2))
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        rows = x[start : start + count]
        gate, up = (rows @ fc1[expert].T).chunk(2, dim=-1)
        outputs.append((F.silu(gate) * up * probs[start : start + count, None]) @ fc2[expert].T)
        start += count
    return dict(out=torch.cat(outputs), leaves=(x, probs, fc1, fc2))


def _results(out, grad, leaves) -> dict:
    out.backward(grad.to(out.dtype))
    return dict(zip(RESULTS, (out.detach(), *(leaf.grad for leaf in leaves))))


def _run_cases(sequential, grouped, cases: dict, dtype: torch.dtype, device: torch.device, counts_on: str) -> dict:
    """Per case: the results of SequentialMLP, GroupedMMExperts and float64, on the host."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for name, counts in cases.items():
        rows = sum(counts)
        x = torch.randn(rows, HIDDEN, generator=gen).to(device, dtype)
        probs = torch.rand(rows, generator=gen).to(device)  # float32, as Megatron's router gives them
        grad = torch.randn(rows, HIDDEN, generator=gen).to(device, dtype)
        tokens_per_expert = torch.tensor(counts, device=device if counts_on == "device" else "cpu")
        case = {}
        for label, module in (("sequential", sequential), ("grouped", grouped)):
            module.zero_grad(set_to_none=True)
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            y, bias = module(xi, tokens_per_expert.cpu() if label == "sequential" else tokens_per_expert, pi)
            assert bias is None
            y.backward(grad)
            case[label] = {k: v.detach().cpu() for k, v in zip(RESULTS, (y, xi.grad, pi.grad, *_weight_grads(module)))}
        fc1, fc2 = _weights(grouped)
        reference = _float64_experts(x.cpu(), counts, probs.cpu(), fc1.cpu(), fc2.cpu())
        case["float64"] = _results(reference["out"], grad.cpu().double(), reference["leaves"])
        out[name] = case
    return out


def _weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, 2F, H), (E, H, F) weights of either module."""
    if hasattr(module, "local_experts"):
        return tuple(torch.stack([getattr(e, n).weight.detach() for e in module.local_experts]) for n in ("linear_fc1", "linear_fc2"))
    return module.linear_fc1.weight.detach(), module.linear_fc2.weight.detach()


def _weight_grads(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, 2F, H), (E, H, F) weight gradients of either module."""
    if hasattr(module, "local_experts"):
        return tuple(torch.stack([getattr(e, n).weight.grad for e in module.local_experts]) for n in ("linear_fc1", "linear_fc2"))
    return module.linear_fc1.weight.grad, module.linear_fc2.weight.grad


def _modules(config, device: torch.device):
    """SequentialMLP from Megatron's local spec and GroupedMMExperts holding its weights."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_mok.megatron.grouped_mm_experts import GroupedMMExperts

    pg = ProcessGroupCollection.use_mpu_process_groups()
    sequential = LocalSpecProvider().grouped_mlp_modules(False)(NUM_EXPERTS, config, pg_collection=pg)
    grouped = GroupedMMExperts(NUM_EXPERTS, config, pg_collection=pg)
    fc1, fc2 = _weights(sequential)
    with torch.no_grad():
        grouped.linear_fc1.weight.copy_(fc1)
        grouped.linear_fc2.weight.copy_(fc2)
    return sequential.to(device), grouped.to(device)


def _cpu_body(rank, world_size, path):
    import megatron_harness as mh
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    mh.init_megatron()
    results = {"cases": _run_cases(*_modules(_config(), torch.device("cpu")), CASES, torch.float32, torch.device("cpu"), "host")}
    # `mok_grouped_mm_experts` inside Megatron's own spec (what register() makes of MoELayer).
    spec = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    chosen = _config()
    chosen.mok_grouped_mm_experts = True
    results["experts"] = [type(spec(config=c).experts).__name__ for c in (_config(), chosen)]
    refused = mh.transformer_config("mok", num_layers=1)
    refused.mok_grouped_mm_experts = True
    try:
        spec(config=refused)
        results["mok refusal"] = None
    except ValueError as error:
        results["mok refusal"] = str(error)
    parallel_state.destroy_model_parallel()
    # Through a file: tensors in the result queue would be shared by file descriptors that close
    # with this process.
    torch.save(results, path)


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("grouped_mm") / "cpu.pt")
    run_distributed(_cpu_body, 1, path)
    return torch.load(path)


def _assert_within_sequential(case: dict, where: str) -> None:
    from oracle import assert_within_same_precision

    for result in RESULTS:
        assert_within_same_precision(case["grouped"][result], case["sequential"][result], case["float64"][result],
                                     msg=f"{where}: {result}: GroupedMMExperts against SequentialMLP")


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_equals_sequential_mlp_on_cpu(cpu_results, case):
    results = cpu_results["cases"][case]
    _assert_within_sequential(results, case)
    for expert, count in enumerate(CASES[case]):
        if count == 0:
            for result in ("fc1 grad", "fc2 grad"):
                assert not results["grouped"][result][expert].any(), f"{case}: expert {expert} has no rows: {result} must be 0"


@pytest.mark.distributed
def test_flag_chooses_the_experts_in_megatrons_spec(cpu_results):
    assert cpu_results["experts"] == ["SequentialMLP", "GroupedMMExperts"]
    assert "--mok-grouped-mm-experts" in (cpu_results["mok refusal"] or "")


# --- Without process groups: the module's own checks and layouts -------------------------------


def _standalone(config):
    """GroupedMMExperts without Megatron's process groups (no collective runs in these tests)."""
    from megatron_mok.megatron.grouped_mm_experts import GroupedMMExperts

    return GroupedMMExperts(NUM_EXPERTS, config, pg_collection=types.SimpleNamespace(ep=None, expt_dp=None))


REFUSED = [  # (config overrides, a word of the message)
    (dict(gated_linear_unit=False, activation_func=F.gelu), "--swiglu"),
    (dict(add_bias_linear=True), "--disable-bias-linear"),
    (dict(moe_ffn_hidden_size=18), "--moe-ffn-hidden-size 18"),
    (dict(hidden_size=34, num_attention_heads=2), "--hidden-size 34"),
    (dict(bias_activation_fusion=True, activation_func=F.gelu), "--no-bias-swiglu-fusion"),
    (dict(moe_latent_size=16), "--moe-latent-size"),
]


@pytest.mark.parametrize("overrides,words", REFUSED, ids=[w for _, w in REFUSED])
def test_refuses_what_it_does_not_run(overrides, words):
    with pytest.raises(ValueError, match=words.replace("-", r"\-")):
        _standalone(_config(**overrides))


BAD_INPUTS = [  # (rows shape, tokens per expert, probs length, argument named)
    ((10, HIDDEN + 1), [4, 2, 2, 2], 10, "permuted_local_hidden_states"),
    ((10,), [4, 2, 2, 2], 10, "permuted_local_hidden_states"),
    ((10, HIDDEN), [4, 2, 4], 10, "tokens_per_expert"),
    ((10, HIDDEN), [4, 2, 2, 3], 10, "tokens_per_expert"),
    ((10, HIDDEN), [4, 2, 2, 2], 9, "permuted_probs"),
]


@pytest.mark.parametrize("shape,counts,num_probs,argument", BAD_INPUTS, ids=[f"{b[3]}{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_value_error_naming_the_argument(shape, counts, num_probs, argument):
    experts = _standalone(_config())
    with pytest.raises(ValueError, match=argument):
        experts(torch.zeros(shape), torch.tensor(counts), torch.zeros(num_probs))


def test_loads_te_grouped_mlp_state_dicts():
    """TEGroupedMLP's per-expert keys, a flat grouped weight and TE's extra states load."""
    source, target = _standalone(_config()), _standalone(_config())
    fc1, fc2 = source.linear_fc1.weight.detach(), source.linear_fc2.weight.detach()
    per_expert = {f"linear_fc1.weight{e}": fc1[e] for e in range(NUM_EXPERTS)}
    per_expert.update({f"linear_fc2.weight{e}": fc2[e] for e in range(NUM_EXPERTS)})
    per_expert.update({"linear_fc1._extra_state": torch.empty(0, dtype=torch.uint8), "linear_fc2._extra_state1": None})
    flat = {"linear_fc1.weight": fc1.reshape(-1, HIDDEN), "linear_fc2.weight": fc2.reshape(-1, FFN)}
    for state in (per_expert, flat, source.state_dict()):
        target.linear_fc1.weight.data.zero_()
        target.linear_fc2.weight.data.zero_()
        target.load_state_dict(state)
        assert torch.equal(target.linear_fc1.weight, fc1) and torch.equal(target.linear_fc2.weight, fc2)
    assert list(source.state_dict()) == ["linear_fc1.weight", "linear_fc2.weight"]


# --- On a GPU: torch's grouped GEMM on CUDA, bf16 with Megatron's fused SwiGLU ----------------


def _gpu_body(rank, world_size, counts_on, path):
    import megatron_harness as mh
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    mh.init_megatron()
    # bf16 rows of 64 and 32 bytes; the fused SwiGLU is what the throughput configs run.
    config = _config(params_dtype=torch.bfloat16, bf16=True, bias_activation_fusion=True)
    device = torch.device("cuda", 0)
    results = _run_cases(*_modules(config, device), CASES, torch.bfloat16, device, counts_on)
    parallel_state.destroy_model_parallel()
    torch.save(results, path)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_equals_sequential_mlp_on_gpu(counts_on, tmp_path):
    from distributed import GPU_RANK_ENV, assert_every_rank_returned, spawn_ranks

    path = str(tmp_path / "gpu.pt")
    assert_every_rank_returned(spawn_ranks(_gpu_body, 1, counts_on, path, timeout_s=600, env=GPU_RANK_ENV, barrier_at_end=True))
    for name, case in torch.load(path).items():
        _assert_within_sequential(case, f"{name}, tokens_per_expert on the {counts_on}")
        for expert, count in enumerate(CASES[name]):
            if count == 0:
                assert not case["grouped"]["fc1 grad"][expert].any() and not case["grouped"]["fc2 grad"][expert].any()
