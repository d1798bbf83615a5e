"""scripts/throughput.py: the loss-agreement arithmetic, the run summaries, the profile split (fake
profiler events for the GPU path), and one real CPU run of the tiny config with both dispatchers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import throughput  # noqa: E402

# (got, want, significant digits of `want` that `got` reproduces)
DIGITS = [
    ("equal", 6.9379, 6.9379, math.inf),
    ("4th digit off by 1", 6.9379, 6.9380, 4),
    ("3rd digit off by 1", 6.930, 6.940, 2),
    ("large value, 0.4 off", 1000.0, 1000.4, 4),
    ("small value", 0.0012346, 0.0012345, 4),
    ("nothing in common", 2.0, 3.0, 0),
]


@pytest.mark.parametrize("case,got,want,digits", DIGITS, ids=[d[0] for d in DIGITS])
def test_significant_digits_agreeing(case, got, want, digits):
    assert throughput.significant_digits_agreeing(got, want) == digits


def test_compare_losses_reports_worst_iteration_and_verdict():
    base = {1: 10.0, 2: 9.0, 3: 8.0}
    close = throughput.compare_losses({1: 10.0, 2: 9.0004, 3: 8.0001}, base)
    assert close["agree_4_digits"] is True and close["worst_iteration"] == 2
    assert close["max_rel_diff"] == pytest.approx(0.0004 / 9.0)
    far = throughput.compare_losses({1: 10.0, 2: 9.0, 3: 8.01}, base)
    assert far["agree_4_digits"] is False and far["worst_iteration"] == 3 and far["min_digits"] == 2
    short = throughput.compare_losses({1: 10.0, 2: 9.0}, base)
    assert short["missing"] == [3] and short["iterations"] == 2


def _write_run(run_dir: Path, ms: list[float], peaks: list[int], world: int = 1) -> None:
    run_dir.mkdir(parents=True)
    with open(run_dir / "iterations.jsonl", "w") as handle:
        for i, value in enumerate(ms, 1):
            handle.write(json.dumps({"iteration": i, "ms": value, "tflops": 100.0 + i, "losses": {"lm loss": 10.0 - i}}) + "\n")
    for rank, peak in enumerate(peaks):
        meta = {"rank": rank, "experts": ["SequentialMLP"], "device": "NVIDIA H200", "peak_allocated_bytes": peak,
                "peak_reserved_bytes": peak}
        if rank == world - 1:
            meta.update(global_batch_size=4, seq_length=4096, world_size=world, transformer_impl="local")
        (run_dir / f"rank{rank}.json").write_text(json.dumps(meta))


def test_summarize_run_takes_medians_after_warmup_and_leaves_the_profiled_iteration_out(tmp_path):
    options = types.SimpleNamespace(warmup=2, iters=5)
    # iterations 1-2 warm-up, 3-5 timed (median 1000), 6 the profiled one (slow, left out)
    _write_run(tmp_path / "r", [5000.0, 3000.0, 1100.0, 1000.0, 900.0, 9000.0], [2 * throughput.GIB, 3 * throughput.GIB], world=2)
    run = throughput.summarize_run("alltoall", 0, tmp_path / "r", options)
    assert run["timed_iterations"] == [3, 4, 5]
    assert run["median_ms"] == 1000.0
    assert run["tokens_per_s_per_gpu"] == pytest.approx(4 * 4096 / 1.0 / 2)
    assert run["tflops_per_gpu"] == 104.0  # median of 103, 104, 105
    assert run["peak_allocated_gib"] == [2.0, 3.0]
    assert throughput._peak(run["peak_allocated_gib"]) == "3.0 (min 2.0, 2 ranks)"


def test_table_marks_a_failed_run_and_disagreeing_losses(tmp_path):
    options = types.SimpleNamespace(warmup=1, iters=3)
    _write_run(tmp_path / "a", [2000.0, 1000.0, 1000.0], [throughput.GIB])
    (tmp_path / "b").mkdir()
    runs = [throughput.summarize_run("mok", 0, tmp_path / "a", options), throughput.summarize_run("alltoall", 1, tmp_path / "b", options)]
    runs[0]["speedup"] = 1.0
    runs[0]["loss_vs_first"] = throughput.compare_losses({1: 9.0}, {1: 9.0})
    report = {"config": "x", "world_size": 1, "device": "cpu", "iters": 3, "warmup": 1, "seed": 1, "runs": runs}
    table = throughput.format_tables(report)
    assert "| mok | SequentialMLP | 1000.0 | 16,384 | 102.5 | 1.0 | 1.00x | - | (baseline) |" in table
    assert "| alltoall | - | failed (exit code 1" in table


def _event(name, kernels=(), children=(), cpu_us=0.0):
    from torch.autograd import DeviceType

    event = types.SimpleNamespace(
        name=name, device_type=DeviceType.CPU, cpu_parent=None, cpu_time_total=cpu_us,
        kernels=[types.SimpleNamespace(name=k, duration=d) for k, d in kernels], cpu_children=list(children),
    )
    for child in children:
        child.cpu_parent = event
    return event


def test_profile_split_on_gpu_counts_outermost_moe_ranges_and_skips_annotations():
    """Forward range: 2 + 3 us own kernels + 5 us in a child op. Backward range (another thread):
    4 us, plus a recomputed forward inside it (6 us) that must count once, as backward. The
    ranges' GPU-timeline annotations (same names) are not kernels. Other ops: 7 us."""
    fwd = _event(throughput.MOE_FORWARD, [("gemm", 2.0), ("swiglu", 3.0), (throughput.MOE_FORWARD, 99.0)],
                 [_event("aten::mm", [("gemm", 5.0)])])
    recompute = _event(throughput.MOE_FORWARD, [("gemm", 6.0)])
    bwd = _event(throughput.MOE_BACKWARD, [("dgrad", 4.0)], [recompute])
    step = _event(throughput.STEP, [(throughput.STEP, 500.0)], [fwd, _event("aten::add", [("add", 7.0)])])
    events = [step, fwd, *fwd.cpu_children, step.cpu_children[1], bwd, recompute]
    summary = throughput.summarize_profile(events, on_gpu=True)
    assert summary["moe_forward_ms"] == pytest.approx(10e-3)
    assert summary["moe_backward_ms"] == pytest.approx(10e-3)
    assert summary["step_ms"] == pytest.approx(27e-3)
    assert summary["rest_ms"] == pytest.approx(7e-3)
    assert (summary["moe_forward_calls"], summary["moe_backward_calls"]) == (1, 1)


