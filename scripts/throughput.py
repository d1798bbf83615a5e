"""End-to-end Megatron throughput of MoE dispatchers, from the same seed, one table.

    python scripts/throughput.py --config proxy_1gpu --dispatchers alltoall_grouped,mok,alltoall --iters 20
    torchrun --nproc-per-node 8 scripts/throughput.py --config proxy_8gpu --dispatchers alltoall,mok
    python scripts/throughput.py --config tiny --iters 4 --profile -- --moe-router-topk 4

Each dispatcher trains in its own `python -m megatron_mok.pretrain` process (one per rank under
torchrun), so memory peaks don't mix; flags after `--` go to every run. A dispatcher is a value of
`--moe-token-dispatcher-type` (alltoall, allgather, flex, mok) or NAME_grouped: Megatron's NAME
dispatcher with `--mok-grouped-mm-experts`, i.e. its experts on torch's grouped GEMM
(GroupedMMExperts, what TEGroupedMLP computes, without Transformer Engine) instead of
SequentialMLP's loop over experts. `mok_fp8` is mok with the routed experts in FP8 blockwise
(`--mok-precision fp8_blockwise`, no Transformer Engine needed) and `mok_fp8_reference` the same on
the reference backend (the recipe in PyTorch); `mok_fp8_uncached` is mok_fp8 without the FP8 weight
cache (`--mok-no-fp8-weight-cache`: the same bits, less memory) and `mok_fp8_kept_transposed` mok_fp8
with the dgrads' transposed weight copies kept in the cache (`--mok-fp8-cache-transposed-weights`: the
same bits, more memory). Each is also held against its twins that ran (LOSS_TWINS: mok_fp8 against
BF16 mok and against mok_fp8_reference, mok_fp8_uncached and mok_fp8_kept_transposed against
mok_fp8), in a table of its own.

The table gives, after `--warmup` iterations: the median time per iteration (Megatron's own
`interval-time`), tokens/s/GPU, TFLOP/s/GPU (Megatron's count, `--log-throughput`), the peak memory
of each rank, the speed-up over each baseline (`--baselines`: by default every dispatcher but mok)
and whether the lm-loss curve is the first dispatcher's ("same curve", SAME_CURVE below). `--out`
receives throughput.json, throughput.md (the tables), throughput.png (throughput bars, every
dispatcher's loss curve and its relative difference from the first's) and each run's logs
(runs/DISPATCHER/rankN.log).

`--summarize A.json B.json ...` prints one table of mok's speed-ups from finished runs' JSON.

`--profile` trains one more iteration under torch.profiler and splits its GPU time (kernels summed;
CPU time on a CPU) into the MoE layers' forward and backward and the rest of the step; that
iteration is left out of the medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
MARKER = "MOK_THROUGHPUT "  # a worker's per-iteration record on stdout, JSON after the marker
LOSS_KEY = "lm loss"
MOE_FORWARD, MOE_BACKWARD, STEP = "mok_throughput::moe_forward", "mok_throughput::moe_backward", "mok_throughput::step"
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
GIB = 1024**3
GROUPED_SUFFIX = "_grouped"  # NAME_grouped: Megatron's NAME dispatcher with GroupedMMExperts
MOK_FP8 = "mok_fp8"  # mok with the routed experts in FP8 blockwise
# mok_fp8 on the reference backend (the recipe computed in PyTorch: the oracle, slow) whatever `--`
# says: kernel FP8 against it separates "the kernels compute the recipe" from "the recipe costs loss".
MOK_FP8_REFERENCE = "mok_fp8_reference"
# mok_fp8 with no FP8 weight copy held between passes: its loss curve is mok_fp8's, bit for bit.
MOK_FP8_UNCACHED = "mok_fp8_uncached"
# mok_fp8 keeping the transposed weight copies beside the forward ones: its loss curve is mok_fp8's, bit for bit.
MOK_FP8_KEPT_TRANSPOSED = "mok_fp8_kept_transposed"
# The runs a dispatcher's loss curve is also held against, beside the first dispatcher's: its twins
# in the other precision or backend, where they ran. mok_fp8 against mok is the FP8 criterion of the
# recipe (docs/design.md §12); against mok_fp8_reference it is the kernels' (same recipe: the
# curves differ only by fp32 summation order, as BF16 mok's differs from the baselines').
LOSS_TWINS = {MOK_FP8: ("mok", MOK_FP8_REFERENCE), MOK_FP8_REFERENCE: ("mok",), MOK_FP8_UNCACHED: (MOK_FP8,),
              MOK_FP8_KEPT_TRANSPOSED: (MOK_FP8,)}
# "Same curve": the first EARLY_ITERATIONS lm losses within EARLY_RTOL relative of the first
# dispatcher's, and the mean of the last min(TAIL_ITERATIONS, n) within TAIL_RTOL relative.
# Up to iteration 4 both runs compute the same function of (nearly) the same weights, so only
# rounding separates them (2e-6 to 2e-5 seen in bf16 on the H200 proxies); a wrong route, expert,
# weight half or routing weight moves iteration 1 by far more than 1e-4. Later, bf16 rounding
# differences compound through Adam into per-iteration differences of up to ~2e-2 while the
# curves track; their mean over ten iterations stays under 1% even were they all of one sign
# (0.8% on proxy_1gpu, 2026-12-01), while a wrong gradient (the loss falling slower or not at
# all) moves it further with every iteration.
EARLY_ITERATIONS, EARLY_RTOL = 4, 1e-4
TAIL_ITERATIONS, TAIL_RTOL = 10, 1e-2


def _power_of_ten(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-")  # 1e-4, not 1e-04


SAME_CURVE = (
    f"same curve: iterations 1-{EARLY_ITERATIONS} within {_power_of_ten(EARLY_RTOL)} relative and the mean of "
    f"the last min({TAIL_ITERATIONS}, n) iterations within {TAIL_RTOL:.0%} relative"
)


# ------------------------------------------------------------------------------------------------
# Worker: one rank of one training run, with Megatron's log hooked in-process.
# ------------------------------------------------------------------------------------------------

def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _install_log_hooks(run_dir: Path, records: list[dict]) -> None:
    """Records every iteration's lm loss (exact, from the loss dict), Megatron's elapsed ms and
    TFLOP/s (from the log line it builds) on the last rank, which holds the loss."""
    from megatron.training import training

    last_message: list[str] = []
    original_print, original_log = training.print_rank_last, training.training_log

    def print_rank_last(message: Any) -> None:
        if isinstance(message, str):
            last_message.append(message)
        original_print(message)

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        last_message.clear()
        result = original_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        line = next((m for m in reversed(last_message) if _ELAPSED.search(m)), None)
        if line is not None and _rank() == _world() - 1:
            tflops = _TFLOPS.search(line)
            record = {
                "iteration": int(iteration),
                "ms": float(_ELAPSED.search(line).group(1)),
                "tflops": float(tflops.group(1)) if tflops else None,
                "losses": {key: float(value) for key, value in loss_dict.items()},
            }
            records.append(record)
            with open(run_dir / "iterations.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(MARKER + json.dumps(record), flush=True)
        return result

    training.print_rank_last = print_rank_last
    training.training_log = training_log


def _write_meta(run_dir: Path, meta: dict, final: bool) -> None:
    """This rank's facts: the run's shape from Megatron's arguments, its experts, and at the end
    (`final`) the peak memory."""
    import torch

    try:
        from megatron.training import get_args

        args = get_args()
        meta.update(
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            world_size=args.world_size,
            transformer_impl=args.transformer_impl,
            params_dtype=str(args.params_dtype).replace("torch.", ""),
        )
    except Exception:  # before Megatron parsed its arguments
        pass
    on_gpu = torch.cuda.is_available()
    meta["device"] = torch.cuda.get_device_name() if on_gpu else "cpu"
    meta["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() if on_gpu and final else None
    meta["peak_reserved_bytes"] = torch.cuda.max_memory_reserved() if on_gpu and final else None
    (run_dir / f"rank{_rank()}.json").write_text(json.dumps(meta))


def _install_model_probe(run_dir: Path, meta: dict) -> None:
    """Notes the experts module of the MoE layers Megatron builds (SequentialMLP, TEGroupedMLP, ...)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mok.megatron import gpt_training

    original = gpt_training.model_provider

    @functools.wraps(original)
    def model_provider(*args, **kwargs):
        model = original(*args, **kwargs)
        meta["experts"] = sorted({type(m.experts).__name__ for m in model.modules() if isinstance(m, MoELayer)})
        _write_meta(run_dir, meta, final=False)  # a run stopped later still has its shape
        return model

    gpt_training.model_provider = model_provider


