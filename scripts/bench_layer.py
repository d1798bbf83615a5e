"""MoE layer benchmark on one GPU: the PyTorch grouped-GEMM pipeline, Megatron's MoE layer with
the alltoall dispatcher (if megatron-core is installed) and mok, on the same inputs.

    python scripts/bench_layer.py [--shapes deepseek_v3,qwen3_235b,qwen3_30b] [--out DIR] [--fp8]

--fp8 adds the FP8 blockwise rows: mok's kernel backend with MoKConfig(precision="fp8_blockwise")
(with and without its weight cache, MoKConfig.fp8_cache_weights; a later microbatch's, the same weight
leaves call after call, mok_kernel_fp8_later_microbatch; both with the transposed weight copies kept
beside the forward ones, MoKConfig.fp8_cache_transposed_weights, mok_kernel_fp8_kept_transposed*;
and with act quantized where
backends.tuning.FP8_ACT_QUANTIZE does not choose, mok_kernel_fp8_act_*), and torchao's FP8 rowwise MoE op
where torchao is installed (torch's grouped GEMM pipeline with each GEMM through torchao's
dynamically quantizing FP8 rowwise grouped GEMM), each with its forward error beside the bf16 rows'.

Prints ms, effective TFLOP/s (6*T*K*H*F forward, twice that backward), peak memory, and the
same-run dense cuBLAS bf16 GEMM rate; a table last, a plot saved to DIR/bench_layer.png. Each
call is timed alone (the device idles while the host launches its first kernels) and queued back
to back (the host runs ahead, as in a training loop, unless the method synchronizes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import dense_gemm_tflops, held_memory_mb, median_ms, median_ms_queued, peak_memory_mb  # noqa: E402

from megatron_mok import MoKConfig, fp8_weights, mok_moe  # noqa: E402

SHAPES = {
    # name: (tokens, hidden, ffn, experts, topk)
    "deepseek_v3": (8192, 7168, 2048, 32, 8),  # DeepSeek-V3 per rank at EP = 8
    "qwen3_235b": (8192, 4096, 1536, 16, 8),
    "qwen3_30b": (16384, 2048, 768, 128, 8),  # Qwen3-30B-A3B at EP = 1
}
NUM_INPUT_SETS = 2
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def make_inputs(shape, seed):
    t, h, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    scores = torch.randn(t, e, device="cuda", generator=gen)
    weights, ids = torch.softmax(scores, dim=1).topk(k, dim=1)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16()
    grad = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    return dict(x=x, ids=ids, weights=weights.float().contiguous(), fc1=fc1, fc2=fc2, grad=grad)


def pytorch_pipeline(x, ids, weights, fc1, fc2):
    """Gather -> grouped_mm gate/up -> SwiGLU -> grouped_mm down -> weighted index_add_ (fp32)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=fc1.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    token = order // k
    rows = x.index_select(0, token)
    gate, up = _grouped_mm(rows, fc1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = _grouped_mm(F.silu(gate) * up, fc2.transpose(1, 2), offs=offs)
    scaled = out.float() * weights.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, token, scaled)
    return y.to(x.dtype)


