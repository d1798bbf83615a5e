"""The first run on a node of 8 GPUs, as two device calls of at most 10 minutes: `scripts/device_ep8.sh`.

    bash scripts/device_ep8.sh --part 1          # build, EP 2/4/8 bitwise and the failure tests
    bash scripts/device_ep8.sh --part 2          # links, the layer at EP 8, Megatron end to end
    bash scripts/device_ep8.sh --dry-run         # on any machine: the steps, their bounds, the files

Part 1 (the correctness of the multi-process path over real GPUs):
- build: the extension, skipped where it already loads (carry megatron_mok/_C*.so from part 1's
  $OUT into part 2 to skip it there);
- ep_bitwise: tests/comm/test_gpu_processes.py with rank r on GPU r (torch symmetric memory): the
  layer at EP 2, 4, 8 bitwise EP = 1, forward and backward, every routing, one window and several,
  two calls in a row, unequal shapes, `auto`'s choice;
- ep_failures: the same module's failure tests: a rank that never arrives (leaves before a call or
  between forward and backward) and a bad expert id end every other rank with the named error
  within the bound.
Part 2 (the numbers; each a torchrun over every GPU):
- nvlink: scripts/bench_nvlink.py at the DeepSeek-V3 per-rank shape (pull, push, peer copy, signal round);
- layer: scripts/bench_ep.py, DeepSeek-V3 and Qwen3-30B per-rank shapes, mok against NCCL
  all-to-all + grouped GEMM and Megatron's alltoall, with scripts/ep_model.py's predictions at the
  measured pull rate;
- throughput: scripts/throughput.py --config proxy_8gpu, alltoall then mok, tokens/s/GPU and whether
  the loss curves are the same (throughput.py's criterion).
Every step runs under `timeout` with its bound, cut to what is left of --budget-s; a step that cannot
start in time is listed as not run. Logs and JSON go to $OUT (default /tmp/mok_ep8); a table prints
last. The exit status is non-zero when a step failed or did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALL_LIMIT_S = 600  # one device call
NUM_GPUS = 8


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    part: int
    bound_s: int
    command: tuple[str, ...]
    needs: tuple[str, ...]  # files of the repository it runs
    env: tuple[tuple[str, str], ...] = ()
    what: str = ""


def _torchrun(script: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NUM_GPUS}", script, *args)


def _pytest(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-rfEs", *args)


def steps(out: Path) -> list[Step]:
    processes = "tests/comm/test_gpu_processes.py"
    distinct = (("MEGATRON_MOK_TEST_RANK_DEVICES", "distinct"), ("MEGATRON_MOK_REQUIRE_EXTENSION", "1"))
    build = Step("build", 0, 300, (sys.executable, "setup.py", "build_ext", "--inplace"), ("setup.py",),
                 (("MAX_JOBS", "16"),), "the CUDA extension (skipped where it loads)")
    return [
        dataclasses.replace(build, part=1),
        Step("ep_bitwise", 1, 120, _pytest(processes, "-k", "equals_ep1"), (processes, "tests/comm/ep_ranks.py"), distinct,
             "EP 2, 4, 8 over GPUs bitwise EP = 1, every routing, windows, two calls"),
        Step("ep_failures", 1, 150, _pytest(processes, "-k", "not equals_ep1"), (processes,), distinct,
             "never-arrives, a rank raising mid-step, a bad expert id: named errors within the bound"),
        dataclasses.replace(build, part=2),
        Step("nvlink", 2, 90, _torchrun("scripts/bench_nvlink.py", "--shape", "deepseek_v3", "--json", str(out / "nvlink.json")),
             ("scripts/bench_nvlink.py", "scripts/ranks.py"), (), "pull, push, peer copy, signal round at the DeepSeek-V3 shape"),
        Step("layer", 2, 180, _torchrun("scripts/bench_ep.py", "--shapes", "deepseek_v3,qwen3_30b", "--nvlink", str(out / "nvlink.json"),
                                         "--json", str(out / "layer.json")),
             ("scripts/bench_ep.py", "scripts/ep_model.py", "scripts/bench_layer.py", "scripts/ranks.py"), (),
             "the layer at EP 8 against NCCL all-to-all + grouped GEMM and Megatron's alltoall"),
        Step("throughput", 2, 300, _torchrun("scripts/throughput.py", "--config", "proxy_8gpu", "--dispatchers", "alltoall,mok",
                                              "--iters", "10", "--timeout", "140", "--out", str(out / "throughput")),
             ("scripts/throughput.py", "configs/proxy_8gpu.yaml"), (), "Megatron end to end, proxy_8gpu, alltoall then mok"),
    ]


@dataclasses.dataclass
class Outcome:
    step: Step
    status: str  # ok, failed (rc N), timed out, not run (...), skipped (...)
    seconds: float
    summary: str = ""


def _extension_loads() -> bool:
    probe = "from megatron_mok.ops import extension_error; import sys; sys.exit(extension_error() is not None)"
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True).returncode == 0


def run_step(step: Step, out: Path, left_s: float) -> Outcome:
    if step.name == "build" and _extension_loads():
        return Outcome(step, "skipped (the extension loads)", 0.0)
    bound = min(step.bound_s, int(left_s))
    if bound < 30:
        return Outcome(step, f"not run ({int(left_s)} s left)", 0.0)
    log = out / f"{step.name}_part{step.part}.log"
    env = {**os.environ, **dict(step.env), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with log.open("w") as handle:
        try:
            rc = subprocess.run(step.command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=bound).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    status = "ok" if rc == 0 else ("timed out" if rc is None else f"failed (rc {rc})")
    return Outcome(step, status, seconds, summarize(step, out, log.read_text(errors="replace")))


def summarize(step: Step, out: Path, text: str) -> str:
    """The step's result in a table cell: pytest's counts, or the benchmark's JSON."""
    if step.name.startswith("ep_"):
        counts = re.findall(r"(\d+) (passed|failed|skipped|error)", text)
        per_size = re.findall(r"^R = (\d+) processes .*forward \+ backward ([0-9.]+) ms", text, re.M)
        sizes = ", ".join(f"R={r}: {ms} ms/step" for r, ms in per_size)
        return " ".join(f"{n} {w}" for n, w in counts[-3:]) + (f"; {sizes}" if sizes else "")
    if step.name == "nvlink" and (out / "nvlink.json").exists():
        r = json.loads((out / "nvlink.json").read_text())
        return (f"pull {r['pull_gbs']:.0f}, push {r['push_gbs']:.0f}, copy {r['copy_gbs']:.0f} GB/s; "
                f"signal round {r['signal_round_us']:.1f} us")
    if step.name == "layer" and (out / "layer.json").exists():
        r = json.loads((out / "layer.json").read_text())
        cells = []
        for row in r["rows"]:
            ms = row["fwd_bwd"]["ms"]
            base = [ms[m] for m in ("a2a_grouped_mm", "megatron_alltoall") if m in ms]
            ratio = f" ({min(base) / ms['mok']:.2f}x best baseline)" if base else ""
            cells.append(f"{row['shape']} f+b mok {ms['mok']:.1f} ms{ratio}, predicted {row['fwd_bwd']['predicted_ms']['mok']:.1f}")
        return "; ".join(cells)
    if step.name == "throughput" and (out / "throughput" / "throughput.json").exists():
        r = json.loads((out / "throughput" / "throughput.json").read_text())
        cells = []
        for run in r["runs"]:
            cell = f"{run['dispatcher']} rc {run.get('rc')}"
            if run.get("tokens_per_s_per_gpu"):
                cell += f": {run['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
            for baseline, ratio in run.get("speedup", {}).items():
                if baseline != run["dispatcher"]:
                    cell += f", {ratio:.2f}x {baseline}"
            loss = run.get("loss_vs_reference")
            if loss and loss.get("same_curve") is not None:
                cell += f", loss max rel diff {loss['max_rel_diff']:.1e} (same curve: {loss['same_curve']})"
            cells.append(cell)
        return "; ".join(cells)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def dry_run(selected: list[Step], budget_s: int) -> int:
    """Lists the steps and their bounds, checks every file they need and that each part's bounds fit
    one call; compiles the Python they run. No GPU, no build."""
    problems = []
    for part in sorted({s.part for s in selected}):
        in_part = [s for s in selected if s.part == part]
        total = sum(s.bound_s for s in in_part if s.name != "build")
        build = next((s.bound_s for s in in_part if s.name == "build"), 0)
        print(f"part {part}: {total} s of steps + {build} s build bound (skipped where the extension loads), "
              f"call budget {budget_s} s")
        for s in in_part:
            print(f"  {s.name:<12} {s.bound_s:>4} s  {s.what}")
            print(f"  {'':<12}        $ {' '.join(s.command[1:] if s.command[0] == sys.executable else s.command)}")
            for need in s.needs:
                path = REPO / need
                if not path.exists():
                    problems.append(f"{s.name}: {need} is missing")
                elif path.suffix == ".py":
                    try:
                        compile(path.read_text(), str(path), "exec")
                    except SyntaxError as error:
                        problems.append(f"{s.name}: {need} does not compile: {error}")
        if total > budget_s:
            problems.append(f"part {part}: its steps' bounds ({total} s) exceed the call budget ({budget_s} s)")
        if total + build > budget_s:
            print(f"  (with a build: {total + build} s > {budget_s} s; carry the .so of part 1, or the last steps are cut)")
    for problem in problems:
        print(f"dry run: {problem}")
    print("dry run: ok" if not problems else f"dry run: {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("1", "2", "all"), default="all")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and check the files; run nothing")
    parser.add_argument("--budget-s", type=int, default=CALL_LIMIT_S - 30, help="seconds one part may take (per call)")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT", "/tmp/mok_ep8"))
    selected = [s for s in steps(out) if args.part == "all" or s.part == int(args.part)]
    if args.dry_run:
        return dry_run(selected, args.budget_s)
    import torch

    if torch.cuda.device_count() < NUM_GPUS:
        print(f"device_ep8: needs {NUM_GPUS} GPUs, {torch.cuda.device_count()} here", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for part in sorted({s.part for s in selected}):
        start = time.monotonic()
        for step in (s for s in selected if s.part == part):
            outcome = run_step(step, out, args.budget_s - (time.monotonic() - start))
            print(f"{step.name} (part {part}): {outcome.status}, {outcome.seconds:.0f} s. {outcome.summary}", flush=True)
            outcomes.append(outcome)
    print("\n| part | step | bound s | took s | status | result |\n| ---: | --- | ---: | ---: | --- | --- |")
    for o in outcomes:
        print(f"| {o.step.part} | {o.step.name} | {o.step.bound_s} | {o.seconds:.0f} | {o.status} | {o.summary} |")
    return 0 if all(o.status == "ok" or o.status.startswith("skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
