"""Checks of a forward + backward step on a CUDA device (graph replay, sync-free reproducibility), the
marks of the tests that need the Hopper kernels, the trapping-kernel harness and ptxas's report on a
translation unit."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Sequence

import pytest
import torch


def hopper_gpu_present() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def require_extension() -> None:
    """Fails the calling test when the CUDA extension did not load: on a Hopper GPU (or wherever
    the kernels are expected) a missing extension is a broken build, never a reason to skip."""
    from megatron_mok import ops

    if ops.extension_error() is not None:
        pytest.fail(f"the megatron_mok CUDA extension did not load: {ops.extension_error()}")


# The tests that compile the kernels (ptxas's verdicts, their SASS) need nvcc and a CUDA build of
# torch; they skip without them unless the run demands them (CI sets MEGATRON_MOK_REQUIRE_EXTENSION=1,
# and then a missing toolchain fails them instead).
TOOLCHAIN_REQUIRED = os.environ.get("MEGATRON_MOK_REQUIRE_EXTENSION") == "1"
TOOLCHAIN_PRESENT = shutil.which("nvcc") is not None and torch.version.cuda is not None
NEEDS_TOOLCHAIN = pytest.mark.skipif(not (TOOLCHAIN_REQUIRED or TOOLCHAIN_PRESENT), reason="no CUDA toolchain")


# pytestmark of the test modules that run the kernels: skipped without a Hopper GPU; on one, the
# `hopper_extension` fixture (tests/conftest.py) fails every test of the module if the extension
# cannot load.
NEEDS_HOPPER_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper_gpu_present(), reason="needs a Hopper GPU"),
    pytest.mark.usefixtures("hopper_extension"),
]


# The caching allocator serves requests of at most 1 MiB from a separate pool of 2 MiB segments
# (its small pool); larger ones from the large pool.
SMALL_POOL_LIMIT_BYTES = 1 << 20


# The poison: every 4-byte word 0x7FFFFFFF. Read as fp32, as either bf16 half (0x7FFF, 0xFFFF) and as
# any E4M3 byte (0x7F, 0xFF) it is NaN; as an int32 it is INT32_MAX, no valid index or count (and not
# -1, the "no route" sentinel an unwritten index must not pass for).
POISON_WORD = 0x7FFFFFFF


def poison_allocator(num_bytes: int = 8 << 30, small_pool_bytes: int = 256 << 20) -> None:
    """Hands the caching allocator poisoned blocks (POISON_WORD) in both of its pools, so the outputs
    of the next call, large or small, are carved from poisoned memory and any element a kernel
    forgets to write stays NaN (an integer: INT32_MAX). Without the small pool an output of at most
    1 MiB (an act_scales, a small act) would come from memory of earlier tests, and a forgotten
    element would pass or fail with what they left there."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    small = [
        torch.full((SMALL_POOL_LIMIT_BYTES // 4,), POISON_WORD, dtype=torch.int32, device="cuda")
        for _ in range(small_pool_bytes // SMALL_POOL_LIMIT_BYTES)
    ]
    block = torch.full((min(num_bytes, free // 2) // 4,), POISON_WORD, dtype=torch.int32, device="cuda")
    del block, small


def assert_graph_replays_eager(
    step: Callable[[], torch.Tensor],
    leaves: Sequence[torch.Tensor],
    eager_y: torch.Tensor,
    eager_grads: Sequence[torch.Tensor],
) -> None:
    """Captures `step` (which resets and fills leaves' grads, returns y) and checks two replays
    reproduce the eager output and gradients bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs requires
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, eager_y)
        for leaf, want in zip(leaves, eager_grads):
            assert torch.equal(leaf.grad, want)


def assert_mok_moe_graph_replays_eager(config, x, topk_ids, topk_weights, fc1, fc2, grad) -> None:
    """mok_moe(config) forward + backward of `grad`, captured in a CUDA graph: two replays give the
    eager call's y and the gradients of x, topk_weights, fc1 and fc2 bit for bit."""
    from megatron_mok import mok_moe

    def fresh_leaves():
        return [t.detach().clone().requires_grad_() for t in (x, topk_weights, fc1, fc2)]

    def fwd_bwd(leaves):
        for leaf in leaves:
            leaf.grad = None
        y = mok_moe(leaves[0], topk_ids, leaves[1], leaves[2], leaves[3], config=config)
        y.backward(grad.to(y.dtype))
        return y

    eager = fresh_leaves()
    poison_allocator()  # what the eager call allocates starts as NaN: a read of unwritten memory shows
    eager_y = fwd_bwd(eager).detach()
    leaves = fresh_leaves()
    assert_graph_replays_eager(lambda: fwd_bwd(leaves), leaves, eager_y, [leaf.grad for leaf in eager])


def assert_bitwise_reproducible_without_host_sync(
    run: Callable[[], tuple[torch.Tensor, Sequence[torch.Tensor]]],
) -> None:
    """Runs `run` (-> y, grads) twice with host synchronization turned into an error, after one
    warm-up (lazy initialization may synchronize once), and checks both runs agree bit for bit."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y1, g1 = run()
        y2, g2 = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def run_until_trap(script: str, timeout_s: float = 120) -> tuple[str, str, float]:
    """Runs `script` in a fresh interpreter (a trapped kernel leaves its CUDA context unusable); the
    script must print "no error" if its kernels returned and then "record:" with ops.last_failure().
    Asserts that it trapped; returns (the record's text, the whole output, seconds taken)."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s)
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert "record:" in out and "no error" not in out, out
    return out.split("record:", 1)[1], out, elapsed


# The end of a run_until_trap script (after its kernels' launches): waits for them, then prints what
# run_until_trap reads. The script must have imported torch and megatron_mok.ops as `ops`.
TRAP_SCRIPT_TAIL = """
try:
    torch.cuda.synchronize()
    print("no error")
except Exception as error:
    print("error:", type(error).__name__)
print("record:", ops.last_failure())
"""

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def ptxas_report(binding: str, out_dir) -> tuple[str, list[tuple[str, int]]]:
    """Compiles csrc/bindings/<binding> as setup.py does (its flags and megatron_mok/limits.py COMPILED),
    with ptxas's report (-Xptxas=-v); asserts it compiled. Returns the log and, per entry function in
    compile order, (its mangled name, its spill-store bytes): ptxas reports each function as it compiles
    it, "Compiling entry function '<mangled>'" then its spill line."""
    from torch.utils.cpp_extension import include_paths

    from megatron_mok import limits

    source = os.path.join(CSRC, "bindings", binding)
    result = subprocess.run(
        ["nvcc", "-O3", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v", "--expt-relaxed-constexpr",
         f"-I{CSRC}", *(f"-I{path}" for path in include_paths(device_type="cuda")),
         *(f"-DMOK_{name}={value}" for name, value in limits.COMPILED.items()),
         "-DTORCH_EXTENSION_NAME=_C", "-D_GLIBCXX_USE_CXX11_ABI=1",
         "-c", source, "-o", os.path.join(str(out_dir), binding + ".o")],
        capture_output=True, text=True, timeout=1200,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    found = re.findall(r"Compiling entry function '(\S+)'.*?(\d+) bytes spill stores", log, re.S)
    return log, [(name, int(spill)) for name, spill in found]


def cuobjdump_path() -> str:
    """cuobjdump: on PATH, in CUDA_HOME, or from the nvidia-cuda-cuobjdump wheel (requirements.txt:
    machines with nvcc but without the rest of the toolkit). Fails, rather than skips, when none is
    found: every machine that compiles the kernels can read their SASS."""
    toolkit = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [shutil.which("cuobjdump"), os.path.join(toolkit, "bin", "cuobjdump")]
    try:
        import nvidia.cu13  # the wheel's namespace package

        candidates += [os.path.join(path, "bin", "cuobjdump") for path in nvidia.cu13.__path__]
    except ImportError:
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    pytest.fail("no cuobjdump: install nvidia-cuda-cuobjdump (requirements.txt) or put the CUDA toolkit's on PATH")


def sass_by_function(object_path: str) -> dict[str, list[str]]:
    """The SASS of every function in a compiled object (cuobjdump -sass): mangled name -> its
    instructions in order, each as "OPCODE operands" without address or encoding."""
    result = subprocess.run([cuobjdump_path(), "-sass", object_path], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    functions: dict[str, list[str]] = {}
    current = None
    for line in result.stdout.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if current is not None and instruction:
            current.append(instruction.group(1))
    return functions


def named_barrier_syncs(code: list[str], barrier: int, threads: int) -> list[str]:
    """The instructions of a function's SASS (sass_by_function's list) that sync on named barrier
    `barrier` over `threads` threads: "[@P] BAR.SYNC[.modifiers] 0x<barrier>, 0x<threads>"."""
    return [ins for ins in code if "BAR.SYNC" in ins and ins.endswith(f"{barrier:#x}, {threads:#x}")]