class _Profiled:
    """Marks the MoE layers' forward and backward with profiler ranges during one train_step."""

    active = False
    open_ranges: list[Any] = []


def _open_range(name: str) -> None:
    import torch

    handle = torch.autograd.profiler.record_function(name)
    handle.__enter__()
    _Profiled.open_ranges.append(handle)


def _close_range() -> None:
    if _Profiled.open_ranges:
        _Profiled.open_ranges.pop().__exit__(None, None, None)


def _range_functions():
    import torch

    class OpenBackwardRange(torch.autograd.Function):
        """Identity on the layer's output: its backward runs first, so it opens the range."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            _open_range(MOE_BACKWARD)
            return grad

    class CloseBackwardRange(torch.autograd.Function):
        """Identity on the layer's input: its backward runs once every path through the layer
        (router, experts, shared experts) has produced the input's gradient."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            _close_range()
            return grad

    return OpenBackwardRange, CloseBackwardRange


def _kernel_us(event, skip: frozenset) -> float:
    """GPU time of the device activity an event and its CPU descendants launched, in us."""
    own = sum(k.duration for k in event.kernels if k.name not in skip)
    return own + sum(_kernel_us(child, skip) for child in event.cpu_children)


def summarize_profile(events, on_gpu: bool) -> dict:
    """MoE forward / backward / rest of one step, in ms (GPU kernel time, or CPU time on a CPU).
    Only outermost MoE ranges count (a recomputed forward inside a backward is part of it)."""
    from torch.autograd import DeviceType

    ranges = (MOE_FORWARD, MOE_BACKWARD)
    skip = frozenset((*ranges, STEP))  # the ranges' own GPU-timeline annotations

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in ranges:
                return True
            parent = parent.cpu_parent
        return False

    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    moe = {name: 0.0 for name in ranges}
    calls = {name: 0 for name in ranges}
    for event in cpu_events:
        if event.name in ranges and not nested(event):
            moe[event.name] += _kernel_us(event, skip) if on_gpu else event.cpu_time_total
            calls[event.name] += 1
    device_events = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in skip]
    if on_gpu and device_events:
        # Each device activity once, from the device timeline: a kernel can also be listed under
        # both its launch call and the op around it, which summing `kernels` over every CPU event
        # counted more than once (seen on the H200: a "step" of 14.8 s of kernels in 1.1 s).
        total = sum(e.time_range.elapsed_us() for e in device_events)
    elif on_gpu:
        total = sum(k.duration for e in cpu_events for k in e.kernels if k.name not in skip)
    else:
        total = sum(e.cpu_time_total for e in cpu_events if e.name == STEP)
    moe_us = moe[MOE_FORWARD] + moe[MOE_BACKWARD]
    return {
        "clock": "GPU kernel time" if on_gpu else "CPU time",
        "moe_forward_ms": moe[MOE_FORWARD] / 1e3,
        "moe_backward_ms": moe[MOE_BACKWARD] / 1e3,
        "moe_ms": moe_us / 1e3,
        "rest_ms": (total - moe_us) / 1e3,
        "step_ms": total / 1e3,
        "moe_share": moe_us / total if total > 0 else None,
        "moe_forward_calls": calls[MOE_FORWARD],
        "moe_backward_calls": calls[MOE_BACKWARD],
    }


