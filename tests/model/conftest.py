"""The fp32 reference trajectory, computed once for every tolerance test."""

from __future__ import annotations

import pytest

from tests.support.teacher_forcing import Reference, fp32_reference


@pytest.fixture(scope="session")
def reference(model_path: str) -> Reference:
    return fp32_reference(model_path)