def torchao_fp8_rowwise_pipeline():
    """(pytorch_pipeline with both grouped GEMMs through torchao's FP8 rowwise op, None), or (None,
    why). torch._scaled_grouped_mm takes groups that start at multiples of 16 rows, so each expert's
    rows are placed at a 16-aligned start of a buffer of T*K + 16*E rows (zero padding rows)."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm
    except Exception as error:  # noqa: BLE001 (not installed, or no Triton)
        return None, f"torchao: {str(error).splitlines()[0] if str(error) else type(error).__name__}"

    def run(x, ids, weights, fc1, fc2):
        t, k = ids.shape
        e, h = fc1.shape[0], x.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        padded = (counts + 15) // 16 * 16
        ends = torch.cumsum(padded, 0)
        sorted_expert = flat[order]
        # Route order[i] (the i-th in expert order) lands at its expert's aligned start plus its rank there.
        position = (ends - padded)[sorted_expert] + torch.arange(t * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
        token = order // k
        rows = x.new_zeros(t * k + 16 * e, h).index_copy(0, position, x.index_select(0, token))
        offs = ends.to(torch.int32)
        gate, up = fp8_mm(rows, fc1.transpose(1, 2), offs, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False).chunk(2, dim=-1)
        out = fp8_mm(F.silu(gate) * up, fc2.transpose(1, 2), offs, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False)
        scaled = out.index_select(0, position).float() * weights.reshape(-1)[order].unsqueeze(1)
        y = torch.zeros(t, h, device=x.device, dtype=torch.float32)
        y.index_add_(0, token, scaled)
        return y.to(x.dtype)

    return run, None


FP8_KERNEL = MoKConfig(backend="kernel", precision="fp8_blockwise")
# The same without the weight cache: every forward quantizes its weights, no FP8 copy held between passes.
FP8_KERNEL_UNCACHED = MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_cache_weights=False)
# The same keeping the dgrads' transposed weight copies beside the forward ones (made in one pass).
FP8_KERNEL_KEPT_TRANSPOSED = MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_cache_transposed_weights=True)
# The same with BF16 weight gradients (MoKConfig.fp8_weight_grad=False): no column-wise quantization,
# the BF16 kernel's weight gradients on bf16 rows, dY and act.
FP8_KERNEL_BF16_WGRAD = MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_weight_grad=False)


def mok_layer(config):
    def run(x, ids, weights, fc1, fc2):
        return mok_moe(x, ids, weights, fc1, fc2, config=config)

    return run


def later_microbatch(run):
    """run, marked to be timed (forward, and forward + backward) with the FP8 weight cache kept from
    call to call, and forward + backward with the same fc1 and fc2 leaves call after call (their
    gradients dropped before each call, not accumulated): a microbatch after the first of an
    optimizer step, whose FP8 forward copies the weight cache already holds. Every other row empties
    the cache at the start of each timed call (fp8_weights.clear(); a detached leaf over the same
    bytes would otherwise find the copies an earlier call made), so it quantizes its weights inside
    the timed call, forward alone too, as the first microbatch after an optimizer step does."""
    run.same_weights = True
    return run


@contextlib.contextmanager
def tuning_set(settings: dict):
    """backends.tuning's names set to their choices in settings inside the block (forward and backward
    both read them at call time), so a choice and the one tuning makes run side by side in one process."""
    from megatron_mok.backends import tuning

    chosen = {name: getattr(tuning, name) for name in settings}
    for name, choice in settings.items():
        setattr(tuning, name, choice)
    try:
        yield
    finally:
        for name, choice in chosen.items():
            setattr(tuning, name, choice)


def with_tuning(name: str, choice, run, **more):
    """run, marked to be timed (forward, and forward with backward) under tuning_set: name set to
    choice, and each of `more`'s names to its value."""
    run.tuning = {name: choice, **more}
    return run