def _install_profiler(run_dir: Path, profile_call: int) -> None:
    """Runs train_step number `profile_call` under torch.profiler with the MoE ranges on."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training import training

    OpenBackwardRange, CloseBackwardRange = _range_functions()
    original_forward, original_step = MoELayer.forward, training.train_step
    calls = [0]

    def forward(self, hidden_states, intermediate_tensors=None, *args, **kwargs):
        if not _Profiled.active or intermediate_tensors is not None or not torch.is_grad_enabled():
            return original_forward(self, hidden_states, intermediate_tensors, *args, **kwargs)
        hidden_states = CloseBackwardRange.apply(hidden_states)
        with torch.autograd.profiler.record_function(MOE_FORWARD):
            output, bias = original_forward(self, hidden_states, None, *args, **kwargs)
        return OpenBackwardRange.apply(output), bias

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] != profile_call:
            return original_step(*args, **kwargs)
        on_gpu = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            _Profiled.active = True
            try:
                with torch.autograd.profiler.record_function(STEP):
                    result = original_step(*args, **kwargs)
                if on_gpu:
                    torch.cuda.synchronize()
            finally:
                _Profiled.active = False
                while _Profiled.open_ranges:
                    _close_range()
        started = time.perf_counter()
        summary = summarize_profile(prof.events(), on_gpu)
        summary["iteration_call"] = profile_call
        summary["analysis_s"] = round(time.perf_counter() - started, 2)
        if _rank() == _world() - 1:
            (run_dir / "profile.json").write_text(json.dumps(summary, indent=1))
        return result

    MoELayer.forward = forward
    training.train_step = train_step


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="throughput.py --worker")
    parser.add_argument("--worker", type=Path, required=True, help="run folder")
    parser.add_argument("--profile-call", type=int, default=0)
    parser.add_argument("pretrain_argv", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    run_dir: Path = options.worker
    pretrain_argv = options.pretrain_argv[1:] if options.pretrain_argv[:1] == ["--"] else options.pretrain_argv

    from megatron_mok.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()  # before megatron.training is imported (no-op with CUDA)
    # The driver stops an overlong run with SIGTERM: exit through `finally` to write the peak.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    records: list[dict] = []
    meta: dict[str, Any] = {"rank": _rank()}
    _install_log_hooks(run_dir, records)
    _install_model_probe(run_dir, meta)
    if options.profile_call:
        _install_profiler(run_dir, options.profile_call)

    from megatron_mok import pretrain

    try:
        pretrain.main(pretrain_argv)
    finally:
        _write_meta(run_dir, meta, final=True)


# ------------------------------------------------------------------------------------------------
# Driver: one worker per dispatcher (per rank), then the table.
# ------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Group:
    """The drivers' own gloo group under torchrun (port choice, barriers); nothing otherwise."""

    def __init__(self) -> None:
        self.rank, self.world = _rank(), _world()
        self.dist = None
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.dist = dist

    def broadcast(self, value: Any) -> Any:
        if self.dist is None:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()


