"""Builds megatron_mok. The CUDA extension (megatron_mok._C, sm_90a) is built only where a CUDA
toolchain and a CUDA build of torch are present and csrc/ holds sources; elsewhere the package
installs as pure Python and runs the reference backend."""

from __future__ import annotations

import glob
import os
import runpy
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extension_sources() -> list[str]:
    patterns = ("csrc/**/*.cpp", "csrc/**/*.cu")
    return sorted(
        os.path.relpath(path, ROOT)
        for pattern in patterns
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    )


def _compiled_limit_flags() -> list[str]:
    """-DMOK_<NAME>=<value> for every entry of megatron_mok/limits.py COMPILED (csrc/common/limits.h),
    read by running that file on its own: it imports nothing, so neither torch nor the package
    need be importable here."""
    limits = runpy.run_path(os.path.join(ROOT, "megatron_mok", "limits.py"))["COMPILED"]
    return [f"-DMOK_{name}={int(value)}" for name, value in limits.items()]


def _cuda_extension():
    """Returns (ext_modules, cmdclass) for the CUDA extension, or ([], {}) with one line saying why."""
    if os.environ.get("MEGATRON_MOK_SKIP_EXTENSION") == "1":
        print("megatron_mok: MEGATRON_MOK_SKIP_EXTENSION=1, building without the CUDA extension")
        return [], {}
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        # torch derives CUDA_HOME from nvcc's folder; where nvcc sits in /usr/local/bin that misses
        # the toolkit's lib64 (libcudart), so name the toolkit root that has it.
        nvcc = shutil.which("nvcc")
        roots = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
        for root in roots + ["/usr/local/cuda"]:
            if os.path.exists(os.path.join(root, "lib64", "libcudart.so")):
                os.environ["CUDA_HOME"] = root
                break
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("megatron_mok: torch is not importable at build time (use --no-build-isolation); "
              "building without the CUDA extension")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None or shutil.which("nvcc") is None and not os.path.exists(
        os.path.join(CUDA_HOME or "", "bin", "nvcc")
    ):
        print("megatron_mok: no CUDA toolchain or no CUDA build of torch; building without the CUDA extension")
        return [], {}
    sources = _extension_sources()
    if not sources:
        print("megatron_mok: csrc/ holds no kernel sources yet; building without the CUDA extension")
        return [], {}
    # torch >= 2.13's headers need C++20; older ones compile with it too.
    nvcc_flags = [
        "-O3",
        "-std=c++20",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-lineinfo",
        "-Xptxas=--warn-on-spills",
        "--expt-relaxed-constexpr",
    ]
    limit_flags = _compiled_limit_flags()
    nvcc_flags += limit_flags
    # Build-time variants for measurements, e.g. MOK_NVCC_FLAGS=-DMOK_EXPERT_GEMM_STAGES=3.
    nvcc_flags += os.environ.get("MOK_NVCC_FLAGS", "").split()
    extension = CUDAExtension(
        name="megatron_mok._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"] + limit_flags, "nvcc": nvcc_flags},
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extension()

setup(
    name="megatron_mok",
    version="0.1.0",
    description="Mixture-of-Kittens MoE megakernel for Hopper as a Megatron-LM plugin",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_mok", "megatron_mok.*"]),
    install_requires=["torch>=2.9", "megatron-core>=0.19,<0.20", "triton", "pyyaml"],
    extras_require={"test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