def _throughput(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "scripts" / "throughput.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.slow
def test_cpu_run_of_the_tiny_config(tmp_path):
    result = _throughput("--config", "tiny", "--dispatchers", "mok,alltoall", "--iters", "3", "--warmup", "1",
                         "--profile", "--out", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "throughput.json").read_text())
    mok, alltoall = report["runs"]
    assert (mok["dispatcher"], mok["experts"], alltoall["experts"]) == ("mok", ["MoKGroupedExperts"], ["SequentialMLP"])
    for run in report["runs"]:
        assert [r["iteration"] for r in run["iterations"]] == [1, 2, 3, 4]  # 3 + the profiled one
        assert run["timed_iterations"] == [2, 3] and run["median_ms"] > 0
        assert run["tokens_per_s_per_gpu"] == pytest.approx(4 * 64 / (run["median_ms"] / 1e3))
        profile = run["profile"]
        # tiny: 2 MoE layers x 2 micro-batches (global batch 4, micro-batch 2)
        assert (profile["moe_forward_calls"], profile["moe_backward_calls"]) == (4, 4)
        assert 0 < profile["moe_ms"] < profile["step_ms"]
    assert mok["speedup"] == 1.0
    # fp32 on the CPU: same data, same weights; the dispatchers differ in summation order only.
    assert alltoall["loss_vs_first"]["agree_4_digits"] is True, alltoall["loss_vs_first"]
    assert "| mok | MoKGroupedExperts |" in result.stdout and "| alltoall | SequentialMLP |" in result.stdout
    assert "MoE share" in result.stdout
    assert (tmp_path / "throughput.png").exists() or "no PNG: matplotlib is not installed" in result.stdout


def test_failed_run_gives_exit_code_1_and_a_table(tmp_path):
    result = _throughput("--config", "tiny", "--dispatchers", "nonexistent", "--iters", "2", "--out", str(tmp_path), timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "| nonexistent | - | failed (exit code 2" in result.stdout
    assert "invalid choice: 'nonexistent'" in result.stdout  # the run's own error, from its log tail