def _child_env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(port),
        RANK=str(_rank()),
        WORLD_SIZE=str(_world()),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


def dispatcher_flags(dispatcher: str) -> list[str]:
    """The pretrain flags of a dispatcher name (module docstring)."""
    if dispatcher == MOK_FP8:
        return ["--moe-token-dispatcher-type", "mok", "--mok-precision", "fp8_blockwise"]
    if dispatcher == MOK_FP8_REFERENCE:  # after the `--` flags: the last --mok-backend wins
        return [*dispatcher_flags(MOK_FP8), "--mok-backend", "reference"]
    if dispatcher == MOK_FP8_UNCACHED:
        return [*dispatcher_flags(MOK_FP8), "--mok-no-fp8-weight-cache"]
    if dispatcher == MOK_FP8_KEPT_TRANSPOSED:
        return [*dispatcher_flags(MOK_FP8), "--mok-fp8-cache-transposed-weights"]
    if dispatcher.endswith(GROUPED_SUFFIX):
        return ["--moe-token-dispatcher-type", dispatcher[: -len(GROUPED_SUFFIX)], "--mok-grouped-mm-experts"]
    return ["--moe-token-dispatcher-type", dispatcher]


def is_mok(dispatcher: str) -> bool:
    """mok in either precision: never a default baseline."""
    return dispatcher in ("mok", MOK_FP8, MOK_FP8_REFERENCE, MOK_FP8_UNCACHED, MOK_FP8_KEPT_TRANSPOSED)