def fp8_alternatives() -> dict:
    """The FP8 kernel layer with the act quantization tuning does not choose (tuning.FP8_ACT_QUANTIZE):
    label -> run."""
    from megatron_mok.backends import tuning

    runs = {"mok_kernel_fp8_act_" + choice: with_tuning("FP8_ACT_QUANTIZE", choice, mok_layer(FP8_KERNEL))
            for choice in tuning.FP8_ACT_QUANTIZE_CHOICES if choice != tuning.FP8_ACT_QUANTIZE}
    # The dgrads over the whole transposed weight copies at once (one launch each), beside the ranges
    # tuning.FP8_DGRAD_EXPERT_RANGES makes them in: what the ranges cost, and what they save in peak.
    if tuning.FP8_DGRAD_EXPERT_RANGES != 1:
        runs["mok_kernel_fp8_dgrad_whole_copy"] = with_tuning("FP8_DGRAD_EXPERT_RANGES", 1, mok_layer(FP8_KERNEL))
    # The weight gradients in the 128 x 192 wide kernel, without and with its consumers' blocks issued
    # in turn (wide_ordered), whichever tuning does not choose, beside tuning's.
    for variant in ("wide", "wide_ordered"):
        if tuning.FP8_WGRAD_VARIANT != variant:
            runs["mok_kernel_fp8_wgrad_" + variant] = with_tuning("FP8_WGRAD_VARIANT", variant, mok_layer(FP8_KERNEL))
    # The plain FP8 GEMMs (fc2, the dgrads; fc1 with the act kernel) with their scale products made
    # after each block's wait (ops.fp8_gemm's overlap_late_scales), beside tuning's mainloop.
    if tuning.FP8_EXPERT_GEMM_VARIANT != "overlap_late_scales":
        runs["mok_kernel_fp8_gemm_late_scales"] = with_tuning("FP8_EXPERT_GEMM_VARIANT", "overlap_late_scales",
                                                              mok_layer(FP8_KERNEL))
    # The plain FP8 GEMMs in 128 x 192 tiles (ops.fp8_gemm's wide; wide_ordered: the consumers' blocks
    # issued in turn; wide_ordered_across_tiles: and the next tile's first block before a tile's
    # epilogue; wide_ordered_staged_scales: in turn, the A scales through the stages) and in the
    # 128 x 128 overlap mainloop, whichever tuning does not choose, beside tuning's.
    for variant in ("wide", "wide_ordered", "wide_ordered_across_tiles", "wide_ordered_staged_scales", "overlap"):
        if tuning.FP8_EXPERT_GEMM_VARIANT != variant:
            runs["mok_kernel_fp8_gemm_" + variant] = with_tuning("FP8_EXPERT_GEMM_VARIANT", variant,
                                                                 mok_layer(FP8_KERNEL))
    # The FP8 GEMMs (all but the weight gradients) at 2-CTA clusters, each CTA loading half of a tile's
    # weight slice and multicasting it into both (fewer L2 -> SM bytes per FLOP), beside tuning's launch:
    # in tuning's mainloop and, where tuning runs another, in wide_ordered.
    if tuning.FP8_EXPERT_GEMM_CLUSTER_M != 2:
        runs["mok_kernel_fp8_gemm_cluster_2"] = with_tuning("FP8_EXPERT_GEMM_CLUSTER_M", 2, mok_layer(FP8_KERNEL))
        if not tuning.FP8_EXPERT_GEMM_VARIANT.startswith("wide_ordered"):
            runs["mok_kernel_fp8_gemm_wide_ordered_cluster_2"] = with_tuning(
                "FP8_EXPERT_GEMM_CLUSTER_M", 2, mok_layer(FP8_KERNEL), FP8_EXPERT_GEMM_VARIANT="wide_ordered")
    # Every wide kernel with its blocks issued in turn, the GEMMs and the weight gradients (where tuning
    # runs the GEMMs in a mainloop without turns; else the wgrad row above is nearly this one).
    if not tuning.FP8_EXPERT_GEMM_VARIANT.startswith("wide_ordered"):
        runs["mok_kernel_fp8_all_wide_ordered"] = with_tuning(
            "FP8_EXPERT_GEMM_VARIANT", "wide_ordered", mok_layer(FP8_KERNEL), FP8_WGRAD_VARIANT="wide_ordered")
    # The SwiGLU backward in the down dgrad's epilogue (ops.fp8_expert_gemm_swiglu_backward), beside
    # tuning's launch of its own.
    if not tuning.FP8_SWIGLU_BACKWARD_IN_DGRAD:
        runs["mok_kernel_fp8_swiglu_bwd_epilogue"] = with_tuning("FP8_SWIGLU_BACKWARD_IN_DGRAD", True,
                                                                 mok_layer(FP8_KERNEL))
    # d gate_up's two FP8 copies from one pass (ops.fp8_quantize_swiglu_backward_copies, no bf16 d
    # gate_up), or from the SwiGLU backward's launch and a column quantization, whichever tuning does
    # not choose, beside tuning's.
    one_pass = not tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS
    runs["mok_kernel_fp8_grad_gate_up_" + ("one_pass" if one_pass else "two_launches")] = with_tuning(
        "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", one_pass, mok_layer(FP8_KERNEL))
    # And act's column copy from that pass too (gate_up read once in backward), unless tuning runs it.
    if not (tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS and tuning.FP8_ACT_COLUMNS_IN_ONE_PASS):
        runs["mok_kernel_fp8_grad_gate_up_and_act_one_pass"] = with_tuning(
            "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", True, mok_layer(FP8_KERNEL), FP8_ACT_COLUMNS_IN_ONE_PASS=True)
    return runs


