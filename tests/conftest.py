"""Fixtures shared by the test modules."""

import os

# Before anything starts CUDA: the emulated symmetric ranks need every kernel loaded up front
# (megatron_mok/emulation.py says why); their tests share the process with every other GPU test.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402

from cuda_checks import require_extension  # noqa: E402


@pytest.fixture
def hopper_extension() -> None:
    require_extension()