def run_one(dispatcher: str, options, run_dir: Path, port: int, index: int, count: int) -> int:
    """Trains one dispatcher on this rank; streams its progress on the reporting ranks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*run_dir.glob("rank*.json"), run_dir / "iterations.jsonl", run_dir / "profile.json"):
        stale.unlink(missing_ok=True)
    total_iters = options.iters + (1 if options.profile else 0)
    pretrain_argv = [
        "--config", options.config, *options.megatron_args, *dispatcher_flags(dispatcher),
        "--train-iters", str(total_iters), "--seed", str(options.seed),
        "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
    ]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(run_dir)]
    if options.profile:
        cmd += ["--profile-call", str(total_iters)]
    cmd += ["--", *pretrain_argv]
    reporter, first = _rank() == _world() - 1, _rank() == 0
    log_path = run_dir / f"rank{_rank()}.log"
    if reporter:
        print(f"[{index}/{count}] {dispatcher}: python -m megatron_mok.pretrain {' '.join(pretrain_argv)}  (log: {log_path})", flush=True)
    started = time.perf_counter()
    tail: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env(port), cwd=options.cwd
    ) as child:
        def stop() -> None:  # past --timeout: SIGTERM (the worker writes its peak), then SIGKILL
            print(f"[rank {_rank()}] {dispatcher}: stopping the run after {options.timeout:.0f} s (--timeout)", flush=True)
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()

        timer = threading.Timer(options.timeout, stop)
        timer.start()
        for line in child.stdout:
            log.write(line)
            if not line.startswith(MARKER):
                tail = (tail + [line.rstrip()])[-40:]
            if line.startswith(MARKER) and reporter:
                record = json.loads(line[len(MARKER):])
                loss = record["losses"].get(LOSS_KEY)
                shown = f"  {LOSS_KEY} {loss:.6f}" if loss is not None else ""
                print(f"    {dispatcher:>10}  iteration {record['iteration']:3d}/{total_iters}  {record['ms']:9.1f} ms{shown}", flush=True)
            elif line.startswith("megatron_mok:") and first:
                print("    " + line.rstrip(), flush=True)
        child.wait()
        timer.cancel()
    if child.returncode != 0:
        print(f"[rank {_rank()}] {dispatcher}: exit code {child.returncode} after {time.perf_counter() - started:.0f} s;"
              f" last lines of {log_path}:", flush=True)
        print("\n".join("    " + t for t in tail), flush=True)
    elif reporter:
        print(f"    {dispatcher}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return child.returncode


def compare_losses(losses: dict[int, float], reference: dict[int, float]) -> dict:
    """A run's lm loss per iteration against the reference run's, and the SAME_CURVE verdict over
    the iterations both logged (None when they share none)."""
    common = sorted(set(losses) & set(reference))
    missing = sorted(set(reference) - set(losses))
    if not common:
        return {"iterations": 0, "same_curve": None, "missing": missing}
    rel = {i: abs(losses[i] - reference[i]) / abs(reference[i]) if reference[i] else math.inf for i in common}
    early = [i for i in common if i <= EARLY_ITERATIONS]
    tail = common[-min(TAIL_ITERATIONS, len(common)):]
    tail_reference = statistics.fmean(reference[i] for i in tail)
    tail_mean = statistics.fmean(losses[i] for i in tail)
    tail_rel = abs(tail_mean - tail_reference) / abs(tail_reference) if tail_reference else math.inf
    early_rel = max(rel[i] for i in early) if early else None
    return {
        "iterations": len(common),
        "rel_diff": {str(i): rel[i] for i in common},
        "max_rel_diff": max(rel.values()),
        "worst_iteration": max(common, key=rel.__getitem__),
        "early_iterations": early,
        "early_max_rel_diff": early_rel,
        "tail_iterations": tail,
        "tail_mean_rel_diff": tail_rel,
        # Every early iteration of the reference must be there: a curve whose start was not logged
        # is not known to be the same.
        "same_curve": (
            bool(early) and early == [i for i in sorted(reference) if i <= EARLY_ITERATIONS]
            and early_rel <= EARLY_RTOL and tail_rel <= TAIL_RTOL
        ),
        "missing": missing,
    }


def summarize_run(dispatcher: str, rc: int, run_dir: Path, options) -> dict:
    records = []
    path = run_dir / "iterations.jsonl"
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    meta = next((r for r in ranks if "global_batch_size" in r), ranks[0] if ranks else {})
    timed = [r for r in records if options.warmup < r["iteration"] <= options.iters]
    run: dict[str, Any] = {
        "dispatcher": dispatcher,
        "rc": rc,
        "iterations": records,
        "timed_iterations": [r["iteration"] for r in timed],
        "experts": sorted({e for r in ranks for e in r.get("experts", [])}),
        "transformer_impl": meta.get("transformer_impl"),
        "device": meta.get("device"),
        "peak_allocated_gib": [r["peak_allocated_bytes"] / GIB if r.get("peak_allocated_bytes") is not None else None for r in ranks],
        "peak_reserved_gib": [r["peak_reserved_bytes"] / GIB if r.get("peak_reserved_bytes") is not None else None for r in ranks],
        "log": str(run_dir),
    }
    if timed:
        ms = statistics.median(r["ms"] for r in timed)
        tflops = [r["tflops"] for r in timed if r["tflops"] is not None]
        run["median_ms"] = ms
        run["min_ms"], run["max_ms"] = min(r["ms"] for r in timed), max(r["ms"] for r in timed)
        if "global_batch_size" in meta:
            tokens = meta["global_batch_size"] * meta["seq_length"]
            run["tokens_per_iteration"] = tokens
            run["tokens_per_s_per_gpu"] = tokens / (ms / 1e3) / meta["world_size"]
        run["tflops_per_gpu"] = statistics.median(tflops) if tflops else None
    profile = run_dir / "profile.json"
    if profile.exists():
        run["profile"] = json.loads(profile.read_text())
    return run


def _fmt(value: Optional[float], spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _peak(values: list) -> str:
    known = [v for v in values if v is not None]
    if not values:
        return "-"
    if not known:
        return "n/a (CPU)"
    return f"{max(known):.1f}" if len(known) == 1 else f"{max(known):.1f} (min {min(known):.1f}, {len(known)} ranks)"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _loss_cells(run: dict, reference: str) -> tuple[str, str, str]:
    """(iterations 1-4 max rel. diff, last-10 mean rel. diff, verdict) of a run's lm loss against
    the reference run's."""
    if run["dispatcher"] == reference:
        return "-", "-", "(reference)"
    cmp = run.get("loss_vs_reference", {})
    if cmp.get("same_curve") is None:
        return "-", "-", "-"
    verdict = "yes" if cmp["same_curve"] else "NO"
    if cmp["missing"]:
        verdict += f" ({cmp['iterations']} of {cmp['iterations'] + len(cmp['missing'])} iterations)"
    return _fmt(cmp["early_max_rel_diff"], ".1e"), _fmt(cmp["tail_mean_rel_diff"], ".1e"), verdict