def megatron_alltoall_layer(shape, expert_parallel: int = 1):
    """(Megatron's MoELayer with the alltoall dispatcher and the installed experts, their name), or
    (None, why). With expert_parallel = 1 it starts a one-rank process group if none exists; with
    more, the launch's group (torchrun) must exist and hold expert_parallel ranks."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as error:
        return None, f"megatron-core does not import ({error})"
    t, h, f, e, k = shape
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
        model_parallel_cuda_manual_seed(0)
    try:
        import transformer_engine  # noqa: F401

        use_te = True
    except ImportError:
        use_te = False
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=8, num_moe_experts=e, moe_router_topk=k,
        moe_ffn_hidden_size=f, moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        moe_grouped_gemm=use_te, moe_router_load_balancing_type="none", gradient_accumulation_fusion=False,
        expert_model_parallel_size=expert_parallel,
    )
    layer = get_moe_module_spec(use_te=use_te, num_experts=e, moe_grouped_gemm=use_te)(config=config).cuda()
    experts = "TEGroupedMLP" if use_te else "SequentialMLP (no Transformer Engine)"
    return layer, experts


def kernel_forward_stage_ms(s, expert_gemm: str, reps: int = 10) -> dict:
    """Median time of each stage of the kernel backend's forward (events between stages)."""
    import statistics

    from megatron_mok import build_schedule
    from megatron_mok.backends import stages_for
    from megatron_mok.comm import exchange_for, get_expert_parallel_group
    from megatron_mok.functional import plan_for
    from megatron_mok.receive import windows

    st = stages_for("kernel", expert_gemm)
    exchange = exchange_for(get_expert_parallel_group(None, s["x"].device))
    plan = plan_for(exchange, s["x"].shape[0], s["ids"].shape[1], s["fc1"].shape[0], MoKConfig())  # one window
    # dispatch_gate_up is one stage: the sm90 GEMM folds the dispatch into its loads.
    names = ("schedule", "dispatch+gate_up+swiglu", "down_gemm", "combine")
    samples = {n: [] for n in names}
    for _ in range(reps + 2):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        events[0].record()
        schedule = build_schedule(s["ids"], num_local_experts=s["fc1"].shape[0])
        events[1].record()
        _, gate_up, act = st.dispatch_gate_up(exchange.dispatch_source(s["x"]), schedule, s["fc1"], MoKConfig().dispatch_ring_minibatches)
        events[2].record()
        out = st.expert_down(act, s["fc2"], schedule.expert_offsets)
        events[3].record()
        returned = exchange.open_return(schedule, out.shape[1], out.dtype)
        returned.push(out, windows(schedule, plan)[0])
        table = returned.table(keep=True)
        index = exchange.route_index(schedule, s["ids"])
        st.combine(table, index, s["weights"], schedule.topk, s["x"].dtype)
        events[4].record()
        events[-1].synchronize()
        for i, n in enumerate(names):
            samples[n].append(events[i].elapsed_time(events[i + 1]))
    return {n: statistics.median(v[2:]) for n, v in samples.items()}


