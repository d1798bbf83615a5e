"""Fixtures shared by the test modules."""

import pytest

from cuda_checks import require_extension


@pytest.fixture
def hopper_extension() -> None:
    require_extension()