def format_tables(report: dict) -> str:
    runs = report["runs"]
    reference, baselines = report["loss_reference"], report["baselines"]
    lines = [
        f"Megatron end to end: --config {report['config']}, {report['world_size']} rank(s) on {report['device']}, "
        f"{report['iters']} iterations, median after {report['warmup']} warm-up, seed {report['seed']}; "
        f"lm loss against {reference}'s, {SAME_CURVE}",
        "",
        _row("dispatcher", "experts", "ms/iteration", "tokens/s/GPU", "TFLOP/s/GPU", "peak GiB/rank",
             *(f"x {b}" for b in baselines), f"lm loss it. 1-{EARLY_ITERATIONS}: max rel. diff",
             f"last {TAIL_ITERATIONS}: mean rel. diff", "same curve"),
        _row("---", "---", "---:", "---:", "---:", "---:", *("---:" for _ in baselines), "---:", "---:", "---"),
    ]
    for run in runs:
        experts = ", ".join(run["experts"]) or "-"
        if "median_ms" not in run:
            lines.append(_row(run["dispatcher"], experts, f"failed (exit code {run['rc']}, log {run['log']})",
                              *[""] * (6 + len(baselines))))
            continue
        name = run["dispatcher"]
        if run["rc"] != 0:  # stopped early: the iterations it logged are still timed
            name += f" (exit code {run['rc']} after {len(run['iterations'])} iterations)"
        speedups = run.get("speedup", {})
        lines.append(_row(
            name, experts, f"{run['median_ms']:.1f}", _fmt(run.get("tokens_per_s_per_gpu"), ",.0f"),
            _fmt(run.get("tflops_per_gpu"), ".1f"), _peak(run["peak_allocated_gib"]),
            *(_fmt(speedups.get(b), ".2f", "-") + ("x" if b in speedups else "") for b in baselines),
            *_loss_cells(run, reference),
        ))
    twinned = [(run, twin, cmp) for run in runs for twin, cmp in run.get("loss_vs_twins", {}).items()]
    if twinned:
        lines += ["", "lm loss against each run's twins (LOSS_TWINS; the same criterion)", "",
                  _row("dispatcher", "against", f"it. 1-{EARLY_ITERATIONS}: max rel. diff", "worst it.",
                       f"last {TAIL_ITERATIONS}: mean rel. diff", "same curve"),
                  _row("---", "---", "---:", "---:", "---:", "---")]
        for run, twin, cmp in twinned:
            if cmp.get("same_curve") is None:
                lines.append(_row(run["dispatcher"], twin, "-", "-", "-", "-"))
                continue
            early = cmp["early_iterations"]
            worst = max(early, key=lambda i: cmp["rel_diff"][str(i)]) if early else "-"
            verdict = "yes" if cmp["same_curve"] else "NO"
            lines.append(_row(run["dispatcher"], twin, _fmt(cmp["early_max_rel_diff"], ".2e"), str(worst),
                              _fmt(cmp["tail_mean_rel_diff"], ".2e"), verdict))
    profiled = [run for run in runs if "profile" in run]
    if profiled:
        clock = profiled[0]["profile"]["clock"]
        lines += ["", f"Where one training step's time goes (torch.profiler, {clock}; that iteration is not in the medians)", "",
                  _row("dispatcher", "MoE forward ms", "MoE backward ms", "MoE ms", "rest ms", "step ms", "MoE share"),
                  _row("---", "---:", "---:", "---:", "---:", "---:", "---:")]
        for run in profiled:
            p = run["profile"]
            times = (p[k] for k in ("moe_forward_ms", "moe_backward_ms", "moe_ms", "rest_ms", "step_ms"))
            lines.append(_row(run["dispatcher"], *(f"{t:.1f}" for t in times), _fmt(p["moe_share"], ".0%")))
    impls = sorted({run["transformer_impl"] for run in runs if run.get("transformer_impl")})
    if impls:
        lines += ["", f"transformer impl: {', '.join(impls)}"]
    return "\n".join(lines)