def forward_errors(s, fp8: bool = False) -> dict:
    """||y - y_fp32|| / ||y_fp32|| of the kernel and of the bf16 reference (same precision); with fp8,
    of the FP8 rows too."""
    from megatron_mok import MoKConfig as C

    with torch.no_grad():
        exact = mok_moe(s["x"].float(), s["ids"], s["weights"], s["fc1"].float(), s["fc2"].float(), config=C(backend="reference"))
        errors = {}
        for label, cfg in (
            ("mok_kernel", C(backend="kernel")),
            ("mok_kernel_sm90", C(backend="kernel", expert_gemm="sm90")),
            ("mok_kernel_grouped_mm", C(backend="kernel", expert_gemm="grouped_mm")),
            ("bf16_reference", C(backend="reference")),
        ):
            y = mok_moe(s["x"], s["ids"], s["weights"], s["fc1"], s["fc2"], config=cfg).float()
            errors[label] = float((y - exact).norm() / exact.norm())
        if fp8:
            fns = {"mok_kernel_fp8": mok_layer(FP8_KERNEL), "torchao_fp8_rowwise": torchao_fp8_rowwise_pipeline()[0]}
            for label, fn in fns.items():
                if fn is not None:
                    y = fn(s["x"], s["ids"], s["weights"], s["fc1"], s["fc2"]).float()
                    errors[label] = float((y - exact).norm() / exact.norm())
    return errors


