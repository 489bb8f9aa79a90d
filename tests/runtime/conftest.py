"""Fixtures of the runtime's tests (fixtures only: no test module imports this file)."""

from __future__ import annotations

import openvino as ov
import pytest

from appliance.runtime import kernels
from tests.helpers import ours_missing


@pytest.fixture(scope="module")
def loaded() -> tuple[ov.Core, kernels.Kernels]:
    """An ov.Core with our kernels' extension added, and the loaded kernels; a skip (a failure under CI) without
    the library, which `make venv` builds."""
    core = ov.Core()
    got, why = kernels.load(core)
    if got is None:
        ours_missing(f"our kernels are not available: {why} (make venv builds them)")
    return core, got