def format_summary(reports: list[dict]) -> str:
    """mok against every baseline, one row per report (config): `--summarize`."""
    baselines = list(dict.fromkeys(b for report in reports for b in report["baselines"] if b != "mok"))
    lines = [
        "mok end to end: speed-up over each baseline (median ms/iteration), and whether its lm-loss curve is "
        f"the reference's ({SAME_CURVE})",
        "",
        _row("config", "mok ms/iteration", *(f"x {b} (its ms)" for b in baselines), "mok: same curve as"),
        _row("---", "---:", *("---:" for _ in baselines), "---"),
    ]
    for report in reports:
        runs = {run["dispatcher"]: run for run in report["runs"]}
        mok = runs.get("mok", {})
        cells = []
        for baseline in baselines:
            ratio = mok.get("speedup", {}).get(baseline)
            ms = runs.get(baseline, {}).get("median_ms")
            cells.append("-" if ratio is None else f"{ratio:.2f}x ({ms:.1f})")
        verdict = _loss_cells(mok, report["loss_reference"])[2] if "median_ms" in mok else "-"
        lines.append(_row(report["config"], _fmt(mok.get("median_ms"), ".1f"), *cells, f"{report['loss_reference']}: {verdict}"))
    return "\n".join(lines)


def write_plot(report: dict, path: Path) -> Optional[str]:
    """Throughput bars with the speed-ups, every dispatcher's loss curve, and each curve's relative
    difference from the reference's with the SAME_CURVE bounds; returns why not when it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no PNG: matplotlib does not import here ({error})"
    runs = [run for run in report["runs"] if "median_ms" in run]
    if not runs:
        return "no PNG: no run finished"
    reference = report["loss_reference"]
    figure, (bars, curves, diffs) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {run["dispatcher"]: f"C{i}" for i, run in enumerate(report["runs"])}
    names = [run["dispatcher"] for run in runs]
    values = [run.get("tokens_per_s_per_gpu") or 0.0 for run in runs]
    drawn = bars.bar(names, values, color=[colors[n] for n in names])
    for bar, run in zip(drawn, runs):
        ratios = "\n".join(f"{ratio:.2f}x {base}" for base, ratio in run.get("speedup", {}).items() if base != run["dispatcher"])
        bars.annotate(f"{run['median_ms']:.0f} ms\n{ratios}".strip(), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    bars.set_ylim(0, max(values + [1.0]) * 1.35)  # room for the labels
    bars.set_ylabel("tokens/s/GPU")
    bars.set_title(f"{report['config']}: median after {report['warmup']} warm-up iterations", fontsize=10)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(report["runs"]):
        points = [(r["iteration"], r["losses"][LOSS_KEY]) for r in run["iterations"] if LOSS_KEY in r["losses"]]
        if not points:
            continue
        verdict = run.get("loss_vs_reference", {}).get("same_curve")
        label = run["dispatcher"] + (" (reference)" if run["dispatcher"] == reference else
                                     f" (same curve: {'yes' if verdict else 'NO'})" if verdict is not None else "")
        # Each its own line style over the others: equal curves stay visible.
        curves.plot(*zip(*points), marker=".", linestyle=styles[i % len(styles)], color=colors[run["dispatcher"]], label=label)
        rel = run.get("loss_vs_reference", {}).get("rel_diff", {})
        if run["dispatcher"] != reference and rel:
            steps = sorted(int(k) for k in rel)
            # Equal losses (0) shown at the floor of the log scale.
            diffs.plot(steps, [max(rel[str(k)], 1e-9) for k in steps], marker=".", linestyle=styles[i % len(styles)],
                       color=colors[run["dispatcher"]], label=run["dispatcher"])
    curves.xaxis.get_major_locator().set_params(integer=True)
    curves.set_xlabel("iteration")
    curves.set_ylabel(LOSS_KEY)
    curves.set_title("lm loss (same seed, same data)", fontsize=10)
    curves.legend(fontsize=8)
    diffs.set_yscale("log")
    diffs.plot([1, EARLY_ITERATIONS], [EARLY_RTOL] * 2, color="black", linewidth=1,
               label=f"it. 1-{EARLY_ITERATIONS} bound {_power_of_ten(EARLY_RTOL)}")
    diffs.axhline(TAIL_RTOL, color="gray", linewidth=1, linestyle="--",
                  label=f"last-{TAIL_ITERATIONS} mean bound {TAIL_RTOL:.0%}")
    diffs.xaxis.get_major_locator().set_params(integer=True)
    diffs.set_xlabel("iteration")
    diffs.set_ylabel(f"|loss - {reference}'s| / {reference}'s")
    diffs.set_title("relative difference from the reference (equal: drawn at 1e-9)", fontsize=10)
    diffs.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def add_comparisons(runs: list[dict], baselines: list[str]) -> None:
    """Each run's speed-up over every baseline that finished (`speedup`: {baseline: ratio}) and its
    loss curve against the first run's (`loss_vs_reference`)."""
    by_name = {run["dispatcher"]: run for run in runs}

    def losses(run: dict) -> dict[int, float]:
        return {r["iteration"]: r["losses"][LOSS_KEY] for r in run["iterations"] if LOSS_KEY in r["losses"]}

    reference = losses(runs[0])
    for run in runs:
        if "median_ms" in run:
            run["speedup"] = {b: by_name[b]["median_ms"] / run["median_ms"] for b in baselines if "median_ms" in by_name[b]}
        run["loss_vs_reference"] = compare_losses(losses(run), reference)
        twins = [t for t in LOSS_TWINS.get(run["dispatcher"], ()) if t in by_name and t != runs[0]["dispatcher"]]
        if twins:
            run["loss_vs_twins"] = {t: compare_losses(losses(run), losses(by_name[t])) for t in twins}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        worker_main(argv)
        return 0
    if argv[:1] == ["--summarize"]:  # throughput.json files -> one table of mok's speed-ups
        reports = [json.loads(Path(p).read_text()) for p in argv[1:] if Path(p).is_file()]
        missing = [p for p in argv[1:] if not Path(p).is_file()]
        print(format_summary(reports) if reports else "no throughput.json to summarize")
        for p in missing:
            print(f"{p}: missing (that config did not finish)")
        return 0 if reports and not missing else 1
    megatron_args: list[str] = []
    if "--" in argv:
        argv, megatron_args = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", help="configs/NAME.yaml or a path (default: tiny)")
    parser.add_argument("--dispatchers", default="alltoall_grouped,mok,alltoall",
                        help="comma-separated (module docstring); the first is the loss curves' reference")
    parser.add_argument("--baselines", default=None,
                        help="comma-separated dispatchers to give speed-ups over (default: every dispatcher but mok and mok_fp8)")
    parser.add_argument("--iters", type=int, default=20, help="training iterations per dispatcher (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="iterations left out of the medians (default iters // 4, >= 1)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default /tmp/mok_throughput/CONFIG)")
    parser.add_argument("--profile", action="store_true", help="split one more step into MoE layers vs the rest (torch.profiler)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is stopped (logged iterations count)")
    options = parser.parse_args(argv)
    options.megatron_args = megatron_args
    options.cwd = os.getcwd()
    dispatchers = [d for d in options.dispatchers.split(",") if d]
    if options.warmup is None:
        options.warmup = max(1, options.iters // 4)
    if not dispatchers or options.iters <= options.warmup:
        parser.error("need at least one dispatcher and --iters > --warmup")
    if len(set(dispatchers)) != len(dispatchers):
        parser.error(f"--dispatchers {options.dispatchers}: each at most once")
    if options.baselines is None:
        baselines = [d for d in dispatchers if not is_mok(d)] or dispatchers[:1]
    else:
        baselines = [d for d in options.baselines.split(",") if d]
        if not baselines or not set(baselines) <= set(dispatchers):
            parser.error(f"--baselines {options.baselines}: must name some of --dispatchers {options.dispatchers}")
    config_stem = Path(options.config).stem
    out = (options.out or Path("/tmp/mok_throughput") / config_stem).resolve()

    group = _Group()
    reporter = group.rank == group.world - 1
    codes = []
    for index, dispatcher in enumerate(dispatchers, 1):
        port = group.broadcast(_free_port() if group.rank == 0 else None)
        codes.append(run_one(dispatcher, options, out / "runs" / dispatcher, port, index, len(dispatchers)))
        group.barrier()  # every rank's files are written
    if reporter:
        runs = [summarize_run(d, rc, out / "runs" / d, options) for d, rc in zip(dispatchers, codes)]
        add_comparisons(runs, baselines)
        report = {
            "config": options.config,
            "dispatchers": dispatchers,
            "baselines": baselines,
            "loss_reference": dispatchers[0],
            "loss_criterion": {
                "text": SAME_CURVE, "early_iterations": EARLY_ITERATIONS, "early_rtol": EARLY_RTOL,
                "tail_iterations": TAIL_ITERATIONS, "tail_rtol": TAIL_RTOL,
            },
            "iters": options.iters,
            "warmup": options.warmup,
            "seed": options.seed,
            "profile": options.profile,
            "world_size": group.world,
            "device": next((run["device"] for run in runs if run.get("device")), "unknown"),
            "megatron_args": megatron_args,
            "command": [sys.executable, *sys.argv],
            "runs": runs,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "throughput.json").write_text(json.dumps(report, indent=1, default=str))
        skipped = write_plot(report, out / "throughput.png")
        tables = format_tables(report)
        (out / "throughput.md").write_text(tables + "\n")
        print()
        print(tables)
        print()
        print(f"wrote {out / 'throughput.json'}, throughput.md" + (f"; {skipped}" if skipped else " and throughput.png"))
    group.close()
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