def bench_shape(name, shape, results, progress, fp8: bool = False):
    t, h, f, e, k = shape
    flops_fwd = 6 * t * k * h * f
    sets = [make_inputs(shape, seed) for seed in range(NUM_INPUT_SETS)]
    methods = {
        "pytorch": pytorch_pipeline,
        "mok_kernel": mok_layer(MoKConfig(backend="kernel")),
        "mok_kernel_sm90": mok_layer(MoKConfig(backend="kernel", expert_gemm="sm90")),
        # The same without the dispatch's ring buffer: every dispatched row kept for backward.
        "mok_kernel_sm90_no_ring": mok_layer(MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=0)),
        "mok_kernel_grouped_mm": mok_layer(MoKConfig(backend="kernel", expert_gemm="grouped_mm")),
        "mok_reference": mok_layer(MoKConfig(backend="reference")),
    }
    row = {"shape": name, "T": t, "H": h, "F": f, "E": e, "K": k}
    if fp8:
        methods["mok_kernel_fp8"] = mok_layer(FP8_KERNEL)
        methods["mok_kernel_fp8_uncached"] = mok_layer(FP8_KERNEL_UNCACHED)
        methods["mok_kernel_fp8_later_microbatch"] = later_microbatch(mok_layer(FP8_KERNEL))
        methods["mok_kernel_fp8_kept_transposed"] = mok_layer(FP8_KERNEL_KEPT_TRANSPOSED)
        methods["mok_kernel_fp8_kept_transposed_later_microbatch"] = later_microbatch(
            mok_layer(FP8_KERNEL_KEPT_TRANSPOSED))
        methods["mok_kernel_fp8_bf16_wgrad"] = mok_layer(FP8_KERNEL_BF16_WGRAD)
        methods.update(fp8_alternatives())  # the tuning choices not made, beside the ones made
        torchao_run, row["torchao_why"] = torchao_fp8_rowwise_pipeline()
        if torchao_run is not None:
            methods["torchao_fp8_rowwise"] = torchao_run
    for label, fn in methods.items():
        progress(f"{name}: {label}")

        chosen = functools.partial(tuning_set, fn.tuning) if hasattr(fn, "tuning") else contextlib.nullcontext

        fp8_weights.clear()  # (no row finds copies another row's config made)
        first_microbatch = not getattr(fn, "same_weights", False)

        def fwd(s, fn=fn, chosen=chosen, first_microbatch=first_microbatch):
            if first_microbatch:
                fp8_weights.clear()
            with torch.no_grad(), chosen():
                return fn(s["x"], s["ids"], s["weights"], s["fc1"], s["fc2"])

        def fwd_with_grad(s, fn=fn, chosen=chosen, label=label, first_microbatch=first_microbatch):
            if first_microbatch:
                fp8_weights.clear()
            leaves = [s[n].detach().requires_grad_() for n in ("x", "weights", "fc1", "fc2")]
            if getattr(fn, "same_weights", False):
                for i, n in ((2, "fc1"), (3, "fc2")):
                    # (each row's own leaves: the weight cache keeps one entry per leaf, and a row
                    # must find there only what its own config made)
                    leaf = s.setdefault(f"{n}_leaf_{label}", s[n].detach().requires_grad_())
                    leaf.grad = None
                    leaves[i] = leaf
            with chosen():
                return fn(leaves[0], s["ids"], leaves[1], leaves[2], leaves[3])

        def fwd_bwd(s, fn=fn, chosen=chosen, label=label):
            with chosen():
                fwd_with_grad(s).backward(s["grad"])
            if getattr(fn, "same_weights", False):
                # Dropped here too, not only before the next call: a held-memory measurement after
                # this call would otherwise see them freed inside it (a negative held MB).
                for n in ("fc1", "fc2"):
                    s[f"{n}_leaf_{label}"].grad = None

        ms_f, ms_fb = median_ms(fwd, sets), median_ms(fwd_bwd, sets)
        row[label] = dict(
            fwd_ms=ms_f, fwd_tflops=flops_fwd / ms_f / 1e9,
            fwd_bwd_ms=ms_fb, fwd_bwd_tflops=3 * flops_fwd / ms_fb / 1e9,
            peak_mb=peak_memory_mb(fwd_bwd, sets[0]), held_mb=held_memory_mb(fwd_with_grad, sets[0]),
            queued_fwd_ms=median_ms_queued(fwd, sets), queued_fwd_bwd_ms=median_ms_queued(fwd_bwd, sets),
        )
    progress(f"{name}: megatron alltoall")
    layer, experts = megatron_alltoall_layer(shape)
    row["megatron_experts"] = experts
    if layer is not None:
        hidden_sets = [s["x"].view(t, 1, h) for s in sets]

        def mfwd(x):
            with torch.no_grad():
                return layer(x)

        def mfwd_bwd(x):
            xi = x.detach().requires_grad_()
            y, _ = layer(xi)
            y.backward(torch.ones_like(y))

        ms_f, ms_fb = median_ms(mfwd, hidden_sets, reps=5), median_ms(mfwd_bwd, hidden_sets, reps=5)
        row["megatron_alltoall"] = dict(
            fwd_ms=ms_f, fwd_tflops=flops_fwd / ms_f / 1e9, fwd_bwd_ms=ms_fb,
            fwd_bwd_tflops=3 * flops_fwd / ms_fb / 1e9, peak_mb=peak_memory_mb(mfwd_bwd, hidden_sets[0]),
            queued_fwd_ms=median_ms_queued(mfwd, hidden_sets), queued_fwd_bwd_ms=median_ms_queued(mfwd_bwd, hidden_sets),
        )
        del layer
    row["kernel_stages_ms"] = {gemm: kernel_forward_stage_ms(sets[0], gemm) for gemm in ("auto", "grouped_mm", "sm90")}
    row["forward_error"] = forward_errors(sets[0], fp8)
    results.append(row)
    del sets
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--fp8", action="store_true", help="add mok's FP8 blockwise kernel layer and torchao's FP8 rowwise MoE op")
    args = parser.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    names = args.shapes.split(",")
    bar = tqdm(total=len(names) * 7 + 1, file=sys.stderr) if tqdm else None

    def progress(label):
        if bar:
            bar.set_description(label)
            bar.update(1)
        else:
            print(label, file=sys.stderr)

    progress("dense cuBLAS GEMM")
    dense = dense_gemm_tflops()
    results = []
    for name in names:
        bench_shape(name, SHAPES[name], results, progress, args.fp8)
    if bar:
        bar.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_layer.json").write_text(json.dumps(dict(dense_tflops=dense, device=torch.cuda.get_device_name(), results=results), indent=1))
    _plot(results, dense, out / "bench_layer.png")

    _print_details(results)
    _print_queued(results)
    print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}; dense bf16 GEMM 8192^3: {dense:.0f} TFLOP/s")
    print(f"{'shape':<12} {'method':<46} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'peak MB':>9} {'held MB':>8} {'fwd x':>6} {'f+b x':>6}")
    for row in results:
        base = row["pytorch"]
        for label in METHOD_LABELS + (fp8_labels(row) if args.fp8 else ()):
            r = row.get(label)
            if r is None:
                why = row.get("torchao_why") if label == "torchao_fp8_rowwise" else row.get("megatron_experts")
                print(f"{row['shape']:<12} {label:<46} {'n/a: ' + str(why):>40}")
                continue
            held = f"{r['held_mb']:8.0f}" if "held_mb" in r else f"{'-':>8}"  # (megatron_alltoall's is not measured)
            print(
                f"{row['shape']:<12} {label:<46} {r['fwd_ms']:8.2f} {r['fwd_tflops']:8.0f} {r['fwd_bwd_ms']:8.2f} "
                f"{r['fwd_bwd_tflops']:8.0f} {r['peak_mb']:9.0f} {held} "
                f"{base['fwd_ms'] / r['fwd_ms']:6.2f} {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:6.2f}"
            )


# mok_kernel is the default configuration (expert_gemm="auto"); the others force one GEMM family
# (sm90_no_ring: without the dispatch's ring buffer). held MB: memory a forward under autograd leaves
# allocated (output + saved activations).
METHOD_LABELS = (
    "pytorch", "megatron_alltoall", "mok_reference", "mok_kernel_grouped_mm", "mok_kernel_sm90_no_ring",
    "mok_kernel_sm90", "mok_kernel",
)
# With --fp8: mok's FP8 blockwise kernel layer and torchao's FP8 rowwise op, then every alternative
# to tuning's choices the run timed (fp8_alternatives: the rows present, in the order they ran).
FP8_LABELS = ("torchao_fp8_rowwise", "mok_kernel_fp8", "mok_kernel_fp8_later_microbatch", "mok_kernel_fp8_uncached",
              "mok_kernel_fp8_bf16_wgrad")


def fp8_labels(row: dict) -> tuple:
    return FP8_LABELS + tuple(label for label in row if label.startswith("mok_kernel_fp8_") and label not in FP8_LABELS)


def _print_queued(results):
    print("\nqueued back to back (the host runs ahead, as in training; ms per call, x = speed-up over pytorch):")
    for row in results:
        base = row["pytorch"]
        cells = []
        for label in METHOD_LABELS + fp8_labels(row):
            r = row.get(label)
            if r is None or "queued_fwd_ms" not in r:
                continue
            cells.append(
                f"{label} {r['queued_fwd_ms']:.2f}/{r['queued_fwd_bwd_ms']:.2f} "
                f"({base['queued_fwd_ms'] / r['queued_fwd_ms']:.2f}x/{base['queued_fwd_bwd_ms'] / r['queued_fwd_bwd_ms']:.2f}x)"
            )
        print(f"  {row['shape']:<12} fwd/f+b: " + "; ".join(cells))


def _print_details(results):
    print("\nkernel backend forward, stage by stage (ms, median):")
    for row in results:
        for gemm, stages in row["kernel_stages_ms"].items():
            parts = " ".join(f"{k} {v:.2f}" for k, v in stages.items())
            print(f"  {row['shape']:<12} {gemm:<10} {parts} | sum {sum(stages.values()):.2f}")
    print("forward error vs fp32 reference (||y - y32|| / ||y32||):")
    for row in results:
        e = row["forward_error"]
        kernels = "  ".join(
            f"{label} {e[label]:.3e} (ratio {e[label] / e['bf16_reference']:.3f})" for label in e if label != "bf16_reference"
        )
        print(f"  {row['shape']:<12} {kernels}  bf16 reference {e['bf16_reference']:.3e}")


def _plot(results, dense, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = METHOD_LABELS + tuple(dict.fromkeys(
        label for row in results for label in fp8_labels(row) if any(r.get(label) for r in results)))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwd_bwd_tflops", "forward + backward")):
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            values = [row[label][key] if row.get(label) else 0 for row in results]
            ax.bar([j + i * width for j in range(len(results))], values, width, label=label)
        ax.axhline(dense, color="k", linestyle="--", label="dense bf16 GEMM")
        ax.set_xticks([j + (len(labels) - 1) / 2 * width for j in range(len(results))], [r["shape"] for r in results])
        ax.set_ylabel("effective TFLOP/s")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
